"""Triton backward of Attn-QAT: dK and dV in one kernel, dQ in another, S recomputed tile by tile.

The kernels take the operands S is recomputed from and their per-(batch, head) FP32 scales: for the matched
backward (Attn-QAT) the forward's NVFP4 values of Q, K, V, so the backward's S and P are the forward's
(matching recomputation); for the drop-in backward the unquantized q, k, v with scale 1, which makes these
FlashAttention's backward. Per ``BLOCK_M x BLOCK_N`` tile, as :mod:`.qat_reference`:

* ``P = exp2(S - lse)``; ``dV += bf16(fq(P))^T dO`` with ``fq(P)`` P re-quantized per row of the tile as the
  forward quantized it (``QUANTIZE_P``; the drop-in backward takes ``bf16(P)``);
* ``dP = (dO V^T) s_V``, ``dS = P (dP - delta)`` with ``delta`` from O_hp (matched) or O (drop-in);
* ``dQ += tau (bf16(dS) K) s_K``, ``dK += tau (bf16(dS)^T Q) s_Q``.

The dK/dV program owns one key block of a kv head and loops over every query head of its group (each with
its own Q scale), so GQA gradients are summed without repeating K or V. Its key blocks are the forward's key
tiles, so P's quantization rows are the forward's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qat_quant import quantize_p_rows
from .quant import backward_preprocess, dot_precision, hp_dot, padded_head_dim, seq_bucket, to_dtype, tuning_configs
from .tiles import LOG2E, load_tile, scores_tile

_BACKWARD_CONFIGS = ((8, 2), (8, 3), (4, 2))
# Every constexpr that changes the code is in the key.
_BACKWARD_KEY = ["HEAD_DIM", "SEQ_BUCKET", "BLOCK_M", "BLOCK_N", "CAUSAL", "DOT_PRECISION"]


@triton.autotune(configs=tuning_configs(_BACKWARD_CONFIGS), key=_BACKWARD_KEY + ["QUANTIZE_P"])
@triton.jit
def _qat_dkdv_kernel(
    Q,
    Q_SCALE,
    K,
    K_SCALE,
    V,
    V_SCALE,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    HEADS,
    GROUP,
    SEQ_Q,
    SEQ_K,
    HEAD_DIM,
    SEQ_BUCKET,
    qk_scale,
    tau,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    QUANTIZE_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    kv_heads = HEADS // GROUP
    b = pid_bkv // kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D_PAD)
    io_dtype = DK.dtype.element_ty
    k = load_tile(K + pid_bkv * SEQ_K * HEAD_DIM, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
    v = load_tile(V + pid_bkv * SEQ_K * HEAD_DIM, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
    k_scale = tl.load(K_SCALE + pid_bkv)
    v_scale = tl.load(V_SCALE + pid_bkv)
    no_mean = tl.zeros([D_PAD], dtype=tl.float32)
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        # Query blocks that end before this key block starts see none of its keys.
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(0, GROUP):
        bh = b * HEADS + (pid_bkv % kv_heads) * GROUP + g
        head = bh % HEADS
        q_scale = tl.load(Q_SCALE + bh)
        dk_head = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
        for start_m in range(lo, SEQ_Q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = load_tile(Q + bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
            do = tl.load(
                DO + b * stride_dob + head * stride_doh + offs_m[:, None] * stride_don + cols[None, :] * stride_dod,
                mask=(offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM),
                other=0.0,
            )
            lse = tl.load(LSE + bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
            delta = tl.load(DELTA + bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
            s, invalid = scores_tile(
                q, q_scale, no_mean, k, k_scale, offs_m, offs_n, SEQ_Q, SEQ_K, qk_scale, CAUSAL, "bf16", False,
                DOT_PRECISION,
            )  # fmt: skip
            p = tl.where(invalid, 0.0, tl.math.exp2(s - lse[:, None]))
            if QUANTIZE_P:
                p_values, p_scale = quantize_p_rows(p, BLOCK_M, BLOCK_N)
                p_dv = p_values * p_scale[:, None]
            else:
                p_dv = p
            dv += hp_dot(tl.trans(to_dtype(p_dv, io_dtype, DOT_PRECISION)), do, DOT_PRECISION)
            dp = hp_dot(do, tl.trans(v), DOT_PRECISION) * v_scale
            ds = p * (dp - delta[:, None])
            dk_head += hp_dot(tl.trans(to_dtype(ds, io_dtype, DOT_PRECISION)), q, DOT_PRECISION)
        dk += dk_head * q_scale
    valid = (offs_n[:, None] < SEQ_K) & (cols[None, :] < HEAD_DIM)
    offsets = pid_bkv * SEQ_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + cols[None, :]
    tl.store(DK + offsets, to_dtype(dk * tau, io_dtype, DOT_PRECISION), mask=valid)
    tl.store(DV + offsets, to_dtype(dv, io_dtype, DOT_PRECISION), mask=valid)


@triton.autotune(configs=tuning_configs(_BACKWARD_CONFIGS), key=_BACKWARD_KEY)
@triton.jit
def _qat_dq_kernel(
    Q,
    Q_SCALE,
    K,
    K_SCALE,
    V,
    V_SCALE,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    HEADS,
    GROUP,
    SEQ_Q,
    SEQ_K,
    HEAD_DIM,
    SEQ_BUCKET,
    qk_scale,
    tau,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    head = pid_bh % HEADS
    kv_bh = b * (HEADS // GROUP) + head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    io_dtype = DQ.dtype.element_ty
    q = load_tile(Q + pid_bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
    q_scale = tl.load(Q_SCALE + pid_bh)
    k_scale = tl.load(K_SCALE + kv_bh)
    v_scale = tl.load(V_SCALE + kv_bh)
    do = tl.load(
        DO + b * stride_dob + head * stride_doh + offs_m[:, None] * stride_don + cols[None, :] * stride_dod,
        mask=(offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM),
        other=0.0,
    )
    lse = tl.load(LSE + pid_bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    delta = tl.load(DELTA + pid_bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    no_mean = tl.zeros([D_PAD], dtype=tl.float32)
    k_base = K + kv_bh * SEQ_K * HEAD_DIM
    v_base = V + kv_bh * SEQ_K * HEAD_DIM
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    hi = SEQ_K
    if CAUSAL:
        hi = tl.minimum(SEQ_K, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        v = load_tile(v_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        s, invalid = scores_tile(
            q, q_scale, no_mean, k, k_scale, offs_m, offs_n, SEQ_Q, SEQ_K, qk_scale, CAUSAL, "bf16", False,
            DOT_PRECISION,
        )  # fmt: skip
        p = tl.where(invalid, 0.0, tl.math.exp2(s - lse[:, None]))
        dp = hp_dot(do, tl.trans(v), DOT_PRECISION) * v_scale
        ds = p * (dp - delta[:, None])
        dq += hp_dot(to_dtype(ds, io_dtype, DOT_PRECISION), k, DOT_PRECISION)
    tl.store(
        DQ + pid_bh * SEQ_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + cols[None, :],
        to_dtype(dq * (k_scale * tau), io_dtype, DOT_PRECISION),
        mask=(offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM),
    )


def qat_backward(
    grad_out: torch.Tensor,
    out_for_delta: torch.Tensor,
    lse: torch.Tensor,
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v_op: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    quantize_p: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the Attn-QAT backward: ``(dQ, dK, dV)`` in the input dtype.

    Args:
        grad_out: dO ``[B, Hq, N, D]``, any strides.
        out_for_delta: the output ``delta = rowsum(dO * O)`` reads: O_hp (matched) or O (drop-in).
        lse: the forward's logsumexp ``[B, Hq, N]`` (fp32, base 2).
        q_op, q_scale: ``[B, Hq, N, D]`` contiguous and ``[B, Hq]`` fp32: the forward's NVFP4 values of Q and their
            scales (matched) or q and ones (drop-in).
        k_op, k_scale, v_op, v_scale: the same for K and V (``[B, Hkv, Nk, D]``, ``[B, Hkv]``).
        is_causal, scale, block_m, block_n: as the forward (``block_n`` must be the forward's).
        quantize_p: re-quantize P for dV as the forward did (matched).

    Example::

        dq, dk, dv = qat_backward(do, out_hp, lse2, u_q, s_q, u_k, s_k, u_v, s_v, is_causal=True, scale=0.125,
                                  block_m=128, block_n=64, quantize_p=True)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    delta, *_ = backward_preprocess(grad_out, out_for_delta, block_m, codes=False, codes_t=False)
    dq = torch.empty_like(q_op)
    dk = torch.empty_like(k_op)
    dv = torch.empty_like(v_op)
    common = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D_PAD=padded_head_dim(head_dim),
        CAUSAL=is_causal,
        DOT_PRECISION=dot_precision(q_op.dtype),
    )
    sizes = (heads, heads // kv_heads, seq_q, seq_k, head_dim, seq_bucket(max(seq_q, seq_k)), scale * LOG2E, scale)
    operands = (q_op, q_scale, k_op, k_scale, v_op, v_scale, grad_out, lse, delta)
    if seq_k and batch * kv_heads:
        _qat_dkdv_kernel[(triton.cdiv(seq_k, block_n), batch * kv_heads)](
            *operands, dk, dv, *grad_out.stride(), *sizes, QUANTIZE_P=quantize_p, **common
        )
    if seq_q and batch * heads:
        _qat_dq_kernel[(triton.cdiv(seq_q, block_m), batch * heads)](
            *operands, dq, *grad_out.stride(), *sizes, **common
        )
    return dq, dk, dv
