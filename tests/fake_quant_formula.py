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
from sage_lightning.kernels.reference import quantize_int8


def fake_quant(x: torch.Tensor, row_block: int, col_block: int) -> torch.Tensor:
    """``deq(psi(x))`` with one scale per ``row_block x col_block`` block of the last two dims."""
    *lead, rows, cols = x.shape
    rp, cp = -(-rows // row_block) * row_block, -(-cols // col_block) * col_block
    xb = F.pad(x, (0, cp - cols, 0, rp - rows)).reshape(*lead, rp // row_block, row_block, cp // col_block, col_block)
    codes, scale = quantize_int8(xb, (-3, -1))
    return (codes * scale).reshape(*lead, rp, cp)[..., :rows, :cols]


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
    int8 = set(precision.int8_products)

    def st(x: torch.Tensor, rb: int, cb: int) -> torch.Tensor:
        return _StraightThrough.apply(x, lambda t: fake_quant(t, rb, cb))

    def qgrad(x: torch.Tensor, rb: int, cb: int) -> torch.Tensor:
        return _QuantizeGrad.apply(x, lambda g: fake_quant(g, rb, cb))

    k_mean = k.mean(dim=2, keepdim=True).detach() if precision.smooth_k else torch.zeros_like(k[:, :, :1])
    k_smooth = k - k_mean
    q_mean_rows = torch.zeros_like(q)
    if precision.smooth_q:
        for start in range(0, n, block_m):
            rows = slice(start, min(start + block_m, n))
            q_mean_rows[:, :, rows] = q[:, :, rows].mean(dim=2, keepdim=True).detach()
    q_smooth = q - q_mean_rows
    q_op = st(q_smooth, block_m, d) if "qk" in int8 else q_smooth
    k_op = st(k_smooth, block_n, d) if "qk" in int8 else k_smooth
    k_op = k_op.repeat_interleave(group, dim=1)

    s_main = tau * q_op @ k_op.transpose(-1, -2)
    if "ds" in int8:  # dQ and dK consume psi(dS), one scale per tile
        s_main = qgrad(s_main, block_m, block_n)
    s = s_main
    if precision.smooth_q:  # the dropped term, in high precision; its gradient reaches K through deq(K'^)
        s = s + tau * q_mean_rows @ k_op.transpose(-1, -2)
    if is_causal:
        s = s.masked_fill(torch.ones(n, nk, dtype=torch.bool).tril().logical_not(), -math.inf)

    row_max = s.amax(dim=-1, keepdim=True).detach()
    p_unnorm = torch.exp(s - row_max)
    row_sum = p_unnorm.sum(dim=-1, keepdim=True)
    p = p_unnorm / row_sum

    # Forward value: P quantized per row of each key tile (scale rowmax/127 of that tile), V per block.
    v_op = fake_quant(v, block_n, d) if "pv" in int8 else v
    v_op = v_op.repeat_interleave(group, dim=1)
    with torch.no_grad():
        out_value = torch.zeros_like(q)
        for start in range(0, nk, block_n):
            keys = slice(start, min(start + block_n, nk))
            tile_max = s[..., keys].amax(dim=-1, keepdim=True)
            tile_max = torch.where(tile_max == -math.inf, torch.zeros_like(tile_max), tile_max)
            p_tile = torch.exp(s[..., keys] - tile_max)
            if "pv" in int8:
                p_tile = fake_quant(p_tile, 1, block_n)
            out_value += torch.exp(tile_max - row_max) * (p_tile @ v_op[:, :, keys])
        out_value /= row_sum

    # dP = dO V^T (psi(dO) psi(V)^T when dp is int8), and dS = P * (dP - delta) with delta from the stored O.
    v_dp = (fake_quant(v, block_n, d) if "dp" in int8 else v).repeat_interleave(group, dim=1).detach()
    through_p = (p_unnorm @ v_dp) / row_sum.detach()
    if "dp" in int8:
        through_p = qgrad(through_p, block_m, d)
    log_sum = torch.log(row_sum)
    through_delta = (log_sum - log_sum.detach()) * -out_value.detach()
    # dV = psi(P)^T psi(dO): P per key column of each row block (one scale per row of P^T), dO per row block.
    p_dv = (fake_quant(p, block_m, 1) if "dv" in int8 else p).detach()
    through_v = p_dv @ v.repeat_interleave(group, dim=1)
    if "dv" in int8:
        through_v = qgrad(through_v, block_m, d)

    def zero(t: torch.Tensor) -> torch.Tensor:
        return t - t.detach()

    return out_value + zero(through_p) + through_delta + zero(through_v)
