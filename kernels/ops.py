"""The Triton path as PyTorch operators: ``sage_lightning::sagebwd_forward`` / ``sagebwd_backward``.

Both are ``torch.library.custom_op``\\ s with fake (meta) implementations, and the backward is registered as
the forward's autograd formula, so a ``torch.compile``\\ d model traces through them without a graph break.
The forward saves only what the backward needs: the INT8 Q'^ and K'^ with their scales (not q and k), V,
O and the logsumexp.

Eager calls run the operators' two functions through a ``torch.autograd.Function`` instead (:class:`_SageBwd`):
the operators' Python dispatch costs the host more than the kernels' launches.

Under ``torch.compile`` a change of :class:`AttentionPrecision` changes the operators' constant arguments,
which costs one recompile per distinct setting (each layer's setting is a guard).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .backward import backward
from .forward import forward
from .hopper import gluon_dq as gluon_dq_module
from .hopper import gluon_forward as gluon_forward_module
from .hopper.forward import hopper_forward
from .hopper.gluon_backward import gluon_dkdv
from .hopper.gluon_dq import gluon_dq
from .plan import (
    GLUON_DKDV,
    GLUON_DKDV_WG,
    GLUON_DQ,
    GLUON_DQ_WG,
    GLUON_FORWARD,
    HOPPER_FORWARD,
    IN_OPERATOR,
    MAX_TRITON_HEAD_DIM,
    QAT_BLOCK_M,
    KernelPlan,
    plan_attention,
)
from .precision import AttentionPrecision
from .quant import (
    CODE_DTYPES,
    NO_BAD_KEY,
    finite_mean,
    output_like,
    quantize_channels_fp8,
    quantize_heads_nvfp4,
    quantize_rows,
)
from .reference import DEFAULT_BLOCK_N, softmax_scale, undo_k_smoothing_shift
from .tiles import LOG2E

__all__ = ["MAX_TRITON_HEAD_DIM", "QAT_BLOCK_M", "sage_attention_triton"]

_EMPTY = (0,)
#: The plan's ``gluon_dq_wg``: :func:`.hopper.gluon_dq.gluon_dq`'s one-warpgroup-per-block variant, under a name of
#: its own so that a test wrapping this module's kernels sees which of the two ran.
gluon_dq_wg = functools.partial(gluon_dq, wg=True)
#: The plan's ``gluon_dkdv_wg``: :func:`.hopper.gluon_backward.gluon_dkdv`'s one-warpgroup-per-64-keys variant, under a
#: name of its own for the same reason.
gluon_dkdv_wg = functools.partial(gluon_dkdv, wg=True)


def _operator_plan(
    q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float, block_m: int, block_n: int, **formats: object
) -> KernelPlan:
    """The plan of a traced call, whose passes are named :data:`.plan.IN_OPERATOR`, made by the operator on its
    concrete tensors (``q``, ``k`` or stand-ins of their shapes, dtype and device) and the precision its format
    arguments give: the kernels an eager call of these shapes runs."""
    return plan_attention(
        q, k, AttentionPrecision(**formats), is_causal=is_causal, scale=scale, block_m=block_m, block_n=block_n,
        backend="triton",
    )  # fmt: skip


def _sagebwd_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stats: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    qk: str,
    pv: str,
    dv: str,
    dp: str,
    ds: str,
    smooth_k: bool,
    smooth_q: bool,
    block_m: int,
    block_n: int,
    forward_kernel: str,
    dkdv_kernel: str,
    dq_kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SageBwd forward. Returns ``(O, lse2, Q'^, q_scale, q_mean, K'^, k_scale)``.

    ``lse2`` is the internal logsumexp (base 2, of the smoothed scores); ``q_mean`` is empty without
    Q-smoothing. ``forward_kernel`` is the plan's (:class:`.plan.KernelPlan`; a traced call's
    :data:`.plan.IN_OPERATOR` is planned here); ``stats``, the backward formats and the backward's kernels are taken
    here only so the autograd formula sees them.
    """
    if forward_kernel == IN_OPERATOR:
        formats = {"qk": qk, "pv": pv, "dv": dv, "dp": dp, "ds": ds, "smooth_k": smooth_k, "smooth_q": smooth_q}
        forward_kernel = _operator_plan(q, k, is_causal, scale, block_m, block_n, **formats).forward
    # Confined quantizers: a NaN or infinity is read as 0 by its block's scale and means (so it stays out of every
    # other row), reported per query row and as each head's first bad key, and the forward's epilogue makes exactly
    # the rows NaN that SDPA makes non-finite (quant.py's module docstring).
    k_mean = finite_mean(k) if smooth_k else None
    row_poison = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    first_bad = torch.full((k.shape[0] * k.shape[1],), NO_BAD_KEY, dtype=torch.int32, device=k.device)
    q_op, q_scale, q_mean = quantize_rows(q, block_m, fmt=qk, block_mean=smooth_q, confine=True, row_poison=row_poison)
    k_op, k_scale, _ = quantize_rows(k, block_n, fmt=qk, mean=k_mean, confine=True, first_bad=first_bad)
    if pv == "int8":
        # The Hopper forward takes V^'s keys in its registers' order (quant.MMA_KEY_ORDER).
        mma = forward_kernel == HOPPER_FORWARD
        v_op, v_scale, _ = quantize_rows(v, block_n, fmt="int8", transposed=True, mma_order=mma, confine=True,
                                         first_bad=first_bad)  # fmt: skip
    elif pv == "fp8":
        v_op, v_scale = quantize_channels_fp8(v, confine=True, first_bad=first_bad)
    else:
        v_op, v_scale = v.contiguous(), k_scale  # V in its own dtype: a NaN reaches O through the product, as SDPA's
    operands = (q_op, q_scale, q_mean, k_op, k_scale, v_op, v_scale)
    # O in q's layout (a model's [B, N, H, D] memory: its reshape of O after the call stays a view).
    tiles = {"out_dtype": q.dtype, "is_causal": is_causal, "scale": scale, "block_m": block_m, "block_n": block_n,
             "out": output_like(q), "row_poison": row_poison, "first_bad": first_bad}  # fmt: skip
    if forward_kernel == GLUON_FORWARD:
        # Looked up at each call (as the backward's kernels), so that a test wrapping it sees its calls.
        out, lse = gluon_forward_module.gluon_forward(*operands, **tiles, qk=qk, pv=pv)
    elif forward_kernel == HOPPER_FORWARD:
        out, lse = hopper_forward(*operands, **tiles, qk=qk, pv=pv)
    else:
        out, lse = forward(*operands, **tiles, qk=qk, pv=pv)
    q_mean = q_mean if q_mean is not None else q.new_empty(_EMPTY, dtype=torch.float32)
    return out, lse, q_op, q_scale, q_mean, k_op, k_scale


#: The forward as an operator (what traced calls take); eager calls run :func:`_sagebwd_forward` in :class:`_SageBwd`.
sagebwd_forward = torch.library.custom_op("sage_lightning::sagebwd_forward", mutates_args=())(_sagebwd_forward)


@sagebwd_forward.register_fake
def _sagebwd_forward_fake(q, k, v, stats, is_causal, scale, qk, pv, dv, dp, ds, smooth_k, smooth_q, block_m,
                          block_n, forward_kernel, dkdv_kernel, dq_kernel):  # fmt: skip
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    op_dtype = CODE_DTYPES.get(qk, q.dtype)
    m_blocks, n_blocks = triton.cdiv(seq_q, block_m), triton.cdiv(seq_k, block_n)
    f32 = torch.float32
    return (
        output_like(q),
        q.new_empty((batch, heads, seq_q), dtype=f32),
        q.new_empty(q.shape, dtype=op_dtype),
        q.new_empty((batch, heads, m_blocks), dtype=f32),
        q.new_empty((batch, heads, m_blocks, head_dim) if smooth_q else _EMPTY, dtype=f32),
        k.new_empty(k.shape, dtype=op_dtype),
        k.new_empty((batch, kv_heads, n_blocks), dtype=f32),
    )


def _sagebwd_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    q_mean: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    stats: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    qk: str,
    dv: str,
    dp: str,
    ds: str,
    block_m: int,
    block_n: int,
    dkdv_kernel: str,
    dq_kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SageBwd backward: ``(dQ, dK, dV)`` from the plan's dK/dV and dQ kernels (by name; a traced call's
    :data:`.plan.IN_OPERATOR` is planned here); adds the dS statistics into ``stats`` when given."""
    if IN_OPERATOR in (dkdv_kernel, dq_kernel):
        # O and V stand in for q and k (their shapes, dtype and device); pv and smooth_k choose no backward kernel, and
        # Q-smoothing is what gave q_mean its [B, H, blocks, D] shape (an empty one without it).
        formats = {"qk": qk, "dv": dv, "dp": dp, "ds": ds, "smooth_q": q_mean.dim() > 1}
        plan = _operator_plan(out, v, is_causal, scale, block_m, block_n, **formats)
        dkdv_kernel = plan.dkdv if dkdv_kernel == IN_OPERATOR else dkdv_kernel
        dq_kernel = plan.dq if dq_kernel == IN_OPERATOR else dq_kernel
    # Looked up at each call, so that a test wrapping a kernel of this module sees its calls.
    dkdv_run = {GLUON_DKDV: gluon_dkdv, GLUON_DKDV_WG: gluon_dkdv_wg}.get(dkdv_kernel)
    dq_run = {GLUON_DQ: gluon_dq, GLUON_DQ_WG: gluon_dq_wg}.get(dq_kernel)
    if ds != "int8":
        # An FP8 or bf16 dS (every Gluon kernel takes those): the kernel is told its format.
        dkdv_run = functools.partial(dkdv_run, ds_fmt=ds) if dkdv_run is not None else None
        dq_run = functools.partial(dq_run, ds_fmt=ds) if dq_run is not None else None
    widen_q = widen_q_here(dkdv_kernel, ds)
    # With an INT8 dS the one-warpgroup dK/dV kernel stores each tile's dS scale for the one-warpgroup dQ kernel where
    # that kernel then takes three warpgroups of 64 queries (gluon_dq.wg_consumers: causal calls), which cannot reduce
    # the scale over the tile's 128 queries themselves (N x Nk / 2048 bytes per query head).
    share_ds_scales = share_ds_scales_here(dkdv_kernel, dq_kernel, ds, is_causal)
    return backward(
        grad_out,
        out,
        q_op,
        q_scale,
        q_mean if q_mean.numel() else None,
        k_op,
        k_scale,
        v,
        lse,
        stats,
        is_causal=is_causal,
        scale=scale,
        block_m=block_m,
        block_n=block_n,
        qk=qk,
        dv=dv,
        dp=dp,
        ds=ds,
        dkdv_kernel=dkdv_run,
        dq_kernel=dq_run,
        widen_q=widen_q,
        share_ds_scales=share_ds_scales,
    )


def widen_q_here(dkdv_kernel: str, ds: str) -> bool:
    """Whether the backward's preprocess launch writes Q'^ in bf16 for the dK/dV kernel (``backward``'s ``widen_q``,
    N x D x 2 bytes per query head while that kernel runs): either Gluon dK/dV kernel (:data:`.plan.GLUON_DKDV`,
    :data:`.plan.GLUON_DKDV_WG`, both warp-specialised without ``defer`` as ``ops`` runs them) with an FP8 or bf16
    dS, whose bf16 dK product then reads the copy through TMA instead of widening every tile's INT8 codes itself. In
    the one-warpgroup kernel that widening cost 10% of its loop (offline sm_90 compile, FP8 dS: 1,453 against 1,299
    instructions, 248 against 196 bytes of spills); in the two-warpgroup kernel at D=128 (bf16 dS) 14% of its stall
    samples (issue 42, Nsight Compute on an H200). Looked up at each call: a benchmark patching it to return
    ``False`` runs the kernels' own widening (the same gradients bit for bit).

    Example::

        widen_q_here("gluon_dkdv", "bf16")   # True
    """
    return dkdv_kernel in (GLUON_DKDV, GLUON_DKDV_WG) and ds != "int8"


def share_ds_scales_here(dkdv_kernel: str, dq_kernel: str, ds: str, is_causal: bool) -> bool:
    """Whether the backward hands the dK/dV kernel's INT8 dS tile scales to the dQ kernel (``backward``'s
    ``share_ds_scales``): both kernels the one-warpgroup ones (:data:`.plan.GLUON_DKDV_WG`, :data:`.plan.GLUON_DQ_WG`),
    an INT8 dS, and the dQ kernel's rule (:func:`.hopper.gluon_dq.wg_consumers`, looked up at each call: a benchmark
    patching it to its old rule turns the path off) giving three consumer warpgroups with the scales.

    Example::

        share_ds_scales_here("gluon_dkdv_wg", "gluon_dq_wg", "int8", True)   # True
    """
    return (
        dkdv_kernel == GLUON_DKDV_WG
        and dq_kernel == GLUON_DQ_WG
        and ds == "int8"
        and gluon_dq_module.wg_consumers(ds, is_causal, ds_scale=True) == 3
    )


#: The backward as an operator (the forward operator's autograd formula calls it).
sagebwd_backward = torch.library.custom_op("sage_lightning::sagebwd_backward", mutates_args=("stats",))(
    _sagebwd_backward
)


@sagebwd_backward.register_fake
def _sagebwd_backward_fake(grad_out, out, lse, q_op, q_scale, q_mean, k_op, k_scale, v, stats, is_causal, scale,
                           qk, dv, dp, ds, block_m, block_n, dkdv_kernel, dq_kernel):  # fmt: skip
    return grad_out.new_empty(q_op.shape), grad_out.new_empty(k_op.shape), grad_out.new_empty(k_op.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, stats, is_causal, scale, qk, _pv, dv, dp, ds, _sk, _sq, block_m, block_n, _fwd, dkdv, dq = inputs
    out, lse, q_op, q_scale, q_mean, k_op, k_scale = output
    # q and k themselves are not kept: the backward recomputes S from Q'^, K'^ (matching recomputation).
    ctx.save_for_backward(out, lse, q_op, q_scale, q_mean, k_op, k_scale, v)
    # Not saved as a tensor: the backward adds into it in place, and a layer called twice per step (shared
    # weights, activation checkpointing) would trip autograd's saved-tensor version check.
    ctx.stats = stats
    ctx.config = (is_causal, scale, qk, dv, dp, ds, block_m, block_n, dkdv, dq)
    ctx.mark_non_differentiable(lse, q_op, q_scale, q_mean, k_op, k_scale)
    # The backward reads only O's gradient. Materialized, the other six outputs' gradients would be zero tensors
    # of their shapes allocated for every backward (66 MiB at 16K tokens and 2048 channels, at the peak).
    ctx.set_materialize_grads(False)


def _gradients(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor | None, run_backward: Callable[..., tuple]
) -> tuple:
    # The forward's 18 inputs get (dQ, dK, dV) and 15 Nones from ``run_backward`` (the operator or its function).
    if grad_out is None:  # gradients are not materialized (_setup_context): O took no part in what is derived
        return (None,) * 18
    out, lse, q_op, q_scale, q_mean, k_op, k_scale, v = ctx.saved_tensors
    dq, dk, dv = run_backward(grad_out, out, lse, q_op, q_scale, q_mean, k_op, k_scale, v, ctx.stats, *ctx.config)
    return (dq, dk, dv) + (None,) * 15


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, *_unused: torch.Tensor) -> tuple:
    return _gradients(ctx, grad_out, sagebwd_backward)


torch.library.register_autograd("sage_lightning::sagebwd_forward", _backward, setup_context=_setup_context)


def _per_block(scale: torch.Tensor, seq: int, block: int) -> torch.Tensor:
    """A per-(batch, head) scale ``[B, H]`` as the kernels read scales: one per block of ``block`` rows."""
    return scale[:, :, None].expand(-1, -1, triton.cdiv(seq, block)).contiguous()


@torch.library.custom_op("sage_lightning::attn_qat_forward", mutates_args=())
def attn_qat_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    matched: bool,
    block_m: int,
    block_n: int,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """Attn-QAT's forward: the SageBwd kernels with ``qk`` and ``pv`` in ``"nvfp4"``. Returns
    ``(O, lse2, O_hp, U_Q, s_Q, U_K, s_K, U_V, s_V)``: the NVFP4 values of Q, K, V (the input dtype, contiguous)
    with their scales per block (``[B, H, blocks]``); ``O_hp`` (the output of the unquantized P) only when
    ``matched`` (empty otherwise); ``lse2`` base 2, of the quantized scores.
    """
    seq_q, seq_k = q.shape[2], k.shape[2]
    q_values, q_scale = quantize_heads_nvfp4(q)
    k_values, k_scale = quantize_heads_nvfp4(k)
    v_values, v_scale = quantize_heads_nvfp4(v)
    q_scale = _per_block(q_scale, seq_q, block_m)
    k_scale, v_scale = _per_block(k_scale, seq_k, block_n), _per_block(v_scale, seq_k, block_n)
    out = output_like(q)
    out_hp = torch.empty_like(out) if matched else None
    out, lse = forward(
        q_values, q_scale, None, k_values, k_scale, v_values, v_scale, out_dtype=q.dtype, is_causal=is_causal,
        scale=scale, block_m=block_m, block_n=block_n, qk="nvfp4", pv="nvfp4", out=out, out_hp=out_hp,
    )  # fmt: skip
    out_hp = out_hp if out_hp is not None else q.new_empty(_EMPTY)
    return out, lse, out_hp, q_values, q_scale, k_values, k_scale, v_values, v_scale


@attn_qat_forward.register_fake
def _attn_qat_forward_fake(q, k, v, is_causal, scale, matched, block_m, block_n):  # noqa: ANN001, ANN202
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    f32 = torch.float32
    m_blocks, n_blocks = triton.cdiv(seq_q, block_m), triton.cdiv(seq_k, block_n)
    return (
        output_like(q),
        q.new_empty((batch, heads, seq_q), dtype=f32),
        output_like(q) if matched else q.new_empty(_EMPTY),
        q.new_empty(q.shape),
        q.new_empty((batch, heads, m_blocks), dtype=f32),
        k.new_empty(k.shape),
        k.new_empty((batch, kv_heads, n_blocks), dtype=f32),
        v.new_empty(v.shape),
        v.new_empty((batch, kv_heads, n_blocks), dtype=f32),
    )


@torch.library.custom_op("sage_lightning::attn_qat_backward", mutates_args=())
def attn_qat_backward(
    grad_out: torch.Tensor,
    out_for_delta: torch.Tensor,
    lse: torch.Tensor,
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v_op: torch.Tensor,
    v_scale: torch.Tensor,
    is_causal: bool,
    scale: float,
    matched: bool,
    block_m: int,
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attn-QAT's backward, ``(dQ, dK, dV)``: the SageBwd kernels in the formats of
    :meth:`AttentionPrecision.attn_qat`'s backward (``dv``, ``dp`` in ``"nvfp4"`` and ``ds`` in ``"bf16"`` from the
    NVFP4 values when ``matched``; every product in ``"bf16"`` from q, k, v with scale 1 for the drop-in backward).
    ``out_for_delta`` is O_hp (matched) or O."""
    precision = AttentionPrecision.attn_qat(backward="matched" if matched else "dropin")
    formats = precision.formats
    # The drop-in backward recomputes S from the unquantized inputs: the forward's NVFP4 Q K is not its product.
    qk = "bf16" if precision.backward_from_inputs else formats["qk"]
    return backward(
        grad_out, out_for_delta, q_op, q_scale, None, k_op, k_scale, v_op, lse, None, v_scale=v_scale,
        is_causal=is_causal, scale=scale, block_m=block_m, block_n=block_n,
        qk=qk, dv=formats["dv"], dp=formats["dp"], ds=formats["ds"],
    )  # fmt: skip


@attn_qat_backward.register_fake
def _attn_qat_backward_fake(grad_out, out_for_delta, lse, q_op, q_scale, k_op, k_scale, v_op, v_scale, is_causal,
                            scale, matched, block_m, block_n):  # fmt: skip  # noqa: ANN001, ANN202
    return grad_out.new_empty(q_op.shape), grad_out.new_empty(k_op.shape), grad_out.new_empty(v_op.shape)


def _attn_qat_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, is_causal, scale, matched, block_m, block_n = inputs
    out, lse, out_hp, q_values, q_scale, k_values, k_scale, v_values, v_scale = output
    if matched:
        # Matching recomputation: the backward's S and P come from the forward's NVFP4 values, not from q and k.
        ctx.save_for_backward(out_hp, lse, q_values, q_scale, k_values, k_scale, v_values, v_scale)
    else:
        # FlashAttention's backward: the inputs themselves (scale 1), the forward's O and logsumexp.
        q_ones, k_ones = torch.ones_like(q_scale), torch.ones_like(k_scale)
        ctx.save_for_backward(out, lse, q, q_ones, k, k_ones, v, k_ones)
    ctx.config = (is_causal, scale, matched, block_m, block_n)
    ctx.mark_non_differentiable(lse, out_hp, q_values, q_scale, k_values, k_scale, v_values, v_scale)
    # The backward reads only O's gradient: no zero gradients for the other eight outputs.
    ctx.set_materialize_grads(False)


def _attn_qat_gradients(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor | None, *_unused: torch.Tensor | None
) -> tuple:
    if grad_out is None:  # gradients are not materialized: O took no part in what is derived
        return (None,) * 8
    out_for_delta, lse, q_op, q_scale, k_op, k_scale, v_op, v_scale = ctx.saved_tensors
    q_op, k_op, v_op = (t.contiguous() for t in (q_op, k_op, v_op))  # the drop-in's inputs may have any strides
    dq, dk, dv = attn_qat_backward(
        grad_out, out_for_delta, lse, q_op, q_scale, k_op, k_scale, v_op, v_scale, *ctx.config
    )
    return (dq, dk, dv) + (None,) * 5


torch.library.register_autograd(
    "sage_lightning::attn_qat_forward", _attn_qat_gradients, setup_context=_attn_qat_setup_context
)


class _SageBwd(torch.autograd.Function):
    """The same forward and backward as the two operators, for eager calls: ``torch.library``'s dispatch of a
    Python operator costs the host about 0.2 ms per forward and 0.3 ms per backward (measured on an H100 host at
    the example's shape, ``benchmarks/host_breakdown.py``), more than cuDNN's whole call. Traced calls
    (``torch.compile``, fake tensors, dispatch modes) take the operators, which trace without a graph break."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, *inputs: object) -> tuple[torch.Tensor, ...]:
        output = _sagebwd_forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, *_unused: torch.Tensor) -> tuple:
        return _gradients(ctx, grad_out, _sagebwd_backward)


def _traced(q: torch.Tensor) -> bool:
    """Whether a call is being traced (``torch.compile``, fake or subclass tensors, a dispatch mode): such calls
    take the registered operators, eager calls :class:`_SageBwd`."""
    return torch.compiler.is_compiling() or type(q) is not torch.Tensor or _get_current_dispatch_mode() is not None


def sage_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
    stats: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    with_lse: bool = True,
    plan: KernelPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SageBwd or Attn-QAT through the Triton kernels, differentiable; returns ``(O, logsumexp)`` like the reference.

    Callers normally use :func:`sage_lightning.kernels.sage_attention`, which checks arguments and routes
    CUDA tensors here. This function trusts its arguments (SDPA layout, ``Hq % Hkv == 0``, bf16/fp16/fp32,
    head dim up to :data:`MAX_TRITON_HEAD_DIM`) and runs on any device Triton runs on, the CPU included
    under ``TRITON_INTERPRET=1``.

    Args:
        q, k, v, is_causal, scale, precision, stats: as :func:`sage_lightning.kernels.sage_attention` (``stats`` is
            SageBwd's: a ``mode="attn_qat"`` precision adds nothing to it).
        block_m, block_n: the tiles, which are also SageBwd's quantization blocks (powers of two, 16 to 256);
            ``block_m`` ``None`` is 128 (SageBwd) or 64 (Attn-QAT, where it changes no result); Attn-QAT's
            ``block_n`` sets P's quantization rows.
        with_lse: also compute SDPA's logsumexp (one more pass over q); ``False`` returns ``None`` for it.
        plan: the call's :class:`.plan.KernelPlan`, when the caller has made it (its tiles replace ``block_m`` and
            ``block_n``); ``None`` plans the call here, with the Triton kernels whatever the device.

    Raises:
        UnsupportedAttention: a tile that is not a power of two from 16 to 256, FP8 products on a GPU without them.

    Returns:
        ``O`` ``[B, Hq, N, D]`` and SDPA's row logsumexp ``[B, Hq, N]`` (fp32, natural log) or ``None``.

    Example::

        out, lse = sage_attention_triton(q, k, v, is_causal=True)
    """
    precision = AttentionPrecision() if precision is None else precision
    if plan is None:
        plan = plan_attention(
            q, k, precision, is_causal=is_causal, scale=scale, block_m=block_m, block_n=block_n, backend="triton"
        )
    block_m, block_n = plan.block_m, plan.block_n
    tau = softmax_scale(q.shape[-1], scale)
    if precision.mode == "attn_qat":
        out, lse2, *_ = attn_qat_forward(q, k, v, is_causal, tau, precision.high_precision_out, block_m, block_n)
        return out, (lse2.detach() / LOG2E if with_lse else None)
    attention = sagebwd_forward if _traced(q) else _SageBwd.apply
    out, lse2, *_ = attention(
        q, k, v, stats, is_causal, tau, precision.qk, precision.pv, precision.dv, precision.dp, precision.ds,
        precision.smooth_k, precision.smooth_q, block_m, block_n, plan.forward, plan.dkdv, plan.dq,
    )  # fmt: skip
    if not with_lse:
        return out, None
    lse = lse2.detach() / LOG2E
    if precision.smooth_k:
        lse = undo_k_smoothing_shift(lse, q.detach(), finite_mean(k.detach()), tau)
    return out, lse
