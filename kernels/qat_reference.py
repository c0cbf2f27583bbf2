"""Attn-QAT (``mode="attn_qat"``) in plain PyTorch: simulated NVFP4 attention, the Triton kernels' oracle.

Numerics (every NVFP4 step is :mod:`.nvfp4`'s: E2M1 values in blocks of 16 along one dim, E4M3 block scales,
round to nearest even, saturating, and an FP32 second-level scale):

Forward, over key tiles of ``BLOCK_N`` keys (the online softmax of FlashAttention):

* ``Q, K, V`` fake-quantized along the head dim with one FP32 scale per (batch, head), computed in fp32:
  ``Q ~= U_Q s_Q``; the values ``U`` are exact in bf16 and fp16, so every product below takes them as they
  are and applies the FP32 scales to its fp32 result;
* ``S = tau (U_Q U_K^T) s_Q s_K``, products in the input dtype with fp32 accumulation (Hopper has no FP4
  tensor cores: the FP4 values are simulated, the products are bf16);
* ``P~ = exp(S - m)`` with the running row max ``m``; the row sum ``l`` adds up the unquantized ``P~``;
* ``P~`` fake-quantized along the keys, one FP32 scale per row of the tile, ``rowmax(P~) / (6 * 448)``
  (SageAttention3's two-level P): its block scales and values depend only on ``exp(S - tilemax)``, not on
  the running max, so the backward's P, normalised differently, quantizes to the same values;
* ``O = sum_tiles U_P (U_V s_V) s_P / l`` (the quantized P) and ``O_hp = sum_tiles bf16(P~) (U_V s_V) / l``
  (the unquantized P, kept for the backward); ``lse = m + log(l)``.

Backward, ``qat_backward="matched"`` (Attn-QAT), per tile:

* ``S`` and ``P = exp(S - lse)`` recomputed from the saved ``U_Q, U_K`` and scales (matching recomputation);
* ``dV += bf16(fq(P))^T dO``, ``fq(P)`` quantized exactly as the forward (per row of the tile);
* ``dP = dO (U_V s_V)^T``; ``delta = rowsum(dO * O_hp)``, which is ``rowsum(P * dP)``, the softmax
  gradient's own term (``rowsum(dO * O)`` with the quantized O would not be);
* ``dS = P (dP - delta)``; ``dQ += tau bf16(dS) (U_K s_K)``, ``dK += tau bf16(dS)^T (U_Q s_Q)``.

Straight-through: the gradients that reach the fake-quantized Q, K, V pass to q, k, v unchanged, and the one
that reaches the quantized P passes to P.

Backward, ``qat_backward="dropin"`` (the "drop-in" QAT the Attn-QAT paper finds unstable): FlashAttention's
backward from the unquantized q, k, v, fed the FP4 forward's O and lse: ``S = tau q k^T``,
``P = exp(S - lse)`` (lse of the quantized scores, so P does not sum to 1), ``dV += bf16(P)^T dO``,
``dP = dO v^T``, ``delta = rowsum(dO * O)`` with the forward's O, ``dS = P (dP - delta)``,
``dQ += tau bf16(dS) k``, ``dK += tau bf16(dS)^T q``.

"bf16" above is the input's dtype (fp16 inputs run in fp16, fp32 inputs in fp32). The reference keeps every
operand in fp32 (fp64 for fp64 inputs), rounded to the input dtype where the kernels round it, so its
products equal the kernels' up to summation order.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .nvfp4 import NVFP4_BLOCK, nvfp4_quantize, nvfp4_tensor_scale
from .precision import AttentionPrecision
from .reference import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, _Geometry, _geometry

__all__ = ["attn_qat_intermediates", "attn_qat_reference", "quantize_p_tile", "quantize_qkv"]


def quantize_qkv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of Q, K or V ``[B, H, N, D]`` along the head dim, one FP32 scale per (batch, head).

    Computed in fp32 whatever ``x``'s dtype (the second-level scale is an FP32 number, as the kernels compute
    it): a bf16 tensor and its float64 copy quantize to the same values. That matters more than it seems:
    16-bit inputs put many values exactly on E2M1 rounding ties, which a division carried out in another
    precision would break the other way.

    Args:
        x: ``[B, H, N, D]``, any float dtype.

    Returns:
        ``(values, scale)``: values ``[B, H, N, D]`` (exact in bf16 and fp16) and ``scale`` ``[B, H, 1, 1]``,
        both in fp32 (fp64 for fp64 ``x``, holding the same numbers); ``x ~= values * scale``.

    Example::

        u_q, s_q = quantize_qkv(q)
    """
    x32 = x.to(torch.float32)
    scale = nvfp4_tensor_scale(x32, dims=(-2, -1))
    values, _ = nvfp4_quantize(x32, scale)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return values.to(dtype), scale.to(dtype)


def quantize_p_tile(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of a tile of probabilities ``[..., rows, keys]`` along the keys, one FP32 scale per row.

    The row scale is ``rowmax / (6 * 448)`` (1 for a row of zeros), so the row's largest block gets the block
    scale 448 and its max the value 6: the values depend only on the row's shape, not on its normalisation.

    Args:
        p: non-negative probabilities (unnormalised or normalised), keys a multiple of 16.

    Returns:
        ``(values, row_scale)``; ``p ~= values * row_scale``, ``row_scale`` shaped ``[..., rows, 1]``.

    Example::

        values, row_scale = quantize_p_tile(torch.rand(128, 64))
    """
    row_scale = nvfp4_tensor_scale(p, dims=(-1,))
    values, _ = nvfp4_quantize(p, row_scale)
    return values, row_scale


def _round(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """``x`` rounded to the input dtype, kept in the compute dtype (an operand of a 16-bit product)."""
    return x.to(geo.io_dtype).to(geo.compute_dtype)


def _row_scales(scale: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """Per-(batch, query head) scales ``[B, Hq, 1, 1]`` -> one per row of the rows layout ``[B, Hkv, R, 1]``."""
    return geo.to_rows(scale.expand(-1, -1, geo.seq_q, 1))


def _scores(q_op, q_scale_rows, k_op, k_scale, geo: _Geometry, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``S`` of one key tile for every row, masked, from the operands (forward and backward alike)."""
    keys = slice(tile * geo.block_n, (tile + 1) * geo.block_n)
    s = (q_op @ k_op[:, :, keys].transpose(-1, -2)) * (q_scale_rows * k_scale * geo.scale)
    invalid = geo.invalid(tile, s.device)
    return s.masked_fill(invalid, -math.inf), invalid


def _forward(
    q_op: torch.Tensor,
    q_scale_rows: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v_op: torch.Tensor,
    v_scale: torch.Tensor,
    geo: _Geometry,
    record: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax over key tiles: O (quantized P), O_hp (unquantized P) ``[B, Hkv, R, D]``, lse ``[B, Hkv, R]``."""
    shape = (geo.batch, geo.kv_heads, geo.rows)
    row_max = torch.full(shape, -math.inf, dtype=geo.compute_dtype, device=q_op.device)
    row_sum = torch.zeros(shape, dtype=geo.compute_dtype, device=q_op.device)
    acc = torch.zeros(*shape, geo.head_dim, dtype=geo.compute_dtype, device=q_op.device)
    acc_hp = torch.zeros_like(acc)
    tiles_p, tiles_max = [], []
    for tile in range(geo.key_tiles):
        s, _ = _scores(q_op, q_scale_rows, k_op, k_scale, geo, tile)
        new_max = torch.maximum(row_max, s.amax(dim=-1))
        # A row with every key so far masked has max -inf; exp(-inf - 0) = 0 keeps it empty (NaN stays NaN).
        safe_max = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max[..., None])
        alpha = torch.exp(row_max - safe_max)
        row_sum = row_sum * alpha + p.sum(dim=-1)  # the unquantized P: lse normalises the backward's P exactly
        v_tile = v_op[:, :, tile * geo.block_n : (tile + 1) * geo.block_n]
        p_values, p_scale = quantize_p_tile(p)
        acc = acc * alpha[..., None] + (p_values @ v_tile) * p_scale
        acc_hp = acc_hp * alpha[..., None] + _round(p, geo) @ v_tile
        row_max = new_max
        if record is not None:
            tiles_p.append(p_values * p_scale)
            tiles_max.append(safe_max)
    out = acc / row_sum[..., None] * v_scale
    out_hp = acc_hp / row_sum[..., None] * v_scale
    lse = row_max + torch.log(row_sum)
    if record is not None:
        norm = [
            p * torch.exp(m - row_max)[..., None] / row_sum[..., None] for p, m in zip(tiles_p, tiles_max, strict=True)
        ]
        record["P"] = torch.cat(norm, dim=-1)[..., : geo.seq_k]
    return out, out_hp, lse


def _backward(
    do: torch.Tensor,
    out_for_delta: torch.Tensor,
    lse: torch.Tensor,
    q_op: torch.Tensor,
    q_scale: torch.Tensor,
    k_op: torch.Tensor,
    k_scale: torch.Tensor,
    v_op: torch.Tensor,
    v_scale: torch.Tensor,
    geo: _Geometry,
    quantize_p: bool,
    record: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ ``[B, Hkv, R, D]``, dK and dV ``[B, Hkv, padded Nk, D]``.

    ``q_op``.. are the operands S is recomputed from (the NVFP4 values and their scales for ``"matched"``,
    q, k, v with scale 1 for ``"dropin"``); ``out_for_delta`` is O_hp or O; ``quantize_p`` re-quantizes P for
    dV as the forward did.
    """
    b, h, g, nb, d = geo.batch, geo.kv_heads, geo.group, geo.block_n, geo.head_dim
    do_r = geo.to_rows(do)
    delta = (do_r * geo.to_rows(out_for_delta)).sum(dim=-1)
    do_op = _round(do_r, geo)
    q_scale_rows = _row_scales(q_scale, geo)
    q_heads = q_op.reshape(b, h, g, geo.padded_q, d)
    q_scale_heads = q_scale.reshape(b, h, g, 1, 1)
    dq = torch.zeros_like(do_r)
    dk = torch.zeros(b, h, geo.padded_k, d, dtype=geo.compute_dtype, device=do.device)
    dv = torch.zeros_like(dk)
    tiles: dict[str, list[torch.Tensor]] = {"dP": [], "dS": []}
    for tile in range(geo.key_tiles):
        keys = slice(tile * nb, (tile + 1) * nb)
        s, invalid = _scores(q_op, q_scale_rows, k_op, k_scale, geo, tile)
        p = torch.exp(s - lse[..., None]).masked_fill(invalid, 0.0)  # padded rows have lse = -inf
        if quantize_p:
            p_values, p_scale = quantize_p_tile(p)
            p_dv = p_values * p_scale
        else:
            p_dv = p
        dv[:, :, keys] = _round(p_dv, geo).transpose(-1, -2) @ do_op
        dp = (do_op @ v_op[:, :, keys].transpose(-1, -2)) * v_scale
        ds = p * (dp - delta[..., None])
        ds_op = _round(ds, geo)
        dq += (ds_op @ k_op[:, :, keys]) * (k_scale * geo.scale)
        # dK sums over the rows of every query head of the group: each head's Q scale applies to its own part.
        ds_heads = ds_op.reshape(b, h, g, geo.padded_q, nb)
        dk[:, :, keys] = ((ds_heads.transpose(-1, -2) @ q_heads) * q_scale_heads).sum(dim=2) * geo.scale
        if record is not None:
            tiles["dP"].append(dp.masked_fill(invalid, 0.0))
            tiles["dS"].append(ds)
    if record is not None:
        record["delta"] = delta
        for name, parts in tiles.items():
            record[name] = torch.cat(parts, dim=-1)[..., : geo.seq_k]
    return dq, dk, dv


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geo: _Geometry) -> tuple[torch.Tensor, ...]:
    """The forward's operands: NVFP4 values of Q (rows layout), K, V (padded keys) and their scales."""
    q_values, q_scale = quantize_qkv(q)
    k_values, k_scale = quantize_qkv(k)
    v_values, v_scale = quantize_qkv(v)
    return geo.to_rows(q_values), q_scale, geo.to_keys(k_values), k_scale, geo.to_keys(v_values), v_scale


def _check_block_n(block_n: int) -> None:
    if block_n % NVFP4_BLOCK:
        raise ValueError(
            f"attn_qat reference: block_n must be a multiple of {NVFP4_BLOCK} (P is quantized in blocks of "
            f"{NVFP4_BLOCK} keys within a key tile); received {block_n}."
        )


class _AttnQatFunction(torch.autograd.Function):
    """Autograd glue: the forward saves what its backward recomputes from, nothing more."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool,
        scale: float | None,
        matched: bool,
        block_m: int,
        block_n: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        geo = _geometry(q, k, is_causal, scale, block_m, block_n)
        q_op, q_scale, k_op, k_scale, v_op, v_scale = _prepare(q, k, v, geo)
        out_rows, out_hp_rows, lse_rows = _forward(q_op, _row_scales(q_scale, geo), k_op, k_scale, v_op, v_scale, geo)
        out = geo.from_rows(out_rows).to(q.dtype)
        ctx.geo, ctx.matched = geo, matched
        if matched:
            out_hp = geo.from_rows(out_hp_rows).to(q.dtype)  # stored in the input dtype, as the kernel stores it
            ctx.save_for_backward(q_op, q_scale, k_op, k_scale, v_op, v_scale, out_hp, lse_rows)
        else:
            ones = q.new_ones((), dtype=geo.compute_dtype)
            # FlashAttention's backward keeps the inputs themselves, the output and the logsumexp.
            ctx.save_for_backward(q, ones, k, ones, v, ones, out, lse_rows)
        lse = geo.from_rows(lse_rows[..., None])[..., 0]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q_op, q_scale, k_op, k_scale, v_op, v_scale, out_for_delta, lse_rows = ctx.saved_tensors
        geo: _Geometry = ctx.geo
        if not ctx.matched:
            q_scale = q_scale.expand(geo.batch, geo.kv_heads * geo.group, 1, 1)
            q_op, k_op, v_op = geo.to_rows(q_op), geo.to_keys(k_op), geo.to_keys(v_op)
        dq, dk, dv = _backward(
            grad_out, out_for_delta, lse_rows, q_op, q_scale, k_op, k_scale, v_op, v_scale, geo, ctx.matched
        )
        dq = geo.from_rows(dq).to(geo.io_dtype)
        dk = dk[:, :, : geo.seq_k].to(geo.io_dtype)
        dv = dv[:, :, : geo.seq_k].to(geo.io_dtype)
        return dq, dk, dv, None, None, None, None, None


def attn_qat_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attn-QAT attention in plain PyTorch, differentiable; returns ``(O, logsumexp)``.

    Callers normally use :func:`sage_lightning.kernels.sage_attention` with ``AttentionPrecision(mode="attn_qat")``,
    which checks its arguments and picks the path; this function trusts them (SDPA layout, ``Hq % Hkv == 0``,
    one float dtype, float64 allowed for numerical studies).

    Args:
        q: ``[B, Hq, N, D]``.
        k: ``[B, Hkv, Nk, D]``.
        v: ``[B, Hkv, Nk, D]``.
        is_causal: top-left aligned causal mask, as SDPA's ``is_causal``.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.
        precision: ``qat_backward`` picks the backward (``"matched"`` when ``None``); its other fields are not read.
        block_m: query tile (changes nothing in the result; the rows are processed a tile at a time).
        block_n: key tile, a multiple of 16: P is quantized with one scale per row of each key tile.

    Returns:
        ``O`` ``[B, Hq, N, D]`` in the input dtype and the row logsumexp of the quantized scores ``[B, Hq, N]``
        in fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: ``block_n`` not a multiple of 16.

    Example::

        q = torch.randn(1, 4, 100, 64, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 2, 100, 64, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 2, 100, 64, dtype=torch.bfloat16, requires_grad=True)
        out, lse = attn_qat_reference(q, k, v, is_causal=True)
        out.sum().backward()
    """
    _check_block_n(block_n)
    matched = precision is None or precision.qat_backward == "matched"
    return _AttnQatFunction.apply(q, k, v, is_causal, scale, matched, block_m, block_n)


def attn_qat_intermediates(
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
    """Every tensor of one Attn-QAT forward and backward, for error studies (small shapes: it keeps ``[N, Nk]``).

    The same code as :func:`attn_qat_reference`. ``P`` is the quantized, normalised P the output used; ``dP``
    and ``dS`` are the backward's (``dS`` before its rounding to the input dtype); ``delta`` is the backward's
    (from O_hp when matched, from O for the drop-in backward).

    Args:
        q, k, v: as :func:`attn_qat_reference`.
        grad_out: the gradient of O, ``[B, Hq, N, D]``.
        is_causal, scale, precision, block_m, block_n: as :func:`attn_qat_reference`.

    Returns:
        A dict with ``O, O_hp, lse, delta, P, dP, dS, dQ, dK, dV`` in the compute dtype, each shaped like its
        counterpart in :func:`~sage_lightning.kernels.reference.exact_attention`.

    Example::

        parts = attn_qat_intermediates(q, k, v, torch.randn_like(q))
        parts["P"].shape   # [B, Hq, N, Nk]
    """
    _check_block_n(block_n)
    matched = precision is None or precision.qat_backward == "matched"
    geo = _geometry(q, k, is_causal, scale, block_m, block_n)
    q_op, q_scale, k_op, k_scale, v_op, v_scale = _prepare(q, k, v, geo)
    record: dict[str, torch.Tensor] = {}
    out_rows, out_hp_rows, lse_rows = _forward(
        q_op, _row_scales(q_scale, geo), k_op, k_scale, v_op, v_scale, geo, record=record
    )
    out = geo.from_rows(out_rows).to(q.dtype)
    out_hp = geo.from_rows(out_hp_rows).to(q.dtype)
    if matched:
        operands = (q_op, q_scale, k_op, k_scale, v_op, v_scale)
        out_for_delta = out_hp
    else:
        one = q.new_ones((), dtype=geo.compute_dtype)
        q_scale_one = one.expand(geo.batch, geo.kv_heads * geo.group, 1, 1)
        operands = (geo.to_rows(q), q_scale_one, geo.to_keys(k), one, geo.to_keys(v), one)
        out_for_delta = out
    dq, dk, dv = _backward(grad_out, out_for_delta, lse_rows, *operands, geo, matched, record=record)
    result = {
        "O": out.to(geo.compute_dtype),
        "O_hp": out_hp.to(geo.compute_dtype),
        "lse": geo.from_rows(lse_rows[..., None])[..., 0],
        "dQ": geo.from_rows(dq),
        "dK": dk[:, :, : geo.seq_k],
        "dV": dv[:, :, : geo.seq_k],
    }
    result["delta"] = geo.from_rows(record["delta"][..., None])[..., 0]
    for name in ("P", "dP", "dS"):
        result[name] = geo.from_rows(record[name])
    return result
