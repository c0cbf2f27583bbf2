"""Triton backward of SageBwd and Attn-QAT: dK and dV in one kernel, dQ in another, S recomputed from the saved
Q'^, K'^.

Both kernels walk the same ``BLOCK_M x BLOCK_N`` tiles the forward used and recompute each tile's ``S``,
``P = exp2(S - lse)``, ``dP`` and ``dS = P * (dP - delta)`` with the same code (:func:`_tile_gradients`,
:func:`_ds_tile`), so the two see the same dS and its INT8 codes. Per tile (as the reference):

* ``dV += psi(P)^T psi(dO)``: one scale per key column of the tile of P (INT8; FP8 codes ``448 P`` with one
  scale), one per block of dO;
* ``dP = dO V^T`` in the input dtype with fp32 accumulation (or INT8 / FP8 when ``dp`` says so);
* ``dQ += tau psi(dS) K'^`` and ``dK += tau psi(dS)^T Q'^``, one scale per tile of dS (INT8 or FP8; where dS and
  Q'^, K'^ differ in format, both are cast to the input dtype, which holds every code exactly); with dS in the input
  dtype (``"bf16"``) dQ's operand is ``P fma(dP, s_K, -(delta s_K))`` rounded, dS times K's tile scale, and dK's
  ``P fma(dP, s_Q, -(delta s_Q))``, dS times Q's, so each tile's product adds into dQ or dK inside the tensor core
  (the reference rounds ``P (dP s_K - delta s_K)`` and ``P (dP s_Q - delta s_Q)``);
* Q-smoothing's correction ``dK += tau colsum(dS)^T qbar``.

Simulated NVFP4 (Attn-QAT): ``dv="nvfp4"`` re-quantizes P per row of the tile as the forward did
(:func:`.quant.quantize_p_rows`; the dK/dV program's key block is the forward's key tile) and multiplies it in the
input dtype; ``dp="nvfp4"`` is dO (input dtype) against V's NVFP4 values and their scale. Q'^ and K'^ are then the
NVFP4 values of Q and K with their per-head scales, and ``dS`` runs in ``"bf16"`` against them. The drop-in backward
is every product in ``"bf16"`` from q, k, v themselves with scale 1.

The dK/dV program owns one key block of a kv head and loops over every query head of its group, so GQA
gradients are summed without repeating K or V. The dS statistics (``STATS``) are accumulated by the dK/dV
kernel only, once per tile, and added into the caller's buffer with two atomics per program.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .precision import LOW_BIT_FORMATS
from .quant import (
    FP8_MAX,
    backward_preprocess,
    dot_precision,
    fp8_codes,
    fp8_scale,
    hp_dot,
    int8_codes,
    int8_scale,
    int32_scaled,
    low_bit_dot,
    nan_max,
    padded_head_dim,
    quantize_p_rows,
    quantize_rows,
    round_half_even,
    seq_bucket,
    to_dtype,
    to_e4m3,
    transpose_rows,
    tuning_configs,
)
from .tiles import LOG2E, ds_scales_shape, key_range, load_tile, load_tile_t, rows_layout, scores_tile, tile_mask

_BACKWARD_CONFIGS = ((8, 2), (8, 3), (4, 2))
# Every constexpr that changes the code is in the key: a tuning found for one variant may not fit another.
_BACKWARD_KEY = [
    *("HEAD_DIM", "SEQ_BUCKET", "HEADS_BUCKET", "CAUSAL"),
    *("QK_FMT", "DP_FMT", "DS_FMT", "SMOOTH_Q", "DOT_PRECISION"),
]


@triton.jit
def _tile_gradients(
    q,
    q_scale,
    q_mean,
    k,
    k_scale,
    v,
    v_scale,
    do_dp,
    do_scale,
    lse,
    offs_m,
    offs_n,
    SEQ_Q,
    SEQ_K,
    qk_scale,
    CAUSAL: tl.constexpr,
    QK_FMT: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    DP_FMT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    masked,
):
    """``P`` and ``dP`` (fp32) of one tile (dS: :func:`_ds_tile`); P is zero where the pair takes no part.
    ``masked`` (the same for the whole program): whether the tile may hold such a pair; only then are the mask's
    compares and selects run."""
    s, _ = scores_tile(
        q, q_scale, q_mean, k, k_scale, offs_m, offs_n, SEQ_Q, SEQ_K, qk_scale, CAUSAL, QK_FMT, SMOOTH_Q,
        DOT_PRECISION, False,
    )  # fmt: skip
    p = tl.math.exp2(s - lse[:, None])
    if masked:
        p = tl.where(tile_mask(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), 0.0, p)
    if DP_FMT == "int8":
        dp = int32_scaled(tl.dot(do_dp, tl.trans(v)), do_scale * v_scale)
    elif DP_FMT == "fp8":
        dp = low_bit_dot(do_dp, tl.trans(v), DOT_PRECISION) * (do_scale * v_scale)
    elif DP_FMT == "nvfp4":
        dp = hp_dot(do_dp, tl.trans(v), DOT_PRECISION) * v_scale  # dO in the input dtype, V's NVFP4 values
    else:
        dp = hp_dot(do_dp, tl.trans(v), DOT_PRECISION)
    return p, dp


@triton.jit
def _ds_tile(p, dp, delta, ds_fold=None):
    """``dS = P (dP - delta)`` of a tile (zero where P is); with ``ds_fold``, a scalar ``c``, dS times it as
    ``P fma(dP, c, -(delta c))``: a bf16 dS's dQ operand takes K's tile scale so, its dK operand Q's
    (:func:`_dq_kernel`, :func:`_dkdv_kernel`)."""
    if ds_fold is None:
        ds = p * (dp - delta[:, None])
    else:
        ds = p * tl.fma(dp, ds_fold, -(delta * ds_fold)[:, None])
    return ds


# restore_value: tuning runs the kernel several times, and each run adds into the caller's statistics.
@triton.autotune(
    configs=tuning_configs(_BACKWARD_CONFIGS), key=_BACKWARD_KEY + ["DV_FMT", "WITH_STATS"], restore_value=["STATS"]
)
@triton.jit
def _dkdv_kernel(
    Q_OP,
    Q_OP_T,
    Q_SCALE,
    Q_MEAN,
    K_OP,
    K_SCALE,
    V,
    V_SCALE,
    DO,
    DO_CODES,
    DO_CODES_T,
    DO_SCALE,
    DO_T_SCALE,
    LSE,
    DELTA,
    DK,
    DV,
    STATS,
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
    HEADS_BUCKET,
    qk_scale,
    tau,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_FMT: tl.constexpr,
    DV_FMT: tl.constexpr,
    DP_FMT: tl.constexpr,
    DS_FMT: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    WITH_STATS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    kv_heads = HEADS // GROUP
    b = pid_bkv // kv_heads
    m_blocks = tl.cdiv(SEQ_Q, BLOCK_M)
    k_blocks = tl.cdiv(SEQ_K, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D_PAD)
    k = load_tile(K_OP + pid_bkv * SEQ_K * HEAD_DIM, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
    k_scale = tl.load(K_SCALE + pid_bkv * k_blocks + pid_n)
    # V as dP's operand: INT8 or FP8 codes (then V_SCALE holds their scales) or the input itself.
    v = load_tile(V + pid_bkv * SEQ_K * HEAD_DIM, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
    v_scale = 1.0
    if DP_FMT != "bf16":
        v_scale = tl.load(V_SCALE + pid_bkv * k_blocks + pid_n)
    io_dtype = DK.dtype.element_ty
    # dK and dV are accumulated [BLOCK_N, D], the codes of P and dS as left-hand operands. The transposed form
    # ([D, BLOCK_N], the codes as right-hand operands, 0fd6d4e) returned a wrong dV on H100 and H200 under Triton
    # 3.6 (rel_l2 1.03, cosine -0.5; dK in the same form was right) while passing in the interpreter, which runs
    # tl.dot in numpy and never sees the GPU's operand layouts; it was also slower there (NOTES.md).
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    # Per key column, so the loop carries tensors of one type (a scalar 0.0 would change type in the loop).
    err2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    norm2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        # Query blocks that end before this key block starts see none of its keys.
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(0, GROUP):
        bh = b * HEADS + (pid_bkv % kv_heads) * GROUP + g
        head = bh % HEADS
        for start_m in range(lo, SEQ_Q, BLOCK_M):
            m_block = start_m // BLOCK_M
            # A mask only where the tile may hold a pair that takes no part: a padded key or query, or with
            # CAUSAL a key after a query of the tile.
            masked = ((pid_n + 1) * BLOCK_N > SEQ_K) | (start_m + BLOCK_M > SEQ_Q)
            if CAUSAL:
                masked = masked | (start_m + 1 < (pid_n + 1) * BLOCK_N)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = load_tile(Q_OP + bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
            q_scale = tl.load(Q_SCALE + bh * m_blocks + m_block)
            q_mean = tl.zeros([D_PAD], dtype=tl.float32)
            if SMOOTH_Q:
                q_mean = tl.load(Q_MEAN + (bh * m_blocks + m_block) * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
            do = tl.load(
                DO + b * stride_dob + head * stride_doh + offs_m[:, None] * stride_don + cols[None, :] * stride_dod,
                mask=(offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM),
                other=0.0,
            )
            do_scale = 1.0
            if DP_FMT == "int8" or DP_FMT == "fp8":
                do_scale = tl.load(DO_SCALE + bh * m_blocks + m_block)
            do_t_scale = 1.0
            if DV_FMT == "int8" or DV_FMT == "fp8":
                do_t_scale = tl.load(DO_T_SCALE + bh * m_blocks + m_block)
            lse = tl.load(LSE + bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
            delta = tl.load(DELTA + bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
            if DP_FMT == "int8" or DP_FMT == "fp8":
                do_codes = load_tile(DO_CODES + bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
                p, dp = _tile_gradients(
                    q, q_scale, q_mean, k, k_scale, v, v_scale, do_codes, do_scale, lse, offs_m, offs_n,
                    SEQ_Q, SEQ_K, qk_scale, CAUSAL, QK_FMT, SMOOTH_Q, DP_FMT, DOT_PRECISION, masked,
                )  # fmt: skip
            else:
                p, dp = _tile_gradients(
                    q, q_scale, q_mean, k, k_scale, v, v_scale, do, 1.0, lse, offs_m, offs_n,
                    SEQ_Q, SEQ_K, qk_scale, CAUSAL, QK_FMT, SMOOTH_Q, DP_FMT, DOT_PRECISION, masked,
                )  # fmt: skip
            ds = _ds_tile(p, dp, delta)
            if DV_FMT == "fp8":
                # P = exp2(S - lse) is at most 1: codes e4m3(448 P), one scale; dO^ per block, read as stored [D, N].
                do_t = load_tile_t(DO_CODES_T + bh * SEQ_Q * HEAD_DIM, offs_m, cols, SEQ_Q, HEAD_DIM)
                p_codes = to_e4m3(p * FP8_MAX)
                dv += low_bit_dot(tl.trans(p_codes), tl.trans(do_t), DOT_PRECISION) * (do_t_scale / FP8_MAX)
            elif DV_FMT == "int8":
                # P per key column of the tile: one scale per row of P^T, i.e. per row of dV.
                p_scale = int8_scale(nan_max(p, axis=0))
                p_codes = int8_codes(p, p_scale[None, :])
                # dO^ read as stored [D, N]: the 8-bit product wants the summed-over queries contiguous.
                do_t = load_tile_t(DO_CODES_T + bh * SEQ_Q * HEAD_DIM, offs_m, cols, SEQ_Q, HEAD_DIM)
                dv += int32_scaled(tl.dot(tl.trans(p_codes), tl.trans(do_t)), p_scale[:, None] * do_t_scale)
            elif DV_FMT == "nvfp4":
                # P re-quantized per row of the tile, as the forward quantized it, in the input dtype.
                p_values, p_scale = quantize_p_rows(p, BLOCK_M, BLOCK_N)
                p_dv = to_dtype(p_values * p_scale[:, None], io_dtype, DOT_PRECISION)
                dv += hp_dot(tl.trans(p_dv), do, DOT_PRECISION)
            else:
                dv += hp_dot(tl.trans(to_dtype(p, io_dtype, DOT_PRECISION)), do, DOT_PRECISION)
            if WITH_STATS:
                # The INT8 error of dS whatever ds runs in, so the controller sees what it would return to.
                stat_scale = int8_scale(nan_max(tl.abs(ds)))
                err = ds - round_half_even(ds / stat_scale) * stat_scale
                err2 += tl.sum(err * err, axis=0)
                norm2 += tl.sum(ds * ds, axis=0)
            # dS as the dK product takes it: INT8 or FP8 codes with one scale for the tile, or rounded to the input
            # dtype. (Written out in both kernels: Triton 3.6 refuses a helper whose constexpr branches return
            # different types.)
            if DS_FMT == "int8":
                ds_scale = int8_scale(nan_max(tl.abs(ds)))
                ds_codes = int8_codes(ds, ds_scale)
                if QK_FMT == "int8":
                    q_t = load_tile_t(Q_OP_T + bh * SEQ_Q * HEAD_DIM, offs_m, cols, SEQ_Q, HEAD_DIM)
                    dk += int32_scaled(tl.dot(tl.trans(ds_codes), tl.trans(q_t)), ds_scale * q_scale)
                else:
                    ds_t = tl.trans(to_dtype(ds_codes, io_dtype, DOT_PRECISION))
                    dk += hp_dot(ds_t, to_dtype(q, io_dtype, DOT_PRECISION), DOT_PRECISION) * (ds_scale * q_scale)
            elif DS_FMT == "fp8":
                ds_scale = fp8_scale(nan_max(tl.abs(ds)))
                ds_codes = fp8_codes(ds, ds_scale)
                if QK_FMT == "fp8":
                    q_t = load_tile_t(Q_OP_T + bh * SEQ_Q * HEAD_DIM, offs_m, cols, SEQ_Q, HEAD_DIM)
                    dk += low_bit_dot(tl.trans(ds_codes), tl.trans(q_t), DOT_PRECISION) * (ds_scale * q_scale)
                else:
                    ds_t = tl.trans(to_dtype(ds_codes, io_dtype, DOT_PRECISION))
                    dk += hp_dot(ds_t, to_dtype(q, io_dtype, DOT_PRECISION), DOT_PRECISION) * (ds_scale * q_scale)
            else:
                # dS times Q's tile scale, rounded (dS_Q = P (dP s_Q - delta s_Q)): the product adds into dK inside
                # the tensor core. ds itself then serves only the statistics and Q-smoothing's term.
                ds_t = tl.trans(to_dtype(_ds_tile(p, dp, delta, q_scale), io_dtype, DOT_PRECISION))
                dk = hp_dot(ds_t, to_dtype(q, io_dtype, DOT_PRECISION), DOT_PRECISION, dk)
            if SMOOTH_Q:
                dk += tl.sum(ds, axis=0)[:, None] * q_mean[None, :]
    mask = (offs_n[:, None] < SEQ_K) & (cols[None, :] < HEAD_DIM)
    out_offs = pid_bkv * SEQ_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + cols[None, :]
    tl.store(DK + out_offs, to_dtype(dk * tau, io_dtype, DOT_PRECISION), mask=mask)
    tl.store(DV + out_offs, to_dtype(dv, io_dtype, DOT_PRECISION), mask=mask)
    if WITH_STATS:
        tl.atomic_add(STATS, tl.sum(err2, axis=0))
        tl.atomic_add(STATS + 1, tl.sum(norm2, axis=0))


@triton.autotune(configs=tuning_configs(_BACKWARD_CONFIGS), key=_BACKWARD_KEY)
@triton.jit
def _dq_kernel(
    Q_OP,
    Q_SCALE,
    Q_MEAN,
    K_OP,
    K_OP_T,
    K_SCALE,
    V,
    V_SCALE,
    DO,
    DO_CODES,
    DO_SCALE,
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
    HEADS_BUCKET,
    qk_scale,
    tau,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_FMT: tl.constexpr,
    DP_FMT: tl.constexpr,
    DS_FMT: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HEADS
    head = bh % HEADS
    kv_bh = b * (HEADS // GROUP) + head // GROUP
    m_blocks = tl.cdiv(SEQ_Q, BLOCK_M)
    k_blocks = tl.cdiv(SEQ_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    io_dtype = DQ.dtype.element_ty
    q = load_tile(Q_OP + bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
    q_scale = tl.load(Q_SCALE + bh * m_blocks + pid_m)
    q_mean = tl.zeros([D_PAD], dtype=tl.float32)
    if SMOOTH_Q:
        q_mean = tl.load(Q_MEAN + (bh * m_blocks + pid_m) * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0)
    do = tl.load(
        DO + b * stride_dob + head * stride_doh + offs_m[:, None] * stride_don + cols[None, :] * stride_dod,
        mask=(offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM),
        other=0.0,
    )
    do_scale = 1.0
    if DP_FMT == "int8" or DP_FMT == "fp8":
        do = load_tile(DO_CODES + bh * SEQ_Q * HEAD_DIM, offs_m, cols, HEAD_DIM, SEQ_Q, HEAD_DIM)
        do_scale = tl.load(DO_SCALE + bh * m_blocks + pid_m)
    lse = tl.load(LSE + bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    delta = tl.load(DELTA + bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # Key tiles before full_hi need no mask, unless this query tile has padded rows.
    hi, full_hi = key_range(pid_m, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL)
    partial_rows = (pid_m + 1) * BLOCK_M > SEQ_Q
    for start_n in range(0, hi, BLOCK_N):
        tile = start_n // BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(K_OP + kv_bh * SEQ_K * HEAD_DIM, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        k_scale = tl.load(K_SCALE + kv_bh * k_blocks + tile)
        v = load_tile(V + kv_bh * SEQ_K * HEAD_DIM, offs_n, cols, HEAD_DIM, SEQ_K, HEAD_DIM)
        v_scale = 1.0
        if DP_FMT != "bf16":
            v_scale = tl.load(V_SCALE + kv_bh * k_blocks + tile)
        # A bf16 dS enters dQ's product times K's tile scale (dS_K = P (dP s_K - delta s_K), rounded), so the product
        # adds into dQ in the tensor core; an INT8 or FP8 dS is coded against its own scale over the tile.
        p, dp = _tile_gradients(
            q, q_scale, q_mean, k, k_scale, v, v_scale, do, do_scale, lse, offs_m, offs_n,
            SEQ_Q, SEQ_K, qk_scale, CAUSAL, QK_FMT, SMOOTH_Q, DP_FMT, DOT_PRECISION,
            partial_rows | (start_n >= full_hi),
        )  # fmt: skip
        ds = _ds_tile(p, dp, delta, k_scale if DS_FMT == "bf16" else None)
        if DS_FMT == "int8":
            ds_scale = int8_scale(nan_max(tl.abs(ds)))
            ds_codes = int8_codes(ds, ds_scale)
            if QK_FMT == "int8":
                k_t = load_tile_t(K_OP_T + kv_bh * SEQ_K * HEAD_DIM, offs_n, cols, SEQ_K, HEAD_DIM)
                dq += int32_scaled(tl.dot(ds_codes, tl.trans(k_t)), ds_scale * k_scale)
            else:
                ds_hp = to_dtype(ds_codes, io_dtype, DOT_PRECISION)
                dq += hp_dot(ds_hp, to_dtype(k, io_dtype, DOT_PRECISION), DOT_PRECISION) * (ds_scale * k_scale)
        elif DS_FMT == "fp8":
            ds_scale = fp8_scale(nan_max(tl.abs(ds)))
            ds_codes = fp8_codes(ds, ds_scale)
            if QK_FMT == "fp8":
                k_t = load_tile_t(K_OP_T + kv_bh * SEQ_K * HEAD_DIM, offs_n, cols, SEQ_K, HEAD_DIM)
                dq += low_bit_dot(ds_codes, tl.trans(k_t), DOT_PRECISION) * (ds_scale * k_scale)
            else:
                ds_hp = to_dtype(ds_codes, io_dtype, DOT_PRECISION)
                dq += hp_dot(ds_hp, to_dtype(k, io_dtype, DOT_PRECISION), DOT_PRECISION) * (ds_scale * k_scale)
        else:
            ds_hp = to_dtype(ds, io_dtype, DOT_PRECISION)
            dq = hp_dot(ds_hp, to_dtype(k, io_dtype, DOT_PRECISION), DOT_PRECISION, dq)
    tl.store(
        DQ + bh * SEQ_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + cols[None, :],
        to_dtype(dq * tau, io_dtype, DOT_PRECISION),
        mask=(offs_m[:, None] < SEQ_Q) & (cols[None, :] < HEAD_DIM),
    )


#: A kernel computing dK and dV in place of the portable one (the plan's: :mod:`.ops` passes it), called as
#: ``(grad_out, delta, do_codes_t, do_scale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse, stats, *, is_causal, scale)``
#: and returning ``(dK, dV)``; one that reads Q'^ widened to dO's dtype (``backward``'s ``widen_q``) also takes it as
#: ``q_wide=``, one that stores its dS tile scales for the dQ kernel (``backward``'s ``share_ds_scales``) the tensor
#: they go into as ``ds_scale_out=``. It takes dO and V as they lie (their layout is its to read or copy).
DkdvKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: A kernel computing dQ in place of the portable one, called as
#: ``(grad_out, delta, q_op, q_scale, k_op, k_scale, v, lse, *, is_causal, scale)``, and ``ds_scale=`` with
#: ``backward``'s ``share_ds_scales``; it takes dO and V as they lie and K'^ as it is (no ``[D, N]`` copy).
DqKernel = Callable[..., torch.Tensor]


def backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    q_mean: torch.Tensor | None,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    stats: torch.Tensor | None,
    *,
    v_scale: torch.Tensor | None = None,
    is_causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    qk: str,
    dv: str,
    dp: str,
    ds: str,
    dkdv_kernel: DkdvKernel | None = None,
    dq_kernel: DqKernel | None = None,
    widen_q: bool = False,
    share_ds_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dO's codes and the operands' transposed (or widened) copies, then the dK/dV and dQ kernels; returns
    ``(dQ, dK, dV)`` contiguous in dO's dtype.

    Each temporary lives only as long as its kernel needs it, so the peak holds fewer of them: Q'^'s ``[D, N]``
    copy (or its copy in dO's dtype) and dO's ``[D, N]`` codes (read by the dK/dV kernel) are freed before dQ and the
    portable dQ kernel's ``[D, N]`` copy of K'^ are allocated (a planned dQ kernel reads K'^ as it is).

    Args:
        grad_out: dO ``[B, Hq, N, D]``, any strides.
        out: the forward's O, for ``delta`` (:func:`.quant.backward_preprocess`).
        q_op, q_scale, q_mean, k_op, k_scale: the forward's saved operands (``q_mean`` ``None`` without
            Q-smoothing).
        v: V itself; its codes are made here when ``dp`` is ``"int8"`` or ``"fp8"``. For ``dp="nvfp4"``, V's NVFP4
            values ``[B, Hkv, Nk, D]`` contiguous, with ``v_scale``.
        v_scale: V's NVFP4 scale per key block ``[B, Hkv, Nk / BLOCK_N]`` (``dp="nvfp4"`` only).
        lse: the forward's internal logsumexp (base 2).
        stats: fp32 ``(2,)`` buffer the dS statistics are added to, or ``None`` (nothing computed).
        is_causal, scale, block_m, block_n: as the forward.
        qk, dv, dp, ds: the products' formats (``"int8"``, ``"fp8"``, ``"bf16"`` or ``"nvfp4"``, which ``ds`` does not
            take); ``qk`` must be the forward's.
        dkdv_kernel, dq_kernel: the kernels the call's plan (:func:`.plan.plan_attention`) runs in place of the
            portable ones, which it has checked serve the call (:data:`DkdvKernel`, :data:`DqKernel`); ``None``: the
            portable kernel.
        widen_q: the preprocess launch also writes Q'^ in dO's dtype (``[B, Hq, N, D]``, 2 bytes an element while the
            dK/dV kernel runs), handed to ``dkdv_kernel`` as ``q_wide=``: a non-INT8 ``ds``'s dK product reads it
            through TMA (:func:`.hopper.gluon_backward.gluon_dkdv`, either variant) instead of widening Q'^'s codes per
            tile.
        share_ds_scales: an fp32 tensor of one INT8 dS scale per 128-query x 64-key tile and query head
            (:func:`.tiles.ds_scales_shape`, N x Nk / 2048 bytes per query head, from before the dK/dV
            kernel to after the dQ kernel) is handed to ``dkdv_kernel`` as ``ds_scale_out=``, which stores each tile's
            scale into it, and to ``dq_kernel`` as ``ds_scale=``, which reads them in place of its own reduction (the
            ``wg`` dQ kernel's three warpgroups of 64 queries: :func:`.hopper.gluon_dq.gluon_dq`).

    Raises:
        ValueError: ``widen_q`` without a ``dkdv_kernel`` (the portable kernel reads no such copy); ``share_ds_scales``
            without both planned kernels or with a non-INT8 ``ds``.

    Example::

        dq, dk, dv = backward(grad_out, out, q_op, q_scale, None, k_op, k_scale, v, lse, None,
                              is_causal=True, scale=0.125, block_m=128, block_n=64, qk="int8",
                              dv="int8", dp="bf16", ds="int8")
    """
    if widen_q and dkdv_kernel is None:
        raise ValueError("backward: widen_q makes Q'^'s copy for a planned dK/dV kernel; received dkdv_kernel=None")
    if share_ds_scales and (dkdv_kernel is None or dq_kernel is None or ds != "int8"):
        raise ValueError(
            "backward: share_ds_scales hands the planned dK/dV kernel's INT8 dS scales to the planned dQ kernel; "
            f"received dkdv_kernel={dkdv_kernel!r}, dq_kernel={dq_kernel!r}, ds={ds!r}"
        )
    # The planned kernels (Hopper's) read dO and V through TMA where they lie, contiguous or a model's [B, N, H, D]
    # memory (hopper/gluon_common.rows_view; another layout is copied once, here: tiles.rows_layout); the portable
    # kernels take dO's strides.
    # The dQ = dS K'^ and dK = dS^T Q'^ products sum over keys and queries: with 8-bit operands, Hopper's tensor
    # cores want those contiguous, so the dK/dV kernel reads Q'^'s [D, N] copy (written by the preprocess launch) and
    # the portable dQ kernel K'^'s (made just before it; a planned dQ kernel transposes K'^'s tiles itself).
    transposed = qk == ds and qk in LOW_BIT_FORMATS
    planned = dkdv_kernel is not None and dq_kernel is not None
    if dkdv_kernel is not None or dq_kernel is not None:
        grad_out = rows_layout(grad_out)  # a layout TMA cannot read is copied here once, not by each kernel
    delta, do_codes, do_codes_t, do_scale, q_op_t, q_wide = backward_preprocess(
        grad_out, out, block_m, codes=dp == "int8", codes_t=dv == "int8", transpose=q_op if transposed else None,
        widen=q_op if widen_q else None,
    )  # fmt: skip
    do_t_scale = do_scale
    # FP8 codes of dO, per block of block_m rows as INT8's (dP reads them [N, D], dV [D, N]).
    if dp == "fp8":
        do_codes, do_scale, _ = quantize_rows(grad_out, block_m, fmt="fp8")
    if dv == "fp8":
        do_codes_t, do_t_scale, _ = quantize_rows(grad_out, block_m, fmt="fp8", transposed=True)
    if dp in LOW_BIT_FORMATS:
        v_dp, v_dp_scale, _ = quantize_rows(v, block_n, fmt=dp)
    elif dp == "nvfp4":
        v_dp, v_dp_scale = v, v_scale
    else:  # V as it lies (or copied once) for the planned kernels (both of them), else contiguous for the portable ones
        v_dp, v_dp_scale = (rows_layout(v) if planned else v.contiguous()), None
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    io_dtype = grad_out.dtype
    d_pad = padded_head_dim(head_dim)
    bucket = seq_bucket(max(seq_q, seq_k))
    heads_bucket = seq_bucket(batch * heads)
    q_mean_arg = q_mean if q_mean is not None else q_scale
    codes_arg = do_codes if do_codes is not None else grad_out
    code_scale_arg = do_scale if do_scale is not None else delta
    code_t_scale_arg = do_t_scale if do_t_scale is not None else delta
    v_scale_arg = v_dp_scale if v_dp_scale is not None else k_scale
    common = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D_PAD=d_pad,
        CAUSAL=is_causal,
        QK_FMT=qk,
        DP_FMT=dp,
        DS_FMT=ds,
        SMOOTH_Q=q_mean is not None,
        DOT_PRECISION=dot_precision(io_dtype),
    )
    q_op_t = q_op_t if q_op_t is not None else q_op
    # The dK/dV kernel's dS tile scales for the dQ kernel (written by the one, read by the other, in stream order).
    ds_scales = None
    if share_ds_scales:
        ds_scales = torch.empty(
            ds_scales_shape(tuple(q_op.shape), tuple(k_op.shape)), dtype=torch.float32, device=q_op.device
        )
    if dkdv_kernel is not None:
        # The plan's kernel: the same dK and dV, bit for bit (on Hopper, from TMA loads and async wgmma).
        grad_k, grad_v = dkdv_kernel(
            grad_out, delta, do_codes_t, do_scale, q_op, q_op_t, q_scale, k_op, k_scale, v_dp, lse, stats,
            is_causal=is_causal, scale=scale, **({"q_wide": q_wide} if widen_q else {}),
            **({"ds_scale_out": ds_scales} if share_ds_scales else {}),
        )  # fmt: skip
    else:
        grad_k = torch.empty(batch, kv_heads, seq_k, head_dim, dtype=io_dtype, device=grad_out.device)
        grad_v = torch.empty_like(grad_k)
        _dkdv_kernel[(triton.cdiv(seq_k, block_n), batch * kv_heads)](
            q_op, q_op_t, q_scale, q_mean_arg, k_op, k_scale, v_dp, v_scale_arg,
            grad_out, codes_arg, do_codes_t if do_codes_t is not None else grad_out, code_scale_arg, code_t_scale_arg,
            lse, delta, grad_k, grad_v,
            stats if stats is not None else delta,
            *grad_out.stride(),
            heads, heads // kv_heads, seq_q, seq_k, head_dim, bucket, heads_bucket, scale * LOG2E, scale,
            DV_FMT=dv, WITH_STATS=stats is not None, **common,
        )  # fmt: skip
    # Back to the caching allocator (the kernels run in stream order): the dQ kernel's buffers may take their place.
    del q_op_t, q_wide, do_codes_t
    if dq_kernel is not None:
        # The plan's kernel: the same dQ, bit for bit; it transposes K'^'s tiles itself (no [D, N] copy).
        grad_q = dq_kernel(
            grad_out, delta, q_op, q_scale, k_op, k_scale, v_dp, lse, is_causal=is_causal, scale=scale,
            **({"ds_scale": ds_scales} if share_ds_scales else {}),
        )  # fmt: skip
    else:
        k_op_t = transpose_rows(k_op) if transposed else k_op
        grad_q = torch.empty(batch, heads, seq_q, head_dim, dtype=io_dtype, device=grad_out.device)
        _dq_kernel[(triton.cdiv(seq_q, block_m), batch * heads)](
            q_op, q_scale, q_mean_arg, k_op, k_op_t, k_scale, v_dp, v_scale_arg,
            grad_out, codes_arg, code_scale_arg, lse, delta, grad_q,
            *grad_out.stride(),
            heads, heads // kv_heads, seq_q, seq_k, head_dim, bucket, heads_bucket, scale * LOG2E, scale,
            **common,
        )  # fmt: skip
    return grad_q, grad_k, grad_v
