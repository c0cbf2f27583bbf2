"""Where ``AdaptivePrecision``'s time goes: a window of training steps under ``torch.profiler``, per setting.

``overhead --profile-steps N`` runs the baseline, the defaults and the dS statistics on every step once more, ``N``
steps each after the warm-up, with the profiler on, and reports per optimizer step ``device_ms`` (each kernel's time
on CUDA, each operator's self time on the CPU: the setting's extra kernels against the baseline's) and ``host_ms``
(the wall time of each of the controller's hooks, ``AdaptivePrecision.<hook>`` ranges: where a host sync shows).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.controller.overhead_timing import (
    HOOKS,  # the controller's training hooks, each traced as ``AdaptivePrecision.<hook>``
    synchronize,
)
from benchmarks.kernels.profiling import kernel_ms

#: Prefix of the host ranges :func:`traced_hooks` adds.
PREFIX = "AdaptivePrecision."


def traced_hooks(controller: Callback) -> None:
    """Wrap ``controller``'s training hooks (those of :data:`HOOKS` it has) in ``record_function`` ranges, so a
    profile shows the host time of each; the hooks themselves do what they did."""
    for name in HOOKS:
        hook = getattr(controller, name, None)
        if hook is None:
            continue

        def traced(*args: Any, _hook: Any = hook, _name: str = name, **kwargs: Any) -> Any:
            with record_function(PREFIX + _name):
                return _hook(*args, **kwargs)

        setattr(controller, name, functools.wraps(hook)(traced))


class ProfilerWindow(Callback):
    """Profile optimizer steps ``start_step`` to ``start_step + steps - 1`` (the device synchronised at both ends;
    ``wall_s``: the time between, once closed). ``device_only``: on CUDA, the kernels only: no CPU operators, which slow
    the host when traced and count their kernels' time twice (``step_profile.py`` at 49163cf), nor the controller's
    hook ranges (CPU events). ``copies``: with shapes and stacks; :meth:`per_step`'s ``copies``: :func:`copy_calls`
    (its ``device_ms`` then counts the operators beside their kernels: read only its ``copies``)."""

    def __init__(self, start_step: int, steps: int, device_only: bool = False, copies: bool = False) -> None:
        self.start_step, self.steps, self.copies = start_step, steps, copies
        self.device_only = device_only and not copies
        self._profile: profile | None = None
        self._averages: Any = None
        self._copies: list[dict[str, Any]] = []
        self._started: float | None = None
        self.wall_s: float | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._profile is None and self._averages is None and trainer.global_step == self.start_step:
            synchronize(pl_module)
            cuda = [ProfilerActivity.CUDA] if pl_module.device.type == "cuda" else []
            activities = cuda if self.device_only and cuda else [ProfilerActivity.CPU, *cuda]
            verbose = torch._C._profiler._ExperimentalConfig(verbose=self.copies)  # verbose: the stacks are kept
            self._profile = profile(activities=activities, record_shapes=self.copies, with_stack=self.copies,
                                    experimental_config=verbose)  # fmt: skip
            self._profile.__enter__()
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._profile is not None and trainer.global_step >= self.start_step + self.steps:
            synchronize(pl_module)
            self._profile.__exit__(None, None, None)
            self._copies = copy_calls(self._profile, self.steps) if self.copies else []
            self._averages, self._profile = self._profile.key_averages(), None
            self.wall_s = time.perf_counter() - self._started

    def per_step(self, top: int = 25) -> dict[str, Any]:
        """Milliseconds per profiled step: the ``top`` kernels (or CPU operators) by self device time, and every
        traced hook's host time.
        """
        if self._averages is None:
            raise RuntimeError(
                f"ProfilerWindow: steps {self.start_step} to {self.start_step + self.steps - 1} were not all run; "
                "give the Trainer max_steps of at least start_step + steps."
            )
        hooks = [event for event in self._averages if event.key.startswith(PREFIX)]
        host = {event.key[len(PREFIX) :]: event.cpu_time_total / 1000 / self.steps for event in hooks}
        others = (event for event in self._averages if not event.key.startswith(PREFIX))
        device = kernel_ms(others, self.steps, cpu_time=not torch.cuda.is_available())
        ranked = dict(sorted(device.items(), key=lambda item: -item[1])[:top])
        found = {"steps": self.steps, "device_ms": ranked, "device_ms_total": sum(device.values()), "host_ms": host}
        return {**found, "copies": self._copies} if self.copies else found


def copy_calls(prof: profile, steps: int, top: int = 12) -> list[dict[str, Any]]:
    """The ``top`` groups of ``aten::copy_`` calls (by shapes and call site) of a profile taken with shapes and stacks,
    by GPU time a step: where a layout costs a copy."""
    events = prof.key_averages(group_by_input_shape=True, group_by_stack_n=8)
    found = [{"shapes": e.input_shapes, "stack": list(e.stack), "calls": e.count / steps,
              "device_ms": getattr(e, "device_time_total", 0) / 1000 / steps}
             for e in events if e.key == "aten::copy_"]  # fmt: skip
    return sorted(found, key=lambda c: -c["device_ms"])[:top]


#: The settings profiled (labels of ``overhead``'s ``SETTINGS``), the baseline first.
PROFILED = ("no callback", "callback, defaults", "callback, dS statistics every step")


def format_profile(profiles: dict[str, dict[str, Any]], baseline: str = "no callback", top: int = 12) -> str:
    """Markdown: each setting's kernels that cost more per step than the baseline's, and the controller's hooks'
    host time per step.
    """
    base = profiles[baseline]["device_ms"]
    lines = []
    for label, found in profiles.items():
        if label == baseline:
            continue
        extra = {name: ms - base.get(name, 0.0) for name, ms in found["device_ms"].items()}
        ranked = sorted(extra.items(), key=lambda item: -item[1])[:top]
        total = found["device_ms_total"] - profiles[baseline]["device_ms_total"]
        lines += [
            f"**{label}**, {found['steps']} profiled steps: device time {total:+.3f} ms per step against "
            f"{baseline}; the kernels that add most:",
            "",
            "| kernel | ms per step | against the baseline |",
            "|---|---:|---:|",
            *(f"| `{name[:70]}` | {found['device_ms'][name]:.3f} | {delta:+.3f} |" for name, delta in ranked),
            "",
            "Host time of the controller's hooks per step: "
            + (", ".join(f"{hook} {ms:.3f} ms" for hook, ms in sorted(found["host_ms"].items())) or "none traced")
            + ".",
            "",
        ]
    return "\n".join(lines)
