"""The SageBwd reference: exactness, agreement with float64 attention, the INT8 error band, gradients."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from fake_quant_formula import fake_quant, sagebwd_formula
from sage_lightning.kernels import AttentionPrecision, sage_attention
from sage_lightning.kernels.reference import (
    MAX_EXACT_CONTRACTION,
    MAX_EXACT_CONTRACTION_INT32,
    exact_attention,
    fp8_round,
    quantize_fp8,
    quantize_int8,
    sage_attention_intermediates,
    sage_attention_reference,
)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def cos(x: torch.Tensor, ref: torch.Tensor) -> float:
    return F.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0).item()


def make_inputs(
    b: int, hq: int, hkv: int, n: int, nk: int, d: int, dtype: torch.dtype, seed: int, sigma: float = 1.0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, n, d, generator=g, dtype=torch.float64) * sigma).to(dtype)
    k = (torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64) * sigma).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def run(q, k, v, do, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """O, dQ, dK, dV of the reference autograd Function."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = sage_attention_reference(q, k, v, **kwargs)
    out.backward(do)
    return out, q.grad, k.grad, v.grad


# --- the integer products -------------------------------------------------------------------------------


def test_exactness_bound_on_the_contraction_length() -> None:
    """int8 x int8 products sum exactly in fp32 up to 1040 terms, and the bound is tight."""
    assert MAX_EXACT_CONTRACTION == 1040 and 1040 * 127**2 <= 2**24 < 1041 * 127**2
    assert MAX_EXACT_CONTRACTION_INT32 == 133144 and 133144 * 127**2 <= 2**31 - 1 < 133145 * 127**2
    for length, exact in ((1040, True), (1041, False)):
        a = torch.full((1, length), 127.0)
        exact_sum = int((a.long() @ a.long().T).item())
        assert (int((a @ a.T).item()) == exact_sum) is exact
    # random codes at the bound, summed in fp32 by the same matmul the reference uses
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (64, 1040), generator=g)
    b = torch.randint(-127, 128, (48, 1040), generator=g)
    assert torch.equal((a.float() @ b.float().T).long(), a @ b.T)


def test_reference_refuses_contractions_it_cannot_sum_exactly() -> None:
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="block_n=2048 is over 1040"):
        sage_attention_reference(q, q, q, block_n=2048)


# --- the quantizer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_quantize_int8_properties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 16, 32, generator=g) * 10 ** torch.empty(3, 4, 1, 1).uniform_(-3, 3, generator=g)
    x[0, 0] = 0.0  # an all-zero block
    codes, scale = quantize_int8(x, (-2, -1))
    assert scale.shape == (3, 4, 1, 1)
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 127
    assert (codes.abs().amax(dim=(-2, -1)).flatten()[1:] == 127).all()  # every non-zero block uses the range
    assert scale[0, 0].item() == 1.0 and not codes[0, 0].any()
    assert ((codes * scale - x).abs() <= scale / 2 * (1 + 1e-6)).all()  # round to nearest


@pytest.mark.parametrize("seed", range(5))
def test_quantize_fp8_properties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 16, 32, generator=g) * 10 ** torch.empty(3, 4, 1, 1).uniform_(-3, 3, generator=g)
    x[0, 0] = 0.0  # an all-zero block
    codes, scale = quantize_fp8(x, (-2, -1))
    assert scale.shape == (3, 4, 1, 1)
    assert torch.equal(codes, fp8_round(codes)) and codes.abs().max() <= 448  # e4m3 values, in range
    assert (codes.abs().amax(dim=(-2, -1)).flatten()[1:] == 448).all()  # every non-zero block uses the range
    assert scale[0, 0].item() == 1.0 and not codes[0, 0].any()
    # Round to nearest: within half a step of e4m3 (3 mantissa bits: 2**-4 of the value, 2**-10 below 2**-6).
    ratio = x / scale
    assert ((codes - ratio).abs() <= torch.maximum(ratio.abs() * 2**-4, torch.tensor(2.0**-10)) * (1 + 1e-6)).all()
    x[1, 1, 2, 3] = math.nan
    codes, scale = quantize_fp8(x, (-2, -1))
    assert not torch.isfinite(codes[1, 1] * scale[1, 1]).all() and torch.isfinite(codes[1, 0] * scale[1, 0]).all()


def test_fp8_round_agrees_with_torchs_cast_at_every_boundary() -> None:
    """Every e4m3 value, each midpoint between neighbours (a tie) and the floats just either side of it."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, mid.nextafter(torch.tensor(math.inf)), mid.nextafter(torch.tensor(-math.inf))])
    assert torch.equal(fp8_round(x), x.to(torch.float8_e4m3fn).float())


def test_fp8_round_is_torchs_e4m3_cast_ties_to_even() -> None:
    assert fp8_round(torch.tensor([1.0625, 1.1875, 300.0, 448.0, -0.0009765625 * 1.5])).tolist() == [
        1.0,  # the tie 1 + 1/16 goes to the even neighbour 1.0
        1.25,  # the tie 1 + 3/16 goes to 1.25 (even mantissa)
        288.0,
        448.0,
        -0.001953125,  # a subnormal: 1.5 * 2**-10 = 0.75 * 2**-9 goes to the nearest multiple of 2**-9
    ]


def test_quantize_int8_keeps_non_finite_values_non_finite() -> None:
    x = torch.randn(2, 8, 8)
    x[0, 3, 3] = math.nan
    x[1, 0, 0] = math.inf
    codes, scale = quantize_int8(x, (-2, -1))
    assert not torch.isfinite(codes[0] * scale[0]).all()
    assert not torch.isfinite(codes[1] * scale[1]).all()


# --- agreement with float64 attention ---------------------------------------------------------------------

SHAPES = [  # (b, hq, hkv, n, nk, d, causal)
    (1, 1, 1, 64, 64, 32, False),
    (2, 4, 2, 100, 100, 64, True),  # GQA, ragged
    (1, 4, 1, 130, 70, 32, False),  # MQA, N > Nk
    (2, 2, 2, 50, 190, 16, True),  # N < Nk, causal top-left
    (1, 6, 3, 257, 129, 48, True),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_high_precision_products_match_float64_attention(shape: tuple) -> None:
    """With no INT8 product, the tiled online softmax and the backward are attention itself."""
    b, hq, hkv, n, nk, d, causal = shape
    q, k, v, do = make_inputs(b, hq, hkv, n, nk, d, torch.float32, seed=n)
    ref = exact_attention(q, k, v, do, is_causal=causal)
    for smooth in (False, True):
        precision = AttentionPrecision.all_bf16(smooth_k=smooth, smooth_q=smooth)
        out, dq, dk, dv = run(q, k, v, do, is_causal=causal, precision=precision, block_m=32, block_n=16)
        for name, x in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
            assert rel_l2(x, ref[name]) < 2e-6, (name, smooth)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_high_precision_products_in_16_bit_match_to_rounding(shape: tuple, dtype: torch.dtype) -> None:
    b, hq, hkv, n, nk, d, causal = shape
    q, k, v, do = make_inputs(b, hq, hkv, n, nk, d, dtype, seed=1)
    ref = exact_attention(q, k, v, do, is_causal=causal)
    out, dq, dk, dv = run(q, k, v, do, is_causal=causal, precision=AttentionPrecision.all_bf16())
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # unit roundoff of the 16-bit type
    for name, x in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert x.dtype == dtype
        assert rel_l2(x, ref[name]) < 2 * eps, name


def test_smoothing_leaves_the_forward_unchanged_in_float64() -> None:
    q, k, v, _ = make_inputs(2, 4, 2, 90, 77, 32, torch.float64, seed=3)
    k = k + torch.randn(1, 1, 1, 32, dtype=torch.float64) * 5  # a channel bias for K-smoothing to remove
    base = AttentionPrecision.all_bf16(smooth_k=False)
    out, lse = sage_attention_reference(q, k, v, precision=base, is_causal=True, block_m=32, block_n=16)
    for smooth_q in (False, True):
        other = base.replace(smooth_k=True, smooth_q=smooth_q)
        out2, lse2 = sage_attention_reference(q, k, v, precision=other, is_causal=True, block_m=32, block_n=16)
        assert (out2 - out).abs().max() < 1e-12 and (lse2 - lse).abs().max() < 1e-12
    assert (lse - exact_attention(q, k, v, q, is_causal=True)["lse"]).abs().max() < 1e-12


def test_logsumexp_is_sdpas_also_with_smoothing_and_int8() -> None:
    q, k, v, do = make_inputs(1, 2, 1, 100, 80, 32, torch.bfloat16, seed=8)
    k = (k.float() + 4).to(torch.bfloat16)  # K-smoothing shifts S by tau * q . kbar per row
    _, lse = sage_attention_reference(q, k, v, is_causal=True)
    exact = exact_attention(q, k, v, do, is_causal=True)["lse"]
    assert lse.shape == (1, 2, 100) and lse.dtype == torch.float32
    assert (lse - exact).abs().max() < 0.05


# --- the INT8 band ------------------------------------------------------------------------------------------

# SageBwd defaults on N(0, 1) inputs, b=1, h=2, N=512, D=64. The bands hold the measured values with a
# margin on each side, so the test fails both when the error grows and when a product silently stops being
# quantized (the all-bf16 setting's error is 15-100x smaller).
# Measured over seeds 7-9, bf16 and fp16: rel_l2 O 0.018-0.020, dQ 0.053-0.056, dK 0.053-0.055,
# dV 0.021-0.022 (0.046-0.050 before P was scaled per key column for dV); the all-bf16 setting: 0.003 (bf16)
# and 0.0004 (fp16).
INT8_BANDS = {  # tensor: (min rel_l2, max rel_l2, min cos)
    "O": (0.012, 0.03, 0.9995),
    "dQ": (0.035, 0.08, 0.997),
    "dK": (0.035, 0.08, 0.997),
    "dV": (0.012, 0.035, 0.9995),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sagebwd_defaults_land_in_the_stated_band(dtype: torch.dtype) -> None:
    q, k, v, do = make_inputs(1, 2, 2, 512, 512, 64, dtype, seed=7)
    ref = exact_attention(q, k, v, do)
    got = dict(zip(("O", "dQ", "dK", "dV"), run(q, k, v, do), strict=True))
    for name, (lo, hi, min_cos) in INT8_BANDS.items():
        err = rel_l2(got[name], ref[name])
        assert lo < err < hi, (name, err)
        assert cos(got[name], ref[name]) > min_cos, name


def test_ds_is_the_dominant_error_and_dq_dk_inherit_it() -> None:
    """The SageBwd study's ordering: among P, dP, dS the score gradient is worst; dQ, dK worst outputs."""
    q, k, v, do = make_inputs(1, 2, 2, 512, 512, 64, torch.bfloat16, seed=11)
    ref = exact_attention(q, k, v, do)
    ours = sage_attention_intermediates(q, k, v, do)
    errs = {name: rel_l2(ours[name], ref[name]) for name in ref}
    assert errs["dS"] > max(errs["P"], errs["dP"])
    assert min(errs["dQ"], errs["dK"]) > max(errs["O"], errs["dV"])
    ds_only = sage_attention_intermediates(q, k, v, do, precision=AttentionPrecision.all_bf16(ds="int8"))
    # switching ds alone to INT8 carries most of the dQ error of the full SageBwd setting
    assert rel_l2(ds_only["dQ"], ref["dQ"]) > 0.5 * errs["dQ"]


def test_k_smoothing_tames_a_channel_bias_in_k() -> None:
    q, k, v, do = make_inputs(1, 2, 2, 256, 256, 64, torch.bfloat16, seed=5)
    bias = 20 * torch.randn(64, generator=torch.Generator().manual_seed(0)).abs()
    k = (k.float() + bias).to(torch.bfloat16)  # per-channel offset, shared by tokens
    ref = exact_attention(q, k, v, do)
    on = run(q, k, v, do, precision=AttentionPrecision(smooth_k=True))
    off = run(q, k, v, do, precision=AttentionPrecision(smooth_k=False))
    for i, name in enumerate(("O", "dQ", "dK")):
        assert rel_l2(on[i], ref[name]) < 0.5 * rel_l2(off[i], ref[name]), name


def test_q_smoothing_tames_outlier_channels_in_q() -> None:
    q, k, v, do = make_inputs(1, 2, 2, 256, 256, 64, torch.bfloat16, seed=6)
    q = q.float()
    q[..., [3, 17, 40, 51]] += 10.0  # four channels with a large shared offset
    q = q.to(torch.bfloat16)
    ref = exact_attention(q, k, v, do)
    on = sage_attention_intermediates(q, k, v, do, precision=AttentionPrecision(smooth_q=True))
    off = sage_attention_intermediates(q, k, v, do, precision=AttentionPrecision(smooth_q=False))
    # Measured over seeds 6-9, offsets 10 and 15: P x0.6-0.7, dK x0.45-0.7, O x0.7. The gain is capped by K's
    # own quantization error, which the restored term tau * qbar . deq(K'^) multiplies by the large qbar.
    assert rel_l2(on["P"], ref["P"]) < 0.8 * rel_l2(off["P"], ref["P"])
    assert rel_l2(on["dK"], ref["dK"]) < 0.7 * rel_l2(off["dK"], ref["dK"])


# --- gradients: the tiled backward against autograd through an explicit fake-quantization formula ----------

FORMULA_SETTINGS = {
    "sagebwd": AttentionPrecision(),
    "all_int8": AttentionPrecision.all_int8(),
    "all_bf16": AttentionPrecision.all_bf16(),
    "smooth_q": AttentionPrecision(smooth_q=True),
    "no_smoothing": AttentionPrecision(smooth_k=False),
    "ds_bf16": AttentionPrecision(ds="bf16", smooth_q=True),
    "only_dv": AttentionPrecision.all_bf16(dv="int8", smooth_k=False),
    "only_dp": AttentionPrecision.all_bf16(dp="int8"),
    "all_fp8": AttentionPrecision.all_fp8(),
    "fp8_pv_ds": AttentionPrecision(pv="fp8", ds="fp8", smooth_q=True),
    "fp8_qk_dv_dp": AttentionPrecision(qk="fp8", dv="fp8", dp="fp8", smooth_k=False),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("setting", FORMULA_SETTINGS)
def test_gradients_match_autograd_through_the_fake_quant_formula(setting: str, causal: bool) -> None:
    precision = FORMULA_SETTINGS[setting]
    q, k, v, do = make_inputs(2, 4, 2, 75, 53, 16, torch.float64, seed=len(setting))
    k = k + 3.0  # a channel bias, so K-smoothing's correction is not trivially zero
    kwargs = {"is_causal": causal, "precision": precision, "block_m": 32, "block_n": 16}
    out, dq, dk, dv = run(q, k, v, do, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    formula_out = sagebwd_formula(*leaves, **kwargs)
    formula_out.backward(do)
    for name, ours, theirs in (
        ("O", out, formula_out),
        ("dQ", dq, leaves[0].grad),
        ("dK", dk, leaves[1].grad),
        ("dV", dv, leaves[2].grad),
    ):
        assert rel_l2(ours, theirs) < 1e-10, name


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_tiles_match_the_formula(seed: int) -> None:
    """Property-style: random GQA shapes, ragged lengths, tile sizes and settings, float64, to 1e-10."""
    rnd = random.Random(100 + seed)
    hkv = rnd.choice([1, 2])
    hq = hkv * rnd.choice([1, 3])
    n, nk = rnd.randint(1, 90), rnd.randint(1, 90)
    d = rnd.choice([8, 16, 24])
    block_m, block_n = rnd.choice([16, 32]), rnd.choice([8, 16, 32])
    causal = rnd.random() < 0.5
    fields = {name: rnd.choice(["int8", "fp8", "bf16"]) for name in ("qk", "pv", "dv", "dp", "ds")}
    precision = AttentionPrecision(**fields, smooth_k=rnd.random() < 0.7, smooth_q=rnd.random() < 0.3)
    q, k, v, do = make_inputs(rnd.randint(1, 2), hq, hkv, n, nk, d, torch.float64, seed=seed)
    kwargs = {"is_causal": causal, "precision": precision, "block_m": block_m, "block_n": block_n}
    got = run(q, k, v, do, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    formula_out = sagebwd_formula(*leaves, **kwargs)
    formula_out.backward(do)
    for name, ours, theirs in zip(("O", "dQ", "dK", "dV"), got, (formula_out, *(t.grad for t in leaves)), strict=True):
        assert rel_l2(ours, theirs) < 1e-10, (name, precision.short_name, n, nk, block_m, block_n, causal)


def test_formula_is_not_trivially_satisfied() -> None:
    """The formula test has teeth: a different tile size (other quantization blocks) breaks the match."""
    q, k, v, do = make_inputs(1, 2, 2, 64, 64, 16, torch.float64, seed=0)
    _, dq, _, _ = run(q, k, v, do, block_m=32, block_n=16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sagebwd_formula(*leaves, is_causal=False, precision=AttentionPrecision(), block_m=32, block_n=32).backward(do)
    assert rel_l2(dq, leaves[0].grad) > 1e-4


# --- statistics, non-finite values, the "full" mode ----------------------------------------------------------


def test_ds_statistics_are_the_int8_error_of_ds_whatever_ds_runs_in() -> None:
    q, k, v, do = make_inputs(1, 2, 1, 70, 90, 16, torch.float64, seed=9)
    kwargs = {"is_causal": True, "block_m": 32, "block_n": 16}
    stats_int8, stats_bf16 = torch.zeros(2), torch.zeros(2)
    run(q, k, v, do, stats=stats_int8, **kwargs)
    run(q, k, v, do, stats=stats_bf16, precision=AttentionPrecision(ds="bf16"), **kwargs)
    assert torch.allclose(stats_int8, stats_bf16, rtol=1e-6)
    ds = sage_attention_intermediates(q, k, v, do, precision=AttentionPrecision(ds="bf16"), **kwargs)["dS"]
    err2 = (ds - fake_quant(ds, 32, 16)).square().sum()
    assert stats_bf16[0].item() == pytest.approx(err2.item(), rel=1e-5)
    assert stats_bf16[1].item() == pytest.approx(ds.square().sum().item(), rel=1e-5)
    run(q, k, v, do, stats=stats_bf16, precision=AttentionPrecision(ds="bf16"), **kwargs)
    assert torch.allclose(stats_bf16, 2 * stats_int8, rtol=1e-6)  # accumulates across backwards
    assert 0.001 < math.sqrt(stats_int8[0] / stats_int8[1]) < 0.1


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_non_finite_inputs_give_non_finite_outputs(where: str) -> None:
    q, k, v, do = make_inputs(1, 2, 2, 40, 40, 16, torch.bfloat16, seed=2)
    tensors = {"q": q, "k": k, "v": v}
    tensors[where] = tensors[where].clone()
    tensors[where][0, 1, 5, 3] = math.nan
    out = sage_attention(tensors["q"], tensors["k"], tensors["v"])
    assert out[0, 1, 5].isnan().all() if where == "q" else out[0, 1].isnan().all()
    assert torch.isfinite(out[0, 0]).all()  # the other head never saw it


def test_non_finite_output_gradient_gives_non_finite_input_gradients() -> None:
    q, k, v, do = make_inputs(1, 1, 1, 40, 40, 16, torch.bfloat16, seed=2)
    do[0, 0, 7, 1] = math.inf
    _, dq, dk, dv = run(q, k, v, do)
    assert not torch.isfinite(dq).all() and not torch.isfinite(dk).all() and not torch.isfinite(dv).all()


def test_double_backward_is_refused_clearly() -> None:
    q, k, v, do = make_inputs(1, 1, 1, 16, 16, 8, torch.float32, seed=0)
    q.requires_grad_()
    out, _ = sage_attention_reference(q, k, v)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)  # a gradient penalty, say
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.sum().backward()


def test_full_mode_is_sdpa() -> None:
    q, k, v, _ = make_inputs(2, 4, 2, 33, 47, 16, torch.bfloat16, seed=4)
    out = sage_attention(q, k, v, is_causal=True, precision=AttentionPrecision(mode="full"))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)


# --- property-style: random shapes, dtypes, GQA, causal ------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes_agree_with_float64_attention(seed: int) -> None:
    rnd = random.Random(seed)
    hkv = rnd.choice([1, 2, 3])
    hq = hkv * rnd.choice([1, 2, 4])
    n, nk = rnd.randint(1, 200), rnd.randint(1, 200)
    d = rnd.choice([16, 32, 64, 80])
    causal = rnd.random() < 0.5
    dtype = rnd.choice([torch.bfloat16, torch.float16, torch.float32])
    q, k, v, do = make_inputs(rnd.randint(1, 2), hq, hkv, n, nk, d, dtype, seed=seed)
    ref = exact_attention(q, k, v, do, is_causal=causal)
    out, dq, dk, dv = run(q, k, v, do, is_causal=causal)
    assert out.shape == q.shape and dk.shape == k.shape and out.dtype == dtype
    for name, x in (("O", out), ("dQ", dq), ("dK", dk), ("dV", dv)):
        assert torch.isfinite(x).all(), name
        assert cos(x, ref[name]) > 0.99, (name, cos(x, ref[name]))


def test_quantizer_survives_a_block_max_whose_scale_underflows() -> None:
    """A subnormal block max makes max/127 round to 0; the block must quantize to zeros, not 0/0 = NaN."""
    codes, scale = quantize_int8(torch.tensor([[1e-44, 0.0, 5e-45]]), (-1,))
    assert torch.equal(codes, torch.zeros(1, 3)) and scale.item() == 1.0


def test_peaked_softmax_stays_finite() -> None:
    """sigma=10 scores: forward P rows far below their running max used to hit that underflow."""
    q, k, v, do = make_inputs(1, 2, 2, 256, 256, 64, torch.bfloat16, seed=0, sigma=10.0)
    out, dq, dk, dv = run(q, k, v, do)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
