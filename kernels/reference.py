"""SageBwd and Attn-QAT in plain PyTorch: the oracle for the Triton kernels and the path every CPU caller takes.

The numerics follow the design tile by tile (``BLOCK_M`` queries x ``BLOCK_N`` keys):

* K-smoothing ``K' = K - mean_tokens(K)``; Q-smoothing ``Q' = Q - mean_block(Q)`` with the dropped term
  ``tau * qbar . deq(K'^)`` added back to S in the compute dtype;
* INT8 ``psi``: per block of ``BLOCK_M`` rows for Q' and dO, per block of ``BLOCK_N`` rows for K' and V,
  per row of the tile for the forward's P, per key column of the tile for the backward's P (dV), per
  tile for dS;
* an online softmax over key tiles in the forward, O and the row logsumexp out;
* a backward that recomputes S from exactly the saved Q'^, K'^ (matching recomputation), with INT8
  ``dV``, high-precision ``dP``, INT8 or high-precision ``dQ``/``dK`` and Q-smoothing's correction to dK
  (K-smoothing needs none: see :func:`_backward`).

Quantized values are kept as integer-valued floats in the compute dtype (fp32, or fp64 for fp64
inputs), so a NaN or an infinity in dO, P or dS stays non-finite instead of turning into an int8 code. In q, k and v
one is confined as SDPA confines it: read as 0 by every scale, mean and code (:func:`confine`), and the query rows
that read it made NaN at the end (:func:`_poison_rows`), as the kernels do. Integer
products are exact: every partial sum of a product of int8 codes is an integer of magnitude at most
``K * 127**2`` for a contraction of length ``K``, and fp32 represents every integer up to ``2**24``
exactly, so products over ``K <= MAX_EXACT_CONTRACTION`` (1040) are exact whatever the summation order.
The contractions are the head dim (``QK^T``, ``dO V^T``) and the tile sides (``PV``, ``dV``, ``dQ``,
``dK``); all are checked against that bound. (An int32 accumulator, as in the GPU kernels, allows
``K <= 133144``.)

A product in ``"fp8"`` takes e4m3 codes (kept as floats likewise) with ``s = max|X| / 448`` per the same blocks as
INT8, except two: ``O = P V`` codes V per channel over all keys of its head and P as ``e4m3(448 P~)`` against the
running max (one scale, ``1 / 448``), so the tile products add up as they are; and dV's P is ``e4m3(448 P)``
(P is at most 1). FP8 products are summed in fp32 (the tensor cores accumulate them in fp32 too), not exactly.

``"nvfp4"`` is Attn-QAT's (``mode="attn_qat"``; :attr:`.AttentionPrecision.formats`), simulated NVFP4
(:mod:`.nvfp4`): the values are exact in the input dtype, so an NVFP4 product runs in it with fp32 accumulation
and its FP32 scales are applied to the result. No smoothing. Forward:

* ``Q, K, V`` quantized along the head dim, one FP32 scale per (batch, head), computed in fp32
  (:func:`.nvfp4.quantize_qkv`): ``Q ~= U_Q s_Q``; ``S = tau (U_Q U_K^T) s_Q s_K``;
* ``P~ = exp(S - m)`` against the running max; the row sum ``l`` adds up the unquantized ``P~``; ``P~``
  quantized along the keys with one FP32 scale per row of the tile, ``rowmax(P~) / (6 * 448)``
  (:func:`.nvfp4.quantize_p_tile`), so its values do not depend on the running max and the backward's P,
  normalised differently, quantizes to the same values;
* ``O = sum_tiles U_P U_V s_P / l * s_V``; with :attr:`.AttentionPrecision.high_precision_out` also
  ``O_hp = sum_tiles bf16(P~) U_V / l * s_V`` (the unquantized P) for the backward.

Backward, matched (Attn-QAT: straight-through to q, k, v and P): S and P recomputed from ``U_Q, U_K`` and their
scales; ``dV += bf16(fq(P))^T bf16(dO)`` with P re-quantized as the forward did; ``dP = (bf16(dO) U_V^T) s_V``;
``delta = rowsum(dO * O_hp)`` (``rowsum(P * dP)``, the softmax gradient's own term);
``dQ += tau bf16(dS) (U_K s_K)``, ``dK += tau bf16(dS)^T (U_Q s_Q)``. Drop-in
(:attr:`.AttentionPrecision.backward_from_inputs`, the baseline the Attn-QAT paper finds unstable):
FlashAttention's backward from q, k, v themselves with every product in the input dtype, fed the NVFP4
forward's O (for delta) and logsumexp. "bf16" is the input dtype (fp16 inputs run in fp16, fp32 in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .nvfp4 import NVFP4_BLOCK, quantize_p_tile, quantize_qkv, round_e4m3
from .precision import PRODUCTS, AttentionPrecision

INT8_MAX = 127.0
#: The largest finite e4m3 value: FP8 codes are ``X / s`` with ``s = max|X| / 448``, rounded to e4m3.
FP8_MAX = 448.0
#: Longest contraction whose int8 x int8 products sum exactly in fp32: floor(2**24 / 127**2).
MAX_EXACT_CONTRACTION = (1 << 24) // (127 * 127)
#: Longest contraction whose int8 x int8 products sum exactly in int32: floor((2**31 - 1) / 127**2).
MAX_EXACT_CONTRACTION_INT32 = ((1 << 31) - 1) // (127 * 127)
#: Query tile (and the quantization block of Q' and dO).
DEFAULT_BLOCK_M = 128
#: Key tile (and the quantization block of K' and V; the forward's P is quantized per row of it).
DEFAULT_BLOCK_N = 64

__all__ = [
    "DEFAULT_BLOCK_M",
    "DEFAULT_BLOCK_N",
    "FP8_MAX",
    "INT8_MAX",
    "MAX_EXACT_CONTRACTION",
    "MAX_EXACT_CONTRACTION_INT32",
    "exact_attention",
    "fp8_round",
    "quantize_fp8",
    "quantize_int8",
    "sage_attention_intermediates",
    "sage_attention_reference",
]


def quantize_int8(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 quantization ``psi`` with one scale per block (the block spans ``dims``).

    ``s = max|X| / 127`` (``s = 1`` for an all-zero block) and ``X^ = round(X / s)`` with round half to
    even, clamped to [-127, 127]. A NaN or infinity in a block makes its scale and codes non-finite.

    Args:
        x: the tensor to quantize (fp32 or fp64).
        dims: the dimensions one scale covers.

    Returns:
        ``(codes, scale)``: the integer codes as floats of ``x``'s dtype, and the scales with ``dims`` kept
        as size-1 dimensions, so ``codes * scale`` dequantizes.

    Example::

        codes, scale = quantize_int8(torch.randn(4, 64), dims=(-1,))   # per-row scales
    """
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = amax / INT8_MAX
    # An all-zero block, or one whose max is so small that max/127 underflows to 0: scale 1, codes 0.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX), scale


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest e4m3 value (ties to even), kept in ``x``'s dtype; NaN stays NaN
    (:func:`.nvfp4.round_e4m3`, which NVFP4's block scales use too).

    The callers scale ``x`` into [-448, 448] first, so nothing saturates.

    Example::

        fp8_round(torch.tensor([1.06, 300.0]))   # tensor([1.0, 288.0])
    """
    return round_e4m3(x)


def quantize_fp8(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 (e4m3) quantization with one scale per block (the block spans ``dims``), the 8-bit float twin of
    :func:`quantize_int8`.

    ``s = max|X| / 448`` (``s = 1`` for an all-zero block) and ``X^ = e4m3(X / s)`` with round to nearest even.
    A NaN or infinity in a block makes its scale and codes non-finite.

    Args:
        x: the tensor to quantize (fp32 or fp64).
        dims: the dimensions one scale covers.

    Returns:
        ``(codes, scale)``: the e4m3 values as floats of ``x``'s dtype, and the scales with ``dims`` kept as size-1
        dimensions, so ``codes * scale`` dequantizes.

    Example::

        codes, scale = quantize_fp8(torch.randn(4, 64), dims=(-1,))   # per-row scales
    """
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = amax / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return fp8_round(x / scale), scale


def _operand(
    x: torch.Tensor, fmt: str, dims: tuple[int, ...], io_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A product operand in ``fmt``: INT8 or FP8 codes and scales, or ``x`` rounded to the input dtype (scale 1).

    ``"nvfp4"`` gives the latter too: it is the operand of an NVFP4 product that is not quantized (dO); Q, K, V
    and P take their own quantizers (:func:`_nvfp4_keys`, :func:`_nvfp4_rows`, :func:`.nvfp4.quantize_p_tile`).
    """
    if fmt == "int8":
        return quantize_int8(x, dims)
    if fmt == "fp8":
        return quantize_fp8(x, dims)
    shape = list(x.shape)
    for dim in dims:
        shape[dim] = 1
    return _to_io(x, io_dtype), x.new_ones(shape)


def _to_io(x: torch.Tensor, io_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to the input dtype, kept in its own (an operand of a 16-bit product)."""
    return x.to(io_dtype).to(x.dtype)


def _formats(precision: AttentionPrecision) -> dict[str, str]:
    """The format of each product: :attr:`.AttentionPrecision.formats`, except ``mode="full"`` (which
    ``sage_attention`` serves with SDPA, not with this reference): the SageBwd fields, as they are."""
    if precision.mode == "full":
        return {name: getattr(precision, name) for name in PRODUCTS}
    return precision.formats


@dataclass
class _Geometry:
    """Shapes and constants of one call; rows are ``G`` query heads x padded queries per kv head."""

    batch: int
    kv_heads: int
    group: int  # query heads per kv head
    seq_q: int
    seq_k: int
    head_dim: int
    block_m: int
    block_n: int
    causal: bool
    scale: float
    io_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def padded_q(self) -> int:
        return -(-self.seq_q // self.block_m) * self.block_m

    @property
    def padded_k(self) -> int:
        return -(-self.seq_k // self.block_n) * self.block_n

    @property
    def rows(self) -> int:
        return self.group * self.padded_q

    @property
    def row_blocks(self) -> int:
        return self.rows // self.block_m

    @property
    def key_tiles(self) -> int:
        return self.padded_k // self.block_n

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, N, D]`` -> ``[B, Hkv, G * padded_N, D]`` in the compute dtype, zero-padded."""
        x = x.to(self.compute_dtype)
        pad = self.padded_q - self.seq_q
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(self.batch, self.kv_heads, self.rows, x.shape[3])

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_rows` (crops the padding)."""
        x = x.reshape(self.batch, self.kv_heads, self.group, self.padded_q, *x.shape[3:])
        x = x[:, :, :, : self.seq_q]
        return x.reshape(self.batch, self.kv_heads * self.group, self.seq_q, *x.shape[4:])

    def to_keys(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, Nk, D]`` -> compute dtype, zero-padded to whole key tiles."""
        x = x.to(self.compute_dtype)
        pad = self.padded_k - self.seq_k
        return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x

    def row_blocks_view(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, R, C]`` -> ``[B, Hkv, R / BLOCK_M, BLOCK_M, C]``."""
        return x.reshape(self.batch, self.kv_heads, self.row_blocks, self.block_m, x.shape[-1])

    def expand_rows(self, per_block: torch.Tensor) -> torch.Tensor:
        """Per-row-block values ``[B, Hkv, R / BLOCK_M, C]`` -> per row ``[B, Hkv, R, C]``."""
        b, h, m, c = per_block.shape
        return per_block[:, :, :, None, :].expand(b, h, m, self.block_m, c).reshape(b, h, m * self.block_m, c)

    def invalid(self, tile: int, device: torch.device) -> torch.Tensor:
        """``[R, BLOCK_N]`` mask of the (row, key) pairs of key tile ``tile`` that take no part.

        Padded queries and keys are out; with ``causal`` a key after its query is out (SDPA's
        ``is_causal``: the top-left aligned lower triangle, also when N != Nk).
        """
        q_pos = torch.arange(self.rows, device=device) % self.padded_q
        k_pos = tile * self.block_n + torch.arange(self.block_n, device=device)
        out = (q_pos[:, None] >= self.seq_q) | (k_pos[None, :] >= self.seq_k)
        if self.causal:
            out = out | (k_pos[None, :] > q_pos[:, None])
        return out


@dataclass
class _Saved:
    """What the backward needs: the quantized Q'^, K'^ with scales, the means, V, O and logsumexp."""

    q_op: torch.Tensor  # [B, Hkv, R, D] codes (or high-precision or NVFP4 values) of Q'
    q_scale: torch.Tensor  # [B, Hkv, R / BLOCK_M, 1] one per row block (NVFP4: its query head's)
    k_op: torch.Tensor  # [B, Hkv, padded Nk, D] codes of K'
    k_scale: torch.Tensor  # [B, Hkv, key tiles, 1]
    q_mean: torch.Tensor | None  # [B, Hkv, R / BLOCK_M, D] Q-smoothing means
    k_mean: torch.Tensor | None  # [B, Hkv, 1, D] K-smoothing means
    q_bad: torch.Tensor | None = None  # [B, Hkv, R] query rows that held a NaN or infinity (confined operands)
    k_bad: torch.Tensor | None = None  # [B, Hkv, padded Nk] key rows of k that held one


def _nvfp4_keys(x: torch.Tensor, geo: _Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of K or V ``[B, Hkv, Nk, D]`` (:func:`.nvfp4.quantize_qkv`) in key tiles: values
    ``[B, Hkv, key tiles, BLOCK_N, D]`` (padded keys zero) and the (batch, head) scale repeated per tile,
    ``[B, Hkv, key tiles, 1, 1]``."""
    values, scale = quantize_qkv(x)
    tiles = geo.to_keys(values).reshape(geo.batch, geo.kv_heads, geo.key_tiles, geo.block_n, geo.head_dim)
    return tiles, scale[:, :, None].expand(-1, -1, geo.key_tiles, 1, 1).to(geo.compute_dtype)


def _nvfp4_rows(q: torch.Tensor, geo: _Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of Q ``[B, Hq, N, D]`` (:func:`.nvfp4.quantize_qkv`) in the rows layout: values ``[B, Hkv, R, D]`` and
    the (batch, query head) scale per row block ``[B, Hkv, R / BLOCK_M, 1]`` (a row block lies in one head)."""
    values, scale = quantize_qkv(q)
    per_block = scale.reshape(geo.batch, geo.kv_heads, geo.group, 1).repeat_interleave(geo.padded_q // geo.block_m, 2)
    return geo.to_rows(values), per_block.to(geo.compute_dtype)


def _from_inputs(q: torch.Tensor, k: torch.Tensor, geo: _Geometry) -> _Saved:
    """The operands of a backward that recomputes S from q and k themselves (scale 1, no means):
    :attr:`.AttentionPrecision.backward_from_inputs`."""
    q_rows, k_keys = geo.to_rows(q), geo.to_keys(k)
    q_scale = q_rows.new_ones(geo.batch, geo.kv_heads, geo.row_blocks, 1)
    k_scale = k_keys.new_ones(geo.batch, geo.kv_heads, geo.key_tiles, 1)
    return _Saved(q_op=q_rows, q_scale=q_scale, k_op=k_keys, k_scale=k_scale, q_mean=None, k_mean=None)


def _prepare(q: torch.Tensor, k: torch.Tensor, geo: _Geometry, precision: AttentionPrecision) -> _Saved:
    """Smoothing and quantization of Q and K (the forward's first stage); NVFP4 (Attn-QAT) has no smoothing."""
    if _formats(precision)["qk"] == "nvfp4":
        q_op, q_scale = _nvfp4_rows(q, geo)
        k_tiles, k_scale = _nvfp4_keys(k, geo)
        return _Saved(
            q_op=q_op,
            q_scale=q_scale,
            k_op=k_tiles.reshape(geo.batch, geo.kv_heads, geo.padded_k, geo.head_dim),
            k_scale=k_scale.reshape(geo.batch, geo.kv_heads, geo.key_tiles, 1),
            q_mean=None,
            k_mean=None,
        )
    qr, q_bad = confine(geo.to_rows(q))  # padded rows are zero
    kr, k_bad = confine(geo.to_keys(k))
    k_mean = None
    if precision.smooth_k:
        k_mean = finite_mean(k.to(geo.compute_dtype))
        kr = kr - k_mean
        if geo.padded_k != geo.seq_k:  # padded keys stay zero so they leave the block scale alone
            kr[:, :, geo.seq_k :] = 0
    q_mean = None
    q_blocks = geo.row_blocks_view(qr)
    if precision.smooth_q:
        valid = (torch.arange(geo.rows, device=q.device) % geo.padded_q) < geo.seq_q
        valid = valid.reshape(geo.row_blocks, geo.block_m, 1).to(geo.compute_dtype)
        q_mean = q_blocks.sum(dim=3) / valid.sum(dim=1)  # mean over the valid rows of each block
        q_blocks = (q_blocks - q_mean[:, :, :, None, :]) * valid
    fmt = _formats(precision)["qk"]
    q_op, q_scale = _operand(q_blocks, fmt, (-2, -1), geo.io_dtype)
    k_tiles = kr.reshape(geo.batch, geo.kv_heads, geo.key_tiles, geo.block_n, geo.head_dim)
    k_op, k_scale = _operand(k_tiles, fmt, (-2, -1), geo.io_dtype)
    return _Saved(
        q_op=q_op.reshape(qr.shape),
        q_scale=q_scale.reshape(geo.batch, geo.kv_heads, geo.row_blocks, 1),
        k_op=k_op.reshape(kr.shape),
        k_scale=k_scale.reshape(geo.batch, geo.kv_heads, geo.key_tiles, 1),
        q_mean=q_mean,
        k_mean=k_mean,
        q_bad=q_bad,
        k_bad=k_bad,
    )


def confine(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, bad)``: ``x`` with every NaN or infinity read as 0, and per row (the last dim) whether it held one.

    What the quantizers of Q, K and V see (:func:`.quant.confine_rows`): a bad value changes neither its block's scale
    nor its means, so it stays out of every other row, and the rows it poisons are made NaN at the end
    (:func:`_poison_rows`).

    Example::

        x, bad = confine(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]))   # [[1, 0], [2, 3]], [True, False]
    """
    finite = torch.isfinite(x)
    return torch.where(finite, x, torch.zeros_like(x)), ~finite.all(dim=-1)


def finite_mean(k: torch.Tensor) -> torch.Tensor:
    """K-smoothing's mean over the tokens (dim 2) with NaN and infinities read as 0, keepdim
    (:func:`.quant.finite_mean`'s numerics): a bad key row leaves every other row of K' as it is.

    Example::

        k_mean = finite_mean(k.float())   # [B, Hkv, 1, D]
    """
    return torch.where(torch.isfinite(k), k, torch.zeros_like(k)).mean(dim=2, keepdim=True)


def _poison_rows(
    out: torch.Tensor, lse: torch.Tensor, saved: _Saved, v_bad: torch.Tensor | None, geo: _Geometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """O ``[B, Hkv, R, D]`` and the logsumexp ``[B, Hkv, R]`` NaN in the rows SDPA makes non-finite for a NaN or
    infinity that the confined operands read as 0 (the kernels' ``poison_rows``): a query row that held one, and
    every row that attends a key whose k (or quantized v) row held one. The logsumexp carries it into the backward."""
    if saved.q_bad is None:
        return out, lse
    key_bad = saved.k_bad if v_bad is None else saved.k_bad | v_bad
    keys = torch.arange(geo.padded_k, device=out.device)
    first_bad = torch.where(key_bad, keys, 2**31 - 1).amin(dim=-1, keepdim=True)  # [B, Hkv, 1]; none: int32 max
    if geo.causal:
        q_pos = torch.arange(geo.rows, device=out.device) % geo.padded_q
        attends_bad = first_bad <= q_pos
    else:
        attends_bad = (first_bad < geo.seq_k).expand(-1, -1, geo.rows)
    poisoned = saved.q_bad | attends_bad
    return out.masked_fill(poisoned[..., None], math.nan), lse.masked_fill(poisoned, math.nan)


def _key_tile(x: torch.Tensor, geo: _Geometry, tile: int) -> torch.Tensor:
    return x[:, :, tile * geo.block_n : (tile + 1) * geo.block_n]


def _ds(
    p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor, invalid: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``dS = P (dP - delta)`` of one key tile, 0 at the pairs that take no part even where dP is not finite (a NaN in
    V: 0 * NaN would spread it over the tile); with ``scale``, dS times it as ``P (dP scale - delta scale)`` (a bf16
    dS's operands: K's tile scale for dQ, Q's block scales per row for dK)."""
    if scale is None:
        ds = p * (dp - delta[..., None])
    else:
        ds = p * (dp * scale - delta[..., None] * scale)
    return ds.masked_fill(invalid, 0.0)


def _scores(saved: _Saved, geo: _Geometry, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``S`` of one key tile for every row, from the saved operands (forward and backward alike)."""
    k_op = _key_tile(saved.k_op, geo, tile)
    k_scale = saved.k_scale[:, :, tile, None]  # [B, Hkv, 1, 1]
    q_scale = geo.expand_rows(saved.q_scale)  # [B, Hkv, R, 1]
    s = (saved.q_op @ k_op.transpose(-1, -2)) * (q_scale * k_scale * geo.scale)
    if saved.q_mean is not None:
        # The term Q-smoothing dropped: tau * qbar_i . K'_j, with K' as the product saw it (deq(K'^)),
        # so the backward recomputes exactly the same S from the saved tensors.
        bias = (saved.q_mean @ (k_op * k_scale).transpose(-1, -2)) * geo.scale
        s = s + geo.expand_rows(bias)
    invalid = geo.invalid(tile, s.device)
    return s.masked_fill(invalid, -math.inf), invalid


def _forward(
    v: torch.Tensor,
    saved: _Saved,
    geo: _Geometry,
    precision: AttentionPrecision,
    record: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Online softmax over key tiles. Returns O ``[B, Hkv, R, D]``, logsumexp ``[B, Hkv, R]`` and O_hp (the output of
    the unquantized P, ``[B, Hkv, R, D]``) where :attr:`.AttentionPrecision.high_precision_out` asks for it or an
    NVFP4 ``pv`` is recorded, else ``None``."""
    fmt = _formats(precision)["pv"]
    vr = geo.to_keys(v)
    v_bad = None
    if fmt in ("int8", "fp8") and saved.q_bad is not None:
        vr, v_bad = confine(vr)  # V in the input dtype (and NVFP4's per-head scale) carries a NaN through P V itself
    v_tiles = vr.reshape(geo.batch, geo.kv_heads, geo.key_tiles, geo.block_n, geo.head_dim)
    out_scale = None  # a scale of O's channels applied after the sum over tiles
    if fmt == "fp8":
        # V per channel over all keys of its head: the scale factors out of the sum over keys, so O accumulates the
        # FP8 products of every tile as they are and is scaled once at the end (the tensor core accumulates in fp32).
        v_op, v_scale = quantize_fp8(v_tiles, (2, 3))  # v_scale [B, Hkv, 1, 1, D]
        v_scale = v_scale[:, :, 0]  # [B, Hkv, 1, D]: per channel, for every tile
    elif fmt == "nvfp4":
        # One FP32 scale per (batch, head): applied to O once, after the sum over tiles.
        v_op, v_scale = _nvfp4_keys(v, geo)
        out_scale = v_scale[:, :, 0]  # [B, Hkv, 1, 1]
    else:
        v_op, v_scale = _operand(v_tiles, fmt, (-2, -1), geo.io_dtype)
    shape = (geo.batch, geo.kv_heads, geo.rows)
    row_max = torch.full(shape, -math.inf, dtype=geo.compute_dtype, device=v.device)
    row_sum = torch.zeros(shape, dtype=geo.compute_dtype, device=v.device)
    acc = torch.zeros(*shape, geo.head_dim, dtype=geo.compute_dtype, device=v.device)
    keep_hp = fmt == "nvfp4" and (precision.high_precision_out or record is not None)
    acc_hp = torch.zeros_like(acc) if keep_hp else None
    tiles_p, tiles_max = [], []
    for tile in range(geo.key_tiles):
        s, _ = _scores(saved, geo, tile)
        new_max = torch.maximum(row_max, s.amax(dim=-1))
        # A row with every key so far masked has max -inf; exp(-inf - 0) = 0 keeps it empty (NaN stays NaN).
        safe_max = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max[..., None])
        alpha = torch.exp(row_max - safe_max)
        row_sum = row_sum * alpha + p.sum(dim=-1)  # the unquantized P: lse normalises the backward's P exactly
        if fmt == "fp8":
            # P~ = exp(S - m) against the running max is in [0, 1]: e4m3 of 448 P~, one scale 1 / 448 for all.
            p_op, p_scale = fp8_round(p * FP8_MAX), 1.0 / FP8_MAX
            pv = (p_op @ v_op[:, :, tile]) * (p_scale * v_scale)
        elif fmt == "nvfp4":
            # P per row of the tile, s_P = rowmax(P~) / 2688: the values do not depend on the running max.
            p_op, p_scale = quantize_p_tile(p)
            pv = (p_op @ v_op[:, :, tile]) * p_scale
        else:
            # P per row of the tile: s_P = rowmax(P~) / 127, so the codes do not depend on the running max.
            p_op, p_scale = _operand(p, fmt, (-1,), geo.io_dtype)
            pv = (p_op @ v_op[:, :, tile]) * (p_scale * v_scale[:, :, tile])
        acc = acc * alpha[..., None] + pv
        if acc_hp is not None:
            acc_hp = acc_hp * alpha[..., None] + _to_io(p, geo.io_dtype) @ v_op[:, :, tile]
        row_max = new_max
        if record is not None:
            tiles_p.append(p_op * p_scale)
            tiles_max.append(safe_max)
    out = acc / row_sum[..., None]
    out_hp = None if acc_hp is None else acc_hp / row_sum[..., None]
    if out_scale is not None:
        out = out * out_scale
        out_hp = None if out_hp is None else out_hp * out_scale
    lse = row_max + torch.log(row_sum)
    out, lse = _poison_rows(out, lse, saved, v_bad, geo)
    if record is not None:
        # The probabilities the PV product used, renormalised to the final max and sum.
        norm = [
            p * torch.exp(m - row_max)[..., None] / row_sum[..., None] for p, m in zip(tiles_p, tiles_max, strict=True)
        ]
        record["P"] = torch.cat(norm, dim=-1)[..., : geo.seq_k]
    return out, lse, out_hp


def _backward(
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    v: torch.Tensor,
    saved: _Saved,
    geo: _Geometry,
    precision: AttentionPrecision,
    stats: torch.Tensor | None = None,
    record: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ ``[B, Hkv, R, D]``, dK and dV ``[B, Hkv, padded Nk, D]`` from dO and the saved forward.

    ``out`` is the O that ``delta = rowsum(dO * O)`` takes: the stored O, or O_hp for
    :attr:`.AttentionPrecision.high_precision_out`. ``saved`` holds the operands S is recomputed from (the forward's,
    or q and k themselves for :attr:`.AttentionPrecision.backward_from_inputs`); ``v`` is the input V.
    """
    formats = _formats(precision)
    tau = geo.scale
    b, h, bm, nb, d = geo.batch, geo.kv_heads, geo.block_m, geo.block_n, geo.head_dim
    do_r = geo.to_rows(do)
    delta = (do_r * geo.to_rows(out)).sum(dim=-1)  # rowsum(dO * O) with the stored O (or O_hp)
    do_blocks = geo.row_blocks_view(do_r)
    do_dv, do_dv_scale = _operand(do_blocks, formats["dv"], (-2, -1), geo.io_dtype)
    do_dp, do_dp_scale = _operand(do_blocks, formats["dp"], (-2, -1), geo.io_dtype)
    do_dp = do_dp.reshape(do_r.shape)
    do_dp_scale = geo.expand_rows(do_dp_scale.reshape(b, h, geo.row_blocks, 1))
    if formats["dp"] == "nvfp4":
        v_dp, v_dp_scale = _nvfp4_keys(v, geo)  # V's values and scale, as the forward quantized them
    else:
        vr = geo.to_keys(v)
        v_dp, v_dp_scale = _operand(vr.reshape(b, h, geo.key_tiles, nb, d), formats["dp"], (-2, -1), geo.io_dtype)
    q_blocks = geo.row_blocks_view(saved.q_op)
    q_scale_blocks = saved.q_scale[..., None]  # [B, Hkv, R / BM, 1, 1]
    fold = formats["ds"] == "bf16"  # dS's products take K's and Q's scales into their operands (below)
    q_scale_rows = geo.expand_rows(saved.q_scale) if fold else None  # [B, Hkv, R, 1]

    dq = torch.zeros_like(do_r)
    dk = torch.zeros(b, h, geo.padded_k, d, dtype=geo.compute_dtype, device=do.device)
    dv = torch.zeros_like(dk)
    err2 = torch.zeros((), dtype=geo.compute_dtype, device=do.device)
    norm2 = torch.zeros_like(err2)
    tiles: dict[str, list[torch.Tensor]] = {"dP": [], "dS": []}
    for tile in range(geo.key_tiles):
        keys = slice(tile * nb, (tile + 1) * nb)
        s, invalid = _scores(saved, geo, tile)
        p = torch.exp(s - lse[..., None]).masked_fill(invalid, 0.0)  # padded rows have lse = -inf

        # dV = psi(P)^T psi(dO): P scaled per key column of the tile (per row of P^T, the dual of the
        # forward's P per query row: the scale of an output row factors out of its integer sum), dO per row
        # block; integer products per row block, dequantized and summed over the row blocks in the compute
        # dtype. Per column rather than per tile: a key that few queries attend to keeps its resolution
        # (dV cosine 0.99886 -> 0.9998 at N=4096, D=128; docs/how-it-works.md).
        p_blocks = p.reshape(b, h, geo.row_blocks, bm, nb)
        if formats["dv"] == "fp8":
            # P = exp(S - lse) is in [0, 1]: e4m3 of 448 P, one scale 1 / 448 (e4m3 keeps a key's small
            # probabilities to 3 significant bits down to 2**-6 / 448 without a per-column scale).
            p_op = fp8_round(p_blocks * FP8_MAX)
            p_scale = p_blocks.new_full((b, h, geo.row_blocks, 1, nb), 1.0 / FP8_MAX)
        elif formats["dv"] == "nvfp4":
            # P re-quantized exactly as the forward quantized it (per row of the tile: the same values whatever
            # the normalisation), then as an operand in the input dtype.
            p_values, p_row_scale = quantize_p_tile(p_blocks)
            p_op, p_scale = _operand(p_values * p_row_scale, "bf16", (-2,), geo.io_dtype)
        else:
            p_op, p_scale = _operand(p_blocks, formats["dv"], (-2,), geo.io_dtype)
        dv_parts = (p_op.transpose(-1, -2) @ do_dv) * (p_scale.transpose(-1, -2) * do_dv_scale)
        dv[:, :, keys] = dv_parts.sum(dim=2)

        # dP = dO V^T: the product kept in high precision by default.
        dp = (do_dp @ v_dp[:, :, tile].transpose(-1, -2)) * (do_dp_scale * v_dp_scale[:, :, tile])
        ds = _ds(p, dp, delta, invalid)

        ds_blocks = ds.reshape(b, h, geo.row_blocks, bm, nb)
        ds_op, ds_op_scale = _operand(ds_blocks, formats["ds"], (-2, -1), geo.io_dtype)
        if stats is not None:
            # Measured for the INT8 quantizer whatever ds runs in, so the controller can see the error
            # it would return to before it steps dS back down from bf16.
            ds_codes, ds_scale = (ds_op, ds_op_scale) if formats["ds"] == "int8" else quantize_int8(ds_blocks, (-2, -1))
            err2 = err2 + (ds_blocks - ds_codes * ds_scale).square().sum()
            norm2 = norm2 + ds_blocks.square().sum()

        k_op = _key_tile(saved.k_op, geo, tile)
        k_scale = saved.k_scale[:, :, tile, None]
        if fold:
            # dQ's operand is dS times the tile's K scale, rounded to the input dtype: dS_K = P (dP s_K - delta s_K),
            # so the kernels add each tile's product into dQ inside the tensor core (no scaling after it); dK's
            # likewise, dS times the block's Q scale (dS_Q = P (dP s_Q - delta s_Q)).
            dq += (_to_io(_ds(p, dp, delta, invalid, k_scale), geo.io_dtype) @ k_op) * tau
            ds_q_blocks = _to_io(_ds(p, dp, delta, invalid, q_scale_rows), geo.io_dtype).reshape(
                b, h, geo.row_blocks, bm, nb
            )
            dk[:, :, keys] = (ds_q_blocks.transpose(-1, -2) @ q_blocks).sum(dim=2) * tau
        else:
            dq_parts = ds_op.reshape(ds.shape) @ k_op  # contraction over the tile's keys
            dq += dq_parts * geo.expand_rows(ds_op_scale.reshape(b, h, geo.row_blocks, 1)) * (k_scale * tau)
            # Per row block, so each block's Q scale (its query head's, for NVFP4 under GQA) applies to its own part.
            dk_parts = (ds_op.transpose(-1, -2) @ q_blocks) * (ds_op_scale * q_scale_blocks)
            dk[:, :, keys] = dk_parts.sum(dim=2) * tau

        if saved.q_mean is not None:
            # Gradient of the fp bias tau * qbar_i . K'_j: colsum over each row block of dS times qbar.
            col_sums = ds_blocks.sum(dim=3)  # [B, Hkv, R / BM, BN]
            dk[:, :, keys] += (col_sums.transpose(-1, -2) @ saved.q_mean) * tau
        if record is not None:
            tiles["dP"].append(dp.masked_fill(invalid, 0.0))
            # dS as the dQ/dK products used it; Attn-QAT's before its rounding to the input dtype.
            tiles["dS"].append(ds if precision.mode == "attn_qat" else (ds_op * ds_op_scale).reshape(ds.shape))
    # No K-smoothing term rowsum(dS) x kbar in dQ: the forward computed S from K', so this is the gradient of
    # what ran. The term is zero in exact arithmetic, and in practice rowsum(dS) = dO . (P V - O) carries the
    # PV quantization error, which kbar would amplify (measured: dQ rel_l2 0.0072 -> 0.040 with PV alone in
    # INT8 and four outlier channels in K; see docs/how-it-works.md).
    if stats is not None:
        stats.add_(torch.stack([err2, norm2]).to(device=stats.device, dtype=stats.dtype))
    if record is not None:
        record["delta"] = delta
        for name, parts in tiles.items():
            record[name] = torch.cat(parts, dim=-1)[..., : geo.seq_k]
    return dq, dk, dv


def _geometry(
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    block_m: int,
    block_n: int,
    precision: AttentionPrecision,
) -> _Geometry:
    batch, q_heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    for name, value in (("block_m", block_m), ("block_n", block_n), ("head_dim", head_dim)):
        if value > MAX_EXACT_CONTRACTION:
            raise ValueError(
                f"sage_attention reference: {name}={value} is over {MAX_EXACT_CONTRACTION}, the longest "
                "contraction whose int8 products the reference sums exactly in fp32."
            )
    if "nvfp4" in _formats(precision).values() and block_n % NVFP4_BLOCK:
        raise ValueError(
            f"attn_qat reference: block_n must be a multiple of {NVFP4_BLOCK} (P is quantized in blocks of "
            f"{NVFP4_BLOCK} keys within a key tile); received {block_n}."
        )
    return _Geometry(
        batch=batch,
        kv_heads=kv_heads,
        group=q_heads // kv_heads,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        block_m=block_m,
        block_n=block_n,
        causal=is_causal,
        scale=softmax_scale(head_dim, scale),
        io_dtype=q.dtype,
        compute_dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
    )


def _public_lse(q: torch.Tensor, lse_rows: torch.Tensor, saved: _Saved, geo: _Geometry) -> torch.Tensor:
    """The logsumexp of ``tau * Q K^T`` as SDPA means it, ``[B, Hq, N]``.

    K-smoothing shifts row i of S by ``-tau * q_i . kbar`` (softmax does not see it, the logsumexp does);
    the backward keeps using the shifted one it recomputes S against, callers get this one.
    """
    lse = geo.from_rows(lse_rows[..., None])[..., 0]
    if saved.k_mean is None:
        return lse
    return undo_k_smoothing_shift(lse, q, saved.k_mean, geo.scale)


def softmax_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale ``tau``: ``scale`` as a float, or SDPA's default ``1 / sqrt(head_dim)`` when ``None``.

    Example::

        softmax_scale(64, None)   # 0.125
    """
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def undo_k_smoothing_shift(lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA's logsumexp from the one of K-smoothed scores: row i of S was shifted by ``-tau q_i . kbar``.

    Shared by the reference and the Triton path.

    Args:
        lse: ``[B, Hq, N]`` logsumexp of the smoothed scores (natural log), in the compute dtype.
        q: the queries ``[B, Hq, N, D]``.
        k_mean: the K-smoothing means, ``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``.
        scale: the softmax scale ``tau``.

    Example::

        lse = undo_k_smoothing_shift(lse, q, k.float().mean(dim=2), 1 / 8)
    """
    batch, kv_heads, head_dim = k_mean.shape[0], k_mean.shape[1], k_mean.shape[-1]
    k_mean = k_mean.reshape(batch, kv_heads, 1, head_dim).repeat_interleave(q.shape[1] // kv_heads, dim=1)
    return lse + (q.to(lse.dtype) * k_mean).sum(dim=-1) * scale


class _SageAttentionFunction(torch.autograd.Function):
    """Autograd glue: forward and backward of the reference, saving only what the design lists."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool,
        scale: float | None,
        precision: AttentionPrecision,
        stats: torch.Tensor | None,
        block_m: int,
        block_n: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        geo = _geometry(q, k, is_causal, scale, block_m, block_n, precision)
        saved = _prepare(q, k, geo, precision)
        out_rows, lse_rows, out_hp_rows = _forward(v, saved, geo, precision)
        out = geo.from_rows(out_rows).to(q.dtype)
        ctx.geo, ctx.precision, ctx.stats = geo, precision, stats
        ctx.has_means = (saved.q_mean is not None, saved.k_mean is not None)
        if precision.backward_from_inputs:
            # FlashAttention's backward keeps the inputs themselves, the output and the logsumexp.
            ctx.save_for_backward(q, k, v, out, lse_rows)
        else:
            # O_hp stored in the input dtype, as the kernel stores it.
            out_for_delta = geo.from_rows(out_hp_rows).to(q.dtype) if precision.high_precision_out else out
            means = [m for m in (saved.q_mean, saved.k_mean) if m is not None]
            ctx.save_for_backward(
                saved.q_op, saved.q_scale, saved.k_op, saved.k_scale, v, out_for_delta, lse_rows, *means
            )
        lse = _public_lse(q, lse_rows, saved, geo)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        geo: _Geometry = ctx.geo
        if ctx.precision.backward_from_inputs:
            q, k, v, out, lse_rows = ctx.saved_tensors
            saved = _from_inputs(q, k, geo)
        else:
            q_op, q_scale, k_op, k_scale, v, out, lse_rows, *rest = ctx.saved_tensors
            # A list of its own: torch 2.11's dynamo makes the starred target a tuple, which has no pop.
            means = list(rest)
            has_q_mean, has_k_mean = ctx.has_means
            q_mean = means.pop(0) if has_q_mean else None
            k_mean = means.pop(0) if has_k_mean else None
            saved = _Saved(q_op, q_scale, k_op, k_scale, q_mean, k_mean)
        dq, dk, dv = _backward(grad_out, out, lse_rows, v, saved, geo, ctx.precision, ctx.stats)
        dq = geo.from_rows(dq).to(geo.io_dtype)
        dk = dk[:, :, : geo.seq_k].to(geo.io_dtype)
        dv = dv[:, :, : geo.seq_k].to(geo.io_dtype)
        return dq, dk, dv, None, None, None, None, None, None


def sage_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
    stats: torch.Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SageBwd or Attn-QAT attention in plain PyTorch, differentiable; returns ``(O, logsumexp)``.

    Callers normally use :func:`sage_lightning.kernels.sage_attention`, which checks its arguments and
    picks the path; this function trusts them (shapes as SDPA, ``Hq % Hkv == 0``, one float dtype,
    float64 allowed for numerical studies) and takes the tile sizes, which set the quantization blocks.

    Args:
        q: ``[B, Hq, N, D]``.
        k: ``[B, Hkv, Nk, D]``.
        v: ``[B, Hkv, Nk, D]``.
        is_causal: top-left aligned causal mask, as SDPA's ``is_causal``.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        precision: the numerics; SageBwd defaults when ``None``. ``mode="attn_qat"`` runs simulated NVFP4
            (:attr:`.AttentionPrecision.formats`), with the matched or the drop-in backward.
        stats: optional fp32 tensor of 2 elements; the backward adds ``sum (dS - deq(psi(dS)))^2`` and
            ``sum dS^2`` into it. Ignored in ``mode="attn_qat"`` (no INT8 dS to measure), as
            :func:`sage_lightning.kernels.sage_attention` ignores it.
        block_m: query tile; the quantization block of Q' and dO (Attn-QAT: the rows processed at a time, which
            changes its result only by fp32 summation order).
        block_n: key tile; the quantization block of K' and V (Attn-QAT: a multiple of 16, P is quantized with
            one scale per row of each key tile).

    Returns:
        ``O`` ``[B, Hq, N, D]`` in the input dtype and the row logsumexp ``[B, Hq, N]`` in fp32 (fp64 for
        fp64 inputs); Attn-QAT's is of the quantized scores.

    Raises:
        ValueError: a tile or head dim over :data:`MAX_EXACT_CONTRACTION`, or (Attn-QAT) ``block_n`` not a
            multiple of 16.

    Example::

        q = torch.randn(1, 4, 100, 64, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 2, 100, 64, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 2, 100, 64, dtype=torch.bfloat16, requires_grad=True)
        out, lse = sage_attention_reference(q, k, v, is_causal=True)
        out.sum().backward()
        qat_out, _ = sage_attention_reference(q, k, v, is_causal=True, precision=AttentionPrecision.attn_qat())
    """
    precision = AttentionPrecision() if precision is None else precision
    if precision.mode == "attn_qat":
        stats = None
    return _SageAttentionFunction.apply(q, k, v, is_causal, scale, precision, stats, block_m, block_n)


def sage_attention_intermediates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> dict[str, torch.Tensor]:
    """Every tensor of one SageBwd or Attn-QAT forward and backward, for error attribution.

    The same code as :func:`sage_attention_reference`, with the ``[N, Nk]`` matrices kept: ``P`` (the
    normalised probabilities the PV product used), ``dP``, ``dS`` (as the dQ/dK products used it; Attn-QAT's
    before its rounding to the input dtype). Meant for small shapes: it holds three ``B x Hq x N x Nk`` matrices.

    Args:
        q, k, v: as :func:`sage_attention_reference`.
        grad_out: the gradient of O, ``[B, Hq, N, D]``.
        is_causal, scale, precision, block_m, block_n: as :func:`sage_attention_reference`.

    Returns:
        A dict with ``O, lse, delta, P, dP, dS, dQ, dK, dV`` in the compute dtype (fp32, fp64 for fp64
        inputs), each shaped like its counterpart in :func:`exact_attention`. Attn-QAT adds ``O_hp``, the output
        of the unquantized P; its ``delta`` is the backward's (from O_hp when matched, from O for the drop-in
        backward).

    Example::

        parts = sage_attention_intermediates(q, k, v, torch.randn_like(q))
        parts["dS"].shape   # [B, Hq, N, Nk]
        qat = sage_attention_intermediates(q, k, v, torch.randn_like(q), precision=AttentionPrecision.attn_qat())
        qat["O_hp"].shape   # [B, Hq, N, D]
    """
    precision = AttentionPrecision() if precision is None else precision
    geo = _geometry(q, k, is_causal, scale, block_m, block_n, precision)
    saved = _prepare(q, k, geo, precision)
    record: dict[str, torch.Tensor] = {}
    out_rows, lse_rows, out_hp_rows = _forward(v, saved, geo, precision, record=record)
    out = geo.from_rows(out_rows).to(q.dtype)  # stored in the input dtype, as the kernel stores it
    out_hp = None if out_hp_rows is None else geo.from_rows(out_hp_rows).to(q.dtype)
    out_for_delta = out_hp if precision.high_precision_out else out
    backward_saved = _from_inputs(q, k, geo) if precision.backward_from_inputs else saved
    dq, dk, dv = _backward(grad_out, out_for_delta, lse_rows, v, backward_saved, geo, precision, record=record)
    result = {
        "O": out.to(geo.compute_dtype),
        "lse": _public_lse(q, lse_rows, saved, geo),
        "dQ": geo.from_rows(dq),
        "dK": dk[:, :, : geo.seq_k],
        "dV": dv[:, :, : geo.seq_k],
    }
    if out_hp is not None:
        result["O_hp"] = out_hp.to(geo.compute_dtype)
    result["delta"] = geo.from_rows(record["delta"][..., None])[..., 0]
    for name in ("P", "dP", "dS"):
        result[name] = geo.from_rows(record[name])
    return result


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> dict[str, torch.Tensor]:
    """Plain attention and its gradients in float64 with every intermediate: the accuracy oracle.

    Args:
        q, k, v: SDPA layout; GQA when ``Hq % Hkv == 0``. Cast to float64.
        grad_out: the gradient of O.
        is_causal: top-left aligned causal mask, as SDPA's.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.

    Returns:
        A dict with ``O, lse, delta, P, dP, dS, dQ, dK, dV`` in float64 (``dK``/``dV`` summed over the
        query heads that share a kv head; ``dP`` zero where the causal mask removes a pair).

    Example::

        ref = exact_attention(q, k, v, torch.randn_like(q), is_causal=True)
        ref["dS"].dtype   # torch.float64
    """
    f64 = torch.float64
    group = q.shape[1] // k.shape[1]
    q64, do64 = q.to(f64), grad_out.to(f64)
    k64 = k.to(f64).repeat_interleave(group, dim=1)
    v64 = v.to(f64).repeat_interleave(group, dim=1)
    tau = softmax_scale(q.shape[-1], scale)
    s = (q64 @ k64.transpose(-1, -2)) * tau
    if is_causal:
        n, nk = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(n, nk, dtype=torch.bool, device=q.device).tril().logical_not(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = p @ v64
    delta = (do64 * out).sum(dim=-1)
    dp = do64 @ v64.transpose(-1, -2)
    if is_causal:  # masked pairs have no dP to speak of; zero, as the SageBwd intermediates record them
        dp = dp.masked_fill(s == -math.inf, 0.0)
    ds = p * (dp - delta[..., None])
    dq = (ds @ k64) * tau
    dk = (ds.transpose(-1, -2) @ q64) * tau
    dv = p.transpose(-1, -2) @ do64
    b, hq, nk, d = dk.shape
    dk = dk.reshape(b, hq // group, group, nk, d).sum(dim=2)
    dv = dv.reshape(b, hq // group, group, nk, d).sum(dim=2)
    return {"O": out, "lse": lse, "delta": delta, "P": p, "dP": dp, "dS": ds, "dQ": dq, "dK": dk, "dV": dv}
