"""The forward's quantization health (qk_rel_err): blind to the scale of healthy inputs, sharp on an outlier that
spoils its block's INT8 scale (issue 16, case 6), measured by the layer on the steps that measure dS, and acted on by
the controller in a real Trainer run."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision, PolicyConfig, attention_layers
from sage_lightning.forward_health import qk_quant_error, qk_rel_err


def inputs(scale: float = 1.0, outlier: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q, k = (scale * torch.randn(1, 2, 1024, 64, generator=generator) for _ in range(2))
    if outlier is not None:
        q[0, 0, 5, 3] = outlier
    return q.bfloat16(), k.bfloat16()


@pytest.mark.parametrize("scale", [1.0, 4.0, 10.0])
def test_healthy_inputs_read_the_same_whatever_their_scale(scale: float) -> None:
    q, k = inputs(scale)
    assert qk_rel_err(qk_quant_error(q, k, smooth_q=False, smooth_k=True).tolist()) == pytest.approx(0.0127, abs=2e-3)


@pytest.mark.parametrize(("outlier", "low", "high"), [(100.0, 0.05, 0.07), (300.0, 0.15, 0.19), (1000.0, 0.22, 0.28)])
def test_one_outlier_in_q_reads_well_above_the_threshold(outlier: float, low: float, high: float) -> None:
    # The inputs (1024 rows, one of 16 blocks of 128 ruined): 0.059, 0.17, 0.25 against 0.013 healthy, where
    # the probe's O cosine reads 0.995, 0.962, 0.919 (docs/controller.md).
    q, k = inputs(outlier=outlier)
    assert low < qk_rel_err(qk_quant_error(q, k, smooth_q=False, smooth_k=True).tolist()) < high


class QueryOutlier(Callback):
    """Set one query entry of the first attention layer to 300 (the rest of q is O(1))."""

    def on_train_start(self, trainer, pl_module) -> None:
        def hook(module, args, output):
            output = output.clone()
            output[0, 3, 0] = 300.0  # batch 0, token 3, the first channel of q
            return output

        pl_module.blocks[0].attn.qkv.register_forward_hook(hook)


def test_an_outlier_in_q_moves_its_layer_to_qk_bf16(tmp_path) -> None:
    torch.manual_seed(0)
    # The probe at step 0 would see the outlier too (O cosine 0.989): loosened here so qk_rel_err alone decides.
    lenient_probe = dict(probe_o_cos_min=0.5, probe_grad_cos_min=0.5, probe_catastrophic_cos=0.1)
    config = PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=1000, **lenient_probe)
    controller = AdaptivePrecision(config, verbose=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[controller, QueryOutlier()])
    model = TinyLM()
    trainer.fit(model, token_loader(3))

    (decision,) = controller.history
    assert (decision.step, decision.layer) == (1, "blocks.0.attn") and "qk_rel_err" in decision.reason
    assert attention_layers(model)["blocks.0.attn"].precision.qk == "bf16"
    assert attention_layers(model)["blocks.1.attn"].precision.qk == "int8"
