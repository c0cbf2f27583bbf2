"""The pretraining example clips gradients with the fused AdamW under bf16 mixed precision, which Lightning's own
clipping refuses for optimizers that unscale gradients themselves."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from examples.llama import LlamaConfig
from examples.pretrain import LlamaPretraining

REPO = Path(__file__).resolve().parent.parent

TINY = LlamaConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=16, vocab_size=256)


class FusedEverywhere(LlamaPretraining):
    """The example's optimizer, fused on the CPU too (the example fuses it on CUDA only)."""

    def configure_optimizers(self) -> dict:
        setup = super().configure_optimizers()
        groups = [{**group, "fused": True} for group in setup["optimizer"].param_groups]
        optimizer = torch.optim.AdamW(groups, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, setup["lr_scheduler"]["scheduler"].lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_gradients_are_clipped_with_the_fused_optimizer_under_bf16(tmp_path) -> None:
    torch.manual_seed(0)
    model = FusedEverywhere(TINY, attention="full", lr=1e-3, warmup_steps=1)
    norms: list[float] = []

    class ClippedNorm(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            norms.append(float(model.clipped_norm))

    original = model.configure_gradient_clipping

    def spy(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        original(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        model.clipped_norm = torch.nn.utils.get_total_norm(grads)

    model.configure_gradient_clipping = spy
    ids = torch.randint(0, 256, (8, 17))
    windows = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    loader = torch.utils.data.DataLoader(windows, batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", precision="bf16-mixed", max_steps=2, gradient_clip_val=1e-3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ClippedNorm()], default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(model, loader)
    assert trainer.optimizers[0]._step_supports_amp_scaling  # what Lightning's own clipping refuses
    assert len(norms) == 2 and all(n <= 1e-3 * (1 + 1e-3) for n in norms)
