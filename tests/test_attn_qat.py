"""Attn-QAT (``mode="attn_qat"``): the reference against dense float64 formulas, the straight-through and drop-in
backwards, the Triton kernels against the reference, and the Lightning side (swap, Trainer, controller).

The Triton tests run under ``TRITON_INTERPRET=1`` on a CPU-only machine (conftest.py) at small sizes; on a GPU the
same tests run on CUDA, plus full-size comparisons that the interpreter would take minutes over.
"""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch
import triton
import triton.language as tl
from qat_formula import attn_qat_formula, dropin_backward, nvfp4_qkv
from recording_ctx import RecordingCtx
from sage_lightning.kernels import ops, use_backend
from sage_lightning.kernels.nvfp4 import quantize_qkv, round_e2m1, round_e4m3
from sage_lightning.kernels.ops import sage_attention_triton
from sage_lightning.kernels.quant import quantize_heads_nvfp4
from sage_lightning.kernels.quant import round_e2m1 as triton_round_e2m1
from sage_lightning.kernels.quant import round_e4m3 as triton_round_e4m3
from sage_lightning.kernels.reference import exact_attention, sage_attention_intermediates, sage_attention_reference
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers, sage_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1"
)
QAT = AttentionPrecision(mode="attn_qat")
DROPIN = QAT.replace(qat_backward="dropin")


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cos(x: torch.Tensor, ref: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0).item()


def make_inputs(shape_q, shape_k, dtype, seed, device="cpu", sigma=1.0):  # noqa: ANN001, ANN201
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape_q, generator=g, dtype=torch.float64) * sigma).to(device, dtype).requires_grad_()
    k = (torch.randn(shape_k, generator=g, dtype=torch.float64) * sigma).to(device, dtype).requires_grad_()
    v = torch.randn(shape_k, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    do = torch.randn(shape_q, generator=g, dtype=torch.float64).to(device, dtype)
    return q, k, v, do


def run(fn, q, k, v, do, **kwargs):  # noqa: ANN001, ANN003, ANN201
    out, lse = fn(q, k, v, **kwargs)
    return out, lse, torch.autograd.grad(out, (q, k, v), do)


# (batch, q heads, kv heads, N, Nk, head dim, causal, block_n): ragged lengths, GQA/MQA, N != Nk both ways.
SHAPES = [
    pytest.param(1, 2, 2, 100, 100, 32, False, 64, id="mha-ragged"),
    pytest.param(2, 4, 2, 70, 90, 16, True, 64, id="gqa-causal-n-lt-nk"),
    pytest.param(1, 3, 1, 150, 60, 24, True, 32, id="mqa-causal-n-gt-nk-block32"),
]


# --- the reference against dense float64 formulas --------------------------------------------------------------


@pytest.mark.parametrize("batch, hq, hkv, n, nk, d, causal, block_n", SHAPES)
def test_matched_reference_is_the_straight_through_gradient_of_the_fp4_forward(
    batch, hq, hkv, n, nk, d, causal, block_n
):
    """In float64 the tiled reference (online softmax, P quantized per tile row) equals one dense expression whose
    quantizers are straight-through, gradients included: matching recomputation, delta from O_hp, dV from P
    re-quantized as the forward did."""
    q, k, v, do = make_inputs((batch, hq, n, d), (batch, hkv, nk, d), torch.float64, seed=n + nk)
    out, lse, grads = run(sage_attention_reference, q, k, v, do, is_causal=causal, precision=QAT, block_n=block_n)
    formula = attn_qat_formula(q, k, v, is_causal=causal, scale=None, block_n=block_n)
    assert rel_l2(out, formula) < 1e-10
    for g, ref in zip(grads, torch.autograd.grad(formula, (q, k, v), do), strict=True):
        assert rel_l2(g, ref) < 1e-10
    # The logsumexp is of the quantized scores.
    q_fq, k_fq = nvfp4_qkv(q.detach()), nvfp4_qkv(k.detach())
    s = q_fq @ k_fq.repeat_interleave(hq // hkv, dim=1).transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(n, nk, dtype=torch.bool).tril().logical_not(), -math.inf)
    assert rel_l2(lse, torch.logsumexp(s, dim=-1)) < 1e-12


@pytest.mark.parametrize("batch, hq, hkv, n, nk, d, causal, block_n", SHAPES[:2])
def test_dropin_reference_is_flash_attention_backward_fed_the_fp4_forward(batch, hq, hkv, n, nk, d, causal, block_n):
    q, k, v, do = make_inputs((batch, hq, n, d), (batch, hkv, nk, d), torch.float64, seed=n)
    out, lse, grads = run(sage_attention_reference, q, k, v, do, is_causal=causal, precision=DROPIN, block_n=block_n)
    matched_out, matched_lse, matched_grads = run(
        sage_attention_reference, q, k, v, do, is_causal=causal, precision=QAT, block_n=block_n
    )
    assert torch.equal(out, matched_out) and torch.equal(lse, matched_lse)  # the same FP4 forward
    expected = dropin_backward(q.detach(), k.detach(), v.detach(), out, lse, do, is_causal=causal, scale=None)
    for g, ref, matched in zip(grads, expected, matched_grads, strict=True):
        assert rel_l2(g, ref) < 1e-10
        assert rel_l2(g, matched) > 1e-2  # not the gradient of what ran


def test_qkv_quantize_alike_in_every_precision() -> None:
    """Q, K, V are quantized in fp32: a bf16 tensor and its float64 copy give the same values (16-bit inputs put
    many values on E2M1 ties, which a division in another precision would break differently)."""
    x = (torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 5).to(torch.bfloat16)
    values, scale = quantize_qkv(x)
    values64, scale64 = quantize_qkv(x.double())
    assert values64.dtype == torch.float64 and torch.equal(values.double(), values64)
    assert torch.equal(scale.double(), scale64)


def test_intermediates_are_the_reference_run() -> None:
    q, k, v, do = make_inputs((1, 2, 90, 32), (1, 1, 90, 32), torch.float64, seed=1)
    for precision in (QAT, DROPIN):
        out, lse, grads = run(sage_attention_reference, q, k, v, do, is_causal=True, precision=precision)
        parts = sage_attention_intermediates(q, k, v, do, is_causal=True, precision=precision)
        assert torch.equal(parts["O"], out) and torch.equal(parts["lse"], lse)
        for name, g in zip(("dQ", "dK", "dV"), grads, strict=True):
            assert torch.allclose(parts[name], g, rtol=0, atol=1e-12), name
        exact = exact_attention(q, k, v, do, is_causal=True)
        assert all(parts[name].shape == exact[name].shape for name in exact)
        # The quantized P is normalised by the unquantized row sum: its rows sum to 1 only roughly.
        row_error = (parts["P"].sum(-1) - 1).abs()
        assert 0 < row_error.mean() < 0.05 and row_error.max() < 0.2
        delta_from = parts["O_hp"] if precision is QAT else parts["O"]
        assert torch.allclose(parts["delta"], (do * delta_from).sum(-1), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sage_attention_runs_attn_qat_on_cpu_within_fp4_accuracy(dtype: torch.dtype) -> None:
    q, k, v, do = make_inputs((1, 4, 130, 64), (1, 2, 130, 64), dtype, seed=2)
    out = sage_attention(q, k, v, is_causal=True, precision=QAT)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_out, _, ref_grads = run(sage_attention_reference, q, k, v, do, is_causal=True, precision=QAT)
    assert out.dtype == dtype and torch.equal(out, ref_out)
    assert all(g.dtype == dtype and torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    exact = exact_attention(q, k, v, do, is_causal=True)
    # FP4 on N(0, 1) inputs (benchmarks/results/accuracy-cpu-*-attn_qat.md): cosines about 0.98.
    assert 0.97 < cos(out, exact["O"]) < 0.995
    for name, g in zip(("dQ", "dK", "dV"), grads, strict=True):
        assert 0.96 < cos(g, exact[name]) < 0.995, name
    sagebwd = sage_attention(q, k, v, is_causal=True)
    assert rel_l2(out, sagebwd) > 0.05  # FP4, not INT8


def test_scale_argument_and_stats_left_alone() -> None:
    q, k, v, do = make_inputs((1, 2, 64, 32), (1, 2, 64, 32), torch.float32, seed=3)
    stats = torch.zeros(2)
    out = sage_attention(q, k, v, scale=0.3, precision=QAT, stats=stats)
    out.backward(do)
    assert torch.equal(stats, torch.zeros(2))  # no INT8 dS in attn_qat mode: nothing to measure
    assert torch.equal(out, sage_attention_reference(q, k, v, scale=0.3, precision=QAT)[0])
    assert rel_l2(out, sage_attention_reference(q, k, v, precision=QAT)[0]) > 1e-3


def test_what_the_backward_keeps() -> None:
    """Matched: the NVFP4 values and scales (not q, k, v) and O_hp. Drop-in: q, k, v and O, as FlashAttention."""
    q, k, v, _ = make_inputs((1, 2, 64, 32), (1, 2, 64, 32), torch.bfloat16, seed=4)
    for precision, keeps_inputs in ((QAT, False), (DROPIN, True)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out, _ = sage_attention_reference(q, k, v, precision=precision)
        assert any(t is q for t in saved) is keeps_inputs and any(t is k for t in saved) is keeps_inputs
        assert any(t is out for t in saved) is keeps_inputs  # O_hp instead of O for the matched backward


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_non_finite_input_gives_non_finite_output(where: str) -> None:
    inputs = dict(zip("qkv", make_inputs((1, 2, 40, 16), (1, 2, 40, 16), torch.float32, seed=5)[:3], strict=True))
    poisoned = inputs[where].detach().clone()
    poisoned[0, 0, 3, 5] = float("nan")
    inputs[where] = poisoned.requires_grad_()
    out = sage_attention(*inputs.values(), precision=QAT)
    assert not out[0, 0].isfinite().all()
    grads = torch.autograd.grad(out.sum(), tuple(inputs.values()))
    assert not all(g.isfinite().all() for g in grads)


def test_block_n_must_hold_whole_quantization_blocks() -> None:
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="block_n must be a multiple of 16 .*; received 24"):
        sage_attention_reference(q, q, q, precision=QAT, block_n=24)


# --- the Triton kernels against the reference ----------------------------------------------------------------

# On a GPU the loops divide and exponentiate approximately, which can move a value next to an FP4 rounding
# boundary to the neighbouring value; the interpreter divides exactly (agreement to fp32 rounding there).
OUT_BOUND = 1e-4 if INTERPRETED else 1e-2
GRAD_BOUND = 1e-3 if INTERPRETED else 2e-2
LSE_BOUND = 1e-5 if INTERPRETED else 2e-4

TRITON_CASES = [
    pytest.param(1, 2, 2, 100, 100, 32, False, QAT, torch.bfloat16, id="mha-ragged"),
    pytest.param(1, 2, 2, 130, 130, 32, True, QAT, torch.bfloat16, id="causal-2-query-tiles"),
    pytest.param(2, 4, 2, 70, 70, 16, True, QAT, torch.bfloat16, id="gqa-causal"),
    pytest.param(1, 3, 1, 50, 90, 32, False, QAT, torch.bfloat16, id="mqa-n-lt-nk"),
    pytest.param(1, 2, 1, 140, 60, 16, True, QAT, torch.bfloat16, id="causal-n-gt-nk"),
    pytest.param(1, 2, 2, 90, 90, 40, True, QAT, torch.bfloat16, id="head-dim-40"),
    pytest.param(1, 2, 2, 90, 90, 32, True, QAT, torch.float16, id="fp16"),
    pytest.param(1, 2, 1, 90, 90, 16, True, QAT, torch.float32, id="fp32"),
    pytest.param(1, 4, 2, 100, 80, 32, True, DROPIN, torch.bfloat16, id="dropin-gqa"),
    pytest.param(1, 2, 2, 90, 90, 32, False, DROPIN, torch.float16, id="dropin-fp16"),
]


@needs_triton
@pytest.mark.parametrize("batch, hq, hkv, n, nk, d, causal, precision, dtype", TRITON_CASES)
def test_triton_matches_reference(batch, hq, hkv, n, nk, d, causal, precision, dtype):
    q, k, v, do = make_inputs((batch, hq, n, d), (batch, hkv, nk, d), dtype, seed=n + d, device=DEVICE)
    kw = dict(is_causal=causal, precision=precision)
    out, lse, grads = run(sage_attention_triton, q, k, v, do, **kw)
    ref_out, ref_lse, ref_grads = run(sage_attention_reference, q, k, v, do, **kw)
    assert out.dtype == dtype and out.shape == q.shape and all(g.dtype == dtype for g in grads)
    assert rel_l2(out, ref_out) < OUT_BOUND
    assert rel_l2(lse, ref_lse) < LSE_BOUND
    exact = exact_attention(q, k, v, do, is_causal=causal)
    for name, g, ref in zip(("dQ", "dK", "dV"), grads, ref_grads, strict=True):
        assert g.shape == ref.shape, name
        assert rel_l2(g, ref) < GRAD_BOUND, name
        assert rel_l2(g, exact[name]) < 1.05 * rel_l2(ref, exact[name]) + 1e-3, name  # as accurate as the reference


@triton.jit
def _rounding_kernel(X, E4M3, E2M1, SIZE: tl.constexpr):
    offsets = tl.arange(0, SIZE)
    x = tl.load(X + offsets)
    tl.store(E4M3 + offsets, triton_round_e4m3(tl.abs(x)))
    tl.store(E2M1 + offsets, triton_round_e2m1(x))


@needs_triton
def test_triton_rounding_helpers_match_the_reference_including_ties() -> None:
    e4m3_values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    g = torch.Generator().manual_seed(10)
    x = torch.cat(
        [
            e4m3_values,
            (e4m3_values[1:] + e4m3_values[:-1]) / 2,  # every E4M3 tie
            torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e30, float("inf"), float("nan"), 2.0**-130]),
        ]
    )
    random = torch.exp(torch.empty(1024 - x.numel(), dtype=torch.float32).uniform_(-14, 7, generator=g))
    x = torch.cat([x, random])  # 1024 values: a power of two for tl.arange
    x = torch.cat([x, -x]).to(DEVICE)
    e4m3_out, e2m1_out = torch.empty_like(x), torch.empty_like(x)
    _rounding_kernel[(1,)](x, e4m3_out, e2m1_out, SIZE=x.numel())
    assert torch.allclose(e4m3_out, round_e4m3(x.abs()), rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(e2m1_out, round_e2m1(x), rtol=0, atol=0, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_quantizer_equals_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 3, 100, 40, generator=g) * 3).to(DEVICE, dtype)
    x[0, 0, 3] = 0  # an all-zero row: zero blocks
    x[1, 2] *= 1e-3  # another (batch, head): its own second-level scale
    # E2M1 ties, where the scales allow it.
    x[0, 1, 5, :4] = torch.tensor([0.75, 1.25, -2.5, 5.0], device=DEVICE) * x[0, 1].abs().amax() / 6
    values, scale = quantize_heads_nvfp4(x.transpose(1, 2).contiguous().transpose(1, 2))  # any strides
    ref_values, ref_scale = quantize_qkv(x)
    assert values.dtype == dtype and values.is_contiguous()
    assert torch.equal(values.float(), ref_values.float()) and torch.equal(scale, ref_scale.reshape(2, 3))
    x[1, 0, 7, 3] = float("nan")
    values, _ = quantize_heads_nvfp4(x)
    assert values[1, 0].isnan().all() and values[0].isfinite().all()


@needs_triton
def test_triton_results_are_quantized_and_routed() -> None:
    q, k, v, do = make_inputs((1, 2, 70, 16), (1, 1, 70, 16), torch.bfloat16, seed=7, device=DEVICE)
    with use_backend("triton"):
        out = sage_attention(q, k, v, is_causal=True, precision=QAT)
        grads = torch.autograd.grad(out, (q, k, v), do)
        full_grads = torch.autograd.grad(
            sage_attention(q, k, v, is_causal=True, precision=QAT.replace(mode="full")), (q, k, v), do
        )
    assert torch.equal(out, sage_attention_triton(q, k, v, is_causal=True, precision=QAT)[0])
    assert rel_l2(grads[0], full_grads[0]) > 0.05  # FP4: a kernel that ran in bf16 would be far closer
    with pytest.raises(ValueError, match="qat_backward must be one of"):
        AttentionPrecision(mode="attn_qat", qat_backward="naive")


@needs_triton
def test_triton_backward_keeps_nvfp4_values_not_q_and_k() -> None:
    q, k, v, _ = make_inputs((1, 2, 64, 32), (1, 2, 64, 32), torch.bfloat16, seed=8, device=DEVICE)
    for precision, keeps_inputs in ((QAT, False), (DROPIN, True)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            sage_attention_triton(q, k, v, precision=precision)
        assert any(t is q for t in saved) is keeps_inputs and any(t is k for t in saved) is keeps_inputs


@needs_triton
def test_triton_under_torch_compile_has_no_graph_break() -> None:
    q, k, v, do = make_inputs((1, 2, 64, 16), (1, 1, 64, 16), torch.bfloat16, seed=9, device=DEVICE)

    def attention(q, k, v):  # noqa: ANN001, ANN202
        return sage_attention(q, k, v, is_causal=True, precision=QAT)

    torch._dynamo.reset()
    with use_backend("triton"):
        compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        eager = attention(q, k, v)
        eager_grads = torch.autograd.grad(eager, (q, k, v), do)
    assert torch.equal(out, eager)
    assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads, strict=True))


@pytest.mark.skipif(DEVICE == "cpu", reason="full sizes: on a GPU only (minutes in the interpreter)")
@pytest.mark.parametrize(
    "n, d, causal, precision",
    [(1024, 64, True, QAT), (2048, 128, False, QAT), (2048, 128, True, QAT), (1024, 128, True, DROPIN)],
)
def test_triton_matches_reference_at_full_size(n: int, d: int, causal: bool, precision: AttentionPrecision) -> None:
    q, k, v, do = make_inputs((2, 8, n, d), (2, 2, n, d), torch.bfloat16, seed=n + d, device=DEVICE)
    kw = dict(is_causal=causal, precision=precision)
    out, _, grads = run(sage_attention_triton, q, k, v, do, **kw)
    ref_out, _, ref_grads = run(sage_attention_reference, q, k, v, do, **kw)
    assert rel_l2(out, ref_out) < OUT_BOUND
    for g, ref in zip(grads, ref_grads, strict=True):
        assert rel_l2(g, ref) < GRAD_BOUND


# --- Lightning: the swap, a Trainer, the controller -------------------------------------------------------------


def test_an_attn_qat_layer_collects_no_ds_statistics_and_probes_fine() -> None:
    torch.manual_seed(0)
    model = TinyLM(precision=QAT)
    model.configure_model()
    layers = attention_layers(model)
    for layer in layers.values():
        layer.collect_stats = True
        layer.arm_probe()
    ids = next(iter(token_loader(1)))[0]
    model(ids[:, :-1]).square().mean().backward()
    for layer in layers.values():
        assert layer.precision.short_name == "attn_qat" and layer.calls == 1 and layer.fallback_calls == 0
        assert layer.take_ds_stats() is None  # asked for, nothing to measure: None, as a layer in "full" mode
        probe = layer.take_probe()
        assert set(probe) == {"O", "dQ", "dK", "dV"}
        assert all(0.9 < metrics["cos"] < 1 and 0 < metrics["rel_l2"] < 0.5 for metrics in probe.values())


class HugeQueries(L.Callback):
    """At one optimizer step, scale the q/k/v projection of one attention layer to the edge of fp32: finite inputs
    whose FP4 scores overflow inside the attention, so the layer's output is NaN."""

    def __init__(self, step: int, layer: int) -> None:
        self.step, self.layer, self.fired = step, layer, 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def hook(module, inputs, output):  # noqa: ANN001, ANN202
            if trainer.global_step == self.step and not self.fired:
                self.fired += 1
                return output / output.abs().amax() * 3e38
            return output

        pl_module.blocks[self.layer].attn.qkv.register_forward_hook(hook)


@pytest.mark.parametrize("precision", [QAT, DROPIN], ids=["matched", "dropin"])
def test_trainer_fits_with_attn_qat_and_the_controller_falls_a_layer_back_to_full(tmp_path, precision) -> None:
    """Every signal armed every step (dS statistics, the probe), then a NaN from one layer: the controller rolls
    back and sends that layer, and only it, to full precision."""
    torch.manual_seed(0)
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=1), snapshot_every_n_steps=1, verbose=False
    )
    injector = HugeQueries(step=2, layer=1)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[controller, injector])
    model = TinyLM(precision=precision)
    trainer.fit(model, token_loader(4))

    assert injector.fired == 1 and controller.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(math.isfinite(loss) for i, loss in enumerate(model.step_losses) if i != 2)
    layers = attention_layers(model)
    assert all(layer.fallback_calls == 0 for layer in layers.values())
    rollback, escalation = controller.history
    assert (rollback.step, rollback.lever) == (2, "rollback")
    assert (escalation.layer, escalation.old, escalation.new) == ("blocks.1.attn", precision.short_name, "full")
    assert layers["blocks.1.attn"].precision.mode == "full" and layers["blocks.0.attn"].precision == precision
    # Steps 0-2 ran both layers in attn_qat, step 3 one of them (the other now at full): 7 of 8 layer-steps.
    assert controller.int8_fraction == pytest.approx(7 / 8)


def test_the_backward_is_not_handed_zero_gradients_of_the_other_outputs():
    """Attn-QAT's operator returns O and eight non-differentiable tensors (O in fp32 among them); its autograd
    formula switches the gradients' materialization off, so autograd allocates no zeros for them per backward."""
    ctx = RecordingCtx()
    x = torch.zeros(1)
    ops._attn_qat_setup_context(ctx, (x, x, x, True, 0.1, True, 128, 64), (x,) * 9)
    assert ("materialize", False) in ctx.calls and ("non-differentiable", 8) in ctx.calls
