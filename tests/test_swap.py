"""convert_to_sage_attention on models nobody wrote for us: same Parameters, SageBwd where it can, SDPA where not."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from attention_models import CausalSelfAttention, LitConfig, LitGPT, NanoConfig, NanoGPT, cosine
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from sage_lightning import AttentionPrecision, attention_layers, convert_to_sage_attention
from sage_lightning.layer import AttentionFallbackWarning
from sage_lightning.swap import is_attention_module

NANO_LAYERS = ["transformer.h.0.attn", "transformer.h.1.attn"]


def tokens(batch: int = 2, seq: int = 32, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def nano(seed: int = 0, **config: object) -> NanoGPT:
    torch.manual_seed(seed)
    return NanoGPT(NanoConfig(**config))


def loss_and_grads(model: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_default_filter_picks_the_innermost_attention_modules_by_path() -> None:
    model = convert_to_sage_attention(nano())
    layers = attention_layers(model)
    assert list(layers) == NANO_LAYERS
    for name, layer in layers.items():
        assert model.get_submodule(name).sage_attention_state is layer
        assert layer.precision == AttentionPrecision()

    class AttentionBlock(nn.Module):  # an attention-named container: its child, not itself, makes the call
        def __init__(self) -> None:
            super().__init__()
            self.inner = CausalSelfAttention(NanoConfig())

    block = AttentionBlock()
    assert not is_attention_module(block, "") and is_attention_module(block.inner, "inner")


def test_swapped_nanogpt_is_close_to_the_original_and_not_identical() -> None:
    reference, model = nano(), convert_to_sage_attention(nano())
    idx = tokens()
    ref_logits, ref_grads = loss_and_grads(reference, idx)
    logits, grads = loss_and_grads(model, idx)
    assert cosine(logits, ref_logits) > 0.999
    assert all(cosine(g, r) > 0.99 for g, r in zip(grads, ref_grads, strict=True))
    assert not torch.equal(logits, ref_logits)  # SageBwd really ran
    assert [layer.calls for layer in attention_layers(model).values()] == [1, 1]
    assert all(layer.fallback_calls == 0 for layer in attention_layers(model).values())


def test_full_precision_is_bit_identical_to_the_original() -> None:
    reference = nano()
    model = convert_to_sage_attention(nano(), precision=AttentionPrecision(mode="full"))
    idx = tokens()
    ref_logits, ref_grads = loss_and_grads(reference, idx)
    logits, grads = loss_and_grads(model, idx)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_precision_assigned_on_the_state_is_used_by_the_next_call() -> None:
    reference, model = nano(), convert_to_sage_attention(nano())
    idx = tokens()
    assert not torch.equal(model(idx)[0], reference(idx)[0])
    for layer in attention_layers(model).values():
        layer.precision = AttentionPrecision(mode="full")
    assert torch.equal(model(idx)[0], reference(idx)[0])


def test_parameters_are_the_same_objects_and_an_earlier_optimizer_still_trains_them() -> None:
    model = nano()
    before = {name: id(p) for name, p in model.named_parameters()}
    state_keys = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_sage_attention(model)
    assert {name: id(p) for name, p in model.named_parameters()} == before
    assert list(model.state_dict()) == state_keys
    assert type(model.transformer.h[0].attn) is CausalSelfAttention

    weight = model.transformer.h[0].attn.c_attn.weight
    snapshot = weight.detach().clone()
    _, loss = model(tokens()[:, :-1], tokens()[:, 1:])
    loss.backward()
    optimizer.step()
    assert weight.grad is not None and not torch.equal(weight.detach(), snapshot)
    assert attention_layers(model)["transformer.h.0.attn"].calls == 1


def test_converting_twice_changes_nothing() -> None:
    model = convert_to_sage_attention(nano(), precision=AttentionPrecision(ds="bf16"))
    layers = attention_layers(model)
    forwards = [model.get_submodule(name).forward for name in layers]
    convert_to_sage_attention(model, precision=AttentionPrecision(mode="full"))
    convert_to_sage_attention(model, filter_fn=lambda module, fqn: isinstance(module, CausalSelfAttention))
    again = attention_layers(model)
    assert list(again) == list(layers) and all(again[n] is layers[n] for n in layers)
    assert [model.get_submodule(name).forward for name in layers] == forwards
    assert all(layer.precision == AttentionPrecision(ds="bf16") for layer in again.values())
    model(tokens())
    assert [layer.calls for layer in again.values()] == [1, 1]  # one wrapper, not two


def test_filter_fn_chooses_the_layers() -> None:
    model = convert_to_sage_attention(nano(), filter_fn=lambda module, fqn: fqn == "transformer.h.1.attn")
    assert list(attention_layers(model)) == ["transformer.h.1.attn"]
    model(tokens())
    assert not hasattr(model.transformer.h[0].attn, "sage_attention_state")


def test_root_module_is_named_by_its_class() -> None:
    attention = convert_to_sage_attention(CausalSelfAttention(NanoConfig()))
    assert list(attention_layers(attention)) == ["CausalSelfAttention"]


def test_litgpt_gqa_with_an_imported_binding_is_served() -> None:
    torch.manual_seed(0)
    reference = LitGPT(LitConfig())
    model = convert_to_sage_attention(copy.deepcopy(reference))
    assert list(attention_layers(model)) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    idx = tokens()
    out, ref = model(idx), reference(idx)
    out.square().mean().backward()
    ref.square().mean().backward()
    assert cosine(out, ref) > 0.999 and not torch.equal(out, ref)
    weight, ref_weight = model.transformer.h[0].attn.qkv.weight, reference.transformer.h[0].attn.qkv.weight
    assert cosine(weight.grad, ref_weight.grad) > 0.99
    assert all(layer.calls == 1 and layer.fallback_calls == 0 for layer in attention_layers(model).values())


def test_a_sliding_window_mask_goes_to_sdpa_counted_and_warned_once_per_layer() -> None:
    torch.manual_seed(0)
    reference = LitGPT(LitConfig())
    model = convert_to_sage_attention(copy.deepcopy(reference))
    idx = tokens(seq=16)
    mask = torch.ones(16, 16, dtype=torch.bool).tril().triu(-4)  # each query sees its last 5 keys
    with pytest.warns(AttentionFallbackWarning) as record:
        first = model(idx, mask)
        model(idx, mask)
    messages = [str(w.message) for w in record if w.category is AttentionFallbackWarning]
    assert len(messages) == 2  # one per layer, not one per call
    assert "'transformer.h.0.attn'" in messages[0] and "attn_mask" in messages[0]
    assert torch.equal(first, reference(idx, mask))  # exactly SDPA's result
    for layer in attention_layers(model).values():
        assert (layer.calls, layer.fallback_calls) == (2, 2)
        assert list(layer.fallback_reasons.values()) == [2]


def test_dropout_in_training_goes_to_sdpa_and_eval_is_served() -> None:
    model = convert_to_sage_attention(nano(dropout=0.1))
    with pytest.warns(AttentionFallbackWarning, match="dropout_p"):
        model.train()(tokens())
    model.eval()(tokens())
    for layer in attention_layers(model).values():
        assert (layer.calls, layer.fallback_calls) == (2, 1)


class RawAttention(nn.Module):
    """Calls SDPA on whatever it is given, to exercise what the kernel refuses."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "dtype", "reason"),
    [
        ((1, 1, 4, 1100), (1, 1, 4, 1100), torch.float32, "head_dim=1100"),
        ((1, 2, 8, 16), (1, 2, 8, 16), torch.float64, "dtype torch.float64"),
        ((2, 8, 16), (2, 8, 16), torch.float32, "must be 4-D"),
    ],
)
def test_what_the_kernel_refuses_goes_to_sdpa_unchanged(
    q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype: torch.dtype, reason: str
) -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    q, k, v = torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)
    with pytest.warns(AttentionFallbackWarning, match=reason):
        out = attention(q, k, v, is_causal=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert attention.sage_attention_state.fallback_calls == 1


def test_different_head_counts_without_enable_gqa_behave_as_sdpa() -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError) as ours, pytest.warns(AttentionFallbackWarning, match="enable_gqa"):
        attention(q, k, k)
    with pytest.raises(RuntimeError) as sdpa:
        F.scaled_dot_product_attention(q, k, k)
    assert str(ours.value) == str(sdpa.value)
    out = attention(q, k, k, enable_gqa=True)  # the grouped call is served
    assert attention.sage_attention_state.fallback_calls == 1 and out.shape == q.shape


def test_the_interception_ends_with_the_forward_even_when_it_raises() -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(RuntimeError), pytest.warns(AttentionFallbackWarning):
        attention(q, k, k)  # SDPA raises inside the forward
    assert _get_current_function_mode_stack() == []
    F.scaled_dot_product_attention(q, q, q)
    assert attention.sage_attention_state.calls == 1  # the call outside the module was not caught


def test_a_converted_model_deep_copies_and_pickles_into_independent_layers() -> None:
    model = convert_to_sage_attention(nano())
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        clone(tokens())
        assert [layer.calls for layer in attention_layers(clone).values()] == [1, 1]
        assert all(
            clone_layer is not layer
            for clone_layer, layer in zip(
                attention_layers(clone).values(), attention_layers(model).values(), strict=True
            )
        )
    assert [layer.calls for layer in attention_layers(model).values()] == [0, 0]


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match=r"convert_to_sage_attention: precision .*received str"):
        convert_to_sage_attention(nano(), precision="int8")
    with pytest.raises(TypeError, match=r"convert_to_sage_attention: filter_fn must be a callable.*received str"):
        convert_to_sage_attention(nano(), filter_fn="attn")
    with pytest.raises(TypeError, match=r"filter_fn must return True or False; received None"):
        convert_to_sage_attention(nano(), filter_fn=lambda module, fqn: None)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module; received dict"):
        convert_to_sage_attention({})
    with pytest.raises(ValueError, match=r"found no attention layer in Sequential"):
        convert_to_sage_attention(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"selects 'transformer.h.0.attn' inside 'transformer.h.0'"):
        convert_to_sage_attention(
            nano(), filter_fn=lambda module, fqn: fqn in ("transformer.h.0", "transformer.h.0.attn")
        )


def test_no_warning_when_every_call_is_served() -> None:
    model = convert_to_sage_attention(nano())
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionFallbackWarning)
        model(tokens())


def test_torch_compile_traces_the_swap_and_sees_precision_changes() -> None:
    torch._dynamo.reset()
    reference, model = nano(), convert_to_sage_attention(nano())
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # no graph break in the swapped attention
    idx = tokens()
    assert torch.equal(compiled(idx)[0], eager(idx)[0])
    for layer in attention_layers(model).values():
        layer.precision = AttentionPrecision(mode="full")  # a guarded attribute: recompiles, then takes effect
    assert torch.equal(compiled(idx)[0], reference(idx)[0])
    assert [layer.calls for layer in attention_layers(model).values()] == [2, 2]
    torch._dynamo.reset()


def test_a_head_dim_the_triton_kernels_do_not_take_is_warned_once_per_layer() -> None:
    """head_dim 160 (> MAX_TRITON_HEAD_DIM, 128) is served by the PyTorch reference: a warning says so, where and why,
    once per layer however many calls; head_dim 64 gets none."""
    from sage_lightning.layer import ReferenceAttentionWarning

    model = convert_to_sage_attention(nano(n_embd=320, n_head=2, dropout=0.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(tokens(seq=8)[:, :-1])
        model(tokens(seq=8)[:, :-1])
    messages = [str(w.message) for w in caught if issubclass(w.category, ReferenceAttentionWarning)]
    assert len(messages) == len(NANO_LAYERS)  # one per layer, not per call
    assert "'transformer.h.0.attn': head_dim 160" in messages[0] and "up to 128" in messages[0]
    assert "PyTorch reference" in messages[0] and "filter_fn" in messages[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_sage_attention(nano(n_embd=128, n_head=2, dropout=0.0))(tokens(seq=8)[:, :-1])
    assert not [w for w in caught if issubclass(w.category, ReferenceAttentionWarning)]
