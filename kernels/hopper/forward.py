"""Hopper (sm_90) forward of SageBwd: TMA-fed tiles and fewer instructions per score.

The numerics are the portable forward's (:mod:`..forward`) and the reference's: INT8 ``Q'^ K'^T`` with one Q
scale per ``Q_BLOCK`` rows and one K scale per ``BLOCK_N`` keys, P coded per row of each key tile with
``s_P = rowmax(P~) / 127``, INT8 ``P^ V^`` with one V scale per key tile, an online softmax in base 2. What
differs is how the hot loop spends instructions, which is what bounds it on Hopper: a tile's elementwise work
issues at 128 lanes per clock per SM against the tensor cores' INT8 rate, and the portable loop spends about 25
instructions per score (``benchmarks/sm90_compile.py``, NOTES.md).

* Operand tiles arrive by the bulk tensor copy engine (TMA descriptors over ``[B*H, N, D]`` views), which
  zero-fills past a head's end, in place of per-thread address arithmetic and masks.
* ``P^`` is coded without a division: ``P~ / s_P = 127 * exp2(S - tile_max)``, so one ``exp2`` per score gives
  the code (``E * 127``, rounded by the magic-number add) and, times ``exp2(tile_max - m)`` per row, the
  softmax sum. The portable loop takes ``exp2(S - m)`` and then multiplies each score by ``127 / rowmax``.
* With INT8 ``Q K^T`` and ``P V`` (no Q-smoothing) the scores' int32 product is read as ``R + x`` (``R = 1.5 *
  2**23``, the rounder's bits as its accumulator) and never taken back to ``x``: ``R`` goes into the exp2's per-row
  constant ``c = R a + t`` (``a`` the product's scale cut to 22 bits, so ``R a`` is exact; ``c`` rounded, then one
  ulp up), one add per score less. The tile's shift is then ``c - R a``, at or up to 1.5 ulps of ``c`` above its
  max, so the codes are ``127 exp2(S - shift)``: none passes 127, and a code can flip where the shift moved it
  across a rounding boundary (device run 48e: O's error against float64 unchanged, 1e-3 relative L2 from before).
* ``P^ V^``'s int32 product is converted and scaled by one fused multiply-add per element
  (:func:`..quant.int32_scaled`, which the portable kernels use too).
* V^ holds each 16 keys in :data:`..quant.MMA_KEY_ORDER` (``quantize_rows(..., mma_order=True)``), the order in
  which a thread's registers hold ``Q K^T``'s accumulator, so ``P^`` goes from those registers into ``P^ V^`` as the
  8-bit A operand with no exchange between threads (a sum of int32 products: the order of its terms changes no bit).

With ``pv="fp8"`` (``PV_FMT``) P is coded ``e4m3(448 P~)`` against the running max and V^ per channel, so each tile's
FP8 product adds into O's fp32 accumulator inside the tensor core: no int32 conversion and no per-tile scaling.

With ``qk="fp8"`` (``QK_FMT``) Q'^ and K'^ are the portable forward's e4m3 codes (:func:`..quant.quantize_rows` with
``fmt="fp8"``: ``s = max|X| / 448`` per ``Q_BLOCK`` rows and per ``BLOCK_N`` keys, after K-smoothing's mean and with
Q-smoothing's block means, as for INT8), contiguous ``[B, H, N, D]`` like the INT8 codes, so the same descriptors
read them. The tensor core returns the scores' fp32 sums directly: the rounder's integer add and float subtract per
score (INT8's int32 -> fp32) go, and ``S = x * (s_Q s_K tau log2 e)`` is taken as the INT8 path takes it. Q-smoothing's
branch is :func:`..tiles.scores_tile` in the same format, as the portable forward's.

The first changes no value beyond the last bit of fp32 arithmetic (a code can flip where ``127 * E`` sits
within that of a rounding boundary, as with the portable loop's fast division); the agreement against the
reference is checked by the same tests and bounds as the portable kernels (``benchmarks/gpu_verify.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..quant import (
    _INTERPRETED,
    _ROUNDER,
    _ROUNDER_BITS,
    FP8_MAX,
    dot_precision,
    exact_22_bits,
    int32_scaled,
    low_bit_dot,
    mma_key_order,
    seq_bucket,
    to_dtype,
    to_e4m3,
)
from ..tiles import LOG2E, key_range, poison_rows, scores_tile, tile_mask

#: Head dims the path takes: the tile's D is the operand's (no padding), and 8-bit tensor-core products want
#: D a multiple of 32.
HEAD_DIMS = (64, 128)


def _set_blocks(nargs: dict) -> None:
    """Autotuning pre-hook: the descriptors' block shapes follow the candidate's tile sizes."""
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [1, bm, d]
    nargs["desc_k"].block_shape = [1, bn, d]
    nargs["desc_vt"].block_shape = [1, d, bn]
    nargs["desc_o"].block_shape = [1, 1, bm, d]


def _configs() -> list[triton.Config]:
    """Candidates: 128 or 64 query rows per program (a program of 64 rows reads its Q block's scale), warps and
    pipeline depth. One plain config under the interpreter."""
    if _INTERPRETED:
        return [triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1, pre_hook=_set_blocks)]
    return [
        triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s, pre_hook=_set_blocks)
        for bm, w, s in ((128, 8, 2), (128, 8, 3), (128, 8, 4), (64, 4, 3), (64, 4, 4))
    ]


@triton.autotune(
    configs=_configs(),
    key=[
        "HEAD_DIM",
        "SEQ_BUCKET",
        "HEADS_BUCKET",
        "CAUSAL",
        "SMOOTH_Q",
        "Q_BLOCK",
        "BLOCK_N",
        "QK_FMT",
        "PV_FMT",
        "DOT_PRECISION",
        "CONFINED",
    ],
)
@triton.jit
def _hopper_forward_kernel(
    desc_q,
    desc_k,
    desc_vt,
    desc_o,
    Q_SCALE,
    Q_MEAN,
    K_SCALE,
    V_SCALE,
    LSE,
    ROW_POISON,
    FIRST_BAD,
    HEADS,
    GROUP,
    SEQ_Q,
    SEQ_K,
    SEQ_BUCKET,
    HEADS_BUCKET,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    QK_FMT: tl.constexpr,
    PV_FMT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONFINED: tl.constexpr,
):
    if CAUSAL:
        # Heads vary fastest and the longest query tiles (the last) go first, so the first wave holds the
        # heaviest work and the short tiles fill the tail.
        pid_bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    kv_bh = b * (HEADS // GROUP) + (pid_bh % HEADS) // GROUP
    q_block = pid_m * BLOCK_M // Q_BLOCK
    k_blocks = tl.cdiv(SEQ_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    # INT8 Q K^T with INT8 P V: S's product read as R + x (R = 1.5 * 2**23: the rounder's bits as the accumulator,
    # exact) and never taken back to x; R goes into the exp2's per-row constant (R a is exact with a cut to 22 bits):
    # one add a score less.
    SHIFTED: tl.constexpr = (not SMOOTH_Q) and QK_FMT == "int8" and PV_FMT != "fp8"
    q = desc_q.load([pid_bh, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    q_scale = tl.load(Q_SCALE + pid_bh * tl.cdiv(SEQ_Q, Q_BLOCK) + q_block)
    q_mean = tl.zeros([HEAD_DIM], dtype=tl.float32)
    if SMOOTH_Q:
        q_mean = tl.load(Q_MEAN + (pid_bh * tl.cdiv(SEQ_Q, Q_BLOCK) + q_block) * HEAD_DIM + cols)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi, full_hi = key_range(pid_m, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        tile = start_n // BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = desc_k.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        k_scale = tl.load(K_SCALE + kv_bh * k_blocks + tile)
        # x * a is S (base 2): without Q-smoothing x is the product as fp32 (INT8: the int32 product read exactly
        # as fp32, one add; FP8: the tensor core's fp32 sum as it is) and a its scale, so the multiply folds into the
        # exp2's argument.
        if SMOOTH_Q:
            x, _ = scores_tile(
                q, q_scale, q_mean, k, k_scale, offs_m, offs_n, SEQ_Q, SEQ_K, qk_scale,
                CAUSAL, QK_FMT, True, DOT_PRECISION, False,
            )  # fmt: skip
            a = 1.0
        elif QK_FMT == "fp8":
            x = low_bit_dot(q, tl.trans(k), DOT_PRECISION)
            a = q_scale * k_scale * qk_scale
        else:
            x = (tl.dot(q, tl.trans(k)) + _ROUNDER_BITS).to(tl.float32, bitcast=True)  # R + the int32 product
            if SHIFTED:
                a = exact_22_bits(q_scale * k_scale * qk_scale)
            else:
                x = x - _ROUNDER
                a = q_scale * k_scale * qk_scale
        if start_n >= full_hi:
            x = tl.where(tile_mask(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), float("-inf"), x)
        # (With SHIFTED the row's largest x less R: the max of R + x is taken as it is.)
        tile_max = ((tl.max(x, axis=1) - _ROUNDER) if SHIFTED else tl.max(x, axis=1)) * a
        m_new = tl.maximum(m_i, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        vt = desc_vt.load([kv_bh, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        if PV_FMT == "fp8":
            # P~ = exp2(S - m) against the running max, in [0, 1]: codes e4m3(448 P~) with one scale for every tile,
            # and V^ has one scale per channel, so the tensor core adds the product into O in fp32 as it is.
            p = tl.math.exp2(x * a - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(to_e4m3(p * FP8_MAX), tl.trans(vt), acc * alpha[:, None])
        else:
            t_safe = tl.where(tile_max == float("-inf"), 0.0, tile_max)
            # E = P~ / rowmax(P~) of this tile, in [0, 1]: the codes are 127 * E, the sum is E's times exp2(t - m).
            if SHIFTED:
                # The exp2's argument x a - c with c = R a + t, so the tile's shift is c - R a (exact: |t| < R a / 3,
                # since |x - R| < 2**22). c is the sum rounded, then one ulp up, so the shift is at or above the
                # tile's max (within 1.5 ulp of c) and no code passes 127.
                ra = _ROUNDER * a
                c = ((ra + t_safe).to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
                t_safe = c - ra
                e = tl.math.exp2(x * a - c[:, None])
            else:
                e = tl.math.exp2(x * a - t_safe[:, None])
            beta = tl.where(tile_max == float("-inf"), 0.0, tl.math.exp2(t_safe - m_safe))
            l_i = l_i * alpha + tl.sum(e, axis=1) * beta
            codes = (e * 127.0 + _ROUNDER).to(tl.int32, bitcast=True).to(tl.int8)
            # Each 16 keys in V^'s order: the A operand's registers are the accumulator's.
            codes = mma_key_order(codes, 1)
            v_scale = tl.load(V_SCALE + kv_bh * k_blocks + tile)
            # P~ V = (codes . V^) * (rowmax(P~) / 127) * s_V, rowmax(P~) = beta relative to the running max.
            pv = int32_scaled(tl.dot(codes, tl.trans(vt)), (beta * (v_scale / 127.0))[:, None])
            acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    if PV_FMT == "fp8":
        # V's per-channel scales and P's 1 / 448.
        out = out * (tl.load(V_SCALE + kv_bh * HEAD_DIM + cols) / FP8_MAX)[None, :]
    lse = m_i + tl.math.log2(l_i)
    if CONFINED:
        out, lse = poison_rows(out, lse, ROW_POISON, FIRST_BAD, pid_bh, kv_bh, offs_m, SEQ_Q, SEQ_K, CAUSAL)
    out = to_dtype(out, desc_o.dtype, DOT_PRECISION)
    # O over its [B, H, N, D] strides (the caller's layout, e.g. [B, N, H, D] memory).
    desc_o.store([b, pid_bh % HEADS, pid_m * BLOCK_M, 0], out.reshape(1, 1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + pid_bh * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)


@dataclasses.dataclass(frozen=True)
class ForwardLaunch:
    """What both Hopper forwards' launchers (:func:`hopper_forward`, :func:`.gluon_forward.gluon_forward`) make of
    their common arguments before launching: the shapes, ``O`` and the logsumexp to write, and the kernel arguments
    they pass alike (:func:`forward_launch`)."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    is_causal: bool
    #: O ``[B, Hq, N, D]``: the caller's ``out``, or a fresh one in the output dtype.
    out: torch.Tensor
    #: The base-2 logsumexp ``[B, Hq, N]`` fp32 (written by the kernel).
    lse: torch.Tensor
    #: The kernels' ``ROW_POISON`` and ``FIRST_BAD``: the caller's, or ``lse`` standing in (a pointer the kernel
    #: does not read without ``CONFINED``).
    row_poison: torch.Tensor
    first_bad: torch.Tensor
    #: Whether rows are confined (``row_poison`` given): the kernels' ``CONFINED``.
    confined: bool
    #: The softmax scale in base 2, ``scale * log2(e)``.
    qk_scale: float

    def grid(self, tiles: int) -> tuple[int, int]:
        """The launch grid for ``tiles`` query tiles a head: causal, heads on axis 0 (the kernels vary heads fastest
        and take the longest query tiles first, so the first wave holds the heaviest work); otherwise tiles first."""
        bh = self.batch * self.heads
        return (bh, tiles) if self.is_causal else (tiles, bh)


def forward_launch(
    q_op: torch.Tensor,
    k_op: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    is_causal: bool,
    scale: float,
    out: torch.Tensor | None,
    row_poison: torch.Tensor | None,
    first_bad: torch.Tensor | None,
) -> ForwardLaunch:
    """The argument preparation both Hopper forwards' launchers share (after any refusal of theirs: it allocates
    ``O``, when not given, and the logsumexp, in that order).

    Args:
        q_op, k_op: Q'^ ``[B, Hq, N, D]`` and K'^ ``[B, Hkv, Nk, D]`` (only their shapes and device are read).
        out_dtype, is_causal, scale, out, row_poison, first_bad: as :func:`hopper_forward`.

    Returns:
        :class:`ForwardLaunch`.

    Example::

        launch = forward_launch(q_op, k_op, out_dtype=torch.bfloat16, is_causal=True, scale=0.125, out=None,
                                row_poison=None, first_bad=None)
        launch.grid(32)   # (B * Hq, 32)
    """
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    if out is None:
        out = torch.empty(batch, heads, seq_q, head_dim, dtype=out_dtype, device=q_op.device)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q_op.device)
    return ForwardLaunch(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        is_causal=is_causal,
        out=out,
        lse=lse,
        row_poison=row_poison if row_poison is not None else lse,
        first_bad=first_bad if first_bad is not None else lse,
        confined=row_poison is not None,
        qk_scale=scale * LOG2E,
    )


def hopper_forward(
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
    qk: str = "int8",
    pv: str = "int8",
    out: torch.Tensor | None = None,
    row_poison: torch.Tensor | None = None,
    first_bad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward on Hopper, for INT8 or FP8 ``QK`` and INT8 or FP8 ``PV`` (what :func:`..forward.forward` takes, in
    its layouts).

    Args:
        q_op, q_scale, q_mean, k_op, k_scale: as :func:`..forward.forward`: int8 codes, or for ``qk="fp8"`` e4m3
            (``float8_e4m3fn``) codes, contiguous ``[B, H, N, D]`` (:func:`..quant.quantize_rows`).
        v_op, v_scale: V^ ``[B, Hkv, D, Nk]``: int8 with scales ``[B, Hkv, Nk / block_n]``, its keys in
            :data:`..quant.MMA_KEY_ORDER` (``quantize_rows(v, block_n, fmt="int8", transposed=True,
            mma_order=True)``), or for ``pv="fp8"`` e4m3 with one scale per channel ``[B, Hkv, D]``
            (:func:`..quant.quantize_channels_fp8`).
        out_dtype, is_causal, scale, block_m, block_n: as :func:`..forward.forward`; ``block_m`` is the Q
            quantization block (programs take 128 or 64 of its rows), ``block_n`` the key tile.
        qk: the format of ``Q K^T``, ``"int8"`` or ``"fp8"``, matching ``q_op`` and ``k_op``.
        pv: the format of ``P V``, ``"int8"`` or ``"fp8"``.
        out: where O is written, as :func:`..forward.forward` takes it (its strides must suit a TMA descriptor:
            :func:`..quant.output_like` makes such a tensor).
        row_poison, first_bad: as :func:`..forward.forward`.

    Returns:
        ``O`` ``[B, Hq, N, D]`` and the internal logsumexp ``[B, Hq, N]``, as :func:`..forward.forward`.

    Example::

        out, lse2 = hopper_forward(*q_parts, *k_parts, v_codes, v_scale, out_dtype=torch.bfloat16,
                                   is_causal=True, scale=0.125, block_m=128, block_n=64)
    """
    at = forward_launch(
        q_op, k_op, out_dtype=out_dtype, is_causal=is_causal, scale=scale, out=out, row_poison=row_poison,
        first_bad=first_bad,
    )  # fmt: skip
    bh, bkv = at.batch * at.heads, at.batch * at.kv_heads
    blocks = [1, 1, 1]  # set per autotuning candidate by _set_blocks
    desc_q = TensorDescriptor.from_tensor(q_op.view(bh, at.seq_q, at.head_dim), blocks)
    desc_k = TensorDescriptor.from_tensor(k_op.view(bkv, at.seq_k, at.head_dim), blocks)
    desc_vt = TensorDescriptor.from_tensor(v_op.view(bkv, at.head_dim, at.seq_k), blocks)
    desc_o = TensorDescriptor.from_tensor(at.out, [1, 1, 1, 1])

    def grid(meta: dict) -> tuple[int, int]:
        return at.grid(triton.cdiv(at.seq_q, meta["BLOCK_M"]))

    _hopper_forward_kernel[grid](
        desc_q,
        desc_k,
        desc_vt,
        desc_o,
        q_scale,
        q_mean if q_mean is not None else q_scale,
        k_scale,
        v_scale,
        at.lse,
        at.row_poison,
        at.first_bad,
        at.heads,
        at.heads // at.kv_heads,
        at.seq_q,
        at.seq_k,
        seq_bucket(max(at.seq_q, at.seq_k)),
        seq_bucket(bh),
        at.qk_scale,
        HEAD_DIM=at.head_dim,
        Q_BLOCK=block_m,
        BLOCK_N=block_n,
        CAUSAL=is_causal,
        SMOOTH_Q=q_mean is not None,
        QK_FMT=qk,
        PV_FMT=pv,
        DOT_PRECISION=dot_precision(out_dtype),
        CONFINED=at.confined,
    )
    return at.out, at.lse
