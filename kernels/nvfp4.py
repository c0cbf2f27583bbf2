"""NVFP4 fake quantization in plain PyTorch: the numerics of ``mode="attn_qat"`` (and the Triton kernels' oracle).

NVFP4 stores a tensor as E2M1 values (4 bits: sign, 2 exponent bits, 1 mantissa bit; magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``) in blocks of 16 consecutive elements, each block with an E4M3 scale (the
8-bit float ``float8_e4m3fn``: 3 mantissa bits, largest 448, subnormals down to ``2**-9``, no infinity), and
one FP32 scale over the whole tensor. Fake quantization returns the dequantized values, in a float type, so
the rest of a computation can run in bf16 on hardware without FP4 tensor cores.

For ``x`` with second-level (FP32) scale ``s`` and a block ``b`` of 16 elements along the last dim:

* ``y = x / s``;
* the block scale ``d_b = E4M3(max|y_b| / 6)``, rounded to nearest even and saturating at 448;
* the values ``E2M1(y / d_b)``, rounded to nearest even and saturating at 6 (0 where ``d_b`` is 0: an
  all-zero block, or one whose max is too small for E4M3);
* dequantized: ``E2M1(y / d_b) * d_b * s``.

The second-level scale. With ``s = 1`` the block scales are ``amax / 6`` straight in E4M3, as the format's
block scales are usually described; then a tensor whose values are all below about ``6 * 2**-10 = 0.006``
quantizes to zero (its block scales underflow E4M3) and one above ``6 * 448 = 2688`` is clipped (they
saturate). NVFP4 therefore carries an FP32 scale per tensor, ``s = amax / (6 * 448)``
(:func:`nvfp4_tensor_scale`), which maps the tensor's largest block scale to 448 exactly, so every tensor,
however small or large, keeps 3-bit-mantissa block scales (blocks more than ``2**-9 / 448``, about 5e-6,
below the tensor's max still underflow, as they do in hardware). The attention uses it: per (batch, head)
for Q, K and V (:func:`quantize_qkv`), per row of a key tile for P (:func:`quantize_p_tile`), in
:mod:`.reference`.

Non-finite values: a NaN in a block makes its scale NaN and so every value of the block; an infinity in a
tensor makes its second-level scale infinite and the tensor NaN. (With ``s = 1`` an infinity saturates to
``6 * 448``, as the hardware's saturating conversion does.)
"""

from __future__ import annotations

import torch

#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: The E2M1 magnitudes, in code order (code 0 to 7; the sign is a separate bit).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Largest E4M3 (``float8_e4m3fn``) value.
E4M3_MAX = 448.0
#: Smallest normal exponent of E4M3; subnormals are multiples of ``2**(E4M3_MIN_EXP - 3) = 2**-9``.
E4M3_MIN_EXP = -6
#: Elements per block scale.
NVFP4_BLOCK = 16
#: ``amax / NVFP4_RANGE`` is the second-level scale that maps a tensor's largest block scale to ``E4M3_MAX``.
NVFP4_RANGE = E2M1_MAX * E4M3_MAX

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "NVFP4_BLOCK",
    "NVFP4_RANGE",
    "fake_quantize_nvfp4",
    "nvfp4_quantize",
    "nvfp4_tensor_scale",
    "quantize_p_tile",
    "quantize_qkv",
    "round_e2m1",
    "round_e4m3",
]


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """``y`` rounded to the nearest E2M1 value, ties to even, saturating at +-6 (a NaN stays NaN).

    The grid spacing is 0.5 below 2, 1 from 2 to 4 and 2 from 4 on; rounding the multiple of the spacing to an
    even integer is rounding to an even mantissa bit.

    Args:
        y: float tensor (values already divided by their block scale).

    Example::

        round_e2m1(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0, -1.3]))   # [0, 1, 2, 4, 6, -1.5]
    """
    magnitude = y.abs()
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0)).to(y.dtype)
    rounded = (torch.round(magnitude / step) * step).clamp(max=E2M1_MAX)
    return torch.copysign(rounded, y)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """``v`` rounded to the nearest E4M3 (``float8_e4m3fn``) value, ties to even, saturating at +-448.

    Computed in ``v``'s dtype, so it is the value E4M3 would hold, not a float8 tensor. A NaN stays NaN; an
    infinity saturates to 448 (E4M3 has no infinity).

    Args:
        v: float tensor.

    Example::

        round_e4m3(torch.tensor([1.0625, 500.0, 2.0**-10]))   # [1.0, 448.0, 0.0] (ties to even)
    """
    magnitude = v.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(magnitude), (exponent - 1).clamp(min=E4M3_MIN_EXP) - 3)
    rounded = torch.round(magnitude / step) * step
    rounded = torch.where(rounded > E4M3_MAX, E4M3_MAX, rounded)  # NaN > 448 is False: NaN stays
    return torch.copysign(rounded, v)


def nvfp4_tensor_scale(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The second-level (FP32) scale ``max|x| / (6 * 448)`` over ``dims``; 1 where that is 0.

    Args:
        x: float tensor.
        dims: the dimensions one scale covers (kept as size-1 dimensions).

    Returns:
        The scales in fp32 (fp64 for fp64 ``x``), broadcastable to ``x``.

    Example::

        s = nvfp4_tensor_scale(q, dims=(-2, -1))   # one per (batch, head) of a [B, H, N, D] tensor
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    scale = x.abs().amax(dim=dims, keepdim=True).to(dtype) / NVFP4_RANGE
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def nvfp4_quantize(
    x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization of ``x`` in blocks of 16 along the last dim: the block values and the block scales.

    A last dim that is not a multiple of 16 is zero-padded to whole blocks (zeros leave a block's max alone).

    Args:
        x: float tensor (fp32 and fp64 are computed as they are, 16-bit types in fp32).
        tensor_scale: the second-level scale ``s``, broadcastable to ``x`` with a last dim of 1 (e.g. from
            :func:`nvfp4_tensor_scale`); ``None`` for 1.

    Returns:
        ``(values, block_scales)``: ``values = E2M1(y / d) * d`` shaped like ``x`` (``x ~= values * s``; these
        hold at most 6 significant bits, so they are exact in bf16 and fp16), and the block scales ``d``,
        shaped like ``x`` with the last dim ``ceil(n / 16)``. Both in fp32 (fp64 for fp64 ``x``).

    Example::

        values, block_scales = nvfp4_quantize(torch.randn(4, 64))   # 4 block scales per row
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dtype)
    if tensor_scale is not None:
        y = y / tensor_scale
    length = y.shape[-1]
    pad = -length % NVFP4_BLOCK
    if pad:
        y = torch.nn.functional.pad(y, (0, pad))
    blocks = y.reshape(*y.shape[:-1], -1, NVFP4_BLOCK)
    block_scales = round_e4m3(blocks.abs().amax(dim=-1, keepdim=True) / E2M1_MAX)
    usable = block_scales > 0  # False for 0 (nothing representable) and NaN (which the product below keeps)
    codes = torch.where(usable, round_e2m1(blocks / torch.where(usable, block_scales, 1.0)), 0.0)
    values = (codes * block_scales).reshape(y.shape)[..., :length]
    return values, block_scales[..., 0]


def fake_quantize_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """``x`` through NVFP4 and back: ``values * s`` of :func:`nvfp4_quantize`, in fp32 (fp64 for fp64 ``x``).

    Args:
        x: float tensor; blocks of 16 along its last dim.
        tensor_scale: the second-level scale, as :func:`nvfp4_quantize`; ``None`` for 1.

    Example::

        x = torch.randn(2, 8, 128, 64)
        x_fq = fake_quantize_nvfp4(x, nvfp4_tensor_scale(x, dims=(-2, -1)))
    """
    values, _ = nvfp4_quantize(x, tensor_scale)
    return values if tensor_scale is None else values * tensor_scale


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
