"""Triton NVFP4 fake quantization for ``mode="attn_qat"``: the rounding helpers, P per row of a tile, Q/K/V.

The numerics are :mod:`.nvfp4`'s (E2M1 values in blocks of 16, E4M3 block scales, round to nearest even,
saturating, an FP32 second-level scale). E4M3 and E2M1 rounding are written with fp32 arithmetic on the
value's exponent bits rather than conversions to ``tl.float8e4nv``: the same code then runs on every GPU and
in the interpreter (whose float8 conversions we do not rely on), and rounding a multiple of a power-of-two
step to an even integer (:func:`~.quant.round_half_even`) is IEEE's round to nearest even.

NaN: the values are kept as floats, so a NaN stays a NaN through the rounding, whatever the maxima make of it
(Triton's ``max`` skips NaNs, unlike the reference's). Where the reference spreads a NaN further, the result
is the same: a NaN anywhere in Q, K or V makes the head's second-level scale NaN (a ``torch`` reduction, as in
the reference) and so every value of the head; and a row of S, hence of P, is either all NaN or has none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4 import nvfp4_tensor_scale
from .quant import padded_head_dim, round_e4m3, round_half_even


@triton.jit
def round_e2m1(y):
    """``y`` (fp32) rounded to the nearest E2M1 value (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), ties to even, saturating.

    Steps 0.5 below 2, 1 below 4, 2 above; magnitudes are clipped at 8 first, which rounds to 8 and
    saturates to 6, as anything above 6 does.
    """
    magnitude = tl.abs(y)
    magnitude = tl.where(magnitude > 8.0, 8.0, magnitude)
    step = tl.where(magnitude < 2.0, 0.5, tl.where(magnitude < 4.0, 1.0, 2.0))
    rounded = round_half_even(magnitude * (1.0 / step)) * step  # 1 / step and the product are exact
    rounded = tl.where(rounded > 6.0, 6.0, rounded)
    return tl.where(y < 0, -rounded, rounded)


@triton.jit
def nvfp4_values(y, ROWS: tl.constexpr, COLS: tl.constexpr, EXACT: tl.constexpr):
    """NVFP4 values ``E2M1(y / d) * d`` of a ``[ROWS, COLS]`` fp32 tile ``y`` (already divided by its second-level
    scale), blocks of 16 along the columns, ``d = E4M3(max|y_block| / 6)``; 0 where ``d`` is 0.

    ``EXACT`` divides with IEEE rounding (the quantization pre-pass, whose values equal the reference's bit for
    bit); otherwise the GPU's faster division (the loops), which can move a value within 2 ulp of a rounding
    boundary to the neighbouring one.
    """
    blocks = tl.reshape(y, [ROWS, COLS // 16, 16])
    amax = tl.max(tl.abs(blocks), axis=2)
    if EXACT:
        scale = round_e4m3(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0))
    else:
        scale = round_e4m3(amax / 6.0)
    usable = scale > 0.0  # False for 0 (an all-zero block, or one too small for E4M3)
    divisor = tl.where(usable, scale, 1.0)[:, :, None]
    if EXACT:
        ratio = tl.math.div_rn(blocks, tl.broadcast_to(divisor, [ROWS, COLS // 16, 16]))
    else:
        ratio = blocks / divisor
    codes = tl.where(usable[:, :, None], round_e2m1(ratio), 0.0)
    return tl.reshape(codes * scale[:, :, None], [ROWS, COLS])


@triton.jit
def quantize_p_rows(p, ROWS: tl.constexpr, COLS: tl.constexpr):
    """NVFP4 of a tile of probabilities ``p >= 0`` ``[ROWS, COLS]``: one FP32 scale per row, ``rowmax / 2688``
    (1 for a row of zeros), blocks of 16 keys. Returns ``(values, row_scale)``, ``p ~= values * row_scale[:, None]``.
    """
    row_scale = tl.max(p, axis=1) / 2688.0
    row_scale = tl.where(row_scale == 0.0, 1.0, row_scale)
    return nvfp4_values(p / row_scale[:, None], ROWS, COLS, False), row_scale


@triton.jit
def _nvfp4_rows_kernel(
    X,
    SCALE,
    OUT,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_xd,
    HEADS,
    SEQ,
    HEAD_DIM,
    BLOCK: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """One program per (block of ``BLOCK`` rows, batch x head): the NVFP4 values of ``X / SCALE[b, h]`` along the
    head dim, stored in ``OUT``'s dtype (exact: at most 6 significant bits) as a contiguous ``[B, H, N, D]``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D_PAD)
    valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
    x = tl.load(
        X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xn + cols[None, :] * stride_xd, mask=valid, other=0.0
    ).to(tl.float32)
    scale = tl.load(SCALE + pid_bh)
    values = nvfp4_values(tl.math.div_rn(x, tl.zeros_like(x) + scale), BLOCK, D_PAD, True)
    tl.store(
        OUT + pid_bh * SEQ * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :],
        values.to(OUT.dtype.element_ty),
        mask=valid,
    )


def quantize_qkv_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of Q, K or V ``[B, H, N, D]`` along the head dim, one FP32 scale per (batch, head).

    The kernel twin of :func:`~.qat_reference.quantize_qkv`: the scale is the same ``torch`` reduction, the
    values equal the reference's bit for bit.

    Args:
        x: ``[B, H, N, D]``, bf16/fp16/fp32, any strides.

    Returns:
        ``(values, scale)``: values contiguous ``[B, H, N, D]`` in ``x``'s dtype (exact), ``scale`` fp32
        ``[B, H]`` contiguous; ``x ~= values * scale``.

    Example::

        u_q, s_q = quantize_qkv_triton(q)
    """
    batch, heads, seq, head_dim = x.shape
    scale = nvfp4_tensor_scale(x, dims=(-2, -1)).reshape(batch, heads).contiguous()
    values = torch.empty((batch, heads, seq, head_dim), dtype=x.dtype, device=x.device)
    if seq and batch * heads:
        _nvfp4_rows_kernel[(triton.cdiv(seq, 64), batch * heads)](
            x, scale, values, *x.stride(), heads, seq, head_dim, BLOCK=64, D_PAD=padded_head_dim(head_dim)
        )
    return values, scale
