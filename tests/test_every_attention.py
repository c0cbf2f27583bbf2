"""Attention as users have it (issue 17): nn.MultiheadAttention, hand-written attention, boolean masks,
torch.compile with fallbacks, bad inputs, and the single interception point."""

from __future__ import annotations

import copy
import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from attention_models import LitCausalSelfAttention, LitConfig, LitGPT, NanoConfig, NanoGPT, cosine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sage_lightning import AttentionPrecision, SageAttentionMixin, attention_layers, convert_to_sage_attention
from sage_lightning import masks as masks_module
from sage_lightning.layer import AttentionFallbackWarning, SilentAttentionWarning


def tokens(batch: int = 2, seq: int = 16, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def counts(model: nn.Module) -> list[tuple[int, int]]:
    return [(layer.calls, layer.fallback_calls) for layer in attention_layers(model).values()]


# ------------------------------------------------------------------------- 1. nn.MultiheadAttention, served


def encoder(seed: int = 0) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def encoder_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    out = model(x, mask=causal, is_causal=True)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_transformer_encoder_layers_are_served_close_to_pytorch() -> None:
    reference = encoder()
    model = convert_to_sage_attention(copy.deepcopy(reference))
    assert list(attention_layers(model)) == ["layers.0.self_attn", "layers.1.self_attn"]
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    out, grads = encoder_loss(model, x)
    ref, ref_grads = encoder_loss(reference, x)
    assert counts(model) == [(1, 0), (1, 0)]  # both ran SageBwd: none listed and skipped
    assert cosine(out, ref) > 0.999 and not torch.equal(out, ref)
    assert all(cosine(g, r) > 0.99 for g, r in zip(grads, ref_grads, strict=True))


def test_transformer_encoder_layers_in_full_precision_are_bit_identical() -> None:
    reference = encoder()
    model = convert_to_sage_attention(copy.deepcopy(reference), precision=AttentionPrecision(mode="full"))
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    out, grads = encoder_loss(model, x)
    ref, ref_grads = encoder_loss(reference, x)
    assert torch.equal(out, ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    assert counts(model) == [(1, 0), (1, 0)]


def test_encoder_inference_is_served_and_a_call_that_bypasses_self_attn_is_counted() -> None:
    # eval() without gradients: PyTorch's fused encoder fast path would never call self_attn. A converted layer
    # carries hooks (PyTorch then takes the ordinary path, served), which also count any call that bypasses it.
    model = convert_to_sage_attention(encoder()).eval()
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        model(x)
    assert counts(model) == [(1, 0), (1, 0)]
    model.layers[0].forward = lambda src, *args, **kwargs: src  # what the fused fast path amounts to here
    with torch.no_grad(), pytest.warns(AttentionFallbackWarning, match="inference fast path"):
        model(x)
    assert counts(model) == [(2, 1), (2, 0)]


def test_multihead_attention_calls_it_cannot_serve_run_pytorch_counted() -> None:
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(32, 4, batch_first=True)
    model = convert_to_sage_attention(copy.deepcopy(reference))
    x = torch.randn(2, 8, 32)
    with pytest.warns(AttentionFallbackWarning, match="need_weights=True"):
        out, weights = model(x, x, x)  # the module's default asks for the attention weights
    ref_out, ref_weights = reference(x, x, x)
    assert torch.equal(out, ref_out) and torch.equal(weights, ref_weights)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[0, -2:] = True
    with pytest.warns(AttentionFallbackWarning, match="key_padding_mask"):
        model(x, x, x, key_padding_mask=padding, need_weights=False)
    served, _ = model(x, x, x, need_weights=False)
    assert cosine(served, ref_out) > 0.999
    assert counts(model) == [(3, 2)]


def test_a_filter_that_selects_a_block_holding_multihead_attention_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"selects 'layers.0', which holds the nn.MultiheadAttention 'layers.0.self_attn'"
    ):
        convert_to_sage_attention(encoder(), filter_fn=lambda module, fqn: fqn == "layers.0")


def test_a_direct_multi_head_attention_forward_call_is_counted_not_skipped() -> None:
    class FunctionalAttention(nn.Module):  # calls the functional form itself: its SDPA call cannot be caught
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = nn.Linear(32, 96)
            self.out_proj = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w, b, o = self.in_proj.weight, self.in_proj.bias, self.out_proj
            return F.multi_head_attention_forward(
                x, x, x, 32, 4, w, b, None, None, False, 0.0, o.weight, o.bias, need_weights=False
            )[0]  # fmt: skip

    model = convert_to_sage_attention(FunctionalAttention(), filter_fn=lambda module, fqn: fqn == "")
    with pytest.warns(AttentionFallbackWarning, match="multi_head_attention_forward"):
        model(torch.randn(8, 2, 32))
    assert counts(model) == [(1, 1)]


# ------------------------------------------------------------------ 2. a swapped layer that never calls SDPA


class SoftcappedAttention(LitCausalSelfAttention):
    """litgpt's attention with logit softcapping: computed by hand, no SDPA call."""

    def scaled_dot_product_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = 30.0 * torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) / 30.0)
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def softcapped_litgpt() -> LitGPT:
    torch.manual_seed(0)
    model = LitGPT(LitConfig())
    for block in model.transformer.h:
        block.attn = SoftcappedAttention(model.config)
    return model


def test_a_layer_computing_attention_by_hand_is_warned_once_after_its_first_training_forward() -> None:
    model = convert_to_sage_attention(softcapped_litgpt())
    with pytest.warns(SilentAttentionWarning) as record:
        model(tokens()).square().mean().backward()
        model(tokens()).square().mean().backward()
    messages = [str(w.message) for w in record if w.category is SilentAttentionWarning]
    assert len(messages) == 2  # one per layer, not per step
    assert "'transformer.h.0.attn'" in messages[0] and "made no attention call" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SilentAttentionWarning)
        convert_to_sage_attention(LitGPT(LitConfig()))(tokens()).sum().backward()  # layers that call: silent


class UnusedAttentionModule(SageAttentionMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = NanoGPT(NanoConfig())
        self.spare = LitCausalSelfAttention(LitConfig())  # swapped, never called

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx = batch[0]
        return self.model(idx[:, :-1], idx[:, 1:])[1]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_mixin_warns_after_the_first_training_batch_for_a_layer_never_called() -> None:
    module = UnusedAttentionModule()
    data = DataLoader(TensorDataset(tokens(batch=4, seq=17)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(SilentAttentionWarning, match="'spare'.*first training batch") as record:
        trainer.fit(module, data)
    assert sum(w.category is SilentAttentionWarning for w in record) == 1
    assert attention_layers(module)["model.transformer.h.0.attn"].calls == 2


# ------------------------------------------------------------------------------- 3. masks the kernel computes


class KVCacheAttention(nn.Module):
    """litgpt's KV-cache path: a boolean mask sliced from a causal mask buffer, every call."""

    def __init__(self, max_seq: int = 32) -> None:
        super().__init__()
        self.register_buffer("mask_cache", torch.ones(max_seq, max_seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.mask_cache[input_pos, : k.shape[2]]  # a fresh tensor per call (advanced indexing)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def test_causal_and_all_true_boolean_masks_are_served_by_the_kernel() -> None:
    attention = convert_to_sage_attention(KVCacheAttention(), filter_fn=lambda module, fqn: fqn == "")
    q, k, v = (torch.randn(2, 4, 12, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionFallbackWarning)
        prefill = attention(q, k, v, torch.arange(12))  # the top-left causal mask
        decode = attention(q[:, :, -1:], k, v, torch.tensor([11]))  # one query over every key: all true
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert cosine(prefill, ref) > 0.999 and not torch.equal(prefill, ref)
    assert cosine(decode, ref[:, :, -1:]) > 0.999
    assert counts(attention) == [(2, 0)]


@pytest.mark.parametrize(
    ("name", "mask"),
    [
        ("sliding window", torch.ones(12, 12, dtype=torch.bool).tril().triu(-3)),
        ("bottom-right causal", torch.ones(4, 12, dtype=torch.bool).tril(8)),
        ("padding", torch.ones(2, 1, 12, 12, dtype=torch.bool).tril().index_fill_(0, torch.tensor([0]), False)),
        ("float causal", torch.zeros(12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)),
    ],
)  # fmt: skip
def test_other_masks_fall_back_to_sdpa_unchanged(name: str, mask: torch.Tensor) -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    seq_q = mask.shape[-2]
    q = torch.randn(2, 4, seq_q, 16)
    k, v = torch.randn(2, 4, 12, 16), torch.randn(2, 4, 12, 16)
    with pytest.warns(AttentionFallbackWarning, match="attn_mask"):
        out = attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), name
    assert counts(attention) == [(1, 1)]


def test_a_kept_mask_is_read_once_and_read_again_after_an_in_place_write(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    classify = masks_module._classify
    monkeypatch.setattr(masks_module, "_classify", lambda mask, shape: reads.append(1) or classify(mask, shape))
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    buffer = torch.ones(16, 16, dtype=torch.bool).tril()
    q = torch.randn(1, 2, 16, 8)
    for _ in range(3):
        attention(q, q, q, attn_mask=buffer[:16, :16])  # a new view of the same memory each call
    assert len(reads) == 1 and counts(attention) == [(3, 0)]
    buffer[5, 0] = False  # no longer causal: the version counter moved, so the mask is read again
    with pytest.warns(AttentionFallbackWarning, match="attn_mask"):
        out = attention(q, q, q, attn_mask=buffer[:16, :16])
    assert len(reads) == 2 and counts(attention) == [(4, 1)]
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q, attn_mask=buffer))


# ------------------------------------------------------------------------ 4. torch.compile with fallbacks


def compiled_run(model: nn.Module, fullgraph: bool, steps: int = 3) -> int:
    """Run a compiled training forward and backward ``steps`` times; returns the number of graphs compiled."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    for _ in range(steps):
        compiled(tokens())[0].square().mean().backward()
    torch._dynamo.reset()
    return len(graphs)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_served_calls_are_counted_once_without_recompiling(fullgraph: bool) -> None:
    model = convert_to_sage_attention(NanoGPT(NanoConfig()))
    assert compiled_run(model, fullgraph) == 1
    assert counts(model) == [(3, 0), (3, 0)]


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_fallbacks_compile_and_are_counted_and_warned_once(fullgraph: bool) -> None:
    model = convert_to_sage_attention(NanoGPT(NanoConfig(dropout=0.1)))  # dropout in training: SDPA's call
    with pytest.warns(AttentionFallbackWarning, match="dropout_p") as record:
        graphs = compiled_run(model, fullgraph)
    assert graphs == 1
    assert sum(w.category is AttentionFallbackWarning for w in record) == 2  # once per layer
    assert counts(model) == [(3, 3), (3, 3)]


def test_a_compiled_layer_that_never_calls_sdpa_is_warned() -> None:
    model = convert_to_sage_attention(softcapped_litgpt())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.warns(SilentAttentionWarning, match="made no attention call"):
        compiled(tokens()).sum().backward()
    torch._dynamo.reset()


# -------------------------------------------------------------------------------------------- 5. bad inputs


class RawAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def test_a_non_finite_scale_goes_to_sdpa_named() -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    q = torch.randn(1, 2, 8, 16)
    with pytest.warns(AttentionFallbackWarning, match=r"scale=inf \(not finite"):
        out = attention(q, q, q, scale=math.inf)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, scale=math.inf), equal_nan=True)
    assert attention.sage_attention_state.fallback_calls == 1


def test_a_sparse_query_goes_to_sdpa_and_gets_its_error() -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError) as ours, pytest.warns(AttentionFallbackWarning, match="sparse_coo"):
        attention(q.to_sparse(), q, q)
    with pytest.raises(RuntimeError) as sdpa:
        F.scaled_dot_product_attention(q.to_sparse(), q, q)
    assert str(ours.value) == str(sdpa.value)


def test_a_precision_with_a_numpy_field_is_refused_where_it_is_set() -> None:
    np = pytest.importorskip("numpy")
    # AttentionPrecision refuses it when it is made (an array passes ``in`` and would fail later, at hash) ...
    with pytest.raises(TypeError, match=r"AttentionPrecision: ds must be a str; received array.*ndarray"):
        AttentionPrecision(ds=np.array("bf16"))
    # ... and the swap refuses anything but an AttentionPrecision, naming where it was given.
    with pytest.raises(TypeError, match=r"convert_to_sage_attention: precision must be a sage_lightning"):
        convert_to_sage_attention(NanoGPT(), precision={"ds": "bf16"})
    layer = next(iter(attention_layers(convert_to_sage_attention(NanoGPT())).values()))
    with pytest.raises(TypeError, match=r"\('transformer.h.0.attn'\): precision must be a sage_lightning"):
        layer.precision = "int8"


# ------------------------------------------------------------------------------- 6. one interception point


def test_each_served_call_is_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import sage_lightning.kernels.interface as interface

    checks = []
    check = interface.check_inputs
    monkeypatch.setattr(interface, "check_inputs", lambda *a, **kw: checks.append(1) or check(*a, **kw))
    model = convert_to_sage_attention(NanoGPT(NanoConfig()))
    model(tokens())
    assert counts(model) == [(1, 0), (1, 0)] and len(checks) == 2


def test_hf_and_swap_share_one_interceptor_from_beside_the_layer_state() -> None:
    from pathlib import Path

    import sage_lightning.interception as interception
    import sage_lightning.swap as swap

    assert swap.SDPAInterceptor is interception.SDPAInterceptor
    hf_source = (Path(swap.__file__).parent / "hf.py").read_text()
    assert "from sage_lightning.interception import SDPAInterceptor" in hf_source
    assert "sage_lightning.swap" not in hf_source  # hf and swap no longer import each other


def test_a_full_precision_layer_keeps_its_calls_for_capture() -> None:
    reference = NanoGPT(NanoConfig())
    model = convert_to_sage_attention(copy.deepcopy(reference), precision=AttentionPrecision(mode="full"))
    for layer in attention_layers(model).values():
        layer.keep_calls = True
    logits, _ = model(tokens())
    assert torch.equal(logits, reference(tokens())[0])
    kept = [layer.kept_calls for layer in attention_layers(model).values()]
    assert [len(calls) for calls in kept] == [1, 1]
    call = kept[0][0]
    assert call.q.shape == (2, 4, 16, 16) and call.is_causal and call.out.requires_grad and not call.q.requires_grad


def test_a_compiled_call_with_a_mask_falls_back_with_its_reason() -> None:
    attention = convert_to_sage_attention(RawAttention(), filter_fn=lambda module, fqn: fqn == "")
    q = torch.randn(1, 2, 8, 16)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="eager", fullgraph=True)
    with pytest.warns(AttentionFallbackWarning, match="under torch.compile"):
        out = compiled(q, q, q, attn_mask=causal)
        compiled(q, q, q, attn_mask=causal)
    torch._dynamo.reset()
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q, attn_mask=causal))
    assert counts(attention) == [(2, 2)]


def test_counts_stay_exact_through_aot_autograd() -> None:
    """The ledger op survives AOTAutograd's functionalization and dead-code elimination (as Inductor's input)."""
    served, dropped = (
        convert_to_sage_attention(NanoGPT(NanoConfig())),
        convert_to_sage_attention(NanoGPT(NanoConfig(dropout=0.1))),
    )
    torch._dynamo.reset()
    with pytest.warns(AttentionFallbackWarning, match="dropout_p"):
        for model in (served, dropped):
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
            for _ in range(2):
                compiled(tokens())[0].square().mean().backward()
    torch._dynamo.reset()
    assert counts(served) == [(2, 0), (2, 0)] and counts(dropped) == [(2, 2), (2, 2)]
