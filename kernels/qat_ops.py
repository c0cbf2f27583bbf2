"""The Attn-QAT Triton path as PyTorch operators: ``sage_lightning::attn_qat_forward`` / ``attn_qat_backward``.

Both are ``torch.library.custom_op``\\ s with fake (meta) implementations, and the backward is registered as
the forward's autograd formula, so a ``torch.compile``\\ d model traces through them without a graph break.
What the forward keeps for the backward depends on ``matched``: the NVFP4 values of Q, K, V with their scales,
O_hp and the logsumexp (Attn-QAT); or q, k, v, O and the logsumexp (the drop-in backward, FlashAttention's).
"""

from __future__ import annotations

import torch

from .precision import AttentionPrecision
from .qat_backward import qat_backward
from .qat_forward import qat_forward
from .qat_quant import quantize_qkv_triton
from .reference import DEFAULT_BLOCK_N, softmax_scale
from .tiles import LOG2E

#: Query tile of the Attn-QAT kernels. It changes no result (P's quantization rows are per query, the key tile
#: sets them); 64 rather than SageBwd's 128 because the forward carries two fp32 output accumulators (O and O_hp)
#: and quantizes P in registers.
QAT_BLOCK_M = 64


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
    """Attn-QAT forward. Returns ``(O, lse2, O_hp, U_Q, s_Q, U_K, s_K, U_V, s_V)``.

    ``lse2`` is the base-2 logsumexp of the quantized scores; ``O_hp`` (the output of the unquantized P) is
    computed only when ``matched`` (empty otherwise).
    """
    q_values, q_scale = quantize_qkv_triton(q)
    k_values, k_scale = quantize_qkv_triton(k)
    v_values, v_scale = quantize_qkv_triton(v)
    out, out_hp, lse = qat_forward(
        q_values,
        q_scale,
        k_values,
        k_scale,
        v_values,
        v_scale,
        is_causal=is_causal,
        scale=scale,
        block_m=block_m,
        block_n=block_n,
        high_precision_out=matched,
    )
    out_hp = out_hp if out_hp is not None else q.new_empty((0,))
    return out, lse, out_hp, q_values, q_scale, k_values, k_scale, v_values, v_scale


@attn_qat_forward.register_fake
def _attn_qat_forward_fake(q, k, v, is_causal, scale, matched, block_m, block_n):  # noqa: ANN001, ANN202
    batch, heads, seq_q, _ = q.shape
    kv_heads = k.shape[1]
    f32 = torch.float32
    return (
        q.new_empty(q.shape),
        q.new_empty((batch, heads, seq_q), dtype=f32),
        q.new_empty(q.shape if matched else (0,)),
        q.new_empty(q.shape),
        q.new_empty((batch, heads), dtype=f32),
        k.new_empty(k.shape),
        k.new_empty((batch, kv_heads), dtype=f32),
        v.new_empty(v.shape),
        v.new_empty((batch, kv_heads), dtype=f32),
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
    """Attn-QAT backward: ``(dQ, dK, dV)`` (see :func:`~.qat_backward.qat_backward`)."""
    return qat_backward(
        grad_out,
        out_for_delta,
        lse,
        q_op,
        q_scale,
        k_op,
        k_scale,
        v_op,
        v_scale,
        is_causal=is_causal,
        scale=scale,
        block_m=block_m,
        block_n=block_n,
        quantize_p=matched,
    )


@attn_qat_backward.register_fake
def _attn_qat_backward_fake(grad_out, out_for_delta, lse, q_op, q_scale, k_op, k_scale, v_op, v_scale, is_causal,
                            scale, matched, block_m, block_n):  # fmt: skip  # noqa: ANN001, ANN202
    return grad_out.new_empty(q_op.shape), grad_out.new_empty(k_op.shape), grad_out.new_empty(v_op.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, is_causal, scale, matched, block_m, block_n = inputs
    out, lse, out_hp, q_values, q_scale, k_values, k_scale, v_values, v_scale = output
    if matched:
        # Matching recomputation: the backward's S and P come from the forward's NVFP4 values, not from q and k.
        ctx.save_for_backward(out_hp, lse, q_values, q_scale, k_values, k_scale, v_values, v_scale)
    else:
        # FlashAttention's backward: the inputs themselves (scale 1), the forward's O and logsumexp.
        ones = torch.ones_like(q_scale), torch.ones_like(k_scale)
        ctx.save_for_backward(out, lse, q, ones[0], k, ones[1], v, ones[1])
    ctx.config = (is_causal, scale, matched, block_m, block_n)
    ctx.mark_non_differentiable(lse, out_hp, q_values, q_scale, k_values, k_scale, v_values, v_scale)
    # The backward reads only O's gradient: no zero gradients for the other eight outputs (O's fp32 copy among them).
    ctx.set_materialize_grads(False)


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor | None, *_unused: torch.Tensor | None
) -> tuple:
    if grad_out is None:  # gradients are not materialized (_setup_context): O took no part in what is derived
        return (None,) * 8
    out_for_delta, lse, q_op, q_scale, k_op, k_scale, v_op, v_scale = ctx.saved_tensors
    q_op, k_op, v_op = (t.contiguous() for t in (q_op, k_op, v_op))  # the drop-in's inputs may have any strides
    dq, dk, dv = attn_qat_backward(
        grad_out, out_for_delta, lse, q_op, q_scale, k_op, k_scale, v_op, v_scale, *ctx.config
    )
    return (dq, dk, dv) + (None,) * 5


torch.library.register_autograd("sage_lightning::attn_qat_forward", _backward, setup_context=_setup_context)


def attn_qat_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
    block_m: int = QAT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attn-QAT through the Triton kernels, differentiable; returns ``(O, logsumexp)`` like the reference.

    Callers normally use :func:`sage_lightning.kernels.sage_attention` with ``AttentionPrecision(mode="attn_qat")``,
    which routes CUDA tensors here. This function trusts its arguments (SDPA layout, ``Hq % Hkv == 0``,
    bf16/fp16/fp32, head dim up to 128) and runs on any device Triton runs on, the CPU included under
    ``TRITON_INTERPRET=1``.

    Args:
        q, k, v, is_causal, scale: as :func:`sage_lightning.kernels.sage_attention`.
        precision: ``qat_backward`` picks the backward (``"matched"`` when ``None``); its other fields are not read.
        block_m, block_n: the tiles (powers of two, at least 16); ``block_n`` sets P's quantization rows (the
            reference's default), ``block_m`` changes no result.
        with_lse: also return the logsumexp; ``False`` returns ``None`` for it.

    Returns:
        ``O`` ``[B, Hq, N, D]`` and the row logsumexp of the quantized scores ``[B, Hq, N]`` (fp32, natural log)
        or ``None``.

    Example::

        out, lse = attn_qat_triton(q, k, v, is_causal=True, precision=AttentionPrecision(mode="attn_qat"))
    """
    matched = precision is None or precision.qat_backward == "matched"
    tau = softmax_scale(q.shape[-1], scale)
    out, lse2, *_ = attn_qat_forward(q, k, v, is_causal, tau, matched, block_m, block_n)
    return out, (lse2.detach() / LOG2E if with_lse else None)
