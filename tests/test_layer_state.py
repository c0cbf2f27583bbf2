"""AttentionLayerState: the per-layer signals (dS statistics, probe, non-finite flag) and its checkpoint state."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention_models import NanoConfig, NanoGPT

from sage_lightning import (
    AttentionLayerState,
    AttentionPrecision,
    attention_layers,
    convert_to_sage_attention,
    sage_attention,
)
from sage_lightning.layer import compare_with_full_precision


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed))


def swapped_nano(precision: AttentionPrecision | None = None) -> NanoGPT:
    torch.manual_seed(0)
    return convert_to_sage_attention(NanoGPT(NanoConfig()), precision=precision)


def train_step(model: NanoGPT, seed: int = 0) -> None:
    idx = tokens(seed)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()


def test_ds_stats_accumulate_only_while_collected() -> None:
    model = swapped_nano()
    first, second = attention_layers(model).values()
    train_step(model)
    assert first.stats is None and first.take_ds_stats() is None  # off: no buffer, nothing passed to the kernel

    first.collect_stats = True
    model(tokens())  # a forward alone adds nothing: the backward does
    assert first.take_ds_stats() is None
    train_step(model)
    once = first.take_ds_stats()
    assert once is not None and second.take_ds_stats() is None
    err2, norm2 = once
    assert norm2 > 0 and 0 < math.sqrt(err2 / norm2) < 0.1
    assert first.take_ds_stats() is None  # taking zeroes the buffer

    train_step(model)
    train_step(model)
    assert first.take_ds_stats() == (2 * err2, 2 * norm2)  # raw sums over every backward since the last take

    first.collect_stats = False
    train_step(model)
    assert first.take_ds_stats() is None


def test_full_precision_layers_report_no_ds_stats() -> None:
    model = swapped_nano(AttentionPrecision(mode="full"))
    layer = attention_layers(model)["transformer.h.0.attn"]
    layer.collect_stats = True
    train_step(model)
    assert layer.take_ds_stats() is None


def test_probe_full_precision_layer_matches_full_precision() -> None:
    model = swapped_nano(AttentionPrecision(mode="full"))
    layer = attention_layers(model)["transformer.h.1.attn"]
    layer.arm_probe()
    train_step(model)
    probe = layer.take_probe()
    assert set(probe) == {"O", "dQ", "dK", "dV"}
    for metrics in probe.values():
        assert metrics["cos"] == pytest.approx(1.0, abs=1e-9)
        assert 0 <= metrics["rel_l2"] < 1e-5  # fp32 SDPA against float64


def test_probe_sagebwd_layer_shows_int8_error_with_ds_dominant() -> None:
    model = swapped_nano()
    layer = attention_layers(model)["transformer.h.0.attn"]
    layer.arm_probe()
    train_step(model)
    probe = layer.take_probe()
    for metrics in probe.values():
        assert 0.99 < metrics["cos"] < 1 - 1e-9
        assert 1e-5 < metrics["rel_l2"] < 0.15
    # the score gradient's INT8 error reaches dQ and dK, not O
    assert probe["dQ"]["rel_l2"] > probe["O"]["rel_l2"] and probe["dK"]["rel_l2"] > probe["O"]["rel_l2"]
    assert layer.take_probe() is None  # taking clears the capture


def test_probe_is_none_unless_armed_and_backpropagated() -> None:
    model = swapped_nano()
    layer = attention_layers(model)["transformer.h.0.attn"]
    train_step(model)
    assert layer.take_probe() is None
    layer.arm_probe()
    with torch.no_grad():
        model(tokens())  # validation-style call: not captured, still armed
    model(tokens())  # captured, but no backward yet
    assert layer.take_probe() is None


def test_probe_leaves_training_untouched_and_measures_the_first_call() -> None:
    plain, probed = swapped_nano(), swapped_nano()
    layer = attention_layers(probed)["transformer.h.0.attn"]
    # What layer 0's first call sees, recorded independently of the probe by spying on the layer's SDPA.
    inputs: list[tuple[torch.Tensor, ...]] = []
    grads: list[torch.Tensor] = []
    original = layer.scaled_dot_product_attention

    def spy(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out = original(*args, **kwargs)
        inputs.append(tuple(a.detach().clone() for a in args[:3]))
        out.register_hook(lambda g: grads.append(g.detach().clone()))
        return out

    layer.scaled_dot_product_attention = spy
    layer.arm_probe()
    train_step(probed, seed=0)
    train_step(probed, seed=1)  # a second call while the first capture is held: ignored
    train_step(plain, seed=0)
    train_step(plain, seed=1)
    for p, q in zip(probed.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)

    q, k, v = inputs[0]
    expected = compare_with_full_precision(q, k, v, grads[0], is_causal=True)
    assert layer.take_probe() == expected


def test_compare_with_full_precision_matches_whole_tensor_metrics_under_gqa() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=gen)
    k, v = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)
    do = torch.randn(2, 4, 40, 16, generator=gen)
    probe = compare_with_full_precision(q, k, v, do, is_causal=True, scale=0.3)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sage_attention(*leaves, is_causal=True, scale=0.3)
    low = [out.detach(), *torch.autograd.grad(out, leaves, do)]
    # whole-tensor float64 SDPA: independent of the probe's per-(batch, kv head) oracle
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_leaves, is_causal=True, scale=0.3, enable_gqa=True)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_leaves, do.double())]
    for name, a, b in zip(("O", "dQ", "dK", "dV"), low, ref, strict=True):
        a, b = a.double().flatten(), b.flatten()
        assert probe[name]["cos"] == pytest.approx(F.cosine_similarity(a, b, dim=0).item(), abs=1e-9)
        assert probe[name]["rel_l2"] == pytest.approx(((a - b).norm() / b.norm()).item(), rel=1e-6)


def test_nonfinite_flags_the_layer_where_the_divergence_starts() -> None:
    model = swapped_nano()
    first, second = attention_layers(model).values()
    model(tokens())
    assert not first.take_nonfinite() and not second.take_nonfinite()

    # finite but huge queries and keys overflow the scores of layer 1 only: its output is the first non-finite one
    handle = model.transformer.h[1].attn.register_forward_pre_hook(lambda module, args: (args[0] * 1e30,))
    logits, _ = model(tokens())
    handle.remove()
    assert not torch.isfinite(logits).all()
    assert (first.take_nonfinite(), second.take_nonfinite()) == (False, True)
    assert not second.take_nonfinite()  # taking clears the flag

    # a NaN that enters before attention is not attention's doing: no layer is flagged
    handle = model.transformer.h[0].attn.register_forward_pre_hook(lambda module, args: (args[0] * math.nan,))
    model(tokens())
    handle.remove()
    assert (first.take_nonfinite(), second.take_nonfinite()) == (False, False)

    # clear_nonfinite drops a raised flag without reading it
    handle = model.transformer.h[1].attn.register_forward_pre_hook(lambda module, args: (args[0] * 1e30,))
    model(tokens())
    handle.remove()
    second.clear_nonfinite()
    assert not second.take_nonfinite()


def test_state_dict_round_trip_keeps_precision_and_counters_not_stats() -> None:
    model = swapped_nano(AttentionPrecision(ds="bf16", smooth_q=True))
    layer = attention_layers(model)["transformer.h.0.attn"]
    layer.collect_stats = True
    train_step(model)
    saved = layer.state_dict()
    assert saved == {
        "precision": {
            "mode": "sagebwd",
            "qk": "int8",
            "pv": "int8",
            "dv": "int8",
            "dp": "bf16",
            "ds": "bf16",
            "smooth_k": True,
            "smooth_q": True,
            "qat_backward": "matched",
        },
        "calls": 1,
        "fallback_calls": 0,
        "fallback_reasons": {},
    }
    fresh = AttentionLayerState("transformer.h.0.attn")
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved and fresh.precision == layer.precision and fresh.stats is None
    # A checkpoint from before the attn_qat mode (no qat_backward field) loads with the default.
    older = {**saved, "precision": {k: v for k, v in saved["precision"].items() if k != "qat_backward"}}
    fresh.load_state_dict(older)
    assert fresh.precision == layer.precision


def test_bad_values_are_refused_where_they_are_set() -> None:
    layer = AttentionLayerState("blocks.0.attn")
    with pytest.raises(TypeError, match=r"precision must be a sage_lightning.AttentionPrecision; received str"):
        layer.precision = "full"
    with pytest.raises(TypeError, match=r"collect_stats must be True or False; received 1"):
        layer.collect_stats = 1
    with pytest.raises(TypeError, match=r"name must be a non-empty module path"):
        AttentionLayerState("")
    with pytest.raises(TypeError, match=r"load_state_dict: state must be a dict"):
        layer.load_state_dict({"calls": 3})
    with pytest.raises(ValueError, match=r"fields \['bogus'\]"):
        layer.load_state_dict({"precision": {"bogus": 1}})
    with pytest.raises(ValueError, match=r"ds must be one of"):
        layer.load_state_dict({"precision": {"ds": "fp4"}})


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finiteness_check_flags_exactly_a_nonfinite_output_from_finite_inputs(device: str, dtype: torch.dtype) -> None:
    """A NaN, +inf or -inf anywhere in the output, with finite q, k and v, raises the flag; the same in an input
    does not; empty tensors are finite; strided views (a model's [B, N, H, D] memory) are read whole."""
    layer = AttentionLayerState("l")
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 5, 3, 4, generator=gen).to(device, dtype).transpose(1, 2) for _ in range(4)]
    for bad in (None, math.nan, math.inf, -math.inf):
        for where in range(4):
            for index in ((0, 0, 0, 0), (1, 2, 4, 3)):
                tensors = [t.clone(memory_format=torch.preserve_format) for t in base]
                if bad is not None:
                    tensors[where][index] = bad
                assert not tensors[where].is_contiguous()
                layer._record_finiteness(*tensors)
                assert layer.take_nonfinite() == (bad is not None and where == 3), (bad, where, index)
    empty = base[0][:, :, :0]
    layer._record_finiteness(empty, empty, empty, empty)
    assert not layer.take_nonfinite()
    out = base[3].clone()
    out[0, 0, 0, 0] = math.nan
    layer._record_finiteness(base[0], empty, empty, out)
    assert layer.take_nonfinite()
