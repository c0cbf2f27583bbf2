"""SageAttentionMixin in a real Lightning Trainer (CPU, a few steps)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from attention_models import CausalSelfAttention, NanoGPT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sage_lightning import AttentionPrecision, SageAttentionMixin, attention_layers

LAYERS = ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]


class NanoModule(SageAttentionMixin, L.LightningModule):
    def __init__(self, build_in_init: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = NanoGPT() if build_in_init else None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = NanoGPT()
        super().configure_model()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx = batch[0]
        return self.model(idx[:, :-1], idx[:, 1:])[1]

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        idx = batch[0]
        self.model(idx[:, :-1], idx[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> DataLoader:
    idx = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(idx), batch_size=2)


def trainer(max_steps: int = 3) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_model_built_in_init_is_swapped_trained_and_idempotent_across_stages() -> None:
    module = NanoModule()
    parameters = {name: id(p) for name, p in module.named_parameters()}
    weight = module.model.transformer.h[0].attn.c_attn.weight
    snapshot = weight.detach().clone()
    fit = trainer()
    fit.fit(module, data(), data())
    layers = attention_layers(module)
    assert list(layers) == LAYERS
    assert {name: id(p) for name, p in module.named_parameters()} == parameters
    assert not torch.equal(weight.detach(), snapshot)  # the swapped layer's Parameters trained
    assert [layer.calls for layer in layers.values()] == [3, 3]  # one per training step

    fit.validate(module, data())  # configure_model runs again: nothing changes but the call count
    again = attention_layers(module)
    assert all(again[name] is layers[name] for name in LAYERS)
    assert [layer.calls for layer in again.values()] == [4, 4]  # plus one validation batch


class FirstBlockFullModule(NanoModule):
    sage_precision = AttentionPrecision(ds="bf16")

    def sage_attention_filter(self, module: nn.Module, fqn: str) -> bool:
        return super().sage_attention_filter(module, fqn) and fqn != "model.transformer.h.0.attn"


def test_model_built_in_configure_model_with_class_level_precision_and_filter() -> None:
    module = FirstBlockFullModule(build_in_init=False)
    trainer(max_steps=2).fit(module, data(), data())  # 4 batches an epoch: no validation within 2 steps
    layers = attention_layers(module)
    assert list(layers) == ["model.transformer.h.1.attn"]
    assert layers["model.transformer.h.1.attn"].precision == AttentionPrecision(ds="bf16")
    assert layers["model.transformer.h.1.attn"].calls == 2
    assert isinstance(module.model.transformer.h[1].attn, CausalSelfAttention)


def test_precision_set_on_the_instance_is_used() -> None:
    module = NanoModule()
    module.sage_precision = AttentionPrecision(mode="full")
    module.configure_model()
    assert all(layer.precision.mode == "full" for layer in attention_layers(module).values())


def test_bad_precision_names_the_attribute() -> None:
    module = NanoModule()
    module.sage_precision = "int8"
    with pytest.raises(TypeError, match=r"SageAttentionMixin.configure_model: sage_precision .*received str"):
        module.configure_model()


def test_no_attention_found_says_what_to_do() -> None:
    class Empty(SageAttentionMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"sage_attention_filter found no attention layer in Empty.*super\(\)"):
        Empty().configure_model()


def test_mixin_after_lightning_module_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match=r"list it before LightningModule.*received bases \(LightningModule, "):

        class Wrong(L.LightningModule, SageAttentionMixin):
            pass
