"""AdaptivePrecision in real Trainer runs on CPU: decisions caused by real signals, TensorBoard events,
surviving a NaN, skipping a step, resuming, and its argument checks."""

from __future__ import annotations

import dataclasses
import gc
import glob
import io
import logging
import math
import os
import re
import shutil
import time
import traceback
import weakref
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import sage_lightning.kernels
import torch
import yaml
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_lightning import PressCtrlC, TinyLM, hparams_session, token_loader, trainer_kwargs
from torch.utils._python_dispatch import TorchDispatchMode

import sage_lightning
from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers
from sage_lightning.callback import count_tokens
from sage_lightning.precision_image import PALETTE, color_for

LAYERS = ("blocks.0.attn", "blocks.1.attn")


def events(root) -> EventAccumulator:
    (path,) = glob.glob(f"{root}/**/events.out.tfevents.*", recursive=True)
    accumulator = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def time_series_order(tag: str) -> list[tuple]:
    """TensorBoard's order of charts in a Time Series group (its ``compareTagNames``): '/' before anything else,
    digit runs as numbers, then the characters."""
    key: list[tuple] = []
    for token in re.findall(r"/|\d+|[^/\d]", tag):
        key.append((0, 0, "") if token == "/" else (1, int(token), "") if token.isdigit() else (2, 0, token))
    return key


def decision_texts(accumulator: EventAccumulator) -> list[str]:
    return [event.tensor_proto.string_val[0].decode() for event in accumulator.Tensors("sage/decisions/text_summary")]


def test_a_measured_ds_error_above_threshold_escalates_and_lands_in_tensorboard(tmp_path) -> None:
    """Acceptance: the tiny model's dS error (about 0.015 in fp32) crosses a threshold of 0.01; nothing mocked."""
    torch.manual_seed(0)
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=2, probe_every_n_steps=3, ds_rel_err_high=0.01, ds_rel_err_low=0.005),
        log_every_n_steps=1,
        verbose=False,
    )
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=6, logger=TensorBoardLogger(tmp_path, name="tb")),
        callbacks=[controller],
    )
    model = TinyLM()
    trainer.fit(model, token_loader(6))

    # Escalated at step 2 (measurements at steps 0 and 2, patience 2), for the measured reason.
    escalations = [d for d in controller.history if d.lever == "precision"]
    assert [(d.step, d.layer) for d in escalations] == [(2, name) for name in LAYERS]
    assert all(d.reason.startswith("ds_rel_err 0.01") and "> ds_rel_err_high 0.01" in d.reason for d in escalations)
    assert {n: s.precision.ds for n, s in attention_layers(model).items()} == dict.fromkeys(LAYERS, "bf16")

    accumulator = events(tmp_path)
    scalars = set(accumulator.Tags()["scalars"])
    for layer in LAYERS:
        per_layer = {f"sage/ds_rel_err/{layer}", f"sage/precision_level/{layer}", f"sage/probe/dQ_cos/{layer}"}
        assert per_layer <= scalars
    assert {"sage/tokens_per_step", "sage/tokens_seen", "sage/int8_fraction", "sage/spike/loss"} <= scalars
    ds_err = [e.value for e in accumulator.Scalars("sage/ds_rel_err/blocks.0.attn")]
    assert len(ds_err) == 4 and all(0.01 < v < 0.05 for v in ds_err)  # steps 0, 2, 4 and the probe at 3
    assert [e.value for e in accumulator.Scalars("sage/precision_level/blocks.0.attn")][-1] == 4.0  # ladder[3], ds_bf16
    assert [e.value for e in accumulator.Scalars("sage/tokens_seen")][-1] == 6 * 2 * 33
    # int8 share: 2 layers x 3 steps on INT8 dS, then 2 x 3 with dS in bf16.
    assert [e.value for e in accumulator.Scalars("sage/int8_fraction")][-1] == pytest.approx(0.5)
    (text,) = decision_texts(accumulator)
    assert "step 2 · blocks.0.attn · precision: `sagebwd:int8=qk,pv,dv,ds;smooth_k` -> `sagebwd:int8=qk,pv,dv;" in text
    assert "ds_rel_err 0.01" in text and "blocks.1.attn" in text
    assert "custom_scalars__config__" in accumulator.Tags()["tensors"]
    # TensorBoard's Time Series sorts a group's charts by tag: the sage group opens on the dS error per layer and the
    # gradient norm, then the share, the loss and the picture; no flat counter before them.
    sage_tags = {tag for tag in scalars | set(accumulator.Tags()["images"]) if tag.startswith("sage/")}
    cards = sorted(sage_tags, key=time_series_order)
    first = [*(f"sage/ds_rel_err/{layer}" for layer in LAYERS), "sage/grad_norm"]
    assert cards[:6] == [*first, "sage/int8_fraction", "sage/loss", "sage/precision"], cards[:8]
    images = accumulator.Images("sage/precision")
    # The picture of every layer's precision: at the start, at step 2 where both layers went to ds_bf16, at the end.
    assert [image.step for image in images] == [0, 2, 5]
    picture = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)).convert("RGB"))
    # Two bands of 12 pixels, the 6 steps widened to 43 pixels each, right of the layer names, above the step axis.
    left = next(x for x in range(picture.shape[1]) if tuple(picture[0, x]) == tuple(PALETTE[0]))
    at = [left + 43 * step + 21 for step in range(6)]
    assert [tuple(picture[0, at[step]]) for step in (0, 1, 2, 5)] == [tuple(PALETTE[0])] * 2 + [
        tuple(color_for(4, 7))
    ] * 2
    assert tuple(picture[12, at[5]]) == tuple(color_for(4, 7))  # the second layer's band
    assert picture.shape[0] > 24 and picture.shape[1] == left + 6 * 43 + 4
    dark = picture.sum(axis=2) < 300
    assert dark[:12, :left].any() and dark[12:24, :left].any()  # each band's layer name
    assert dark[24:, left:].any() and dark[24:, :left].any()  # the step labels, and "step"
    legend = accumulator.Tensors("sage/precision_legend/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "level 4, `ds_bf16`" in legend and "`blocks.1.attn`" in legend
    assert trainer.progress_bar_metrics["int8_share"] == pytest.approx(0.5)
    assert trainer.progress_bar_metrics["tokens_per_step"] == 66


class HugeQueries(Callback):
    """At one optimizer step, scale the q/k/v projection of one attention layer to the edge of fp32: finite
    inputs, whose INT8 scores overflow to inf inside the kernel, so the layer's output is NaN."""

    def __init__(self, step: int, layer: int) -> None:
        self.step, self.layer = step, layer
        self.fired = 0

    def on_train_start(self, trainer, pl_module) -> None:
        def hook(module, inputs, output):
            if trainer.global_step == self.step and self.fired == 0:
                self.fired += 1
                return output / output.abs().amax() * 3e38
            return output

        pl_module.blocks[self.layer].attn.qkv.register_forward_hook(hook)


def test_a_nan_from_one_attention_layer_is_survived_and_reported(tmp_path) -> None:
    torch.manual_seed(0)
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=1000, probe_every_n_steps=1000), snapshot_every_n_steps=2, verbose=False
    )
    injector = HugeQueries(step=3, layer=1)
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=8, logger=TensorBoardLogger(tmp_path, name="tb")),
        callbacks=[controller, injector],
    )
    model = TinyLM()
    trainer.fit(model, token_loader(8))

    assert injector.fired == 1 and controller.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(math.isfinite(loss) for i, loss in enumerate(model.step_losses) if i != 3)
    rollback, escalation = controller.history
    assert (rollback.step, rollback.lever, rollback.reason) == (3, "rollback", "loss is nan")
    assert (escalation.layer, escalation.new) == ("blocks.1.attn", "full")
    assert "non-finite attention output from finite inputs" in escalation.reason
    assert attention_layers(model)["blocks.1.attn"].precision.mode == "full"
    assert attention_layers(model)["blocks.0.attn"].precision == AttentionPrecision()
    (text,) = decision_texts(events(tmp_path))
    assert "rollback" in text and "blocks.1.attn" in text and "-> `full`" in text


def poison_gradients(model: TinyLM, steps: tuple[int, ...]) -> None:
    """Make the head bias's gradient infinite at these optimizer steps (the loss stays finite; one gradient not)."""

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if model.trainer.global_step in steps else grad

    model.head.bias.register_hook(poison)


class ParameterTrace(Callback):
    """Parameters and momentum buffers after every optimizer step (placed after AdaptivePrecision)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))
        state = trainer.optimizers[0].state.get(pl_module.head.weight, {})
        buffer = state.get("momentum_buffer", state.get("exp_avg"))
        self.momentum.append(None if buffer is None else buffer.clone())


def test_a_verbose_controller_prints_each_decision_within_the_terminal(tmp_path, monkeypatch, caplog) -> None:
    """Each decision is printed as it happens, wrapped to the terminal's width (here 60 columns)."""
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *args: os.terminal_size((60, 24)))
    model = TinyLM()
    poison_gradients(model, (2,))
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[AdaptivePrecision()])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer.fit(model, token_loader(4))
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptivePrecision: step 2:")]
    assert len(printed) == 1
    lines = printed[0].splitlines()
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines), printed[0]
    assert any(line.startswith("  because gradient norm is") for line in lines), printed[0]


def test_non_finite_gradients_skip_the_step_and_leave_optimizer_state_alone(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    bad_step = 2

    poison_gradients(model, (bad_step,))
    controller = AdaptivePrecision(verbose=False)
    trace = ParameterTrace()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=5), callbacks=[controller, trace])
    trainer.fit(model, token_loader(5))

    (decision,) = controller.history
    assert (decision.step, decision.lever, decision.old, decision.new) == (bad_step, "optimizer_step", "apply", "skip")
    assert "gradient norm is inf" in decision.reason or "gradient norm is nan" in decision.reason
    assert controller.skipped_steps == 1 and controller.rollbacks == 0
    assert torch.equal(trace.params[bad_step], trace.params[bad_step - 1])  # nothing moved ...
    assert torch.equal(trace.momentum[bad_step], trace.momentum[bad_step - 1])  # ... not even the momentum
    assert not torch.equal(trace.params[bad_step + 1], trace.params[bad_step])  # and training went on
    assert all(torch.isfinite(p).all() for p in model.parameters())


def resume_config() -> PolicyConfig:
    """Probes every 4 steps find every layer worse than an impossible 0.999999 cosine (up one rung each time);
    rungs are left after 4 calm steps when the dS error (about 0.015) is below 0.5: escalations, step-downs
    and a backoff, all depending on state kept across the checkpoint (4, not 3: with verdicts two steps late a
    relapse is seen three steps after its step down)."""
    return PolicyConfig(
        ds_stats_every_n_steps=1,
        probe_every_n_steps=4,
        probe_grad_cos_min=0.999999,
        ds_rel_err_high=0.9,
        ds_rel_err_low=0.5,
        calm_steps=4,
    )


@pytest.mark.parametrize("check_before_step", [True, False])
def test_a_resumed_run_decides_as_the_uninterrupted_one(tmp_path, check_before_step: bool) -> None:
    # check_before_step=False: the checkpoint is taken while the last two steps' verdicts are still pending, and
    # each escalation is checked three steps after its step (two with the check), so it needs more steps.
    def fit(ckpt_path=None, seed: int = 0) -> tuple[AdaptivePrecision, TinyLM]:
        controller = AdaptivePrecision(resume_config(), verbose=False, check_before_step=check_before_step)
        # Saved where Lightning resumes cleanly: at the end of each 6-step epoch.
        checkpoints = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, save_on_train_epoch_end=True)
        kwargs = trainer_kwargs(tmp_path, max_steps=14 if check_before_step else 20, enable_checkpointing=True)
        trainer = L.Trainer(**kwargs, callbacks=[controller, checkpoints])
        torch.manual_seed(seed)
        model = TinyLM()
        trainer.fit(model, token_loader(6, same_batch=True), ckpt_path=ckpt_path)
        return controller, model

    uninterrupted, model_a = fit()
    (first_epoch,) = glob.glob(str(tmp_path / "ckpt" / "epoch=0-*.ckpt"))
    # Another initialisation: everything the resumed run knows must come from the checkpoint.
    resumed, model_b = fit(ckpt_path=first_epoch, seed=123)

    decisions = [str(d) for d in uninterrupted.history]
    assert [str(d) for d in resumed.history] == decisions
    assert any(d.step < 6 for d in uninterrupted.history) and any(d.step >= 6 for d in uninterrupted.history)
    assert any("calm period now 8" in d for d in decisions)  # the backoff counted across the checkpoint
    assert resumed.precisions() == uninterrupted.precisions()
    assert {n: s.precision for n, s in attention_layers(model_b).items()} == uninterrupted.precisions()
    assert resumed.tokens_seen == uninterrupted.tokens_seen and resumed.int8_fraction == uninterrupted.int8_fraction
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


DATA = Path(__file__).resolve().parent / "data"


def test_a_checkpoint_of_the_previous_layout_resumes(tmp_path) -> None:
    """A checkpoint written before the two-step verdict lag (controller state version 2: one pending verdict, one
    snapshot candidate; ``tests/data/state_v2.ckpt``, made at 33c9433 by ``tests/data/make_state_v2_checkpoint.py``)
    resumes: its decisions, counters and precisions carry over, its pending verdict is concluded, and training goes
    on to a checkpoint of this version's layout."""
    saved = torch.load(DATA / "state_v2.ckpt", weights_only=False)
    (old,) = [value for key, value in saved["callbacks"].items() if key.startswith("AdaptivePrecision")]
    assert old["version"] == 2 and old["pending"]["step"] == 5 and old["snapshots"]["good"] is not None
    config = PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=4, probe_grad_cos_min=0.999999)
    controller = AdaptivePrecision(config, verbose=False, check_before_step=False)
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=12, enable_checkpointing=True), callbacks=[controller, checkpoints]
    )
    model = TinyLM(layers=1, d_model=16, heads=2)
    trainer.fit(model, token_loader(6, same_batch=True), ckpt_path=DATA / "state_v2.ckpt")

    assert trainer.global_step == 12
    assert [dataclasses.asdict(d) for d in controller.history[: len(old["history"])]] == old["history"]
    assert controller.tokens_seen > old["tokens_seen"] and controller.rollbacks == old["rollbacks"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    new = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    (state,) = [value for key, value in new["callbacks"].items() if key.startswith("AdaptivePrecision")]
    assert state["version"] == 3 and isinstance(state["pending"], list)


def test_misconfigurations_fail_at_train_start(tmp_path) -> None:
    class NoSage(TinyLM):
        def configure_model(self) -> None:  # skip the mixin's swap
            pass

    with pytest.raises(MisconfigurationException, match="no SageBwd attention layer"):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=1), callbacks=[AdaptivePrecision()]).fit(
            NoSage(), token_loader(1)
        )

    class Manual(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(MisconfigurationException, match="automatic optimization"):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=1), callbacks=[AdaptivePrecision()]).fit(
            Manual(), token_loader(1)
        )
    with pytest.raises(MisconfigurationException, match="GradientAccumulationScheduler"):
        callbacks = [AdaptivePrecision(), GradientAccumulationScheduler({0: 2})]
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=1), callbacks=callbacks).fit(TinyLM(), token_loader(1))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"config": {"ds_rel_err_high": 0.1}}, "config"),
        ({"snapshot_every_n_steps": 0}, "snapshot_every_n_steps"),
        ({"log_every_n_steps": -1}, "log_every_n_steps"),
        ({"tokens_fn": 5}, "tokens_fn"),
        ({"progress_bar": "yes"}, "progress_bar"),
        ({"check_before_step": "auto"}, "check_before_step"),
    ],
)
def test_arguments_are_checked(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        AdaptivePrecision(**kwargs)
    assert "received" in str(info.value)


@pytest.mark.parametrize(
    ("batch", "tokens"),
    [
        (torch.zeros(4, 16, dtype=torch.long), 64),
        ({"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 9)}, 16),
        ({"tokens": torch.zeros(3, 5)}, 15),
        ((torch.zeros(2, 33), torch.zeros(2)), 66),
        ([torch.zeros(1, 7)], 7),
    ],
)
def test_count_tokens(batch, tokens: int) -> None:
    assert count_tokens(batch) == tokens


def test_count_tokens_asks_for_tokens_fn() -> None:
    with pytest.raises(ValueError, match="tokens_fn"):
        count_tokens("text")


# ------------------------------------------------------------------ check_before_step=False: verdicts one step late


def test_without_the_per_step_sync_a_nan_is_rolled_back_two_steps_later(tmp_path) -> None:
    torch.manual_seed(0)
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=1000, probe_every_n_steps=1000),
        snapshot_every_n_steps=2,
        check_before_step=False,
        verbose=False,
    )
    injector = HugeQueries(step=3, layer=1)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=8), callbacks=[controller, injector])
    model = TinyLM()
    trainer.fit(model, token_loader(8))

    assert injector.fired == 1 and controller.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    rollback, escalation = controller.history
    assert (rollback.step, rollback.lever, rollback.reason) == (3, "rollback", "loss is nan")
    assert (escalation.layer, escalation.new) == ("blocks.1.attn", "full")
    # Every step counted, the last verdicts at the end of training; the escalation, decided at step 5 (the
    # verdict of step 3), landed two steps later than with the check before the step: steps 4 and 5 still ran
    # both layers on INT8 (and were dropped by the rollback).
    assert controller.int8_fraction == pytest.approx((2 * 6 + 1 * 2) / (2 * 8))
    assert controller.tokens_seen == 8 * 2 * 33


@pytest.mark.parametrize(("optimizer", "fused"), [("sgd", True), ("adamw", True), ("sgd", False)])
def test_without_the_per_step_sync_non_finite_gradients_are_skipped_or_undone(
    tmp_path, optimizer: str, fused: bool
) -> None:
    torch.manual_seed(0)
    model = TinyLM(fused=fused, optimizer=optimizer)
    bad_step = 2

    poison_gradients(model, (bad_step,))
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    controller = AdaptivePrecision(check_before_step=False, verbose=False)
    trace = ParameterTrace()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=5), callbacks=[controller, trace])
    trainer.fit(model, token_loader(5))

    levers = [(d.step, d.lever) for d in controller.history]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if fused:
        # The fused optimizer skipped it on the device: nothing moved, not even the momentum, no rollback.
        assert levers == [(bad_step, "optimizer_step")] and controller.skipped_steps == 1
        assert controller.rollbacks == 0
        assert torch.equal(trace.params[bad_step], trace.params[bad_step - 1])
        assert torch.equal(trace.momentum[bad_step], trace.momentum[bad_step - 1])
    else:
        # Applied, found two steps later, undone by the snapshot (taken at the start: step 0).
        assert levers == [(bad_step, "optimizer_step"), (bad_step, "rollback")] and controller.rollbacks == 1
        assert "were applied" in controller.history[-1].reason
        assert not torch.equal(trace.params[bad_step + 1], initial)  # the step after it was applied too, ...
        assert torch.equal(trace.params[bad_step + 2], initial)  # ... then back to the start, and that step dropped


def test_without_the_per_step_sync_a_snapshot_taken_after_a_bad_step_is_not_restored(tmp_path) -> None:
    # Snapshots every 2 steps are taken before the verdict of the step they follow. The bad steps 5 and 9 are
    # applied (plain SGD cannot skip on the device); the snapshots after them (taken after steps 5 and 9) must be
    # dropped, and both rollbacks must land on the one taken after step 3, which its own verdict had confirmed
    # (the one after step 7 was never taken: steps 6 and 7 were dropped with the first rollback).
    torch.manual_seed(0)
    model = TinyLM()
    bad_steps = (5, 9)

    poison_gradients(model, bad_steps)
    controller = AdaptivePrecision(snapshot_every_n_steps=2, check_before_step=False, verbose=False)
    trace = ParameterTrace()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=12), callbacks=[controller, trace])
    trainer.fit(model, token_loader(12))

    levers = [(d.step, d.lever) for d in controller.history]
    assert levers == [(step, lever) for step in bad_steps for lever in ("optimizer_step", "rollback")]
    for step in bad_steps:
        assert not torch.isfinite(trace.params[step]).all()  # it was applied
        # Found two steps later: back to the state after step 3, and that step's gradients dropped.
        assert torch.equal(trace.params[step + 2], trace.params[3])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("optimizer", "fused", "checked_first"), [("sgd", True, False), ("adamw", True, False), ("adamw", False, True)]
)
def test_by_default_the_check_waits_only_for_optimizers_that_cannot_skip_on_the_device(
    tmp_path, optimizer: str, fused: bool, checked_first: bool
) -> None:
    torch.manual_seed(0)
    model = TinyLM(fused=fused, optimizer=optimizer)
    bad_step = 2

    poison_gradients(model, (bad_step,))
    controller = AdaptivePrecision(verbose=False)
    seen: list[int] = []

    class DecisionsAtBatchEnd(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.append(len(controller.history))

    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=5), callbacks=[controller, DecisionsAtBatchEnd()])
    trainer.fit(model, token_loader(5))

    # Checked before the step: the skip is decided within step 2; otherwise within step 4 (two steps later).
    assert seen[bad_step] == (1 if checked_first else 0)
    assert seen[bad_step + 1] == (1 if checked_first else 0) and seen[bad_step + 2] == 1
    assert controller.skipped_steps == 1 and controller.rollbacks == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", [AttentionPrecision(mode="full"), AttentionPrecision.all_bf16()])
def test_a_run_that_starts_in_full_precision_shows_no_int8_share(tmp_path, precision: AttentionPrecision) -> None:
    """Layers whose base precision is full (or SageBwd with every product in bf16) ran no INT8: the share is 0, not
    the vacuous 1 of "every INT8 product of the base still in INT8"."""
    controller = AdaptivePrecision(PolicyConfig(ds_stats_every_n_steps=1000, probe_every_n_steps=1000), verbose=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[controller])
    trainer.fit(TinyLM(precision=precision), token_loader(3))
    assert controller.int8_fraction == 0.0


def test_an_fp8_base_is_its_fast_path_until_escalated_and_its_checkpoint_loads_back(tmp_path) -> None:
    """A base with FP8 products counts as low-bit while they run FP8; its dS goes FP8 -> bf16 on a dS trigger (the
    share then drops as for INT8); the precisions, FP8 included, come back identically from the checkpoint."""
    torch.manual_seed(0)
    base = AttentionPrecision(pv="fp8", ds="fp8")
    config = PolicyConfig(
        ds_stats_every_n_steps=2, probe_every_n_steps=1000, ds_rel_err_high=0.01, ds_rel_err_low=0.005
    )
    controller = AdaptivePrecision(config, verbose=False)
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=6, enable_checkpointing=True), callbacks=[controller, checkpoints]
    )
    model = TinyLM(precision=base)
    trainer.fit(model, token_loader(6))

    escalated = base.replace(ds="bf16")
    assert [(d.step, d.layer, d.old, d.new) for d in controller.history] == [
        (2, name, base.short_name, escalated.short_name) for name in LAYERS
    ]
    assert controller.precisions() == dict.fromkeys(LAYERS, escalated)
    # 2 layers x 3 steps with pv and dS in FP8 (the base: its fast path), then 2 x 3 with dS in bf16.
    assert controller.int8_fraction == pytest.approx(0.5)

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    (state,) = [value for key, value in saved["callbacks"].items() if key.startswith("AdaptivePrecision")]
    assert state["bases"] == dict.fromkeys(LAYERS, dataclasses.asdict(base))
    assert saved["sage_attention"]["configured"] == dataclasses.asdict(base)
    restored = TinyLM(precision=base)
    restored.configure_model()
    restored.on_load_checkpoint(saved)
    assert {n: layer.precision for n, layer in attention_layers(restored).items()} == dict.fromkeys(LAYERS, escalated)
    # Resumed: the same bases, paths and counters; two more steps with dS in bf16.
    resumed = AdaptivePrecision(config, verbose=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=8), callbacks=[resumed])
    trainer.fit(TinyLM(precision=base), token_loader(8), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.precisions() == dict.fromkeys(LAYERS, escalated)
    assert resumed.history == controller.history and resumed.int8_fraction == pytest.approx(6 / 16)


class PackageHostReads(Callback):
    """Count, over each training batch, the host reads of a device value (``.item()``, ``bool()``, ...) that the
    package's own code makes (the innermost frame of the package or its kernels is under ``sage_lightning/``)."""

    def __init__(self) -> None:
        self.package = os.path.dirname(sage_lightning.__file__) + os.sep
        self.ours = (self.package, os.path.dirname(sage_lightning.kernels.__file__) + os.sep)
        self.reads: list[str] = []
        self._mode: TorchDispatchMode | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        outer = self

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    ours = [f for f in traceback.extract_stack() if f.filename.startswith(outer.ours)]
                    if ours and ours[-1].filename.startswith(outer.package):
                        outer.reads.append(f"{ours[-1].filename}:{ours[-1].lineno}")
                return func(*args, **(kwargs or {}))

        self._mode = Reads()
        self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._mode.__exit__(None, None, None)


def test_without_the_per_step_sync_steps_that_measure_read_nothing_from_the_device(tmp_path) -> None:
    """dS statistics and the forward's health on every step, verdicts one step later: the package reads no device
    value on the host (each read would wait for the step's kernels on a GPU), stale non-finite flags included."""
    torch.manual_seed(0)
    config = PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=10**9)
    controller = AdaptivePrecision(config, check_before_step=False, verbose=False)
    reads = PackageHostReads()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[controller, reads])
    trainer.fit(TinyLM(), token_loader(4))
    assert trainer.global_step == 4 and controller.history == [] and reads.reads == []


class ModelWithHparams(TinyLM):
    """TinyLM whose arguments are its hyperparameters, as ``save_hyperparameters()`` records them."""

    def __init__(self, layers: int = 2, lr: float = 0.05, adaptive_precision: str | None = None) -> None:
        super().__init__(layers=layers, lr=lr)
        self.save_hyperparameters(ignore=[] if adaptive_precision else ["adaptive_precision"])


@pytest.mark.parametrize("default_hp_metric", [True, False])
def test_the_controller_settings_join_the_module_hyperparameters(tmp_path, default_hp_metric: bool) -> None:
    """hparams.yaml and TensorBoard's HParams hold the controller's thresholds beside the module's arguments."""
    controller = AdaptivePrecision(PolicyConfig(ds_rel_err_high=0.15, calm_steps=40), verbose=False)
    assert controller.hparams["config"]["ds_rel_err_high"] == 0.15
    assert controller.hparams["config"]["ladder"] == ["smooth_q", "qk_bf16", "ds_fp8", "ds_bf16", "dv_bf16", "full"]
    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=default_hp_metric)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=2, logger=logger), callbacks=[controller])
    trainer.fit(ModelWithHparams(layers=2, lr=0.03), token_loader(2))

    saved = yaml.safe_load((tmp_path / "tb" / "version_0" / "hparams.yaml").read_text())
    assert saved["layers"] == 2 and saved["lr"] == 0.03  # the module's, untouched
    assert saved["adaptive_precision"]["config"]["ds_rel_err_high"] == 0.15
    assert saved["adaptive_precision"]["config"]["calm_steps"] == 40
    assert saved["adaptive_precision"]["snapshot_every_n_steps"] == 100

    accumulator = events(tmp_path)
    if not default_hp_metric:  # Lightning writes no session then, and neither does the controller
        assert "hp_metric" not in accumulator.Tags()["scalars"]
        with pytest.raises(KeyError):
            accumulator.PluginTagToContent("hparams")
        return
    values, metrics = hparams_session(accumulator)  # the session TensorBoard shows: the run's first
    assert values["lr"] == 0.03 and values["layers"] == 2
    assert values["adaptive_precision/config/ds_rel_err_high"] == 0.15
    assert values["adaptive_precision/config/calm_steps"] == 40
    assert metrics == ["hp_metric"]


def test_the_controller_settings_leave_the_users_hyperparameters_alone(tmp_path) -> None:
    """A hyperparameter of the user's named like the controller's key stays theirs; nothing is logged without the
    Trainer's autolog."""
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=1, logger=logger), callbacks=[AdaptivePrecision(verbose=False)]
    )
    with pytest.warns(UserWarning, match="already have 'adaptive_precision'"):
        trainer.fit(ModelWithHparams(adaptive_precision="mine"), token_loader(1))
    assert yaml.safe_load((tmp_path / "tb" / "version_0" / "hparams.yaml").read_text())["adaptive_precision"] == "mine"

    logger = TensorBoardLogger(tmp_path, name="off")
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=1, logger=logger, enable_autolog_hparams=False),
        callbacks=[AdaptivePrecision(verbose=False)],
    )
    trainer.fit(ModelWithHparams(), token_loader(1))
    assert "adaptive_precision" not in (tmp_path / "off" / "version_0" / "hparams.yaml").read_text()


class FailAt(Callback):
    """Raise at the end of optimizer step ``step`` (a fit that ends with an exception instead of on_train_end)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stop here")


@pytest.mark.parametrize("fails", [False, True])
def test_a_callback_kept_after_its_fit_keeps_no_model_alive(tmp_path, fails: bool) -> None:
    """What the controller holds of its own after a fit, ended or failed, keeps no part of the run alive: once the
    Trainer and the model are dropped, one collection frees them, parameters and optimizer state included; and once
    the controller is dropped too, nothing of it is left in a registry of the package."""
    model, controller = TinyLM(optimizer="adamw"), AdaptivePrecision(verbose=False, progress_bar=False)
    callbacks = [controller] + ([FailAt(2)] if fails else [])
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=callbacks)
    if fails:
        with pytest.raises(RuntimeError, match="stop here"):
            trainer.fit(model, token_loader(4))
    else:
        trainer.fit(model, token_loader(4))
    alive = [weakref.ref(held) for held in (model, trainer, *trainer.optimizers, *model.parameters())]
    layers = [weakref.ref(layer) for layer in attention_layers(model).values()]
    # Lightning gives every callback the module's log and log_dict (_attach_model_logging_functions), through which a
    # kept callback keeps its last model alive whatever it holds itself.
    del controller.log, controller.log_dict, model, trainer, callbacks
    gc.collect()
    assert [ref() for ref in alive if ref() is not None] == []
    assert controller.tokens_seen > 0  # what the run left in the controller is still there
    kept = weakref.ref(controller)
    del controller
    gc.collect()
    assert kept() is None and all(ref() is None for ref in layers)


def test_the_steps_do_not_walk_the_module_tree(tmp_path, monkeypatch) -> None:
    """The gradients are read from the parameters listed when training starts, not from a walk of the module tree on
    every step (about 0.1 ms of host time per step for 8 blocks)."""
    calls = []
    original = TinyLM.parameters

    def parameters(self: TinyLM, recurse: bool = True):  # noqa: ANN202
        if any(
            frame.filename.startswith(os.path.dirname(sage_lightning.__file__)) for frame in traceback.extract_stack()
        ):
            calls.append(self.trainer.global_step)
        return original(self, recurse)

    monkeypatch.setattr(TinyLM, "parameters", parameters)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6), callbacks=[AdaptivePrecision(verbose=False)])
    trainer.fit(TinyLM(), token_loader(6))
    assert calls == [0]  # on_train_start's listing


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"ds_rel_err_high": 0.1}, "in PolicyConfig: AdaptivePrecision(PolicyConfig(ds_rel_err_high=0.1))"),
        ({"calm_step": 5}, "Did you mean the PolicyConfig field 'calm_steps'"),
        ({"snapshot_every": 5}, "Did you mean 'snapshot_every_n_steps'?"),
    ],
)
def test_a_threshold_given_to_the_callback_says_where_it_goes(kwargs: dict, says: str) -> None:
    """Python's bare "unexpected keyword argument" becomes a message naming the argument and the call that works."""
    with pytest.raises(TypeError) as info:
        AdaptivePrecision(**kwargs)
    (name, value), message = next(iter(kwargs.items())), str(info.value)
    assert says in message and f"{name}={value!r}" in message


class _DropoutAttention(torch.nn.Module):
    """Calls SDPA with dropout in training: the kernel cannot serve it, so every call goes to SDPA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.5)
        return out.transpose(1, 2).reshape(x.shape)


def test_a_finished_run_prints_one_line_on_what_ran_and_a_notebook_gets_it_too(tmp_path, caplog) -> None:
    """Silent success no more: after fit, one line names the layers served, the calls sent to SDPA and why, the
    decisions and the low-bit share; attention_summary gives the same line; the mixin alone prints its part."""
    torch.manual_seed(0)
    model = TinyLM()
    model.blocks[1].attn.forward = _DropoutAttention().forward  # blocks.1.attn: every call falls back
    controller = AdaptivePrecision()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[controller])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        with pytest.warns(sage_lightning.layer.AttentionFallbackWarning, match="dropout_p > 0"):
            trainer.fit(model, token_loader(3))
    line = sage_lightning.attention_summary(model, controller)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptivePrecision: 1 of")] == [line]
    assert line.startswith("AdaptivePrecision: 1 of 2 attention layers ran SageBwd (6 calls, 3 sent to SDPA: 3 dropout")
    assert line.endswith(f"{len(controller.history)} decisions, low-bit share 1.000, 198 tokens seen"), line
    assert "\n" not in line

    caplog.clear()
    quiet = TinyLM()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        L.Trainer(**trainer_kwargs(tmp_path, max_steps=2)).fit(quiet, token_loader(2))
    printed = [r.getMessage() for r in caplog.records if "ran SageBwd" in r.getMessage()]
    assert printed == [
        "sage_lightning: 2 of 2 attention layers ran SageBwd (4 calls, none sent to SDPA); no AdaptivePrecision "
        "controller"
    ]
    with pytest.raises(TypeError, match="model must be the torch.nn.Module.*received Trainer"):
        sage_lightning.attention_summary(trainer)
    with pytest.raises(TypeError, match="controller must be .*AdaptivePrecision callback or None; received dict"):
        sage_lightning.attention_summary(model, {})


@pytest.mark.parametrize("check_before_step", [True, False])
def test_an_interrupted_then_resumed_run_logs_each_step_once_and_says_how_to_resume(
    tmp_path, caplog, check_before_step: bool
) -> None:
    """Ctrl-C at step 7 of a run checkpointed every 4 steps: the message names the checkpoint and the ckpt_path; the
    run resumed from step 4 (into the same TensorBoard folder) logs steps 4-7 again, and TensorBoard has each once.
    Without the check before the step, the checkpoint holds the verdicts of steps 2 and 3, still pending."""

    def run(max_steps: int, callbacks: list, ckpt_path=None) -> TinyLM:
        torch.manual_seed(0)
        model = TinyLM()
        checkpoints = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}"
        )
        logger = TensorBoardLogger(tmp_path, name="tb", version=0)
        trainer = L.Trainer(
            **trainer_kwargs(
                tmp_path, max_steps=max_steps, logger=logger, log_every_n_steps=1, enable_checkpointing=True
            ),
            callbacks=[
                AdaptivePrecision(log_every_n_steps=1, check_before_step=check_before_step),
                checkpoints,
                *callbacks,
            ],
        )
        trainer.fit(model, token_loader(12), ckpt_path=ckpt_path)
        return model

    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        with pytest.raises(SystemExit):  # Lightning's answer to Ctrl-C: on_exception hooks, then exit status 1
            run(10, [PressCtrlC(7)])
    (message,) = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    checkpoint = str(tmp_path / "ckpt" / "step=4.ckpt")
    assert message.startswith(f"AdaptivePrecision: training interrupted at step 7. Resume from {checkpoint} (step 4)")
    assert f"ckpt_path={checkpoint!r}" in message

    # TensorBoard reads a folder's event files in name order: time (seconds), host, pid, then a counter global to the
    # process, so two files of one second sort wrong once the counter passes 9 -> 10 (earlier tests' writers count).
    time.sleep(1.1)
    run(10, [], ckpt_path=checkpoint)
    accumulator = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    assert len(glob.glob(str(tmp_path / "tb" / "version_0" / "events.out.tfevents.*"))) == 2
    for tag in ("sage/loss", "sage/int8_fraction", "sage/precision_level/blocks.0.attn"):
        steps = [event.step for event in accumulator.Scalars(tag)]
        assert steps == list(range(10)), (tag, steps)
    images = [event.step for event in accumulator.Images("sage/precision")]
    assert images == sorted(set(images)), images


def test_an_interrupted_run_without_a_checkpoint_says_how_to_keep_one(tmp_path, caplog) -> None:
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=4), callbacks=[AdaptivePrecision(), PressCtrlC(2)])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        with pytest.raises(SystemExit):
            trainer.fit(TinyLM(), token_loader(4))
    (message,) = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert "at step 2. No checkpoint was saved" in message and "ModelCheckpoint(save_on_exception=True)" in message
