"""The forward's quantization health, per layer: how much of Q' and K' their INT8 block quantization destroys.

The dS statistics see the backward; an outlier in q (one entry of 300 among N(0, 1) values) spoils the INT8
scale of its whole block of query rows, so every other row of that block loses its scores, yet ``ds_rel_err`` does
not move (issue 16: 0.039-0.042 against O cosines of 0.944). This signal measures it directly, on the steps that
measure dS: Q' (Q, Q-smoothed per block of query rows when ``smooth_q``) and K' (K minus its mean over tokens when
``smooth_k``) are quantized the way the kernels do (``quantize_int8``, one scale per block of ``BLOCK_M`` query rows
or ``BLOCK_N`` keys), and each row's relative error ``|X_i - deq(psi(X))_i|^2 / |X_i|^2`` is summed. Per row, not
over the whole tensor: an outlier's own norm would otherwise hide the rows it ruined.

``qk_rel_err = sqrt(mean_rows(rel_Q) + mean_rows(rel_K))`` (the relative errors of a product's two operands add in
quadrature). Measured on N(0, 1), N(0, 16) and N(0, 100) inputs it is 0.013 whatever the scale; one q outlier of
100, 300, 1000 reads 0.059, 0.17, 0.25 (``docs/controller.md``). It is computed in PyTorch from the layer's q and
k, a few elementwise passes on measured steps only: no kernel change. The block sizes are the reference's (128
query rows, 64 keys); autotuned Triton blocks may differ, which makes it an estimate of the same quantity.
"""

from __future__ import annotations

import torch

from sage_lightning.kernels.reference import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, quantize_int8


def row_relative_error(x: torch.Tensor, block: int, *, smooth_block_mean: bool = False) -> torch.Tensor:
    """``[sum over rows of |err_i|^2 / |x_i|^2, rows]`` of ``x``'s INT8 quantization, one scale per ``block`` rows.

    One batch element at a time, so the float32 temporaries stay a small multiple of one element's q (not of the
    whole batch's: at 131K tokens per step that would be gigabytes on the measured steps).

    Args:
        x: ``[B, H, N, D]``.
        block: rows per quantization block (the last block is zero-padded; padded and all-zero rows do not count).
        smooth_block_mean: subtract each block's mean row first (Q-smoothing).

    Returns:
        A float64 tensor of 2 elements on ``x``'s device (sums, so they add across calls and ranks).

    Example::

        err, rows = row_relative_error(torch.randn(1, 2, 256, 64), 128).tolist()
        (err / rows) ** 0.5   # about 0.009
    """
    total = torch.zeros(2, dtype=torch.float64, device=x.device)
    for element in x.detach():
        total += _row_relative_error(element, block, smooth_block_mean)
    return total


def _row_relative_error(x: torch.Tensor, block: int, smooth_block_mean: bool) -> torch.Tensor:
    heads, n, dim = x.shape
    padded = -(-n // block) * block
    x = x.float()
    if padded != n:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - n))
    blocks = x.reshape(heads, padded // block, block, dim)
    if smooth_block_mean:
        valid = (torch.arange(padded, device=x.device) < n).reshape(padded // block, block, 1).to(x.dtype)
        mean = blocks.sum(dim=2, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp_min(1)
        blocks = (blocks - mean) * valid
    codes, scale = quantize_int8(blocks, (-2, -1))
    err = (blocks - codes * scale).square().sum(dim=-1)
    norm = blocks.square().sum(dim=-1)
    counted = norm > 0
    rel = torch.where(counted, err / norm.where(counted, torch.ones_like(norm)), torch.zeros_like(norm))
    return torch.stack([rel.sum().double(), counted.sum().double()])


def qk_quant_error(q: torch.Tensor, k: torch.Tensor, *, smooth_q: bool, smooth_k: bool) -> torch.Tensor:
    """``[sum rel_Q, rows_Q, sum rel_K, rows_K]`` of one attention call (float64, on the inputs' device).

    ``qk_rel_err = sqrt(sum_rel_Q / rows_Q + sum_rel_K / rows_K)`` once summed over calls and ranks.

    Example::

        sums = qk_quant_error(q, k, smooth_q=False, smooth_k=True)
    """
    keys = k.detach().float()
    if smooth_k:
        keys = keys - keys.mean(dim=2, keepdim=True)
    return torch.cat(
        [
            row_relative_error(q, DEFAULT_BLOCK_M, smooth_block_mean=smooth_q),
            row_relative_error(keys, DEFAULT_BLOCK_N),
        ]
    )


def qk_rel_err(sums: list[float]) -> float | None:
    """``qk_rel_err`` from the four sums of :func:`qk_quant_error` (summed); ``None`` when no row was measured."""
    rel_q, rows_q, rel_k, rows_k = sums
    if rows_q <= 0 or rows_k <= 0:
        return None
    return (rel_q / rows_q + rel_k / rows_k) ** 0.5
