"""The tile helpers every attention kernel shares: loading a tile, recomputing S, the causal mask and key range.

The portable forward and backward, the Hopper forward and the Attn-QAT kernels all take S from
:func:`scores_tile`, so the backward recomputes exactly the forward's scores whatever the product formats.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .quant import hp_dot, int32_scaled, low_bit_dot

LOG2E = math.log2(math.e)


def rows_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, N, D]`` (dO or V) in a layout the Hopper kernels' TMA descriptors read where it lies: ``x``
    itself when contiguous or a model's ``[B, N, H, D]`` memory (heads split off the last dim, then transposed: what
    SDPA's callers hand), else a contiguous copy. The backward calls it once for both of its planned kernels, whose
    :func:`.hopper.gluon_common.rows_view` then only views it.

    Example::

        do = torch.randn(2, 128, 4, 64).transpose(1, 2)   # [B, H, N, D] over a model's [B, N, H, D]
        rows_layout(do) is do                             # True: read where it lies
        v = torch.randn(2, 4, 64, 128).transpose(2, 3)    # [B, H, N, D] with D strided
        rows_layout(v).is_contiguous()                    # True: a copy
    """
    if x.is_contiguous() or (x.stride(-1) == 1 and x.transpose(1, 2).is_contiguous()):
        return x
    return x.contiguous()


#: The query and key tiles the Gluon backward kernels (:mod:`.hopper.gluon_backward`, :mod:`.hopper.gluon_dq`) are
#: written for: here, so that the portable :mod:`.backward` sizes what it hands them without importing Hopper code.
GLUON_BLOCK_M = 128
GLUON_BLOCK_N = 64


def ds_scales_shape(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The shape of the dS tile scales the ``wg`` dK/dV kernel stores for the ``wg`` dQ kernel's three consumer
    warpgroups (:func:`.hopper.gluon_backward.gluon_dkdv`'s ``ds_scale_out``, :func:`.hopper.gluon_dq.gluon_dq`'s
    ``ds_scale``): one fp32 per (query head, :data:`GLUON_BLOCK_M`-query block, :data:`GLUON_BLOCK_N`-key block),
    ``[B, Hq, N / 128, Nk / 64]`` contiguous, so that a dQ program's scales for one query block lie in a row of
    consecutive key tiles. Here, not in :mod:`.hopper`, so that the portable :mod:`.backward`, which allocates them,
    imports no Hopper code.

    Example::

        ds_scales_shape((64, 10, 2048, 64), (64, 5, 2048, 64))   # (64, 10, 16, 32)
    """
    batch, heads, seq_q, _ = q_shape
    return batch, heads, -(-seq_q // GLUON_BLOCK_M), -(-k_shape[2] // GLUON_BLOCK_N)


@triton.jit
def load_tile(BASE, offs, cols, stride, SEQ, HEAD_DIM):
    """A ``[rows, D_PAD]`` tile of a ``[N, D]`` row-major matrix at ``BASE``; zeros past ``SEQ`` and ``HEAD_DIM``."""
    return tl.load(
        BASE + offs[:, None] * stride + cols[None, :],
        mask=(offs[:, None] < SEQ) & (cols[None, :] < HEAD_DIM),
        other=0.0,  # cast to the element type (0.0, not 0: the interpreter casts no int to fp8)
    )


@triton.jit
def load_tile_t(BASE, offs, cols, SEQ, HEAD_DIM):
    """A ``[D_PAD, rows]`` tile of a ``[D, N]`` matrix at ``BASE`` (an operand stored transposed); zeros outside."""
    return tl.load(
        BASE + cols[:, None] * SEQ + offs[None, :],
        mask=(cols[:, None] < HEAD_DIM) & (offs[None, :] < SEQ),
        other=0.0,
    )


@triton.jit
def scores_tile(
    q,
    q_scale,
    q_mean,
    k,
    k_scale,
    offs_m,
    offs_n,
    SEQ_Q,
    SEQ_K,
    qk_scale,
    CAUSAL: tl.constexpr,
    QK_FMT: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK: tl.constexpr = True,
):
    """``S`` (base 2) of one tile from the quantized operands, and the mask of pairs that take no part
    (``S = -inf`` there). Shared by the forward and both backward kernels, so the backward recomputes exactly
    the forward's S: padded queries and keys are out, and with ``CAUSAL`` keys after their query. ``QK_FMT`` is the
    product's format (``"int8"``, ``"fp8"`` or ``"bf16"``), which the operands' dtype must match.

    ``MASK=False`` is for a tile the caller knows has no such pair (every key exists and, with ``CAUSAL``, is
    visible to every query of the tile); it skips the mask's compares and selects, and returns an all-False mask.
    """
    if QK_FMT == "int8":
        s = int32_scaled(tl.dot(q, tl.trans(k)), q_scale * k_scale * qk_scale)
    elif QK_FMT == "fp8":
        s = low_bit_dot(q, tl.trans(k), DOT_PRECISION) * (q_scale * k_scale * qk_scale)
    else:
        s = hp_dot(q, tl.trans(k), DOT_PRECISION) * (q_scale * k_scale * qk_scale)
    if SMOOTH_Q:
        # The term Q-smoothing dropped, tau * qbar . deq(K'^)_j, per key, in fp32 like the reference.
        bias = tl.sum(k.to(tl.float32) * q_mean[None, :], axis=1) * (k_scale * qk_scale)
        s = s + bias[None, :]
    if MASK:
        invalid = tile_mask(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL)
        s = tl.where(invalid, float("-inf"), s)
    else:
        invalid = (offs_m[:, None] < 0) & (offs_n[None, :] < 0)
    return s, invalid


@triton.jit
def tile_mask(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL: tl.constexpr):
    """The pairs of a tile that take no part: padded queries and keys, and with ``CAUSAL`` keys after their
    query (top-left)."""
    invalid = (offs_m[:, None] >= SEQ_Q) | (offs_n[None, :] >= SEQ_K)
    if CAUSAL:
        invalid = invalid | (offs_n[None, :] > offs_m[:, None])
    return invalid


@triton.jit
def key_range(pid_m, SEQ_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(hi, full_hi)`` for query tile ``pid_m``: it visits the key tiles below ``hi`` (top-left causal: keys after
    its last query contribute exactly zero and are skipped), and those below ``full_hi`` need no mask (every key
    exists and, with ``CAUSAL``, precedes every query of the tile)."""
    hi = SEQ_K
    full_hi = (SEQ_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(SEQ_K, (pid_m + 1) * BLOCK_M)
        full_hi = tl.minimum(full_hi, (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N)
    return hi, full_hi


@triton.jit
def poison_rows(out, lse, ROW_POISON, FIRST_BAD, pid_bh, kv_bh, offs_m, SEQ_Q, SEQ_K, CAUSAL: tl.constexpr):
    """``(out, lse)`` NaN in the query rows SDPA makes non-finite for a NaN or infinity in q, k or v, which the confined
    quantizers read as 0 (:func:`.quant.confine_rows`): a query row that held one (``ROW_POISON``, 0 or NaN per row),
    and every row that attends a key whose k or v row held one (``FIRST_BAD[kv_bh]``, the first such key: every row
    attends it, or with ``CAUSAL`` the rows from it on). The logsumexp carries the NaN into the backward's P.
    Once per query tile, in the epilogue: one row load and one scalar load."""
    poison = tl.load(ROW_POISON + pid_bh * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    first_bad = tl.load(FIRST_BAD + kv_bh)
    if CAUSAL:
        attends_bad = first_bad <= offs_m
    else:
        attends_bad = (offs_m * 0 + first_bad) < SEQ_K
    poison = tl.where(attends_bad, float("nan"), poison)
    return out + poison[:, None], lse + poison
