"""SageBwd written as one dense formula with explicit fake quantization, differentiated by autograd.

An independent statement of the numerics for the tests: no tiles loop, no online softmax, no hand-written
backward. Forward values come from fake-quantized operands (``deq(psi(x))``); where SageBwd's backward
quantizes a gradient or uses a different operand than the forward, zero-valued terms steer autograd to
exactly that gradient (``t - t.detach()`` has value 0 and the gradient of ``t``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.kernels.reference import FP8_MAX, fp8_round, quantize_fp8, quantize_int8


def fake_quant(x: torch.Tensor, row_block: int, col_block: int, fmt: str = "int8") -> torch.Tensor:
    """``deq(psi(x))`` with one scale per ``row_block x col_block`` block of the last two dims, in ``fmt``
    (``"int8"``, ``"fp8"``; ``"bf16"`` returns ``x``)."""
    if fmt == "bf16":
        return x
    *lead, rows, cols = x.shape
    rp, cp = -(-rows // row_block) * row_block, -(-cols // col_block) * col_block
    xb = F.pad(x, (0, cp - cols, 0, rp - rows)).reshape(*lead, rp // row_block, row_block, cp // col_block, col_block)
    codes, scale = (quantize_int8 if fmt == "int8" else quantize_fp8)(xb, (-3, -1))
    return (codes * scale).reshape(*lead, rp, cp)[..., :rows, :cols]


def fake_quant_unit(p: torch.Tensor) -> torch.Tensor:
    """FP8 of a probability with the fixed scale ``1 / 448``: ``e4m3(448 p) / 448``."""
    return fp8_round(p * FP8_MAX) / FP8_MAX


class _StraightThrough(torch.autograd.Function):
    """Forward ``fn(x)``, backward identity."""

    @staticmethod
    def forward(ctx, x, fn):  # noqa: ANN001, ANN205
        return fn(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


class _QuantizeGrad(torch.autograd.Function):
    """Forward identity, backward ``fn(grad)``."""

    @staticmethod
    def forward(ctx, x, fn):  # noqa: ANN001, ANN205
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return ctx.fn(grad), None


def sagebwd_formula(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool,
    precision: AttentionPrecision,
    block_m: int,
    block_n: int,
) -> torch.Tensor:
    """O of SageBwd for float64 inputs; ``O.backward(dO)`` gives SageBwd's dQ, dK, dV."""
    b, hq, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    tau = 1.0 / math.sqrt(d)
    fmt = {name: getattr(precision, name) for name in ("qk", "pv", "dv", "dp", "ds")}
    low = {name for name, value in fmt.items() if value != "bf16"}  # the products with quantized operands

    def st(x: torch.Tensor, rb: int, cb: int, product: str) -> torch.Tensor:
        return _StraightThrough.apply(x, lambda t: fake_quant(t, rb, cb, fmt[product]))

    def qgrad(x: torch.Tensor, rb: int, cb: int, product: str) -> torch.Tensor:
        return _QuantizeGrad.apply(x, lambda g: fake_quant(g, rb, cb, fmt[product]))

    k_mean = k.mean(dim=2, keepdim=True).detach() if precision.smooth_k else torch.zeros_like(k[:, :, :1])
    k_smooth = k - k_mean
    q_mean_rows = torch.zeros_like(q)
    if precision.smooth_q:
        for start in range(0, n, block_m):
            rows = slice(start, min(start + block_m, n))
            q_mean_rows[:, :, rows] = q[:, :, rows].mean(dim=2, keepdim=True).detach()
    q_smooth = q - q_mean_rows
    q_op = st(q_smooth, block_m, d, "qk") if "qk" in low else q_smooth
    k_op = st(k_smooth, block_n, d, "qk") if "qk" in low else k_smooth
    k_op = k_op.repeat_interleave(group, dim=1)

    s_main = tau * q_op @ k_op.transpose(-1, -2)
    if "ds" in low:  # dQ and dK consume psi(dS), one scale per tile
        s_main = qgrad(s_main, block_m, block_n, "ds")
    s = s_main
    if precision.smooth_q:  # the dropped term, in high precision; its gradient reaches K through deq(K'^)
        s = s + tau * q_mean_rows @ k_op.transpose(-1, -2)
    if is_causal:
        s = s.masked_fill(torch.ones(n, nk, dtype=torch.bool).tril().logical_not(), -math.inf)

    row_max = s.amax(dim=-1, keepdim=True).detach()
    p_unnorm = torch.exp(s - row_max)
    row_sum = p_unnorm.sum(dim=-1, keepdim=True)
    p = p_unnorm / row_sum

    # Forward value. INT8: P quantized per row of each key tile (scale rowmax/127 of that tile), V per block.
    # FP8: P~ against the running max (the largest score of this and the earlier key tiles) as e4m3(448 P~) / 448,
    # V per channel over all keys.
    if fmt["pv"] == "fp8":
        v_op = fake_quant(v, nk, 1, "fp8")
    else:
        v_op = fake_quant(v, block_n, d, fmt["pv"])
    v_op = v_op.repeat_interleave(group, dim=1)
    with torch.no_grad():
        out_value = torch.zeros_like(q)
        running = torch.full_like(row_max, -math.inf)
        for start in range(0, nk, block_n):
            keys = slice(start, min(start + block_n, nk))
            tile_max = s[..., keys].amax(dim=-1, keepdim=True)
            if fmt["pv"] == "fp8":
                running = torch.maximum(running, tile_max)
                tile_max = running
            tile_max = torch.where(tile_max == -math.inf, torch.zeros_like(tile_max), tile_max)
            p_tile = torch.exp(s[..., keys] - tile_max)
            if fmt["pv"] == "fp8":
                p_tile = fake_quant_unit(p_tile)
            elif fmt["pv"] == "int8":
                p_tile = fake_quant(p_tile, 1, block_n)
            out_value += torch.exp(tile_max - row_max) * (p_tile @ v_op[:, :, keys])
        out_value /= row_sum

    # dP = dO V^T (psi(dO) psi(V)^T when dp is quantized), and dS = P * (dP - delta) with delta from the stored O.
    v_dp = fake_quant(v, block_n, d, fmt["dp"]).repeat_interleave(group, dim=1).detach()
    through_p = (p_unnorm @ v_dp) / row_sum.detach()
    if "dp" in low:
        through_p = qgrad(through_p, block_m, d, "dp")
    log_sum = torch.log(row_sum)
    through_delta = (log_sum - log_sum.detach()) * -out_value.detach()
    # dV = psi(P)^T psi(dO): INT8 P per key column of each row block (one scale per row of P^T), FP8 P as
    # e4m3(448 P) / 448; dO per row block.
    p_dv = (fake_quant_unit(p) if fmt["dv"] == "fp8" else fake_quant(p, block_m, 1, fmt["dv"])).detach()
    through_v = p_dv @ v.repeat_interleave(group, dim=1)
    if "dv" in low:
        through_v = qgrad(through_v, block_m, d, "dv")

    def zero(t: torch.Tensor) -> torch.Tensor:
        return t - t.detach()

    return out_value + zero(through_p) + through_delta + zero(through_v)
