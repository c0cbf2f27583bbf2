"""How ``benchmarks.controller.overhead`` times a run, and keeps one run from weighing on the next.

* :class:`StepTimer`: the wall time of each optimizer step (the mean and the median of the measured ones).
* :class:`HookClock`: the host time of the controller's own hooks per step (``perf_counter`` around each, no sync).
* :func:`isolated`: one setting's run from the same start as every other. A Trainer, its module, optimizer and
  callbacks hold one another in reference cycles, freed only by a full collection; without it the last of 16 runs
  started with 14 earlier runs' models and snapshots still alive (up to 4 GB a run on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


@dataclasses.dataclass
class RunCosts:
    """What one run spent beside the model and the callback: wall ms in Python's cyclic garbage collector (warm-up
    included) and the CUDA caching allocator's retries (an allocation that failed, every cached block released and the
    allocation tried again: memory held elsewhere, or fragmented; 0 on the CPU)."""

    gc_ms: float = 0.0
    alloc_retries: int = 0


@contextlib.contextmanager
def isolated(device: str) -> Iterator[RunCosts]:
    """Collect every earlier run's garbage and return the CUDA caching allocator's free blocks, then time the
    collector (and count the allocator's retries) until the block ends.
    """
    gc.collect()
    cuda = device == "cuda"
    retries = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    costs = RunCosts()
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            costs.gc_ms += 1000 * (time.perf_counter() - started[0])

    gc.callbacks.append(timed)
    try:
        yield costs
    finally:
        gc.callbacks.remove(timed)
        if cuda:
            costs.alloc_retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries


#: The controller's hooks that run during training steps.
HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class HookClock:
    """The host seconds each optimizer step spends in a callback's training hooks (:data:`HOOKS`), each call timed
    with ``perf_counter`` (no sync; about a microsecond per call) and charged to the step it ran in.

    Replaces the profiler's hook ranges, which read 0 ms for ``on_before_optimizer_step`` (it runs inside Lightning's
    optimizer closure) and slow the host they measure. The callback's instance attributes are wrapped, its class
    untouched."""

    def __init__(self, callback: Callback) -> None:
        self.seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._step = 0
        for name in HOOKS:
            hook = getattr(callback, name, None)
            if hook is not None:
                setattr(callback, name, self._timed(name, hook))

    def _timed(self, name: str, hook: Any) -> Any:
        def timed(trainer: L.Trainer, *args: Any, **kwargs: Any) -> Any:
            if name == "on_train_batch_start":
                self._step = trainer.global_step  # the optimizer step this batch belongs to, to its end
            started = time.perf_counter()
            try:
                return hook(trainer, *args, **kwargs)
            finally:
                self.seconds[self._step][name] += time.perf_counter() - started

        return timed

    def per_step(self, skip: int) -> dict[int, dict[str, float]]:
        """Milliseconds per hook of each step from step ``skip`` on, by step."""
        return {
            step: {name: 1000 * seconds for name, seconds in hooks.items()}
            for step, hooks in sorted(self.seconds.items())
            if step >= skip
        }

    def summary(self, skip: int) -> dict[str, Any]:
        """``median_ms`` and ``mean_ms`` of the hooks' total per step from step ``skip`` on, the median of each
        hook (``by_hook_ms``), and each step's total (``step_ms``, by step, for finding the slow ones)."""
        steps = self.per_step(skip)
        totals = {step: sum(hooks.values()) for step, hooks in steps.items()}
        if not totals:
            return {"median_ms": 0.0, "mean_ms": 0.0, "by_hook_ms": {}, "step_ms": {}}
        by_hook = {name: statistics.median(hooks.get(name, 0.0) for hooks in steps.values()) for name in HOOKS}
        return {
            "median_ms": statistics.median(totals.values()),
            "mean_ms": statistics.fmean(totals.values()),
            "by_hook_ms": {name: ms for name, ms in by_hook.items() if ms > 0},
            "step_ms": totals,
        }


def synchronize(pl_module: L.LightningModule) -> None:
    """Wait for the module's device (a no-op off CUDA)."""
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)


class StepTimer(Callback):
    """Wall time of each optimizer step, the device synchronised at its end; with ``step_sync=False`` on CUDA,
    synchronised only where the measured window starts (the end of step ``skip - 1``) and ends, each step's end
    marked by a CUDA event: the mean is then the window's wall time over its steps, the median the device's. ``skip``:
    the warm-up steps before the measured window."""

    def __init__(self, step_sync: bool = True, skip: int = 0) -> None:
        self.ends: list[float] = []
        self.step_sync = step_sync
        self.skip = skip
        self._step = -1
        self._events: list[torch.cuda.Event] = []
        self._window_start = 0.0
        self._window_ms = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        synchronize(pl_module)
        self.ends.append(time.perf_counter())
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self._step:
            return  # an optimizer step did not end with this batch
        self._step = trainer.global_step
        if self._events_only(pl_module):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
            if len(self._events) == self.skip:
                synchronize(pl_module)
                self._window_start = time.perf_counter()
            return
        synchronize(pl_module)
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._events_only(pl_module):
            synchronize(pl_module)
            self._window_ms = 1000 * (time.perf_counter() - self._window_start)

    def _events_only(self, pl_module: L.LightningModule) -> bool:
        return not self.step_sync and pl_module.device.type == "cuda"

    def step_ms(self, skip: int) -> float:
        """Mean milliseconds per step after the first ``skip`` steps (on CUDA without the per-step sync: from the
        end of step ``skip - 1`` to the last step's end by the events, host stalls included, train-end hooks not)."""
        if self._events:
            return self._events[skip - 1].elapsed_time(self._events[-1]) / (len(self._events) - skip)
        ends = self.ends[skip:]
        return 1000 * (ends[-1] - ends[0]) / (len(ends) - 1)

    def end_ms(self, skip: int) -> float:
        """Wall milliseconds from the last step's end to ``on_train_end`` (the callbacks before this one in the
        list, their ``on_train_end`` included): 0 unless on CUDA without the per-step sync."""
        return self._window_ms - self.step_ms(skip) * (len(self._events) - skip) if self._events else 0.0

    def durations_ms(self, skip: int) -> list[float]:
        """Each measured step's milliseconds after the first ``skip`` steps, in order (from the events' times on
        CUDA without the per-step sync: the device's pace)."""
        if self._events:
            measured = self._events[skip - 1 :]
            return [a.elapsed_time(b) for a, b in zip(measured, measured[1:], strict=False)]
        ends = self.ends[skip:]
        return [1000 * (later - earlier) for earlier, later in zip(ends, ends[1:], strict=False)]

    def median_step_ms(self, skip: int) -> float:
        """Median milliseconds of one step after the first ``skip`` steps: a cost paid on every step moves it, one
        paid on rare steps (dS statistics, snapshots, probes) does not."""
        return statistics.median(self.durations_ms(skip))
