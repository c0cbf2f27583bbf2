"""Triton forward of SageBwd and Attn-QAT: ``Q'^ K'^T`` and ``P^ V^`` in INT8, FP8, bf16 or simulated NVFP4 with an
online softmax over key tiles.

One program per (query tile of ``BLOCK_M`` rows, batch x query head); the kv head is ``query head // group``,
so grouped-query attention reads the shared K and V without repeating them. Scores are kept in base 2
(``tau * log2(e)`` folded into the dequantization scale) so the softmax uses ``exp2``. The stored logsumexp is
the internal one, of the smoothed scores and in base 2: the backward recomputes ``P = exp2(S - lse)`` from it.

NVFP4 (Attn-QAT): Q, K and V arrive as their NVFP4 values (exact in the input dtype) with one scale per (batch,
head), expanded per block, so ``qk="nvfp4"`` is the 16-bit product against those scales; ``pv="nvfp4"`` quantizes
``P~`` per row of the tile in registers (:func:`.quant.quantize_p_rows`) and multiplies V's values in the input dtype.
The row sum adds the unquantized ``P~``; with ``HIGH_PRECISION_OUT`` a second accumulator adds ``bf16(P~) V``, the
output of the unquantized P, which Attn-QAT's backward reads for ``delta``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import (
    FP8_MAX,
    dot_precision,
    hp_dot,
    int8_codes,
    int8_scale,
    int32_scaled,
    low_bit_dot,
    padded_head_dim,
    quantize_p_rows,
    seq_bucket,
    to_dtype,
    to_e4m3,
    tuning_configs,
)
from .tiles import LOG2E, key_range, load_tile, load_tile_t, poison_rows, scores_tile, tile_mask

__all__ = ["forward"]


@triton.jit
def _forward_tile(
    acc,
    acc_hp,
    l_i,
    m_i,
    q,
    q_scale,
    q_mean,
    k_base,
    v_base,
    K_SCALE,
    V_SCALE,
    kv_bh,
    k_blocks,
    start_n,
    offs_m,
    cols,
    SEQ_Q,
    SEQ_K,
    HEAD_DIM,
    qk_scale,
    full_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_FMT: tl.constexpr,
    PV_FMT: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    HIGH_PRECISION_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of the forward's online softmax: returns the updated ``(acc, acc_hp, l_i, m_i)`` (``acc_hp``
    changes only with ``HIGH_PRECISION_OUT``).

    Tiles from ``full_hi`` on (the causal diagonal, a last tile past ``SEQ_K``) are masked here; the earlier
    ones need no mask for any stored row (a padded query row, which is never stored, goes unmasked there).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    tile = start_n // BLOCK_N
    k_scale = tl.load(K_SCALE + kv_bh * k_blocks + tile)
    k = load_tile(k_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
    s, _ = scores_tile(
        q, q_scale, q_mean, k, k_scale, offs_m, offs_n, SEQ_Q, SEQ_K, qk_scale,
        CAUSAL, QK_FMT, SMOOTH_Q, DOT_PRECISION, False,
    )  # fmt: skip
    if start_n >= full_hi:
        s = tl.where(tile_mask(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), float("-inf"), s)
    tile_max = tl.max(s, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    # A row with every key so far masked keeps max -inf; exp2(-inf - 0) = 0 leaves it empty.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if PV_FMT == "fp8":
        # P~ against the running max is in [0, 1]: its codes are e4m3(448 P~), one scale for every tile, and V^ has
        # one scale per channel (applied at the end), so the product adds into O as it is.
        v_t = load_tile_t(v_base, offs_n, cols, SEQ_K, HEAD_DIM)
        pv = low_bit_dot(to_e4m3(p * FP8_MAX), tl.trans(v_t), DOT_PRECISION)
    elif PV_FMT == "int8":
        # V^ is stored [D, Nk]: the 8-bit product wants the summed-over keys contiguous.
        v_t = load_tile_t(v_base, offs_n, cols, SEQ_K, HEAD_DIM)
        # P per row of the tile, s_P = rowmax(P~) / 127: the codes do not depend on the running max.
        # rowmax(P~) is exp2 of the row's largest score (exp2 is monotonic), one exp2 per row instead of a
        # reduction over the tile. A NaN score, which max skips, still reaches O through l_i.
        p_scale = int8_scale(tl.math.exp2(tile_max - m_safe))
        p_codes = int8_codes(p, p_scale[:, None])
        v_scale = tl.load(V_SCALE + kv_bh * k_blocks + tile)
        pv = int32_scaled(tl.dot(p_codes, tl.trans(v_t)), p_scale[:, None] * v_scale)
    elif PV_FMT == "nvfp4":
        # P per row of the tile (values of exp2(S - tilemax), whatever the running max) against V's NVFP4 values;
        # both are exact in the input dtype. V's scale is applied at the end.
        v = load_tile(v_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        p_values, p_scale = quantize_p_rows(p, BLOCK_M, BLOCK_N)
        pv = hp_dot(p_values.to(v.dtype), v, DOT_PRECISION) * p_scale[:, None]
        if HIGH_PRECISION_OUT:
            acc_hp = acc_hp * alpha[:, None] + hp_dot(to_dtype(p, v.dtype, DOT_PRECISION), v, DOT_PRECISION)
    else:
        v = load_tile(v_base, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        pv = hp_dot(to_dtype(p, v.dtype, DOT_PRECISION), v, DOT_PRECISION)
    return acc * alpha[:, None] + pv, acc_hp, l_i, m_new


# Every constexpr that changes the code is in the key: a tuning found for one variant (say without Q-smoothing)
# may not fit another in shared memory.
@triton.autotune(
    configs=tuning_configs(((8, 2), (8, 3), (4, 3))),
    key=[
        *("HEAD_DIM", "SEQ_BUCKET", "HEADS_BUCKET", "BLOCK_M", "CAUSAL"),
        *("QK_FMT", "PV_FMT", "SMOOTH_Q", "HIGH_PRECISION_OUT", "DOT_PRECISION", "CONFINED"),
    ],
)
@triton.jit
def _forward_kernel(
    Q_OP,
    Q_SCALE,
    Q_MEAN,
    K_OP,
    K_SCALE,
    V_OP,
    V_SCALE,
    OUT,
    OUT_HP,
    LSE,
    ROW_POISON,
    FIRST_BAD,
    stride_ob,
    stride_oh,
    stride_on,
    HEADS,
    GROUP,
    SEQ_Q,
    SEQ_K,
    HEAD_DIM,
    SEQ_BUCKET,
    HEADS_BUCKET,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_FMT: tl.constexpr,
    PV_FMT: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    HIGH_PRECISION_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONFINED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    kv_bh = b * (HEADS // GROUP) + (pid_bh % HEADS) // GROUP
    m_blocks = tl.cdiv(SEQ_Q, BLOCK_M)
    k_blocks = tl.cdiv(SEQ_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    # Q'^ / K'^ / V^ are contiguous [B, H, N, D] (written by quantize_rows).
    q = load_tile(Q_OP + pid_bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
    q_scale = tl.load(Q_SCALE + pid_bh * m_blocks + pid_m)
    q_mean = tl.zeros([D_PAD], dtype=tl.float32)
    if SMOOTH_Q:
        q_mean = tl.load(Q_MEAN + (pid_bh * m_blocks + pid_m) * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
    k_base = K_OP + kv_bh * SEQ_K * HEAD_DIM
    v_base = V_OP + kv_bh * SEQ_K * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    acc_hp = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)  # left unchanged (and unused) without HIGH_PRECISION_OUT
    hi, full_hi = key_range(pid_m, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        # One loop: the mask's compares and selects run only in the tiles that need them (a branch the whole
        # program takes alike), which keeps one software-pipelined loop.
        acc, acc_hp, l_i, m_i = _forward_tile(
            acc, acc_hp, l_i, m_i, q, q_scale, q_mean, k_base, v_base, K_SCALE, V_SCALE, kv_bh, k_blocks, start_n,
            offs_m, cols, SEQ_Q, SEQ_K, HEAD_DIM, qk_scale, full_hi, BLOCK_M, BLOCK_N, CAUSAL, QK_FMT, PV_FMT,
            SMOOTH_Q, HIGH_PRECISION_OUT, DOT_PRECISION,
        )  # fmt: skip
    out = acc / l_i[:, None]
    if PV_FMT == "fp8":
        # V's per-channel scales and P's 1 / 448.
        v_scale = tl.load(V_SCALE + kv_bh * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
        out = out * (v_scale / FP8_MAX)[None, :]
    elif PV_FMT == "nvfp4":
        # V's one scale per head (stored per key block, every block alike).
        out = out * tl.load(V_SCALE + kv_bh * k_blocks)
    lse = m_i + tl.math.log2(l_i)
    if CONFINED:
        out, lse = poison_rows(out, lse, ROW_POISON, FIRST_BAD, pid_bh, kv_bh, offs_m, SEQ_Q, SEQ_K, CAUSAL)
    out_offsets = b * stride_ob + (pid_bh % HEADS) * stride_oh + offs_m[:, None] * stride_on + cols[None, :]
    valid = (offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM)
    tl.store(OUT + out_offsets, to_dtype(out, OUT.dtype.element_ty, DOT_PRECISION), mask=valid)
    if HIGH_PRECISION_OUT:
        # O_hp in O's layout, with V's scale (HIGH_PRECISION_OUT comes with pv="nvfp4").
        out_hp = acc_hp / l_i[:, None] * tl.load(V_SCALE + kv_bh * k_blocks)
        tl.store(OUT_HP + out_offsets, to_dtype(out_hp, OUT.dtype.element_ty, DOT_PRECISION), mask=valid)
    tl.store(LSE + pid_bh * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)


def forward(
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    q_mean: torch.Tensor | None,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v_op: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    qk: str,
    pv: str,
    out: torch.Tensor | None = None,
    out_hp: torch.Tensor | None = None,
    row_poison: torch.Tensor | None = None,
    first_bad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on quantized operands (see :func:`.quant.quantize_rows`).

    Args:
        q_op, q_scale, q_mean: Q'^ ``[B, Hq, N, D]``, its scales ``[B, Hq, N / BLOCK_M]`` and, with
            Q-smoothing, the block means ``[B, Hq, N / BLOCK_M, D]``.
        k_op, k_scale: K'^ ``[B, Hkv, Nk, D]`` and ``[B, Hkv, Nk / BLOCK_N]``.
        v_op, v_scale: V^ ``[B, Hkv, D, Nk]`` and its scales (``[B, Hkv, Nk / BLOCK_N]`` for INT8, per channel
            ``[B, Hkv, D]`` for FP8: :func:`.quant.quantize_channels_fp8`); V's NVFP4 values ``[B, Hkv, Nk, D]``
            with its scale per key block ``[B, Hkv, Nk / BLOCK_N]`` for ``"nvfp4"``; or V ``[B, Hkv, Nk, D]`` when
            ``pv`` is high precision.
        out_dtype: dtype of O (the input dtype).
        is_causal: top-left causal mask.
        scale: softmax scale ``tau``.
        block_m, block_n: tile sizes; they must be the quantization blocks of the operands.
        qk, pv: the products' formats (``"int8"``, ``"fp8"``, ``"bf16"`` or ``"nvfp4"``), matching the operands.
        out: where O is written (``[B, Hq, N, D]`` of ``out_dtype``, any strides with the last dim contiguous, e.g.
            :func:`.quant.output_like` of q); a contiguous one is made when ``None``.
        out_hp: where O_hp, the output of the unquantized P, is written (like ``out``; only with ``pv="nvfp4"``),
            or ``None`` for none.
        row_poison, first_bad: the confined quantizers' reports (:func:`.quant.quantize_rows`): ``[B, Hq, N]`` fp32,
            NaN for a query row that held a NaN or infinity, and ``[B * Hkv]`` int32, each head's first such key or
            value row. Given (both), O and the logsumexp are NaN in exactly those query rows and in every query row
            that attends such a key (:func:`.tiles.poison_rows`); ``None``: neither.

    Returns:
        ``O`` ``[B, Hq, N, D]`` and the internal logsumexp ``[B, Hq, N]`` (fp32, base 2, smoothed scores).

    Example::

        out, lse2 = forward(*q_parts, *k_parts, v_codes, v_scale, out_dtype=torch.bfloat16, is_causal=True,
                            scale=0.125, block_m=128, block_n=64, qk="int8", pv="int8")
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    if out is None:
        out = torch.empty(batch, heads, seq_q, head_dim, dtype=out_dtype, device=q_op.device)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q_op.device)
    grid = (triton.cdiv(seq_q, block_m), batch * heads)
    d_pad = padded_head_dim(head_dim)
    _forward_kernel[grid](
        q_op,
        q_scale,
        q_mean if q_mean is not None else q_scale,
        k_op,
        k_scale,
        v_op,
        v_scale,
        out,
        out_hp if out_hp is not None else out,
        lse,
        row_poison if row_poison is not None else lse,
        first_bad if first_bad is not None else lse,
        *out.stride()[:3],
        heads,
        heads // kv_heads,
        seq_q,
        seq_k,
        head_dim,
        seq_bucket(max(seq_q, seq_k)),
        seq_bucket(batch * heads),
        scale * LOG2E,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D_PAD=d_pad,
        CAUSAL=is_causal,
        QK_FMT=qk,
        PV_FMT=pv,
        SMOOTH_Q=q_mean is not None,
        HIGH_PRECISION_OUT=out_hp is not None,
        DOT_PRECISION=dot_precision(out_dtype),
        CONFINED=row_poison is not None,
    )
    return out, lse
