"""Hugging Face transformers models, built from a config (nothing downloaded), through the attention registry."""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from attention_models import cosine  # noqa: E402

from sage_lightning import (  # noqa: E402
    AttentionPrecision,
    SageAttentionMixin,
    attention_layers,
    convert_to_sage_attention,
)
from sage_lightning.hf import SAGE_ATTENTION_NAME  # noqa: E402
from sage_lightning.layer import AttentionFallbackWarning  # noqa: E402

LLAMA_LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def tokens(seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0))


def test_llama_runs_sage_through_the_registry_close_to_sdpa() -> None:
    reference = llama()
    model = convert_to_sage_attention(copy.deepcopy(reference))
    assert model.config._attn_implementation == SAGE_ATTENTION_NAME
    assert reference.config._attn_implementation == "sdpa"
    layers = attention_layers(model)
    assert list(layers) == LLAMA_LAYERS
    for name in LLAMA_LAYERS:  # served by the registry, so the forward is left alone
        assert "forward" not in model.get_submodule(name).__dict__

    ids = tokens()
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    out.loss.backward()
    ref.loss.backward()
    assert cosine(out.logits, ref.logits) > 0.999 and not torch.equal(out.logits, ref.logits)
    q_proj, ref_q_proj = model.model.layers[0].self_attn.q_proj, reference.model.layers[0].self_attn.q_proj
    assert cosine(q_proj.weight.grad, ref_q_proj.weight.grad) > 0.99
    assert [(layer.calls, layer.fallback_calls) for layer in layers.values()] == [(1, 0), (1, 0)]


def test_llama_full_precision_is_bit_identical_to_sdpa() -> None:
    reference = llama()
    model = convert_to_sage_attention(copy.deepcopy(reference), precision=AttentionPrecision(mode="full"))
    ids = tokens()
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_llama_padding_mask_goes_to_sdpa_counted_and_warned_once() -> None:
    reference = llama()
    model = convert_to_sage_attention(copy.deepcopy(reference))
    ids = tokens(seq=16)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: transformers builds a boolean mask, which SageBwd does not take
    with pytest.warns(AttentionFallbackWarning, match="attn_mask") as record:
        out = model(ids, attention_mask=mask).logits
        model(ids, attention_mask=mask)
    assert sum(w.category is AttentionFallbackWarning for w in record) == 2  # one per layer
    assert torch.equal(out, reference(ids, attention_mask=mask).logits)  # every call was SDPA's
    assert [(layer.calls, layer.fallback_calls) for layer in attention_layers(model).values()] == [(2, 2), (2, 2)]


def test_llama_generation_with_a_cache_is_served() -> None:
    model = convert_to_sage_attention(llama())
    ids = tokens(seq=8)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 11)
    # one prefill plus two single-token decode steps per layer, all on the kernel
    assert [(layer.calls, layer.fallback_calls) for layer in attention_layers(model).values()] == [(3, 0), (3, 0)]


def test_a_filter_that_picks_decoder_layers_wraps_them_instead() -> None:
    reference = llama()
    model = convert_to_sage_attention(
        copy.deepcopy(reference), filter_fn=lambda module, fqn: fqn in ("model.layers.0", "model.layers.1")
    )
    assert "forward" in model.model.layers[0].__dict__  # not an attention module the registry calls
    ids = tokens()
    assert cosine(model(ids).logits, reference(ids).logits) > 0.999
    assert [layer.calls for layer in attention_layers(model).values()] == [1, 1]


def test_gpt2_is_close_to_sdpa() -> None:
    torch.manual_seed(0)
    no_dropout = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    config = transformers.GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
        **no_dropout,
    )
    reference = transformers.GPT2LMHeadModel(config)
    model = convert_to_sage_attention(copy.deepcopy(reference))
    assert list(attention_layers(model)) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    ids = tokens()
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    out.loss.backward()
    ref.loss.backward()
    assert cosine(out.logits, ref.logits) > 0.999 and not torch.equal(out.logits, ref.logits)
    c_attn, ref_c_attn = model.transformer.h[0].attn.c_attn, reference.transformer.h[0].attn.c_attn
    assert cosine(c_attn.weight.grad, ref_c_attn.weight.grad) > 0.99
    assert all((layer.calls, layer.fallback_calls) == (1, 0) for layer in attention_layers(model).values())


def test_mixin_swaps_a_transformers_model_inside_a_lightning_module() -> None:
    class Module(SageAttentionMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

    module = Module()
    module.configure_model()
    assert list(attention_layers(module)) == [f"model.{name}" for name in LLAMA_LAYERS]
    assert module.model.config._attn_implementation == SAGE_ATTENTION_NAME
    module.model(tokens())
    assert all(layer.calls == 1 for layer in attention_layers(module).values())


def test_llama_continuation_over_a_cache_goes_to_sdpa_and_its_decode_step_is_served() -> None:
    reference = llama()
    model = convert_to_sage_attention(copy.deepcopy(reference))
    ids = tokens(seq=12)
    prompt, more, last = ids[:, :8], ids[:, 8:11], ids[:, 11:]
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values  # served: no mask, is_causal
        ref_cache = reference(prompt, use_cache=True).past_key_values
        # Three tokens over eight cached ones: transformers passes a causal mask aligned to the last keys, which
        # the kernel's top-left causal mask is not.
        with pytest.warns(AttentionFallbackWarning, match="attn_mask"):
            out = model(more, past_key_values=cache, use_cache=True).logits
        ref = reference(more, past_key_values=ref_cache, use_cache=True).logits
        model(last, past_key_values=cache)  # one token over every key: served
    assert cosine(out, ref) > 0.999
    assert [(layer.calls, layer.fallback_calls) for layer in attention_layers(model).values()] == [(3, 1), (3, 1)]
