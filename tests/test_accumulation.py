"""Tokens per step: accumulate_grad_batches changes only where windows align, gradients stay those of manual
accumulation before and after a change, and the loss per optimizer step undoes Lightning's division."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tiny_lightning import MemoryLogger, TinyLM, lm_loss, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers

DS_BF16 = AttentionPrecision(ds="bf16")


class WindowRecorder(Callback):
    """Per optimizer step: its micro-batches, the accumulation, parameters and precisions at its start, and
    the gradients Lightning accumulated (placed after AdaptivePrecision, so it sees the window as applied)."""

    def __init__(self) -> None:
        self.windows: list[dict] = []
        self._current: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._current is None:
            self._current = {
                "step": trainer.global_step,
                "accumulate": trainer.accumulate_grad_batches,
                "batch_idx": [],
                "ids": [],
                "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                "precisions": {n: s.precision for n, s in attention_layers(pl_module).items()},
            }
        self._current["batch_idx"].append(batch_idx)
        self._current["ids"].append(batch[0].clone())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._current["grads"] = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        self.windows.append(self._current)
        self._current = None


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """accumulate 4; a NaN loss at step 2 rolls back and, every layer's dS being bf16 already, halves the tokens
    per step; after 3 calm steps they double back at the first batch index where a 4-window starts."""
    torch.manual_seed(0)
    model = TinyLM(precision=DS_BF16, nan_loss_at_step=2)
    controller = AdaptivePrecision(
        PolicyConfig(calm_steps=3, ds_stats_every_n_steps=1000, probe_every_n_steps=1000),
        log_every_n_steps=1,
        verbose=False,
    )
    recorder = WindowRecorder()
    logger = MemoryLogger()
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path_factory.mktemp("acc"), max_steps=9, accumulate_grad_batches=4, logger=logger),
        callbacks=[controller, recorder],
    )
    trainer.fit(model, token_loader(40))
    return {"model": model, "controller": controller, "windows": recorder.windows, "logger": logger}


def test_accumulation_changes_only_where_both_windows_start(run: dict) -> None:
    windows = [(w["step"], w["accumulate"], w["batch_idx"]) for w in run["windows"]]
    assert windows == [
        (0, 4, [0, 1, 2, 3]),
        (1, 4, [4, 5, 6, 7]),
        (2, 4, [8, 9, 10, 11]),  # NaN loss: rolled back, accumulate 4 -> 2 (batch 12 starts both windows)
        (3, 2, [12, 13]),
        (4, 2, [14, 15]),
        (5, 2, [16, 17]),  # calm for 3 steps: 2 -> 4 decided here ...
        (6, 2, [18, 19]),  # ... but batch 18 starts no 4-window, so one more 2-window
        (7, 4, [20, 21, 22, 23]),
        (8, 4, [24, 25, 26, 27]),
    ]
    levers = [(d.step, d.lever, d.old, d.new) for d in run["controller"].history]
    assert levers == [
        (2, "rollback", "step 2", "last snapshot"),
        (2, "accumulate_grad_batches", "4", "2"),
        (5, "accumulate_grad_batches", "2", "4"),
    ]


def test_gradients_equal_manual_accumulation_before_and_after_changes(run: dict) -> None:
    reference = TinyLM(precision=DS_BF16)
    reference.configure_model()
    layers = attention_layers(reference)
    compared = 0
    for window in run["windows"]:
        if window["step"] == 2:
            assert window["grads"] == {}  # the rolled-back step: its gradients were dropped before the update
            continue
        reference.load_state_dict(window["params"])
        for name, precision in window["precisions"].items():
            layers[name].precision = precision
        reference.zero_grad(set_to_none=True)
        for ids in window["ids"]:
            (lm_loss(reference, ids) / window["accumulate"]).backward()
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(window["grads"][name], parameter.grad, rtol=0, atol=0)
        compared += 1
    assert compared == 8


def test_loss_per_optimizer_step_undoes_lightnings_division(run: dict) -> None:
    raw = iter(run["model"].step_losses)  # training_step's own values, in order
    logged = run["logger"].series("sage/loss")
    for window in run["windows"]:
        expected = sum(next(raw) for _ in window["batch_idx"]) / len(window["batch_idx"])
        if math.isnan(expected):
            assert window["step"] == 2 and math.isnan(logged[2])  # the injected NaN is logged as it was
        else:
            assert logged[window["step"]] == pytest.approx(expected, rel=1e-6)


def test_tokens_per_step_follow_the_accumulation(run: dict) -> None:
    logger, per_batch = run["logger"], 2 * 33  # token ids [2, 33] per micro-batch
    tokens = logger.series("sage/tokens_per_step")
    assert {step: tokens[step] for step in (1, 3, 7)} == {1: 4 * per_batch, 3: 2 * per_batch, 7: 4 * per_batch}
    assert logger.series("sage/tokens_seen")[8] == (4 * 5 + 2 * 4) * per_batch
    assert logger.series("sage/tokens/accumulate_grad_batches")[3] == 2
    assert run["controller"].tokens_seen == (4 * 5 + 2 * 4) * per_batch
