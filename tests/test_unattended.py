"""Issue 16, "a controller you can leave unattended", in real Trainer runs on CPU: a persistent fault ends the run
with a clear error and the last good weights in a checkpoint; a one-off spike costs one step, not a rollback; a
resumed run rolls back where the uninterrupted one does; checkpoint mismatches are clear errors; the layers'
precisions survive a resume without the callback."""

from __future__ import annotations

import glob

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers
from sage_lightning.callback import TrainingDiverged
from sage_lightning.layer_checkpoint import CHECKPOINT_KEY

QUIET = dict(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)


class LossFault(TinyLM):
    """TinyLM whose loss is NaN on every step from ``nan_from``, or multiplied by 100 at ``spike_at``."""

    def __init__(self, nan_from: int | None = None, spike_at: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_from, self.spike_at = nan_from, spike_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        step = self.trainer.global_step
        if self.nan_from is not None and step >= self.nan_from:
            return loss * float("nan")
        if step == self.spike_at:
            return loss * 100
        return loss


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


# ---------------------------------------------------------------------------------------------- case 2: budget


@pytest.mark.parametrize("check_before_step", [True, False])
def test_a_persistent_nan_stops_with_the_last_good_weights_in_a_checkpoint(tmp_path, check_before_step: bool) -> None:
    torch.manual_seed(0)
    model = LossFault(nan_from=3)
    initial = flat(model)
    controller = AdaptivePrecision(
        PolicyConfig(max_rollbacks=2, **QUIET), verbose=False, check_before_step=check_before_step
    )
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=30), callbacks=[controller])
    # Without the check before the step, each verdict lands two steps late and the two steps after a rolled-back one
    # are dropped: divergences at steps 3, 6 and 9 (3, 4 and 5 with the check).
    stop_step = 5 if check_before_step else 9
    with pytest.raises(TrainingDiverged, match=f"stopped training at step {stop_step}") as info:
        trainer.fit(model, token_loader(30))

    # Three divergences: dS to bf16 (both layers), then nothing left (the tokens lever is at 1): the third stops.
    assert [d.lever for d in controller.history if d.lever in ("rollback", "stop")] == ["rollback"] * 2 + ["stop"]
    message = str(info.value)
    assert "max_rollbacks 2" in message and "loss is nan" in message and "Tried: step 3: blocks.0.attn" in message
    assert info.value.checkpoint == str(tmp_path / "sage-last-good.ckpt")
    saved = torch.load(info.value.checkpoint, weights_only=False)
    # The snapshot of step 0 (snapshots every 100 steps): the weights training started from, no NaN in them.
    torch.testing.assert_close(torch.cat([t.flatten() for t in saved["state_dict"].values()]), initial, rtol=0, atol=0)
    assert torch.equal(flat(model), initial)


# -------------------------------------------------------------------------------------- case 3: proportionate


class ParameterTrace(Callback):
    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params.append(flat(pl_module))


@pytest.mark.parametrize(("check_before_step", "optimizer"), [(True, "sgd"), (False, "adamw")])
def test_a_one_off_loss_spike_costs_one_step_not_a_rollback(tmp_path, check_before_step: bool, optimizer: str) -> None:
    torch.manual_seed(0)
    spike = 20  # after the detectors' 16 values of history
    # Without the check before the step the spike's step is applied before its verdict: with AdamW (what that mode is
    # for: fused optimizers) a 100x gradient moves the weights by one normal step, so keeping it is harmless.
    model = LossFault(spike_at=spike, optimizer=optimizer, fused=optimizer == "adamw")
    controller = AdaptivePrecision(PolicyConfig(**QUIET), verbose=False, check_before_step=check_before_step)
    trace = ParameterTrace()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=24), callbacks=[controller, trace])
    trainer.fit(model, token_loader(24))

    assert controller.rollbacks == 0
    skip = controller.history[0]
    assert (skip.step, skip.lever, skip.new) == (spike, "optimizer_step", "skip") and "one-off" in skip.reason
    if check_before_step:
        assert controller.skipped_steps == 1
        assert torch.equal(trace.params[spike], trace.params[spike - 1])  # the spike's step was dropped
    else:
        # Applied before its verdict with finite gradients: kept (a rollback would cost more), and said so.
        assert [d.new for d in controller.history] == ["skip", "kept"]
    assert not torch.equal(trace.params[-1], trace.params[spike])  # and training went on


# ------------------------------------------------------------------------------------ case 4: exact resume


@pytest.mark.parametrize("check_before_step", [True, False])
def test_a_resumed_run_rolls_back_to_the_same_weights_as_the_uninterrupted_one(
    tmp_path, check_before_step: bool
) -> None:
    """The NaN at step 9 comes after the resume at step 6; both runs must land on the snapshot of step 0."""

    def fit(ckpt_path=None, seed: int = 0) -> tuple[AdaptivePrecision, TinyLM]:
        controller = AdaptivePrecision(PolicyConfig(**QUIET), verbose=False, check_before_step=check_before_step)
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, save_on_train_epoch_end=True)
        trainer = L.Trainer(
            **trainer_kwargs(tmp_path, max_steps=12, enable_checkpointing=True), callbacks=[controller, checkpoints]
        )
        torch.manual_seed(seed)
        model = TinyLM(nan_loss_at_step=9)
        trainer.fit(model, token_loader(6, same_batch=True), ckpt_path=ckpt_path)
        return controller, model

    uninterrupted, model_a = fit()
    (first_epoch,) = glob.glob(str(tmp_path / "ckpt" / "epoch=0-*.ckpt"))
    resumed, model_b = fit(ckpt_path=first_epoch, seed=123)

    assert uninterrupted.rollbacks == resumed.rollbacks == 1
    assert resumed.snapshot_step == uninterrupted.snapshot_step
    assert [str(d) for d in resumed.history] == [str(d) for d in uninterrupted.history]
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------- case 5: checkpoint mismatches


def escalating_run(tmp_path, model: TinyLM, **fit_kwargs) -> tuple[str, AdaptivePrecision]:
    """Two steps whose dS error (about 0.015) crosses a threshold of 0.01: every layer escalates to ds_bf16."""
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=1000, ds_rel_err_high=0.01, ds_rel_err_low=0.005),
        verbose=False,
    )
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[controller])
    trainer.fit(model, token_loader(3), **fit_kwargs)
    path = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(path)
    return path, controller


def test_layer_precisions_survive_a_resume_without_the_callback(tmp_path) -> None:
    torch.manual_seed(0)
    path, controller = escalating_run(tmp_path, TinyLM())
    assert {p.ds for p in controller.precisions().values()} == {"bf16"}

    loaded = TinyLM.load_from_checkpoint(path)
    assert {n: s.precision for n, s in attention_layers(loaded).items()} == controller.precisions()
    # Resumed by a Trainer with no controller at all: the escalations still hold.
    model = TinyLM()
    L.Trainer(**trainer_kwargs(tmp_path, max_steps=4)).fit(model, token_loader(4), ckpt_path=path)
    assert {n: s.precision for n, s in attention_layers(model).items()} == controller.precisions()


class OneAttentionLayer(TinyLM):
    """TinyLM's weights, but only the first block's attention swapped."""

    def sage_attention_filter(self, module, fqn):
        return super().sage_attention_filter(module, fqn) and not fqn.startswith("blocks.1.")


def test_a_checkpoint_whose_layers_are_not_the_models_is_a_clear_error(tmp_path) -> None:
    torch.manual_seed(0)
    path, _ = escalating_run(tmp_path, TinyLM())
    controller = AdaptivePrecision(PolicyConfig(**QUIET), verbose=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[controller])
    # Two layers into one: the module's own entry says so ...
    with pytest.raises(
        ValueError, match=r"checkpoint holds attention layers .*only in the checkpoint: \['blocks.1.attn'\]"
    ):
        trainer.fit(OneAttentionLayer(), token_loader(4), ckpt_path=path)
    # ... and without it (a checkpoint from before the mixin saved it), the controller's state does, both ways.
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(
        MisconfigurationException, match=r"controller state is for attention layers .*only in the checkpoint"
    ):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[AdaptivePrecision(verbose=False)]).fit(
            OneAttentionLayer(), token_loader(4), ckpt_path=str(tmp_path / "old.ckpt")
        )
    torch.manual_seed(0)
    one, _ = escalating_run(tmp_path / "one", OneAttentionLayer())
    with pytest.raises(ValueError, match=r"only in the model: \['blocks.1.attn'\]"):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[AdaptivePrecision(verbose=False)]).fit(
            TinyLM(), token_loader(4), ckpt_path=one
        )


def test_a_changed_starting_precision_on_resume_is_warned_about(tmp_path) -> None:
    torch.manual_seed(0)
    path, controller = escalating_run(tmp_path, TinyLM())
    model = TinyLM(precision=AttentionPrecision(mode="full"))
    resumed = AdaptivePrecision(PolicyConfig(**QUIET), verbose=False)
    with pytest.warns(UserWarning, match="sage_precision is full, the checkpoint was trained from sagebwd") as warned:
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[resumed]).fit(
            model, token_loader(4), ckpt_path=path
        )
    assert resumed.precisions() == controller.precisions()  # the checkpoint's, as the warning says
    assert not [w for w in warned if "configured starting precision" in str(w.message)]  # said once, not twice
    # A checkpoint without the module's entry (written before the mixin kept it): the controller says it.
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match=r"configured starting precision of .* \(full for 'blocks.0.attn'\) differs"):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[AdaptivePrecision(verbose=False)]).fit(
            TinyLM(precision=AttentionPrecision(mode="full")), token_loader(4), ckpt_path=str(tmp_path / "old.ckpt")
        )


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: s.pop("tokens_seen"), r"lacks \['tokens_seen'\]"),
        (lambda s: s.update(version=1), "has version 1"),
        (lambda s: s["policy"]["layers"]["blocks.0.attn"].update(path="ds_bf16"), "must be a list of rung names"),
        (lambda s: s["bases"].update({"blocks.0.attn": {"ds": "fp4"}}), "base precision of layer 'blocks.0.attn'"),
        (lambda s: s["policy"].pop("tokens"), r"lacks \['tokens'\]"),
        (lambda s: s.update(pending=None), "'pending' must be a list of pending steps"),
        # The previous layout (version 2), upgraded when it loads, with a signal vector of the wrong length.
        (lambda s: s.update(version=2, pending={"values": [0.0] * 3}), "holds 3 signal values; one of 2 layers"),
    ],
)
def test_a_malformed_controller_state_is_a_clear_error(tmp_path, corrupt, message: str) -> None:
    torch.manual_seed(0)
    path, _ = escalating_run(tmp_path, TinyLM())
    checkpoint = torch.load(path, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("AdaptivePrecision")]
    corrupt(checkpoint["callbacks"][key])
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=message):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[AdaptivePrecision(verbose=False)]).fit(
            TinyLM(), token_loader(4), ckpt_path=str(tmp_path / "bad.ckpt")
        )


# --------------------------------------------------------------------------- case 1: the rung that fixes it


def test_a_wrong_dv_kernel_sends_every_layer_to_full_at_its_first_probe(tmp_path, monkeypatch) -> None:
    """Main's wrong dV read cosine -0.90 in every layer at step 0 (H200); the controller went to smooth_q, which
    cannot change dV. Here the probe's comparison is given that dV for every layer not yet in full precision."""
    import sage_lightning.layer as layer_module

    real = layer_module.compare_with_full_precision

    def wrong_dv(*args, **kwargs):
        metrics = real(*args, **kwargs)
        if kwargs["precision"].mode != "full":
            metrics["dV"] = {"cos": -0.9, "rel_l2": 1.9}
        return metrics

    monkeypatch.setattr(layer_module, "compare_with_full_precision", wrong_dv)
    torch.manual_seed(0)
    controller = AdaptivePrecision(PolicyConfig(**QUIET), verbose=False)
    probed: list[int] = []

    class Probes(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            probed.append(int(controller._request.probe))

    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[controller, Probes()])
    model = TinyLM()
    trainer.fit(model, token_loader(3))

    assert [(d.step, d.layer, d.new) for d in controller.history] == [(0, n, "full") for n in attention_layers(model)]
    assert all(
        "probe dV cos -0.90000 < probe_catastrophic_cos 0.5: catastrophic" in d.reason for d in controller.history
    )
    assert probed == [1, 1, 0]  # the escalation checked by a probe on the next step, which found it fixed


# ----------------------------------------------------------------------------------- case 7: warm-up compile


def test_the_first_step_of_a_resumed_fit_runs_the_ds_statistics_variant(tmp_path) -> None:
    """The first dS-statistics step compiles and autotunes that kernel variant: it happens on the first step of the
    fit, not as a stall in the middle of training (its sums are dropped, decisions unchanged)."""
    torch.manual_seed(0)
    path, _ = escalating_run(tmp_path, TinyLM())
    collecting: list[bool] = []

    class Spy(Callback):
        def on_before_backward(self, trainer, pl_module, loss) -> None:
            collecting.append(attention_layers(pl_module)["blocks.0.attn"].collect_stats)

    controller = AdaptivePrecision(PolicyConfig(**QUIET), verbose=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6), callbacks=[controller, Spy()])
    trainer.fit(TinyLM(), token_loader(6), ckpt_path=path)
    assert collecting == [True, False, False]  # steps 3, 4, 5: only the first, which the policy did not ask for
    assert controller.history == [d for d in controller.history if d.step < 3]  # nothing new decided from it
