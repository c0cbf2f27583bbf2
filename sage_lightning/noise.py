"""Quantization error against gradient noise: the controller's main signal (``docs/controller.md``, Noise ratio).

Whether low-bit attention costs loss is decided less by how large its error is than by how it compares with the
noise the gradient carries anyway from sampling a finite batch. That noise shrinks as tokens per step grow; an
error that is the same on every sequence (a bias) does not. So the same INT8 dS that is harmless at 16K tokens per
step leaves a loss gap at 131K (SageBwd's findings ii and iii; reproduced here, ``docs/results.md``).

What is measured, per attention layer, on one micro-batch of a measured step (``capture`` sequences of it):

* each sequence's gradient ``G_b`` of the attention's inputs seen through a per-head linear map on each of q, k
  and v (``G_b = [q_b^T dq_b, k_b^T dk_b, v_b^T dv_b]`` per head, D x D each): for a projection ``q = W x`` this is
  ``W`` times the projection's own weight gradient, so error and noise are compared where the optimizer sees them,
  without the layer having to know its projections;
* ``G_b`` from full-precision attention (SDPA in the inputs' dtype: what a full-precision run computes) and from
  the low-bit kernel at a given precision, on the same q, k, v and output gradient; ``E_b`` their difference.

Over the ``S`` captured sequences: ``bias2 = ||mean E||^2 - var(E) / S`` (the squared error every sequence shares,
unbiased), ``err_var = var(E)`` and ``grad_var = var(G)`` (per sequence, summed over coordinates). For an optimizer
step of ``B`` sequences the step's gradient error is ``bias2 + err_var / B`` and its sampling noise
``grad_var / B``, so the ratio is::

    noise_ratio = sqrt((B * max(bias2, 0) + err_var) / grad_var)

It grows like ``sqrt(B)`` where the error is a bias and stays flat where it is noise itself.

The same capture gives the gradient noise scale (McCandlish et al., 2018, "An Empirical Model of Large-Batch
Training": ``B_simple``): ``mean2 = ||mean G||^2 - var(G) / S`` is the unbiased squared norm of the expected
per-sequence gradient, and ``noise_scale = grad_var / mean2`` the step size in sequences beyond which a larger step
averages little noise away. By the study's explanation INT8 dS costs loss where a step's sequences are many times
that scale (its sampling noise small beside a shared error): the noise-scale rule acts on ``sequences per step /
noise_scale`` (``PolicyConfig.noise_scale_ratio_high``; ``docs/controller.md``, Noise scale).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sage_lightning.kernels import AttentionPrecision, sage_attention

#: The sums a measurement returns per precision, in order (``mean2`` is the reference's: the same in every row).
NOISE_FIELDS: tuple[str, ...] = ("bias2", "err_var", "grad_var", "mean2")


def gradient_moments(per_sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_var, mean2)`` of per-sequence gradients: the per-sequence variance summed over coordinates (the trace
    of their covariance) and the unbiased squared norm of their mean (``||mean||^2 - grad_var / S``, which can come
    out negative where the mean is small beside the noise), both without a host sync.

    Args:
        per_sequence: ``[S, P]``, one row per sequence, ``S >= 2``.

    Example::

        gradient_moments(torch.tensor([[1.0, 0.0], [3.0, 0.0]]))   # (tensor(2.), tensor(3.))
    """
    grad_var = per_sequence.var(dim=0).sum()
    return grad_var, per_sequence.mean(dim=0).square().sum() - grad_var / per_sequence.shape[0]


def adapter_gradients(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Each sequence's gradient of a per-head linear map applied to ``x`` (identity at the point of evaluation):
    ``x_b^T grad_b`` per head, flattened, in float32.

    Args:
        x: ``[B, H, N, D]``, the attention input (q, k or v).
        grad: its gradient, the same shape.

    Returns:
        ``[B, H * D * D]``.

    Example::

        adapter_gradients(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4)).shape   # torch.Size([2, 16])
    """
    return torch.einsum("bhnd,bhne->bhde", x.float(), grad.float()).flatten(1)


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([adapter_gradients(x, g) for x, g in zip((q, k, v), grads, strict=True)], dim=1)


def _attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    is_causal: bool,
    scale: float | None,
    precision: AttentionPrecision | None,
) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of ``sage_attention`` at ``precision``, or of SDPA where ``precision`` is ``None``."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        if precision is None:
            gqa = q.shape[1] != k.shape[1]
            out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        else:
            out = sage_attention(*leaves, is_causal=is_causal, scale=scale, precision=precision)
        return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def noise_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    precisions: Sequence[AttentionPrecision],
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``[bias2, err_var, grad_var, mean2]`` (:data:`NOISE_FIELDS`) of each precision against full-precision
    attention, over the batch's sequences, as a float64 ``[len(precisions), 4]`` tensor on the inputs' device (no
    host sync); ``grad_var`` and ``mean2`` are the reference's (:func:`gradient_moments`).

    Args:
        q, k, v: SDPA's layout, at least two sequences (the batch dimension); detached copies are fine.
        grad_out: the gradient that reached the attention's output, shaped like ``q``.
        precisions: the low-bit settings to measure (e.g. the layer's base precision and the one it runs in).
        is_causal, scale: as ``sage_attention``.

    Raises:
        ValueError: fewer than two sequences (the noise is the spread between sequences).

    Example::

        from sage_lightning.kernels import AttentionPrecision
        q, k, v, do = (torch.randn(4, 2, 64, 32) for _ in range(4))
        noise_sums(q, k, v, do, [AttentionPrecision()], is_causal=True)   # [[bias2, err_var, grad_var, mean2]]
    """
    sequences = q.shape[0]
    if sequences < 2:
        raise ValueError(
            f"noise_sums: q must hold at least 2 sequences (the noise is their spread); received q of shape "
            f"{tuple(q.shape)}."
        )
    common = dict(is_causal=is_causal, scale=scale)
    reference = _per_sequence(q, k, v, _attention_grads(q, k, v, grad_out, precision=None, **common))
    grad_var, mean2 = gradient_moments(reference)
    rows = []
    for precision in precisions:
        low = _per_sequence(q, k, v, _attention_grads(q, k, v, grad_out, precision=precision, **common))
        err_var, bias2 = gradient_moments(low - reference)  # the error's spread, and the part every sequence shares
        rows.append(torch.stack([bias2, err_var, grad_var, mean2]))
    return torch.stack(rows).to(torch.float64)


def noise_ratio(bias2: float, err_var: float, grad_var: float, sequences_per_step: float) -> float | None:
    """The step's gradient error over its sampling noise (see the module's docstring), from :func:`noise_sums`.

    Args:
        bias2, err_var, grad_var: the measurement's sums (averaged over the ranks that measured).
        sequences_per_step: the optimizer step's sequences over all micro-batches and ranks.

    Returns:
        The ratio; ``None`` where there is no noise to compare with (``grad_var`` zero or not finite: nothing
        trained through the layer) or no step; ``nan`` where the error itself is not finite.

    Example::

        noise_ratio(bias2=1.0, err_var=0.0, grad_var=16.0, sequences_per_step=64)   # 2.0
    """
    if not grad_var > 0 or not math.isfinite(grad_var) or not sequences_per_step > 0:
        return None
    if not (math.isfinite(bias2) and math.isfinite(err_var)):
        return math.nan
    return math.sqrt(max(sequences_per_step * max(bias2, 0.0) + max(err_var, 0.0), 0.0) / grad_var)


def noise_scale(grad_var: float, mean2: float) -> float | None:
    """The gradient noise scale in sequences, ``grad_var / mean2`` (see the module's docstring), from
    :func:`noise_sums`' reference sums.

    Returns:
        The scale; ``None`` where the capture cannot resolve it: no noise, or a mean gradient at or under zero
        beside the noise (its estimate is unbiased, so small means come out negative), or a sum not finite.

    Example::

        noise_scale(grad_var=32.0, mean2=2.0)   # 16.0: steps of many more than 16 sequences average little noise away
    """
    if not (math.isfinite(grad_var) and math.isfinite(mean2)) or not grad_var > 0 or not mean2 > 0:
        return None
    return grad_var / mean2


def percentile_95(readings: Sequence[float]) -> float:
    """The 95th percentile of ``readings`` (at least one), interpolated between them (numpy's "linear"): how
    :func:`calibrate_threshold` reads the runs without a loss gap.

    Example::

        percentile_95([0.1, 0.1, 0.2])   # 0.19
    """
    return statistics.quantiles(readings, n=20, method="inclusive")[18] if len(readings) > 1 else readings[0]


def calibrate_threshold(
    quiet: Sequence[float], loud: Sequence[Sequence[float]], name: str = "noise_ratio_high"
) -> tuple[float | None, str]:
    """A threshold from readings taken without acting (``PolicyConfig(noise_ratio_high=1e6)``; the callback's
    ``policy.noise_readings``): the geometric mean of the 95th percentile of ``quiet`` (a run where low-bit attention
    costs no loss: the rule must stay quiet there) and the lowest median among ``loud`` (runs where it costs loss:
    the rule must act). For ``noise_ratio_high`` the readings are the noise ratios (the readings' third entries), for
    ``noise_scale_ratio_high`` the steps over the noise scale (their sixth).

    Args:
        quiet: the readings of the run(s) with no loss gap (``None`` and non-finite ones are left out).
        loud: per run with a loss gap, its readings (likewise).
        name: the setting calibrated, as ``why`` names it.

    Returns:
        ``(threshold, why)``; the threshold is ``None`` where the two do not separate (the lowest loud median at or
        under the quiet 95th percentile), ``why`` says which numbers decided.

    Example::

        calibrate_threshold([0.1, 0.1, 0.2], [[0.8, 0.9, 0.8]])   # (0.39, 'noise_ratio_high = sqrt(0.190 x 0.800) ...')
    """
    quiet = [v for v in quiet if v is not None and math.isfinite(v)]  # a step without a scale has no reading
    runs = [[v for v in run if v is not None and math.isfinite(v)] for run in loud]
    medians = [statistics.median(run) for run in runs if run]
    if not quiet or not medians:
        return None, "needs readings of a run without a loss gap and of one with a gap at least"
    ceiling = percentile_95(quiet)
    floor = min(medians)
    if floor <= ceiling:
        return None, f"no separation: the lowest loud median {floor:.3f} <= the quiet 95th percentile {ceiling:.3f}"
    threshold = math.sqrt(ceiling * floor)
    return threshold, f"{name} = sqrt({ceiling:.3f} x {floor:.3f}) = {threshold:.3f} ({floor / ceiling:.2f}x)"
