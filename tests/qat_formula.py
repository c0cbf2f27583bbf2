"""Independent formulas for the Attn-QAT tests: NVFP4 by brute force, attention as one dense float64 expression.

Nothing here calls the package's quantizer: E2M1 rounds by searching the grid (ties to the even code), E4M3 is
PyTorch's own ``float8_e4m3fn`` conversion, and the attention is written densely (no tiles, no online softmax),
its straight-through gradients taken by autograd. Not a test module: the tests import it.
"""

from __future__ import annotations

import math

import torch

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value by search over the grid; a tie goes to the even code (codes 0..7 in grid order)."""
    grid = torch.tensor(GRID, dtype=y.dtype, device=y.device)
    magnitude = y.abs().clamp(max=6.0)  # above 6 saturates
    distance = (magnitude[..., None] - grid).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    odd = torch.arange(8, device=y.device) % 2 == 1
    # Among the nearest (one, or two at a tie), prefer the even code.
    score = nearest.to(torch.int64) * 2 + (nearest & ~odd).to(torch.int64)
    value = grid[score.argmax(dim=-1)]
    value = torch.where(y.isnan(), y, value)
    return torch.copysign(value, y)


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """PyTorch's conversion to ``float8_e4m3fn`` and back (round to nearest even), saturating at 448."""
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(v.dtype)


def nvfp4_values(x: torch.Tensor, second_level: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The NVFP4 values of ``x / second_level``: blocks of 16 along the last dim (zero-padded), E4M3 scales of
    amax / 6, E2M1 values times their block scale (``x ~= values * second_level``)."""
    length = x.shape[-1]
    y = torch.nn.functional.pad(x / second_level, (0, -length % 16))
    blocks = y.unflatten(-1, (-1, 16))
    scale = e4m3(blocks.abs().amax(dim=-1, keepdim=True) / 6)
    values = torch.where(scale > 0, e2m1(blocks / scale), 0.0) * scale
    values = torch.where(scale.isnan(), scale, values)
    return values.flatten(-2)[..., :length]


def nvfp4(x: torch.Tensor, second_level: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Fake-quantized ``x``: :func:`nvfp4_values` times the second-level scale."""
    return nvfp4_values(x, second_level) * second_level


def second_level_scale(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``amax / 2688`` over ``dims`` (1 where 0)."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    return torch.where(amax == 0, 1.0, amax / 2688)


def nvfp4_two_level(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """:func:`nvfp4` with the FP32 scale ``amax / 2688`` over ``dims`` (1 where 0)."""
    return nvfp4(x, second_level_scale(x, dims))


def nvfp4_qkv(x: torch.Tensor) -> torch.Tensor:
    """Q, K or V ``[B, H, N, D]`` fake-quantized as Attn-QAT does: values and per-(batch, head) scale computed in
    fp32 whatever ``x``'s dtype, their product taken in ``x``'s dtype."""
    x32 = x.float()
    scale = second_level_scale(x32, (-2, -1))
    return nvfp4_values(x32, scale).to(x.dtype) * scale.to(x.dtype)


def straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """``quantized`` in the forward, the identity in the backward."""
    return x + (quantized - x).detach()


def attn_qat_formula(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float | None, block_n: int
) -> torch.Tensor:
    """Attn-QAT's forward as one dense expression with straight-through quantizers; autograd gives the matched
    backward. P is quantized normalised, per row of each ``block_n`` keys (its values do not depend on that)."""
    group = q.shape[1] // k.shape[1]
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_fq, k_fq, v_fq = (straight_through(t, nvfp4_qkv(t.detach())) for t in (q, k, v))
    s = q_fq @ k_fq.repeat_interleave(group, dim=1).transpose(-1, -2) * tau
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    p = torch.softmax(s, dim=-1)
    seq_k = p.shape[-1]
    tiles = torch.nn.functional.pad(p.detach(), (0, -seq_k % block_n)).unflatten(-1, (-1, block_n))
    p_fq = nvfp4_two_level(tiles, (-1,)).flatten(-2)[..., :seq_k]
    return straight_through(p, p_fq) @ v_fq.repeat_interleave(group, dim=1)


def dropin_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's backward written densely, from the unquantized inputs and a given O and logsumexp."""
    group = q.shape[1] // k.shape[1]
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k_rep.transpose(-1, -2) * tau
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-1, -2) @ grad_out
    dp = grad_out @ v_rep.transpose(-1, -2)
    ds = p * (dp - (grad_out * out).sum(dim=-1, keepdim=True))
    dq = ds @ k_rep * tau
    dk = ds.transpose(-1, -2) @ q * tau
    b, hq, nk, d = dk.shape
    return dq, dk.reshape(b, hq // group, group, nk, d).sum(2), dv.reshape(b, hq // group, group, nk, d).sum(2)
