"""Triton quantization kernels: INT8 or FP8 ``psi`` per block for Q', K', V and dO (fused with the backward's delta),
and simulated NVFP4 (Q, K, V per head; P per row of a tile, in registers).

The numerics are the reference's (:mod:`.reference`): one scale per block of ``BLOCK`` rows x the head dim,
``s = max|X| / 127`` (1 for a block that is all zero or whose max underflows), round half to even, clamp to
[-127, 127]. A NaN anywhere in a block makes its scale NaN, so the NaN reaches every product that uses the
block instead of hiding in an int8 code: int8 has no NaN, and Triton's ``max`` reduction drops NaNs, hence
:func:`nan_max` and the explicit NaN count.

Q, K and V are quantized *confined* (``confine=True``, as the forward calls them): a NaN or infinity is read as 0 by
the block's scale, means and codes, so it leaves the rest of its block as it is, and its row is reported instead
(per query row, or the first bad key of a head) for the forward to make exactly the outputs NaN that SDPA makes
non-finite: :func:`.tiles.poison_rows`. Huge finite values are kept as they are (docs/attention-support.md says
where they still overflow).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .nvfp4 import nvfp4_tensor_scale

#: Adding then subtracting 1.5 * 2**23 rounds an fp32 of magnitude below 2**22 to the nearest integer, ties
#: to even (IEEE round-to-nearest-even on the add), the same as ``torch.round``; it runs identically on the
#: GPU and in the interpreter, where ``libdevice.rint`` is not available.
_ROUNDER = tl.constexpr(12582912.0)
#: The bits of ``_ROUNDER``. The sum ``y + 1.5 * 2**23`` of an integer-valued y (|y| < 2**22) holds y in its low
#: mantissa bits: its bits are these plus y. That gives both conversions between int32 and fp32 as one add each way
#: plus one float add or a byte select, instead of the conversion instructions, which Hopper issues at 16 per
#: clock per SM against 128 float adds: the hot loops convert every element of every tile (each INT8 product's
#: int32 result, and each code written), and those conversions outweighed the tensor-core work (NOTES.md).
_ROUNDER_BITS = tl.constexpr(0x4B400000)
#: The largest key or query tile the exact int32 -> fp32 conversion allows: every INT8 product sums at most
#: this many (or the head dim's, at most 128) products of two codes, |code| <= 127, and 256 * 127 * 127 < 2**22.
MAX_PRODUCT_TERMS = 256

#: The largest finite e4m3 value; FP8 scales are ``max|X| / 448``.
FP8_MAX = tl.constexpr(448.0)

#: "No bad key" in the first-bad-key buffers the confined quantizers write (int32 max).
NO_BAD_KEY = 2**31 - 1
NO_BAD_KEY_C = tl.constexpr(NO_BAD_KEY)

#: Triton reads ``TRITON_INTERPRET`` once, when it is imported; so do we (not on every launch).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """How :func:`hp_dot` runs the products kept in high precision, for inputs of ``dtype``.

    ``"ieee"``: fp32 inputs, computed in true fp32 (not tf32). ``"upcast"``: bf16/fp16 under
    ``TRITON_INTERPRET=1``, whose ``dot`` multiplies the raw bits of bf16 (Triton 3.9); the operands are cast
    to fp32, which gives the same products (exact) and the same fp32 accumulation. ``"native"``: the tensor
    cores' bf16/fp16 path with fp32 accumulation.
    """
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if _INTERPRETED else "native"


@triton.jit
def to_dtype(x, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``x.to(dtype)`` with round to nearest even, also under the interpreter.

    Triton 3.9's interpreter truncates fp32 -> bf16 and reinterprets int8 -> bf16 bits; there (``"upcast"``)
    the value goes through fp32 and is rounded to bf16 with integer arithmetic on its bits, after which the
    cast is exact.
    """
    if DOT_PRECISION == "upcast" and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def hp_dot(a, b, DOT_PRECISION: tl.constexpr, acc=None):
    """``a @ b`` with fp32 accumulation for the products kept in high precision (see :func:`dot_precision`);
    ``acc + a @ b`` with the sum made in the product (inside the tensor core) when ``acc`` (fp32) is given."""
    if DOT_PRECISION == "upcast":
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    IEEE: tl.constexpr = "ieee" if DOT_PRECISION == "upcast" or DOT_PRECISION == "ieee" else None
    if acc is None:
        # (Not passed on as None: tl.dot reads a given accumulator's type, compiled.)
        out = tl.dot(a, b, out_dtype=tl.float32, input_precision=IEEE)
    else:
        out = tl.dot(a, b, acc, out_dtype=tl.float32, input_precision=IEEE)
    return out


def tuning_configs(warps_stages: tuple[tuple[int, int], ...]) -> list[triton.Config]:
    """Autotuning candidates (``num_warps``, ``num_stages``); one plain config under the interpreter, where
    timing means nothing and each candidate would run the kernel again."""
    if _INTERPRETED:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in warps_stages]


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels' tiles use: the next power of two, at least 32 (8-bit tensor-core products
    on Hopper sum over 32 elements at a time; smaller heads are zero-padded, which changes no result)."""
    return max(32, triton.next_power_of_2(head_dim))


def seq_bucket(n: int) -> int:
    """An autotuning key: the next power of two of a sequence length, or of the (batch, head) pairs a launch
    covers, so sizes in one bucket share a tuning. The kernels key on both: the best tiles for a small launch
    (a check, an evaluation at batch 1) are not those for a training batch that fills the GPU, and a tuning
    found on the first must not be reused for the second."""
    return triton.next_power_of_2(max(n, 1))


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


#: :data:`_INTERPRETED` as a constexpr the kernels can branch on at compile time.
_INTERPRETED_C = tl.constexpr(_INTERPRETED)


@triton.jit
def nan_max(x, axis=None):
    """``max`` that returns NaN when any element is NaN (``tl.max`` ignores NaNs).

    Compiled, one reduction with a NaN-propagating combine. The interpreter runs a reduction with a combine function
    of ours element by element in Python (it took most of the CPU test suite's time), so there the same value comes
    from two built-in reductions: ``tl.max`` and whether any element is NaN."""
    if _INTERPRETED_C:
        has_nan = tl.max((x != x).to(tl.int32), axis) > 0
        return tl.where(has_nan, float("nan"), tl.max(x, axis))
    else:
        return tl.reduce(x, axis, _max_nan)


@triton.jit
def confine_rows(x):
    """``(x, bad)``: ``x`` with every NaN or infinity read as 0, and per row (axis 1) whether it held one.
    ``|x| < inf`` is False for NaN too: one compare per element."""
    finite = tl.abs(x) < float("inf")
    bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0  # elements past the tensor were loaded as 0: finite
    return tl.where(finite, x, 0.0), bad


@triton.jit
def _report_bad_rows(ROW_POISON, FIRST_BAD, bad, rows, SEQ, pid_bh, ROWS_OUT: tl.constexpr, FIRST_OUT: tl.constexpr):
    """Per row, 0 or NaN into ``ROW_POISON`` ``[B * H, SEQ]`` (queries); the first bad row into ``FIRST_BAD[pid_bh]``
    (keys and values: an atomic min over the blocks of a head)."""
    if ROWS_OUT:
        tl.store(ROW_POISON + pid_bh * SEQ + rows, tl.where(bad, float("nan"), 0.0), mask=rows < SEQ)
    if FIRST_OUT:
        first = tl.min(tl.where(bad, rows, NO_BAD_KEY_C), axis=0)
        if first < NO_BAD_KEY_C:
            tl.atomic_min(FIRST_BAD + pid_bh, first)


@triton.jit
def round_half_even(x):
    """Round fp32 values of magnitude below 2**22 to integers, ties to even."""
    return (x + _ROUNDER) - _ROUNDER


@triton.jit
def int32_to_f32(x):
    """``x.to(tl.float32)`` (exact) for int32 ``|x| < 2**22``, the result of an INT8 product of at most
    :data:`MAX_PRODUCT_TERMS` terms: an integer add and a float add (see ``_ROUNDER_BITS``)."""
    return (x + _ROUNDER_BITS).to(tl.float32, bitcast=True) - _ROUNDER


@triton.jit
def exact_22_bits(x):
    """``x`` with its last two mantissa bits cleared (22 significant bits), so that ``1.5 * 2**23 * x``, whose
    significand is ``3 x``'s (at most two bits longer than ``x``'s), is exact in fp32 (24 bits)."""
    return (x.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)


@triton.jit
def int32_scaled(x, scale):
    """``x.to(tl.float32) * scale`` for an int32 ``|x| < 2**22`` (an INT8 product) in one fused multiply-add.

    ``x + 1.5 * 2**23``'s bits read as fp32 hold ``1.5 * 2**23 + x`` exactly (see ``_ROUNDER_BITS``; the add
    folds into the product's accumulator), so ``x * c = bits * c - 1.5 * 2**23 * c``; with ``c`` cut to 22
    significant bits the constant is exact and the fused multiply-add rounds once, as the multiply alone would.
    ``scale`` loses at most 2**-22 of itself. Against the conversion then the multiply, one add less per element.
    """
    c = exact_22_bits(scale)
    return tl.fma((x + _ROUNDER_BITS).to(tl.float32, bitcast=True), c, -(c * _ROUNDER))


@triton.jit
def int8_scale(amax):
    """``amax / 127``, or 1 where that is 0 (an all-zero block, or a max so small the division underflows)."""
    scale = amax / 127.0
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def int8_codes(x, scale, EXACT: tl.constexpr = False):
    """Codes of ``x`` (fp32) for ``scale`` (broadcastable), as int8. Non-finite scales give garbage codes:
    callers always multiply the product by the scale, which carries the NaN or infinity.

    ``EXACT`` divides with IEEE rounding, so the codes equal the reference's bit for bit (the quantization
    kernels, which are memory-bound); the hot loops multiply by the reciprocal of the scale (one division per
    scale, not per element), which is off by at most 2 ulp and so flips a code only for a value within that of
    a rounding boundary, and take the code from the rounded float's bits (one fused multiply-add per element).
    Both need ``scale`` to be ``max|x| / 127`` over the values coded (as every caller's is), so that no code
    needs clamping.
    """
    if EXACT:
        # Clamped before rounding, which gives the same code (127 <= |ratio| < 127.5 rounds to 127 either way, a
        # NaN clamps to -127 in both orders).
        ratio = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.zeros_like(x) + scale), -127.0), 127.0)
        rounded = ratio + _ROUNDER
    else:
        # |ratio| <= 127 up to 2 ulp (scale = max|x| / 127 over the values coded): no clamp.
        rounded = tl.fma(x, 1.0 / scale, _ROUNDER)
    # Adding 1.5 * 2**23 rounds the ratio half to even into the low bits, whose low byte is the code: no float
    # subtract and no conversion instruction an element (see _ROUNDER_BITS).
    return rounded.to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def fp8_scale(amax):
    """``amax / 448``, or 1 where that is 0 (an all-zero block, or a max so small the division underflows)."""
    scale = amax / FP8_MAX
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def round_e4m3(v):
    """``v >= 0`` (fp32) rounded to the nearest E4M3 value, ties to even, saturating at 448; NaN stays NaN.

    The step of ``v``'s binade is ``2**(e - 3)`` (3 mantissa bits), with ``e`` at least -6 (E4M3's subnormals
    share the step of its smallest normal binade). The step and its inverse are built from exponent bits, so
    ``v * (1 / step)`` is exact (and below 16) without a division.
    """
    exponent = ((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
    exponent = tl.minimum(tl.maximum(exponent, 127 - 6), 254)
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((257 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e): biased 254 - (e_b - 3)
    rounded = round_half_even(v * inverse_step) * step
    return tl.where(rounded > 448.0, 448.0, rounded)  # NaN > 448 is False: NaN stays


@triton.jit
def e4m3_round(x):
    """fp32 ``x`` (``|x| <= 448``) rounded to the nearest e4m3 value, ties to even, still fp32 (:func:`round_e4m3` of
    its magnitude). The GPU's conversion instruction rounds the same way; Triton 3.9's interpreter does not (it drops
    the carry into the exponent: 1.97 -> 1.0), so :func:`to_e4m3` rounds here first there."""
    rounded = round_e4m3(tl.abs(x))
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def to_e4m3(x):
    """fp32 values within e4m3's range as ``tl.float8e4nv``, rounded to nearest even on the GPU and in the
    interpreter alike (:func:`e4m3_round`)."""
    if _INTERPRETED_C:
        return e4m3_round(x).to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def fp8_codes(x, scale, EXACT: tl.constexpr = False):
    """e4m3 codes of ``x`` (fp32) for ``scale`` (broadcastable, ``max|x| / 448`` over the values coded), as
    ``tl.float8e4nv``. ``EXACT`` divides with IEEE rounding (the reference's codes bit for bit); otherwise one
    multiply by the reciprocal, as :func:`int8_codes`."""
    if EXACT:
        return to_e4m3(tl.math.div_rn(x, tl.zeros_like(x) + scale))
    else:
        return to_e4m3(x * (1.0 / scale))


@triton.jit
def low_bit_dot(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` of two FP8 operands with fp32 accumulation: the tensor cores' FP8 path, or under the interpreter
    (``"upcast"``) the operands cast to fp32, which is exact."""
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


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


#: With ``mma_order``, the key each slot of 16 holds: slot ``p`` holds key ``MMA_KEY_ORDER[p]``. Bit by bit, key
#: ``8 b3 + 4 b2 + 2 b1 + b0`` sits at slot ``8 b2 + 4 b1 + 2 b3 + b0``: the order in which a thread's registers hold
#: the 8-bit A operand of a Hopper ``wgmma`` (``k``: 4 consecutive codes a register, at ``4 t`` and ``16 + 4 t`` for
#: lane ``t`` of its four) when they come from the accumulator of the product before (columns ``2 t``, ``2 t + 1``,
#: ``8 + 2 t``, ``9 + 2 t``, ...), so the Hopper forward feeds P^ to ``P^ V^`` from ``Q K^T``'s registers as they are.
MMA_KEY_ORDER = tuple((p & 1) | ((p >> 1) & 1) << 3 | ((p >> 2) & 3) << 1 for p in range(16))


@triton.jit
def mma_key_order(x, AXIS: tl.constexpr):
    """The 2-D ``x`` with its keys along ``AXIS`` in :data:`MMA_KEY_ORDER`: index ``16 g + p`` takes key
    ``16 g + MMA_KEY_ORDER[p]`` (``x.shape[AXIS]`` a multiple of 16). V^'s codes are stored so (``AXIS=0``), and the
    Hopper forward relabels P^'s columns so (``AXIS=1``): a reshape and permute, which moves no data between threads
    where the layout already holds them in that order."""
    ROWS: tl.constexpr = x.shape[0]
    COLS: tl.constexpr = x.shape[1]
    if AXIS == 0:
        x = x.reshape(ROWS // 16, 2, 2, 2, 2, COLS).permute(0, 2, 3, 1, 4, 5)
    else:
        x = x.reshape(ROWS, COLS // 16, 2, 2, 2, 2).permute(0, 1, 3, 4, 2, 5)
    return x.reshape(ROWS, COLS)


@triton.jit
def _quantize_rows_kernel(
    X,
    OUT,
    SCALE,
    MEAN_IN,
    MEAN_OUT,
    ROW_POISON,
    FIRST_BAD,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_xd,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_sb,
    stride_sh,
    stride_mib,
    stride_mih,
    stride_mob,
    stride_moh,
    stride_mom,
    HEADS,
    SEQ,
    HEAD_DIM,
    BLOCK: tl.constexpr,
    D_PAD: tl.constexpr,
    SUBTRACT_MEAN: tl.constexpr,
    BLOCK_MEAN: tl.constexpr,
    FMT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONFINE: tl.constexpr,
    ROWS_OUT: tl.constexpr,
    FIRST_OUT: tl.constexpr,
    EVEN: tl.constexpr = False,
    MMA_ORDER: tl.constexpr = False,
):
    """One program per (block of ``BLOCK`` rows, batch x head): optional smoothing, then codes and a scale.

    ``EVEN``: every row of the block exists and ``D_PAD`` is the head dim, so loads and stores take no mask.
    ``MMA_ORDER``: row ``16 g + p`` holds row ``16 g + MMA_KEY_ORDER[p]`` (``SEQ`` a multiple of 16).

    ``CONFINE``: NaN and infinities read as 0 (:func:`confine_rows`) before the means, the scale and the codes; the
    rows that held one reported per row (``ROWS_OUT``) or as the head's first (``FIRST_OUT``). A block's
    NaN-propagating maximum decides first whether it holds any: most blocks hold none and skip ``confine_rows``.

    ``SUBTRACT_MEAN``: subtract the per-(batch, head) mean ``MEAN_IN`` (K-smoothing).
    ``BLOCK_MEAN``: subtract the mean of the block's valid rows and write it to ``MEAN_OUT`` (Q-smoothing).
    ``FMT``: ``"int8"`` writes int8 codes and ``max|X| / 127``, ``"fp8"`` e4m3 codes and ``max|X| / 448``, ``"bf16"``
    the (smoothed) values in ``OUT``'s dtype and 1.
    Rows past ``SEQ`` are zero, so they leave the block's scale alone (as the reference's padding does).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D_PAD)
    valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
    x_ptrs = X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xn + cols[None, :] * stride_xd
    if EVEN:
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=valid, other=0.0).to(tl.float32)
    # Without smoothing, the codes' maximum is the one taken here (confinement changes nothing in a finite block).
    SAME_MAX: tl.constexpr = CONFINE and not SUBTRACT_MEAN and not BLOCK_MEAN and FMT != "bf16"
    if CONFINE:
        # One NaN-propagating maximum an element finds a block without NaN or infinity (nearly every block), which
        # confinement leaves as it is; only a block holding one pays for confine_rows' per-element work.
        amax = nan_max(tl.abs(x))
        if amax < float("inf"):
            bad = rows < 0
        else:
            x, bad = confine_rows(x)
            if SAME_MAX:
                amax = tl.max(tl.abs(x))
        _report_bad_rows(ROW_POISON, FIRST_BAD, bad, rows, SEQ, pid_bh, ROWS_OUT, FIRST_OUT)
    if SUBTRACT_MEAN:
        mean = tl.load(MEAN_IN + b * stride_mib + h * stride_mih + cols, mask=cols < HEAD_DIM, other=0.0)
        x = x - mean[None, :] if EVEN else tl.where(valid, x - mean[None, :], 0.0)
    if BLOCK_MEAN:
        count = tl.minimum(SEQ - pid_m * BLOCK, BLOCK).to(tl.float32)
        mean = tl.sum(x, axis=0) / count
        tl.store(MEAN_OUT + b * stride_mob + h * stride_moh + pid_m * stride_mom + cols, mean, mask=cols < HEAD_DIM)
        x = x - mean[None, :] if EVEN else tl.where(valid, x - mean[None, :], 0.0)
    out_ptrs = OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :] * stride_od
    if not SAME_MAX:
        amax = nan_max(tl.abs(x))
    if FMT == "int8":
        scale = int8_scale(amax)
        codes = int8_codes(x, scale, True)
    elif FMT == "fp8":
        scale = fp8_scale(amax)
        codes = fp8_codes(x, scale, True)
    else:
        scale = 1.0
        codes = to_dtype(x, OUT.dtype.element_ty, DOT_PRECISION)
    if MMA_ORDER:
        # Reordered in registers (a whole 16 rows valid or not: SEQ a multiple of 16), so the stores stay contiguous.
        codes = mma_key_order(codes, 0)
    if EVEN:
        tl.store(out_ptrs, codes)
    else:
        tl.store(out_ptrs, codes, mask=valid)
    tl.store(SCALE + b * stride_sb + h * stride_sh + pid_m, scale)


#: The storage dtype of each 8-bit format's codes.
CODE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@triton.jit
def _quantize_channels_fp8_kernel(
    X,
    OUT,
    SCALE,
    FIRST_BAD,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_xd,
    HEADS,
    SEQ,
    HEAD_DIM,
    BLOCK: tl.constexpr,
    CHANNELS: tl.constexpr,
    CONFINE: tl.constexpr,
    FIRST_OUT: tl.constexpr,
):
    """One program per (block of ``CHANNELS`` channels, batch x head): the channels' max over all ``SEQ`` rows, then
    their e4m3 codes, stored ``[D, N]``. Two reads of the rows, one write of the codes. ``CONFINE``: as
    :func:`_quantize_rows_kernel`'s, the first row with a NaN or infinity in these channels lowering ``FIRST_BAD``."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    cols = pid_c * CHANNELS + tl.arange(0, CHANNELS)
    base = X + b * stride_xb + h * stride_xh + cols[None, :] * stride_xd
    amax = tl.zeros([CHANNELS], dtype=tl.float32)
    for start in range(0, SEQ, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
        x = tl.load(base + rows[:, None] * stride_xn, mask=valid, other=0.0).to(tl.float32)
        if CONFINE:
            x, bad = confine_rows(x)
            _report_bad_rows(FIRST_BAD, FIRST_BAD, bad, rows, SEQ, pid_bh, False, FIRST_OUT)
        amax = _max_nan(amax, nan_max(tl.abs(x), axis=0))
    scale = fp8_scale(amax)
    tl.store(SCALE + pid_bh * HEAD_DIM + cols, scale, mask=cols < HEAD_DIM)
    out = OUT + pid_bh * HEAD_DIM * SEQ + cols[:, None] * SEQ
    for start in range(0, SEQ, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
        x = tl.load(base + rows[:, None] * stride_xn, mask=valid, other=0.0).to(tl.float32)
        if CONFINE:
            x, _ = confine_rows(x)
        codes = fp8_codes(x, scale[None, :], True)
        tl.store(out + rows[None, :], tl.trans(codes), mask=tl.trans(valid))


def quantize_channels_fp8(
    x: torch.Tensor, *, confine: bool = False, first_bad: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``x`` ``[B, H, N, D]`` with one scale per channel over all N rows (``max |x[b, h, :, c]| / 448``),
    stored ``[B, H, D, N]``: V for an FP8 ``O = P V``, whose per-channel scale factors out of the sum over keys.

    The reference's numerics (:func:`..reference.quantize_fp8` over the keys) bit for bit: IEEE division, round to
    nearest even. One launch: each program reads its channels' rows twice (the max, then the codes).

    Args:
        x: the input, any strides, bf16/fp16/fp32.
        confine, first_bad: as :func:`quantize_rows`'s (``first_bad`` needs ``confine``).

    Returns:
        ``(codes, scale)``: ``[B, H, D, N]`` float8_e4m3fn contiguous and ``[B, H, D]`` fp32.

    Example::

        v_codes_t, v_scale = quantize_channels_fp8(v)
    """
    batch, heads, seq, head_dim = x.shape
    codes = torch.empty(batch, heads, head_dim, seq, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=x.device)
    channels = min(32, triton.next_power_of_2(head_dim))
    if seq and batch * heads:
        _quantize_channels_fp8_kernel[(triton.cdiv(head_dim, channels), batch * heads)](
            x, codes, scale, first_bad if first_bad is not None else scale, *x.stride(), heads, seq, head_dim,
            BLOCK=128, CHANNELS=channels, CONFINE=confine, FIRST_OUT=confine and first_bad is not None,
        )  # fmt: skip
    elif batch * heads:
        scale.fill_(1.0)
    return codes, scale


@triton.jit
def _finite_mean_kernel(
    X, PARTIAL, stride_xb, stride_xh, stride_xn, stride_xd, HEADS, SEQ, HEAD_DIM, ROWS_PER_PROGRAM,
    BLOCK: tl.constexpr, CHANNELS: tl.constexpr,
):  # fmt: skip
    """One program per (block of ``CHANNELS`` channels, batch x head, ``ROWS_PER_PROGRAM`` rows): those rows' sum over
    ``SEQ``, NaN and infinities read as 0, into ``PARTIAL`` ``[B * H, chunks, D]``."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_n = tl.program_id(2)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    cols = pid_c * CHANNELS + tl.arange(0, CHANNELS)
    base = X + b * stride_xb + h * stride_xh + cols[None, :] * stride_xd
    total = tl.zeros([CHANNELS], dtype=tl.float32)
    for start in range(pid_n * ROWS_PER_PROGRAM, (pid_n + 1) * ROWS_PER_PROGRAM, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
        x = tl.load(base + rows[:, None] * stride_xn, mask=valid, other=0.0).to(tl.float32)
        total += tl.sum(tl.where(tl.abs(x) < float("inf"), x, 0.0), axis=0)
    chunk = (pid_bh * tl.num_programs(2) + pid_n) * HEAD_DIM
    tl.store(PARTIAL + chunk + cols, total / SEQ, mask=cols < HEAD_DIM)


#: Rows one program of :func:`finite_mean` sums: enough programs to fill the GPU at a training batch's few kv heads.
_MEAN_ROWS_PER_PROGRAM = 512


def finite_mean(x: torch.Tensor) -> torch.Tensor:
    """K-smoothing's mean over the tokens of ``x`` ``[B, H, N, D]``, with NaN and infinities read as 0, ``[B, H, D]``
    fp32: a bad key row leaves the mean, and so every other row of K', as it is (the reference's
    ``where(isfinite(k), k, 0).mean(dim=2)``, to fp32 summation order). One read of ``x``, as ``x.mean(dim=2)``, by
    programs of 512 rows, whose partial means are then added in a fixed order (no atomics: the same bits every run).

    Example::

        k_mean = finite_mean(k)
    """
    batch, heads, seq, head_dim = x.shape
    if not (seq and batch * heads):
        return x.float().mean(dim=2)  # NaN over no rows, as torch's
    chunks = triton.cdiv(seq, _MEAN_ROWS_PER_PROGRAM)
    partial = torch.empty(batch, heads, chunks, head_dim, dtype=torch.float32, device=x.device)
    channels = min(32, triton.next_power_of_2(head_dim))
    _finite_mean_kernel[(triton.cdiv(head_dim, channels), batch * heads, chunks)](
        x, partial, *x.stride(), heads, seq, head_dim, _MEAN_ROWS_PER_PROGRAM, BLOCK=64, CHANNELS=channels
    )
    return partial[:, :, 0] if chunks == 1 else partial.sum(dim=2)


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


def quantize_heads_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of Q, K or V ``[B, H, N, D]`` along the head dim, one FP32 scale per (batch, head).

    The kernel twin of :func:`~.nvfp4.quantize_qkv`: the scale is the same ``torch`` reduction, the
    values equal the reference's bit for bit.

    Args:
        x: ``[B, H, N, D]``, bf16/fp16/fp32, any strides.

    Returns:
        ``(values, scale)``: values contiguous ``[B, H, N, D]`` in ``x``'s dtype (exact), ``scale`` fp32
        ``[B, H]`` contiguous; ``x ~= values * scale``.

    Example::

        u_q, s_q = quantize_heads_nvfp4(q)
    """
    batch, heads, seq, head_dim = x.shape
    scale = nvfp4_tensor_scale(x, dims=(-2, -1)).reshape(batch, heads).contiguous()
    values = torch.empty((batch, heads, seq, head_dim), dtype=x.dtype, device=x.device)
    if seq and batch * heads:
        _nvfp4_rows_kernel[(triton.cdiv(seq, 64), batch * heads)](
            x, scale, values, *x.stride(), heads, seq, head_dim, BLOCK=64, D_PAD=padded_head_dim(head_dim)
        )
    return values, scale


def rows_warps(block: int, head_dim: int) -> int:
    """Warps per program of :func:`quantize_rows` and :func:`backward_preprocess`: 32 elements of the ``block x D``
    tile a thread, 4 to 16 warps.

    A program holds its whole tile in registers (the block's maximum needs every element). With 4 warps, Q's 128 x
    128 tile took 255 registers a thread and spilled 168 bytes (sm_90, Triton 3.6), and two such programs (8 warps)
    ran on an SM, each thread working through 128 elements; with 16 warps it takes 64 registers, spills nothing, and
    32 warps share the SM's work. The maximum is exact in any order, so the codes and scales do not change; only
    Q-smoothing's block means are sums, whose order may move their last bits. The backward's preprocess holds dO's
    and O's tiles: on an H200 these warps (16 at D=128, 8 at D=64) ran it 1.42-1.57x faster than 4 at D=128 and
    0.99-1.10x at D=64, its delta and codes bit for bit (device run 36).

    Example::

        rows_warps(128, 128), rows_warps(64, 128), rows_warps(64, 64)   # 16, 8, 4
    """
    return min(max(block * padded_head_dim(head_dim) // 1024, 4), 16)


def quantize_rows(
    x: torch.Tensor,
    block: int,
    *,
    fmt: str,
    mean: torch.Tensor | None = None,
    block_mean: bool = False,
    transposed: bool = False,
    mma_order: bool = False,
    confine: bool = False,
    row_poison: torch.Tensor | None = None,
    first_bad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` ``[B, H, N, D]`` per block of ``block`` rows (Q', K', V in the forward).

    Args:
        x: the input, any strides, bf16/fp16/fp32.
        block: rows per quantization block (``BLOCK_M`` for Q, ``BLOCK_N`` for K and V).
        fmt: ``"int8"`` (INT8 codes and scales), ``"fp8"`` (e4m3 codes and scales) or ``"bf16"`` (the values in
            ``x``'s dtype with scale 1).
        mean: ``[B, H, D]`` fp32, subtracted from every row first (K-smoothing).
        block_mean: subtract each block's mean over its valid rows first, returned (Q-smoothing).
        transposed: write ``op`` as ``[B, H, D, N]`` (V^ for the forward's ``P V``: 8-bit tensor-core products
            on Hopper take the operand that is summed over, here the keys, contiguous).
        mma_order: with ``transposed``, each 16 keys in :data:`MMA_KEY_ORDER` (the Hopper forward's INT8 ``P V``
            takes V^ so: :func:`.hopper.forward.hopper_forward`); N must be a multiple of 16.
        confine: read NaN and infinities as 0 first, so a bad value changes neither its block's scale nor its means
            (Q, K, V in the forward). Without it (dO) a NaN makes
            its block's scale NaN.
        row_poison: with ``confine``, ``[B, H, N]`` fp32 written 0 per row, NaN per row that held a NaN or infinity.
        first_bad: with ``confine``, ``[B * H]`` int32 (filled with :data:`NO_BAD_KEY` first): lowered to the index
            of the first row of each head that held a NaN or infinity.

    Returns:
        ``(op, scale, block_means)``: ``op`` ``[B, H, N, D]`` (``[B, H, D, N]`` if ``transposed``) contiguous
        (int8, float8_e4m3fn or ``x``'s dtype), ``scale``
        ``[B, H, blocks]`` fp32, and ``block_means`` ``[B, H, blocks, D]`` fp32 or ``None``.

    Example::

        codes, scale, _ = quantize_rows(k, 64, fmt="int8", mean=k.float().mean(dim=2))
    """
    batch, heads, seq, head_dim = x.shape
    if mma_order and not (transposed and seq % 16 == 0):
        raise ValueError(
            f"quantize_rows: mma_order=True orders keys within groups of 16 of a transposed operand; received "
            f"transposed={transposed} and N={seq} (use transposed=True with N a multiple of 16, or mma_order=False)"
        )
    blocks = triton.cdiv(seq, block)
    op_shape = (batch, heads, head_dim, seq) if transposed else x.shape
    op = torch.empty(op_shape, dtype=CODE_DTYPES.get(fmt, x.dtype), device=x.device)
    op_strides = (op.stride(0), op.stride(1), 1, seq) if transposed else op.stride()
    scale = torch.empty(batch, heads, blocks, dtype=torch.float32, device=x.device)
    means = torch.empty(batch, heads, blocks, head_dim, dtype=torch.float32, device=x.device) if block_mean else None
    mean_in = mean if mean is not None else scale  # any tensor: unused unless SUBTRACT_MEAN
    mean_out = means if means is not None else scale
    mi_strides = (mean.stride(0), mean.stride(1)) if mean is not None else (0, 0)
    mo_strides = (means.stride(0), means.stride(1), means.stride(2)) if means is not None else (0, 0, 0)
    d_pad = padded_head_dim(head_dim)
    if blocks and batch * heads:
        _quantize_rows_kernel[(blocks, batch * heads)](
            x,
            op,
            scale,
            mean_in,
            mean_out,
            row_poison if row_poison is not None else scale,
            first_bad if first_bad is not None else scale,
            *x.stride(),
            *op_strides,
            *scale.stride()[:2],
            *mi_strides,
            *mo_strides,
            heads,
            seq,
            head_dim,
            BLOCK=block,
            D_PAD=d_pad,
            SUBTRACT_MEAN=mean is not None,
            BLOCK_MEAN=block_mean,
            FMT=fmt,
            DOT_PRECISION=dot_precision(x.dtype),
            CONFINE=confine,
            ROWS_OUT=confine and row_poison is not None,
            FIRST_OUT=confine and first_bad is not None,
            EVEN=seq % block == 0 and d_pad == head_dim,
            MMA_ORDER=mma_order,
            num_warps=rows_warps(block, head_dim),
        )
    return op, scale, means


@triton.jit
def _backward_preprocess_kernel(
    DO,
    OUT,
    DELTA,
    DO_CODES,
    DO_CODES_T,
    DO_SCALE,
    X,
    X_T,
    W,
    W_OUT,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    HEADS,
    SEQ,
    HEAD_DIM,
    BLOCK_M: tl.constexpr,
    D_PAD: tl.constexpr,
    CODES: tl.constexpr,
    CODES_T: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    WIDEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` per row and dO's INT8 codes and scale per block, in one read of dO.

    ``CODES`` writes the codes ``[N, D]`` (an INT8 ``dP = dO V^T`` sums over D); ``CODES_T`` writes them ``[D, N]``
    (the INT8 ``dV = P^T dO`` sums over queries, which 8-bit tensor-core products want contiguous). ``TRANSPOSE``
    also copies the same rows of ``X`` (contiguous ``[B, H, N, D]``, dO's shape) into ``X_T`` ``[B, H, D, N]``, as
    :func:`transpose_rows` does, saving that launch. ``WIDEN`` copies the same rows of ``W`` (INT8 codes of dO's
    shape, contiguous) into ``W_OUT`` in its dtype (dO's: every INT8 code is a bf16 exactly).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + cols[None, :] * stride_dod,
        mask=valid,
        other=0.0,
    ).to(tl.float32)
    o = tl.load(
        OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :] * stride_od,
        mask=valid,
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(do * o, axis=1)
    tl.store(DELTA + pid_bh * SEQ + rows, delta, mask=rows < SEQ)
    if CODES or CODES_T:
        scale = int8_scale(nan_max(tl.abs(do)))
        codes = int8_codes(do, scale, True)
        base = pid_bh * SEQ * HEAD_DIM
        if CODES:
            tl.store(DO_CODES + base + rows[:, None] * HEAD_DIM + cols[None, :], codes, mask=valid)
        if CODES_T:
            tl.store(DO_CODES_T + base + cols[None, :] * SEQ + rows[:, None], codes, mask=valid)
        tl.store(DO_SCALE + pid_bh * tl.cdiv(SEQ, BLOCK_M) + pid_m, scale)
    if TRANSPOSE:
        _transpose_block(X, X_T, pid_m, pid_bh, SEQ, HEAD_DIM, BLOCK_M, D_PAD)
    if WIDEN:
        # The block's rows of W are one contiguous run (every column): copied as a 1-D range, not as a [BLOCK_M, D_PAD]
        # tile. Such a tile would share dO's and O's mask and offsets, and Triton's coalescing gives the loads of one
        # slice the widest vector any of them takes (16 INT8 codes a thread against 8 bf16): dO's and O's layout, and
        # so the order of delta's row sums, would change with WIDEN, and with it dS and dQ (device run 29). A 1-D range
        # of another shape leaves dO, O and delta compiled as without WIDEN.
        start = pid_m * BLOCK_M
        idx = tl.arange(0, BLOCK_M * D_PAD)
        live = idx < tl.minimum(SEQ - start, BLOCK_M) * HEAD_DIM
        offs = (pid_bh * SEQ + start) * HEAD_DIM + idx
        codes_w = tl.load(W + offs, mask=live, other=0)
        tl.store(W_OUT + offs, to_dtype(codes_w, W_OUT.dtype.element_ty, DOT_PRECISION), mask=live)


def backward_preprocess(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    block_m: int,
    *,
    codes: bool,
    codes_t: bool,
    transpose: torch.Tensor | None = None,
    widen: torch.Tensor | None = None,
) -> tuple[
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """``delta`` ``[B, H, N]`` fp32 and dO's INT8 codes (``[B, H, N, D]`` and/or ``[B, H, D, N]``) and scales, and
    optionally ``transpose_rows(transpose)`` and ``widen.to(grad_out.dtype)``, in one launch.

    Args:
        grad_out: dO ``[B, H, N, D]``, any strides (autograd may hand an expanded tensor).
        out: the stored O, same shape.
        block_m: rows per quantization block of dO.
        codes: write the codes ``[B, H, N, D]`` (needed when ``dp`` runs in INT8).
        codes_t: write the codes ``[B, H, D, N]`` (needed when ``dv`` runs in INT8).
        transpose: a contiguous tensor of dO's shape (the backward's Q'^) whose ``[B, H, D, N]`` copy the same
            programs write (:func:`transpose_rows`'s result, one launch fewer); ``None``: none.
        widen: contiguous INT8 codes of dO's shape (the backward's Q'^) whose copy in dO's dtype, ``[B, H, N, D]``,
            the same programs write (exact: the bf16 operand of a non-INT8 dS's dK product, read by
            :func:`.hopper.gluon_backward.gluon_dkdv`'s ``wg`` variant through TMA); ``None``: none.

    Returns:
        ``(delta, codes, codes_t, scale, transposed, widened)``, each of the last five ``None`` when not asked for.

    Raises:
        ValueError: ``transpose`` or ``widen`` of another shape than ``grad_out`` or not contiguous, or a ``widen``
            that is not INT8.

    Example::

        delta, _, codes_t, scale, q_op_t, _ = backward_preprocess(grad_out, out, 128, codes=False, codes_t=True,
                                                                  transpose=q_op)
    """
    for name, x in (("transpose", transpose), ("widen", widen)):
        if x is not None and (x.shape != grad_out.shape or not x.is_contiguous()):
            raise ValueError(
                f"backward_preprocess: {name} must be contiguous with grad_out's shape {tuple(grad_out.shape)}; "
                f"received shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
            )
    if widen is not None and widen.dtype != torch.int8:
        raise ValueError(f"backward_preprocess: widen must hold INT8 codes; received dtype {widen.dtype}")
    batch, heads, seq, head_dim = grad_out.shape
    blocks = triton.cdiv(seq, block_m)
    device = grad_out.device
    delta = torch.empty(batch, heads, seq, dtype=torch.float32, device=device)
    normal = torch.empty(grad_out.shape, dtype=torch.int8, device=device) if codes else None
    transposed = torch.empty(batch, heads, head_dim, seq, dtype=torch.int8, device=device) if codes_t else None
    scale = torch.empty(batch, heads, blocks, dtype=torch.float32, device=device) if codes or codes_t else None
    x_t = None
    if transpose is not None:
        x_t = torch.empty(batch, heads, head_dim, seq, dtype=transpose.dtype, device=transpose.device)
    widened = torch.empty(grad_out.shape, dtype=grad_out.dtype, device=device) if widen is not None else None
    if blocks and batch * heads:
        _backward_preprocess_kernel[(blocks, batch * heads)](
            grad_out,
            out,
            delta,
            normal if normal is not None else delta,
            transposed if transposed is not None else delta,
            scale if scale is not None else delta,
            transpose if transpose is not None else delta,
            x_t if x_t is not None else delta,
            widen if widen is not None else delta,
            widened if widened is not None else delta,
            *grad_out.stride(),
            *out.stride(),
            heads,
            seq,
            head_dim,
            BLOCK_M=block_m,
            D_PAD=padded_head_dim(head_dim),
            CODES=codes,
            CODES_T=codes_t,
            TRANSPOSE=transpose is not None,
            WIDEN=widen is not None,
            DOT_PRECISION=dot_precision(grad_out.dtype),
            num_warps=rows_warps(block_m, head_dim),
        )
    return delta, normal, transposed, scale, x_t, widened


@triton.jit
def _transpose_kernel(X, OUT, SEQ, HEAD_DIM, BLOCK: tl.constexpr, D_PAD: tl.constexpr):
    _transpose_block(X, OUT, tl.program_id(0), tl.program_id(1), SEQ, HEAD_DIM, BLOCK, D_PAD)


@triton.jit
def _transpose_block(X, OUT, pid_n, pid_bh, SEQ, HEAD_DIM, BLOCK: tl.constexpr, D_PAD: tl.constexpr):
    """Rows ``pid_n * BLOCK ...`` of head ``pid_bh`` of the contiguous ``[B, H, N, D]`` ``X``, stored transposed
    into ``OUT`` ``[B, H, D, N]`` (:func:`transpose_rows`'s programs, and the preprocess kernel's ``TRANSPOSE``)."""
    rows = pid_n * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D_PAD)
    valid = (rows[:, None] < SEQ) & (cols[None, :] < HEAD_DIM)
    base = pid_bh * SEQ * HEAD_DIM
    x = tl.load(X + base + rows[:, None] * HEAD_DIM + cols[None, :], mask=valid, other=0.0)
    tl.store(OUT + base + cols[:, None] * SEQ + rows[None, :], tl.trans(x), mask=tl.trans(valid))


def output_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``x``'s shape, dtype and device in ``x``'s memory layout, as ``torch.empty_like``
    keeps it, when a TMA descriptor can take that layout (last dim contiguous, the other strides multiples of 16
    bytes); contiguous otherwise.

    The forward writes O where the caller's q lives: a model that hands q over as ``[B, N, H, D]`` memory viewed
    ``[B, H, N, D]`` gets O back in that layout, and its reshape after the call stays a view instead of a copy. The
    forward's registered fake uses the same rule, so ``torch.compile`` sees the strides the kernels write.

    Args:
        x: the tensor whose shape, dtype and layout the output takes.

    Example::

        out = output_like(q.transpose(1, 2).contiguous().transpose(1, 2))   # [B, H, N, D] over [B, N, H, D] memory
    """
    out = torch.empty_like(x)
    size = out.element_size()
    if out.stride(-1) != 1 or any(stride * size % 16 for stride in out.stride()[:-1]):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


def transpose_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` contiguous -> ``[B, H, D, N]`` contiguous, tile by tile. (PyTorch's generic strided
    copy of the int8 Q'^ and K'^ took 0.41 ms of a 10.4 ms forward+backward at N=4096, D=128 on an H200.)

    Example::

        q_op_t = transpose_rows(q_op)
    """
    batch, heads, seq, head_dim = x.shape
    out = torch.empty(batch, heads, head_dim, seq, dtype=x.dtype, device=x.device)
    if seq and batch * heads:
        _transpose_kernel[(triton.cdiv(seq, 64), batch * heads)](
            x, out, seq, head_dim, BLOCK=64, D_PAD=padded_head_dim(head_dim)
        )
    return out
