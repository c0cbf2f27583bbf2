"""Triton forward of Attn-QAT: simulated NVFP4 attention with an online softmax over key tiles.

One program per (query tile of ``BLOCK_M`` rows, batch x query head); the kv head is ``query head // group``.
It reads the NVFP4 values of Q, K and V (exact in the input dtype, written by
:func:`~.qat_quant.quantize_qkv_triton`) and their per-(batch, head) FP32 scales, so every product runs in the
input dtype with fp32 accumulation and the scales multiply its fp32 result. Per key tile:

* ``S = (U_Q U_K^T) s_Q s_K tau log2(e)`` (base 2, :func:`~.tiles.scores_tile`), ``P~ = exp2(S - m)``;
* the row sum adds the unquantized ``P~``; ``P~`` is fake-quantized per row of the tile
  (:func:`~.qat_quant.quantize_p_rows`) and ``acc += (U_P U_V) s_P``;
* with ``HIGH_PRECISION_OUT``, ``acc_hp += bf16(P~) U_V``: the output of the unquantized P, which the matched
  backward's ``delta`` needs.

O and O_hp are ``acc * s_V / l``; the stored logsumexp is base 2, of the quantized scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qat_quant import quantize_p_rows
from .quant import dot_precision, hp_dot, padded_head_dim, seq_bucket, to_dtype, tuning_configs
from .tiles import LOG2E, load_tile, scores_tile


# Every constexpr that changes the code is in the key.
@triton.autotune(
    configs=tuning_configs(((8, 2), (8, 3), (4, 2))),
    key=["HEAD_DIM", "SEQ_BUCKET", "BLOCK_M", "BLOCK_N", "CAUSAL", "HIGH_PRECISION_OUT", "DOT_PRECISION"],
)
@triton.jit
def _qat_forward_kernel(
    Q,
    Q_SCALE,
    K,
    K_SCALE,
    V,
    V_SCALE,
    OUT,
    OUT_HP,
    LSE,
    HEADS,
    GROUP,
    SEQ_Q,
    SEQ_K,
    HEAD_DIM,
    SEQ_BUCKET,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    HIGH_PRECISION_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    kv_bh = b * (HEADS // GROUP) + (pid_bh % HEADS) // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    io_dtype = OUT.dtype.element_ty
    # The NVFP4 values are contiguous [B, H, N, D]; O and O_hp are written contiguous too.
    q = load_tile(Q + pid_bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
    q_scale = tl.load(Q_SCALE + pid_bh)
    k_scale = tl.load(K_SCALE + kv_bh)
    v_scale = tl.load(V_SCALE + kv_bh)
    no_mean = tl.zeros([D_PAD], dtype=tl.float32)
    k_base = K + kv_bh * SEQ_K * HEAD_DIM
    v_base = V + kv_bh * SEQ_K * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    acc_hp = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    hi = SEQ_K
    if CAUSAL:
        # Top-left causal: keys after the tile's last query contribute exactly zero, skip them.
        hi = tl.minimum(SEQ_K, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        s, _ = scores_tile(
            q, q_scale, no_mean, k, k_scale, offs_m, offs_n, SEQ_Q, SEQ_K, qk_scale, CAUSAL, "bf16", False,
            DOT_PRECISION,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with every key so far masked keeps max -inf; exp2(-inf - 0) = 0 leaves it empty.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_tile(v_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        # P per row of the tile: values of exp2(S - tilemax), so they do not depend on the running max.
        p_values, p_scale = quantize_p_rows(p, BLOCK_M, BLOCK_N)
        pv = hp_dot(p_values.to(io_dtype), v, DOT_PRECISION)  # the NVFP4 values are exact in the input dtype
        acc = acc * alpha[:, None] + pv * p_scale[:, None]
        if HIGH_PRECISION_OUT:
            acc_hp = acc_hp * alpha[:, None] + hp_dot(to_dtype(p, io_dtype, DOT_PRECISION), v, DOT_PRECISION)
        m_i = m_new
    valid = (offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM)
    out_offsets = pid_bh * SEQ_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + cols[None, :]
    norm = v_scale / l_i
    tl.store(OUT + out_offsets, to_dtype(acc * norm[:, None], io_dtype, DOT_PRECISION), mask=valid)
    if HIGH_PRECISION_OUT:
        tl.store(OUT_HP + out_offsets, to_dtype(acc_hp * norm[:, None], io_dtype, DOT_PRECISION), mask=valid)
    tl.store(LSE + pid_bh * SEQ_Q + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < SEQ_Q)


def qat_forward(
    q_values: torch.Tensor,
    q_scale: torch.Tensor,
    k_values: torch.Tensor,
    k_scale: torch.Tensor,
    v_values: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    high_precision_out: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch the Attn-QAT forward on NVFP4 values (see :func:`~.qat_quant.quantize_qkv_triton`).

    Args:
        q_values, q_scale: ``[B, Hq, N, D]`` contiguous (the input dtype) and ``[B, Hq]`` fp32.
        k_values, k_scale: ``[B, Hkv, Nk, D]`` and ``[B, Hkv]``.
        v_values, v_scale: as K.
        is_causal: top-left causal mask.
        scale: softmax scale ``tau``.
        block_m, block_n: tile sizes; ``block_n`` (a multiple of 16) sets P's quantization rows.
        high_precision_out: also compute O_hp, the output of the unquantized P (the matched backward's delta).

    Returns:
        ``O`` ``[B, Hq, N, D]``, ``O_hp`` (or ``None``) and the logsumexp ``[B, Hq, N]`` (fp32, base 2).

    Example::

        out, out_hp, lse2 = qat_forward(*quantize_qkv_triton(q), *quantize_qkv_triton(k), *quantize_qkv_triton(v),
                                        is_causal=True, scale=0.125, block_m=128, block_n=64, high_precision_out=True)
    """
    batch, heads, seq_q, head_dim = q_values.shape
    kv_heads, seq_k = k_values.shape[1], k_values.shape[2]
    out = torch.empty_like(q_values)
    out_hp = torch.empty_like(q_values) if high_precision_out else None
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q_values.device)
    if seq_q and batch * heads:
        _qat_forward_kernel[(triton.cdiv(seq_q, block_m), batch * heads)](
            q_values,
            q_scale,
            k_values,
            k_scale,
            v_values,
            v_scale,
            out,
            out_hp if out_hp is not None else out,
            lse,
            heads,
            heads // kv_heads,
            seq_q,
            seq_k,
            head_dim,
            seq_bucket(max(seq_q, seq_k)),
            scale * LOG2E,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            D_PAD=padded_head_dim(head_dim),
            CAUSAL=is_causal,
            HIGH_PRECISION_OUT=high_precision_out,
            DOT_PRECISION=dot_precision(q_values.dtype),
        )
    return out, out_hp, lse
