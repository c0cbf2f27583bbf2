"""``sage_attention``: SDPA's layout and meaning, SageBwd or Attn-QAT numerics; checks arguments and runs the plan
(:func:`.plan.plan_attention`)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .precision import AttentionPrecision
from .reference import MAX_EXACT_CONTRACTION, sage_attention_reference


def _broken_install(error: BaseException) -> ImportError:
    module = getattr(error, "name", None)
    where = f" (module {module})" if module else ""
    return ImportError(
        f"sage_lightning.kernels: the Triton kernels failed to import{where}: {type(error).__name__}: {error}. "
        "This install of sage-lightning is incomplete or broken, and on a GPU every call would run the PyTorch "
        "reference, many times slower. Reinstall it (pip install --force-reinstall --no-deps sage-lightning, or "
        "your install command), then check with: python -m sage_lightning"
    )


try:
    # The plan probes Triton: a Triton that is missing is deliberate (every call takes the reference, TRITON_MISSING
    # says why); one that is installed but fails to import, or a kernel module missing from the install, is an error.
    from .plan import (
        BACKENDS,
        MAX_TRITON_HEAD_DIM,
        SDPA,
        TRITON_MISSING,
        KernelPlan,
        UnsupportedAttention,
        UnsupportedAttentionType,
        plan_attention,
        set_backend,
    )

    if not TRITON_MISSING:
        from .ops import sage_attention_triton
except Exception as error:
    raise _broken_install(error) from error
if TRITON_MISSING:
    MAX_TRITON_HEAD_DIM, sage_attention_triton = 0, None

#: Input dtypes ``sage_attention`` takes. float32 is computed as it is (not cast): the INT8 products are
#: the same, and the products set to ``"bf16"`` run with float32 operands.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


def _fail(argument: str, received: str, works: str) -> UnsupportedAttention:
    return UnsupportedAttention(argument, received, works)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: object = False,
    scale: object = None,
    precision: object = None,
    stats: object = None,
) -> None:
    """Refuse what :func:`sage_attention` cannot serve, naming the argument, the value and what works.

    Args:
        q, k, v, is_causal, scale, precision, stats: as :func:`sage_attention`.

    Raises:
        UnsupportedAttention: a shape, dtype, device or value that does not work (a ``ValueError``); an argument of the
            wrong type raises its subclass :class:`~.plan.UnsupportedAttentionType`, also a ``TypeError``.

    Example::

        check_inputs(q, k, v, is_causal=True)   # returns None when the call can be served
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedAttentionType(name, type(t).__name__, "must be a torch.Tensor")
        if t.layout != torch.strided or t.is_nested:
            raise _fail(
                name,
                f"a {'nested' if t.is_nested else str(t.layout).replace('torch.', '')} tensor",
                "must be a dense (strided) tensor: call .to_dense(), or route the call to "
                "torch.nn.functional.scaled_dot_product_attention",
            )
        if t.dim() != 4:
            raise _fail(
                name,
                f"shape {tuple(t.shape)}",
                "must be 4-D, [batch, heads, seq, head_dim] as torch.nn.functional."
                "scaled_dot_product_attention takes it (reshape or unsqueeze a batch dim)",
            )
        if t.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise _fail(name, f"dtype {t.dtype}", f"must be one of {names}")
    if not (q.dtype == k.dtype == v.dtype):
        raise _fail("q, k, v", f"dtypes {q.dtype}, {k.dtype}, {v.dtype}", "must share one dtype")
    if not (q.device == k.device == v.device):
        raise _fail("q, k, v", f"devices {q.device}, {k.device}, {v.device}", "must be on one device")
    if k.shape != v.shape:
        if k.shape[:2] == v.shape[:2] and k.shape[2] != v.shape[2]:
            works = "must have the same sequence length (each key pairs with one value)"
        elif k.shape[:3] == v.shape[:3]:
            works = "must have the same head_dim (a value head dim different from the key's is not supported)"
        else:
            works = "must have the same shape [batch, kv_heads, seq_k, head_dim]"
        raise _fail("k, v", f"shapes {tuple(k.shape)} and {tuple(v.shape)}", works)
    batch, q_heads, seq_q, head_dim = q.shape
    if k.shape[0] != batch:
        raise _fail("k", f"batch {k.shape[0]} with q's batch {batch}", "must have the batch size of q")
    if k.shape[3] != head_dim:
        raise _fail("k", f"head_dim {k.shape[3]} with q's head_dim {head_dim}", "must have q's head_dim")
    kv_heads = k.shape[1]
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise _fail(
            "q, k",
            f"{q_heads} query heads and {kv_heads} kv heads",
            "need a number of query heads divisible by the number of kv heads (MHA, GQA or MQA)",
        )
    if k.shape[2] == 0:
        raise _fail("k", "seq_k=0", "needs at least one key (softmax over no keys is undefined)")
    if not 1 <= head_dim <= MAX_EXACT_CONTRACTION:
        raise _fail(
            "q",
            f"head_dim={head_dim}",
            f"must have a head_dim from 1 to {MAX_EXACT_CONTRACTION} (the longest int8 dot product summed "
            f"exactly in fp32; the Triton kernels take up to {MAX_TRITON_HEAD_DIM or 128} on a GPU, larger heads run "
            "the PyTorch reference); route larger heads to scaled_dot_product_attention",
        )
    if not isinstance(is_causal, bool):
        raise _fail("is_causal", repr(is_causal), "must be True or False")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (scale > 0 and math.isfinite(scale)):
            raise _fail("scale", repr(scale), "must be a positive finite float, or None for 1/sqrt(head_dim)")
    if precision is not None and not isinstance(precision, AttentionPrecision):
        raise UnsupportedAttentionType(
            "precision", type(precision).__name__, "must be a sage_lightning.kernels.AttentionPrecision or None"
        )
    if stats is not None:
        if not isinstance(stats, torch.Tensor):
            raise UnsupportedAttentionType("stats", type(stats).__name__, "must be a torch.Tensor or None")
        if stats.dtype != torch.float32 or stats.shape != (2,) or stats.device != q.device:
            raise _fail(
                "stats",
                f"{stats.dtype} tensor of shape {tuple(stats.shape)} on {stats.device}",
                f"must be a float32 tensor of shape (2,) on q's device ({q.device})",
            )
    if seq_q == 0 and q.requires_grad:
        raise _fail("q", "seq=0 with requires_grad", "needs at least one query when gradients are asked for")


def sage_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with SageBwd (or Attn-QAT) numerics, a drop-in for ``scaled_dot_product_attention`` without a mask.

    Layout and meaning are SDPA's: ``q`` ``[B, Hq, N, D]``, ``k``/``v`` ``[B, Hkv, Nk, D]``, grouped-query
    attention when ``Hq`` is a multiple of ``Hkv`` (SDPA's ``enable_gqa=True``), ``is_causal`` the
    top-left aligned lower triangle (also when ``N != Nk``), any ``N`` and ``Nk``. Differentiable in
    ``q``, ``k`` and ``v``. CUDA tensors with head dim up to 128 run the Triton kernels; everything else
    (CPU tensors, larger heads) runs the pure-PyTorch reference of the same numerics, which is correct but
    slow on a GPU. ``attn_mask`` and dropout are not taken: route such calls to SDPA (the Lightning mixin
    does that per call).

    Args:
        q: queries, bf16, fp16 or fp32 (fp32 is computed as it is, not cast).
        k: keys, same dtype and device as ``q``.
        v: values, same shape as ``k``.
        is_causal: causal mask as SDPA's ``is_causal``.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        precision: how the products run; ``AttentionPrecision()`` (SageBwd defaults) when ``None``.
            ``mode="attn_qat"`` runs simulated NVFP4 attention for quantization-aware training;
            ``mode="full"`` calls SDPA itself.
        stats: optional float32 tensor of shape ``(2,)`` on ``q``'s device; each backward adds the sum of
            squared INT8 quantization error of dS and the sum of dS squared into it (measured whatever
            ``ds`` runs in; left alone in ``"attn_qat"`` and ``"full"`` modes, which have no INT8 dS).
            ``ds_rel_err = sqrt(stats[0] / stats[1])``.

    Returns:
        The attention output ``[B, Hq, N, D]`` in the input dtype.

    Raises:
        TypeError, ValueError: an argument it cannot serve; the message names it, the value received
            and what works.

    Example::

        import torch
        from sage_lightning.kernels import AttentionPrecision, sage_attention

        q = torch.randn(2, 8, 300, 64, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 300, 64, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, 300, 64, dtype=torch.bfloat16, requires_grad=True)
        stats = torch.zeros(2)
        out = sage_attention(q, k, v, is_causal=True, stats=stats)
        out.float().square().mean().backward()
        print("dS relative error", (stats[0] / stats[1]).sqrt().item())
    """
    check_inputs(q, k, v, is_causal=is_causal, scale=scale, precision=precision, stats=stats)
    precision = AttentionPrecision() if precision is None else precision
    if q.shape[2] == 0 and precision.mode != "full":
        return q.new_empty(q.shape)
    plan = plan_attention(q, k, precision, is_causal=is_causal, scale=scale)
    if plan.backend == SDPA:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    # SageBwd and Attn-QAT alike: both paths read the precision's formats, and both ignore stats in attn_qat mode.
    if q.is_cuda and not torch.compiler.is_compiling():
        _announce_once(q.device, q.dtype, q.shape, k.shape, is_causal, precision, plan)
    if plan.triton:
        out, _ = sage_attention_triton(
            q, k, v, is_causal=is_causal, scale=scale, precision=precision, stats=stats, with_lse=False, plan=plan
        )
    else:
        out, _ = sage_attention_reference(q, k, v, is_causal=is_causal, scale=scale, precision=precision, stats=stats)
    return out


@functools.lru_cache(maxsize=256)
def _announce_once(
    device: torch.device,
    dtype: torch.dtype,
    q_shape: torch.Size,
    k_shape: torch.Size,
    is_causal: bool,
    precision: AttentionPrecision,
    plan: KernelPlan,
) -> None:
    # Once per kind of call (a cache hit costs the host well under a microsecond): the path is logged the first time
    # the process takes it (:func:`.paths.announce`), so no CUDA call runs a slower path without a word.
    from .paths import announce

    q = torch.empty((1,) * len(q_shape), dtype=dtype, device=device).expand(q_shape)
    k = torch.empty((1,) * len(k_shape), dtype=dtype, device=device).expand(k_shape)
    announce(q, k, is_causal=is_causal, precision=precision)


class use_backend:  # noqa: N801 - used like a function: ``with use_backend("reference"):``
    """Context manager that makes :func:`sage_attention` take one implementation (tests, accuracy studies).

    Args:
        backend: ``"auto"`` (the default: the Triton kernels for CUDA tensors with head dim up to 128, the
            PyTorch reference otherwise), ``"triton"`` (any device Triton runs on, the CPU included under
            ``TRITON_INTERPRET=1``) or ``"reference"``.

    Raises:
        ValueError: an unknown backend, or ``"triton"`` where Triton is not installed.

    Example::

        with use_backend("reference"):
            out = sage_attention(q, k, v)
    """

    def __init__(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"use_backend: backend must be one of {', '.join(BACKENDS)}; received {backend!r}.")
        if backend == "triton" and TRITON_MISSING:
            raise ValueError("use_backend: backend 'triton' needs the triton package, which is not installed.")
        self.backend = backend
        self._previous = "auto"

    def __enter__(self) -> use_backend:
        self._previous = set_backend(self.backend)
        return self

    def __exit__(self, *exc: object) -> None:
        set_backend(self._previous)
