"""What makes the host wait for the device, counted on CPU: every call that would synchronise on a GPU (``.item()``,
``.tolist()``, ``bool(tensor)``, a number turned into a device tensor, ``torch.cuda.synchronize``, ...) made while
the package's code is on the stack, per optimizer step of a real Trainer run with ``check_before_step=False``.
The only read allowed is the fixed-lag one: the reduced signals of step ``t``, read from their host copy at step
``t + VERDICT_LAG``."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import sage_lightning.kernels
import torch
from lightning.pytorch.callbacks import Callback
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

import sage_lightning
from sage_lightning import AdaptivePrecision, PolicyConfig
from sage_lightning.signals import VERDICT_LAG

OURS = (os.path.dirname(sage_lightning.__file__) + os.sep, os.path.dirname(sage_lightning.kernels.__file__) + os.sep)
#: Where the fixed-lag read lives: the one host read a step may make.
LAG_READ = ("signals.py", "host_values")
#: What a probe step reads: each layer's comparison with float64 attention, and its metrics onto the device.
PROBE_READS = {"layer.py:compare_with_full_precision tolist", "signals.py:pack torch.tensor(device=...)"}


class HostSyncs(Callback):
    """Patches the calls that synchronise host and device on a GPU and records, per optimizer step, those made
    while a frame of the package (``sage_lightning/`` or its kernels) is on the stack, as ``file:function``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = -1
        self.calls: dict[int, list[str]] = {}
        tensor = torch.Tensor
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(tensor, name, self._counted(getattr(tensor, name), name))
        original_to = tensor.to

        def to(self_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # A copy to the host named as such ("cpu"; on a CPU-only run the training device is the CPU too, so a
            # .to(device) cannot be told apart) that does not say non_blocking waits for the device.
            targets = [*args, kwargs.get("device")]
            if "cpu" in targets and not kwargs.get("non_blocking", False):
                self._record("to(cpu)")
            return original_to(self_, *args, **kwargs)

        monkeypatch.setattr(tensor, "to", to)
        original_tensor = torch.tensor

        def new_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
            # Data from the host onto a device: a copy from pageable memory that synchronises the stream.
            if kwargs.get("device") is not None:
                self._record("torch.tensor(device=...)")
            return original_tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", new_tensor)
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize")):
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name), f"cuda.{name}"))

    def _counted(self, function: Callable, name: str) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._record(name)
            return function(*args, **kwargs)

        return counted

    def _record(self, what: str) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(OURS):
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                self.calls.setdefault(self.step, []).append(f"{where} {what}")
                return
            frame = frame.f_back

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.step = trainer.global_step  # the last verdicts, concluded at the end of training

    def others(self, probe_steps: tuple[int, ...] = (0,)) -> dict[int, list[str]]:
        """Every recorded call but the fixed-lag reads and, on probe steps (the policy probes at step 0), the
        probe's own (it compares with float64 attention on the host's word), by step."""
        lag = "{}:{} tolist".format(*LAG_READ)
        found = {
            step: [c for c in calls if c != lag and not (step in probe_steps and c in PROBE_READS)]
            for step, calls in self.calls.items()
        }
        return {step: calls for step, calls in found.items() if calls}

    def lag_reads(self) -> dict[int, int]:
        lag = "{}:{} tolist".format(*LAG_READ)
        return {step: calls.count(lag) for step, calls in self.calls.items() if lag in calls}


def fit(
    tmp_path, monkeypatch, config: PolicyConfig, steps: int, **callback: Any
) -> tuple[HostSyncs, AdaptivePrecision]:
    torch.manual_seed(0)
    controller = AdaptivePrecision(config, snapshot_every_n_steps=3, verbose=False, **callback)
    syncs = HostSyncs(monkeypatch)
    # The counter first: it sees the controller's hooks of a step under that step's number.
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=steps), callbacks=[syncs, controller])
    trainer.fit(TinyLM(fused=True, optimizer="adamw"), token_loader(steps))
    monkeypatch.undo()
    return syncs, controller


def test_the_counter_sees_a_host_read_made_under_the_package(tmp_path, monkeypatch) -> None:
    """The instrument itself: a tokens_fn that reads a tensor's value, called by the controller's hook, is seen at
    every step; the fixed-lag reads are one per step from step VERDICT_LAG on, the rest at the end of training."""

    def tokens_fn(batch: list[torch.Tensor]) -> int:
        (ids,) = batch
        return int(ids.sum().item() * 0) + ids.numel()

    quiet = PolicyConfig(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    syncs, _ = fit(tmp_path, monkeypatch, quiet, 4, tokens_fn=tokens_fn)
    assert syncs.others() == {step: ["callback.py:on_train_batch_start item"] for step in range(4)}
    assert syncs.lag_reads() == {2: 1, 3: 1, 4: 2}


def test_without_the_per_step_sync_no_step_waits_for_the_device(tmp_path, monkeypatch) -> None:
    """Calm steps, snapshot steps (every 3), the progress bar's values, dS-statistics steps (every 4 and the first):
    no host read but the fixed-lag one, which reads step t's signals at step t + VERDICT_LAG."""
    steps = 9
    syncs, controller = fit(
        tmp_path, monkeypatch, PolicyConfig(ds_stats_every_n_steps=4, probe_every_n_steps=10**9), steps
    )
    assert controller.history == [] and controller.verdict_waits == 0
    assert syncs.others() == {}
    assert syncs.lag_reads() == {**dict.fromkeys(range(VERDICT_LAG, steps), 1), steps: VERDICT_LAG}


def test_a_non_finite_step_is_judged_without_waiting_for_the_device(tmp_path, monkeypatch) -> None:
    """Infinite gradients at step 2: the fused optimizer skips it on the device; its verdict (skip, at step 4) reads
    the layers' non-finite flags from the same host copy as the other signals, not one host read per layer."""
    model = TinyLM(fused=True, optimizer="adamw")
    torch.manual_seed(0)
    model.head.bias.register_hook(lambda grad: grad * math.inf if model.trainer.global_step == 2 else grad)
    controller = AdaptivePrecision(PolicyConfig(ds_stats_every_n_steps=1000, probe_every_n_steps=1000), verbose=False)
    syncs = HostSyncs(monkeypatch)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6), callbacks=[syncs, controller])
    trainer.fit(model, token_loader(6))
    monkeypatch.undo()
    (decision,) = controller.history
    assert (decision.step, decision.lever, decision.new) == (2, "optimizer_step", "skip")
    assert controller.skipped_steps == 1 and controller.rollbacks == 0
    assert syncs.others() == {}


def test_verdicts_two_steps_late_decide_as_the_check_before_each_step(tmp_path) -> None:
    """The same measured escalation with and without the check before the step: the same decisions, about the same
    steps; without it they take effect two steps later (from step 5, not 3)."""

    class Precisions(Callback):
        def __init__(self) -> None:
            self.ds: list[tuple[str, ...]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            layers = sage_lightning.attention_layers(pl_module).values()
            self.ds.append(tuple(layer.precision.ds for layer in layers))

    runs = {}
    for check in (True, False):
        torch.manual_seed(0)
        config = PolicyConfig(
            ds_stats_every_n_steps=2, probe_every_n_steps=10**9, ds_rel_err_high=0.01, ds_rel_err_low=0.005
        )
        controller = AdaptivePrecision(config, check_before_step=check, verbose=False)
        precisions = Precisions()
        trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=8), callbacks=[controller, precisions])
        trainer.fit(TinyLM(fused=True, optimizer="adamw"), token_loader(8))
        runs[check] = ([str(d) for d in controller.history], precisions.ds)
    (checked, checked_ds), (lagged, lagged_ds) = runs[True], runs[False]
    assert checked == lagged and [d.split(":")[0] for d in checked] == ["step 2", "step 2"]
    int8, bf16 = ("int8", "int8"), ("bf16", "bf16")
    assert checked_ds == [int8] * 3 + [bf16] * 5
    assert lagged_ds == [int8] * (3 + VERDICT_LAG) + [bf16] * (5 - VERDICT_LAG)
