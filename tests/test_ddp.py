"""Two DDP ranks on CPU (gloo) take the same decisions: the signals are reduced before the policy sees them.

Rank 0 alone gets a NaN loss at step 2 and each rank sees different data, so identical decisions on both
ranks can only come from the cross-rank reduction."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class RankReport(Callback):
    """Each rank writes what it did: decisions, the accumulation of every optimizer step, the precisions."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.windows: list[tuple[int, int, int]] = []
        self._open = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._open:
            self.windows.append((trainer.global_step, batch_idx, trainer.accumulate_grad_batches))
            self._open = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._open = False

    def on_train_end(self, trainer, pl_module) -> None:
        controller = next(cb for cb in trainer.callbacks if isinstance(cb, AdaptivePrecision))
        report = {
            "decisions": [str(d) for d in controller.history],
            "windows": self.windows,
            "precisions": {n: s.precision.short_name for n, s in attention_layers(pl_module).items()},
            "tokens_seen": controller.tokens_seen,
            "first_batch": trainer.train_dataloader.sampler.__class__.__name__,
            "params_finite": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def test_both_ranks_take_the_same_decisions(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM(precision=AttentionPrecision(ds="bf16"), nan_loss_at_step=2, nan_loss_rank=0)
    controller = AdaptivePrecision(
        PolicyConfig(calm_steps=3, ds_stats_every_n_steps=1, probe_every_n_steps=4, probe_grad_cos_min=0.999999),
        verbose=False,
    )
    trainer = L.Trainer(
        **trainer_kwargs(
            tmp_path,
            devices=2,
            strategy=DDPStrategy(start_method="spawn", process_group_backend="gloo"),
            max_steps=8,
            accumulate_grad_batches=4,
        ),
        callbacks=[controller, RankReport(str(tmp_path))],
    )
    trainer.fit(model, token_loader(64))

    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert rank0["params_finite"] and rank0["first_batch"] == "DistributedSampler"
    decisions = rank0["decisions"]
    # The NaN on rank 0 reached both: rollback, and (dS already bf16 everywhere) fewer tokens per step ...
    assert any(d.startswith("step 2: global rollback: step 2 -> last snapshot (loss is nan)") for d in decisions)
    assert any(d.startswith("step 2: global accumulate_grad_batches: 4 -> 2") for d in decisions)
    # ... which double back after 3 calm steps; the probe's layer decisions are shared as well.
    assert any(d.startswith("step 5: global accumulate_grad_batches: 2 -> 4") for d in decisions)
    assert any("precision" in d and "probe" in d for d in decisions)
    assert [w[2] for w in rank0["windows"]] == [4, 4, 4, 2, 2, 2, 2, 4]
    assert rank0["tokens_seen"] == 2 * (4 * 4 + 2 * 4) * 2 * 33  # both ranks' tokens, counted once


class NaNFromStep(TinyLM):
    """A NaN loss on every step from ``nan_from``, on rank 1 only."""

    def __init__(self, nan_from: int) -> None:
        super().__init__()
        self.nan_from = nan_from

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step >= self.nan_from and self.global_rank == 1:
            return loss * float("nan")
        return loss


def test_a_persistent_nan_on_one_rank_stops_both_with_the_last_good_weights(tmp_path) -> None:
    torch.manual_seed(0)
    controller = AdaptivePrecision(
        PolicyConfig(max_rollbacks=1, ds_stats_every_n_steps=1000, probe_every_n_steps=1000), verbose=False
    )
    trainer = L.Trainer(
        **trainer_kwargs(
            tmp_path, devices=2, strategy=DDPStrategy(start_method="spawn", process_group_backend="gloo"), max_steps=20
        ),
        callbacks=[controller],
    )
    with pytest.raises(Exception, match="AdaptivePrecision stopped training at step 3"):
        trainer.fit(NaNFromStep(nan_from=2), token_loader(64))
    saved = torch.load(tmp_path / "sage-last-good.ckpt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())
    (key,) = [k for k in saved["callbacks"] if k.startswith("AdaptivePrecision")]
    assert [d["lever"] for d in saved["callbacks"][key]["history"]][-1] == "stop"
