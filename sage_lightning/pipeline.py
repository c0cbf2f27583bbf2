"""The step pipeline: from an optimizer step's micro-batches to the policy's view of that step.

An optimizer step's accumulation window opens at its first micro-batch (which optional signals the policy wants, the
layers armed for them), gathers each micro-batch's loss and tokens, and closes at the optimizer step, where the
step's signals are packed into one vector and summed across ranks with one all-reduce (:mod:`sage_lightning.signals`
lays the vector out). Its verdict is taken at once (``check_before_step=True``) or :data:`VERDICT_LAG` steps later,
from the vector's copy in pinned host memory, the same step on every rank. :meth:`StepPipeline.signals` unpacks a
step's vector into the :class:`~sage_lightning.policy.StepSignals` the policy decides on; the executor
(:mod:`sage_lightning.executor`) carries the decision out.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import AttentionLayerState, take_nonfinite_flags
from sage_lightning.policy import PrecisionPolicy, SignalRequest, StepSignals
from sage_lightning.signals import (
    HEAD_FIELDS,
    VERDICT_LAG,
    HostCopies,
    SignalLayout,
    StepRecord,
    reduce,
    squared_grad_norm,
)

__all__ = ["VERDICT_LAG", "StepPipeline", "judge_before_step", "step_tokens"]


def judge_before_step(trainer: pl.Trainer, check_before_step: bool | None) -> bool:
    """Whether each step's verdict is taken before its optimizer step: ``check_before_step``, or where it is
    ``None``, when there is a GradScaler or an optimizer that cannot skip a step on the device."""
    if check_before_step is not None:
        return check_before_step
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is not None or not all(
        getattr(optimizer, "_step_supports_amp_scaling", False) for optimizer in trainer.optimizers
    )


class StepPipeline:
    """One fit's optimizer steps on their way to a verdict: the accumulation window, the packed and reduced
    signals, and the steps whose verdict is pending (``check_before_step=False``), oldest first.

    Example::

        pipeline.open_window(policy, step)                     # the step's first micro-batch
        pipeline.add_loss(loss)                                # each micro-batch
        record, grad_norm2 = pipeline.close_window(trainer, policy, scaler)   # the optimizer step
        pipeline.await_verdict(record)
        for due in pipeline.due(until=step - VERDICT_LAG):
            signals = pipeline.signals(trainer, due)         # signals.tokens: the step's, every rank's
    """

    def __init__(self) -> None:
        self.layers: dict[str, AttentionLayerState] = {}
        # The module's parameters, listed once per fit: walking the module tree for the gradients on every step cost
        # about 0.1 ms of host time (8 blocks, 83 parameters). Emptied when the fit ends, so that a callback kept for
        # its history keeps no model alive.
        self.parameters: list[torch.nn.Parameter] = []
        self.layout = SignalLayout(())
        #: The optional signals the step being accumulated measures.
        self.request = SignalRequest(ds_stats=False, probe=False)
        # The optimizer step being accumulated: opened by its first micro-batch, closed by the optimizer step.
        self.window_open = False
        # The first step of a fit runs the dS-statistics kernel variant even when the policy does not ask, so its
        # compilation and autotuning happen with the first step's, not as a stall later (its sums are dropped).
        self._warm_up = False
        self._discard_stats = False
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0
        self._window_tokens = 0
        #: Steps whose verdict is on its way (check_before_step=False), oldest first: at most VERDICT_LAG.
        self.pending: deque[StepRecord] = deque()
        #: Verdicts that found their step's signals not yet on the host and waited for them.
        self.verdict_waits = 0
        self._copies = HostCopies()
        # The layers' precisions as the last step ran them, and how many ran low-bit: recounted only when a
        # precision changed (the count walks every product of every layer).
        self._ran: tuple[tuple[AttentionPrecision, ...], int] = ((), 0)

    def start(
        self,
        layers: dict[str, AttentionLayerState],
        parameters: list[torch.nn.Parameter],
        pending: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Begin a fit with these layers and parameters, and the pending steps a checkpoint kept."""
        self.layers = layers
        self._ran = ((), 0)  # this fit's bases decide what counts as low-bit
        self.parameters = parameters
        self.layout = SignalLayout(tuple(layers))
        self.window_open = False
        self._warm_up = True
        self.pending = deque(StepRecord.from_state(saved) for saved in pending)

    def end(self) -> None:
        """Let go of the model's parameters (the fit ended, or failed)."""
        self.parameters = []

    # ------------------------------------------------------------------------------------ the window

    def open_window(self, policy: PrecisionPolicy, step: int) -> None:
        """Open the window of optimizer step ``step``: arm the layers for the signals the policy wants of it."""
        self.request = request = policy.signals_wanted(step)
        self._discard_stats = self._warm_up and not request.ds_stats
        self._warm_up = False
        for layer in self.layers.values():
            layer.collect_stats = request.ds_stats or self._discard_stats
            if request.probe:
                layer.arm_probe()
            if request.noise:
                layer.arm_noise(policy.config.noise_sequences)
        self._loss_sum = None
        self._micro_batches = 0
        self._window_tokens = 0
        self.window_open = True

    def add_tokens(self, tokens: int) -> None:
        """Count one micro-batch's tokens (this rank's)."""
        self._window_tokens += tokens

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss as Lightning hands it to backward: divided by ``accumulate_grad_batches``
        (and, with fp16 AMP, multiplied by the GradScaler's scale); both are undone once per step, when packed."""
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._micro_batches += 1

    def close_window(
        self, trainer: pl.Trainer, policy: PrecisionPolicy, scaler: Any
    ) -> tuple[StepRecord, torch.Tensor]:
        """Close the window at its optimizer step: the step's record (its signals packed and reduced across ranks)
        and its squared gradient norm on the device (summed across ranks where there are several)."""
        collecting = self.request.ds_stats or self._discard_stats
        packed, grad_norm2, short_head = self._pack(trainer, policy, scaler)
        precisions = tuple(layer.precision for layer in self.layers.values())
        if precisions != self._ran[0]:
            self._ran = (precisions, policy.low_bit_layers(precisions))
        record = StepRecord(
            step=trainer.global_step,
            packed=packed,
            request=self.request,
            grad_scaler=scaler is not None,
            ran_int8=self._ran[1],
            precisions=precisions,
            short_head=short_head,
        )
        if collecting:
            for layer in self.layers.values():
                layer.collect_stats = False
        self.window_open = False
        return record, grad_norm2

    def _pack(
        self, trainer: pl.Trainer, policy: PrecisionPolicy, scaler: Any
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, bool] | None]:
        """The step's raw signals on the device, summed across ranks (one all-reduce); the squared gradient norm
        on the device, summed across ranks where there are several (so every rank skips a non-finite step alike);
        and, for a short vector (:meth:`SignalLayout.pack_short`: one process, nothing optional measured), the host
        numbers it leaves out."""
        loss_sum = self._loss_sum
        if loss_sum is not None:
            if trainer.accumulate_grad_batches != 1:
                loss_sum = loss_sum * trainer.accumulate_grad_batches
            if scaler is not None:
                # The scale as a device tensor: GradScaler.get_scale() reads it on the host, a sync per step.
                scale = getattr(scaler, "_scale", None)
                loss_sum = loss_sum / (scale.reshape(()) if isinstance(scale, torch.Tensor) else scaler.get_scale())
        device = trainer.strategy.root_device
        grads = [grad for parameter in self.parameters if (grad := parameter.grad) is not None]
        grad_norm2 = squared_grad_norm(grads) if grads else torch.zeros((), dtype=torch.float32, device=device)
        if grad_norm2.device != device:  # gradients held elsewhere than the training device (a model split by hand)
            grad_norm2 = grad_norm2.to(device)
        nonfinite = take_nonfinite_flags(list(self.layers.values()), device)
        measures = self.request.ds_stats or self._discard_stats or self.request.probe or self.request.noise
        if trainer.world_size == 1 and not measures:
            # The usual step: only what the device holds goes to the host; no reduction on one process.
            short = self.layout.pack_short(loss_sum, grad_norm2, nonfinite)
            return short, grad_norm2, (self._micro_batches, self._window_tokens, bool(grads))
        ds_sums = qk_sums = None
        if self.request.ds_stats or self._discard_stats:
            # The sums stay on the device: no host sync for them, on this step or any.
            ds_sums = [layer.take_ds_stats_on_device() for layer in self.layers.values()]
            qk_sums = [layer.take_forward_stats_on_device() for layer in self.layers.values()]
            if self._discard_stats:
                ds_sums, qk_sums, self._discard_stats = None, None, False
        probes = [layer.take_probe() for layer in self.layers.values()] if self.request.probe else None
        noise = None
        if self.request.noise:
            noise = [layer.take_noise(policy.base(name)) for name, layer in self.layers.items()]
        packed = self.layout.pack(
            device,
            loss_sum=loss_sum,
            micro_batches=self._micro_batches,
            tokens=self._window_tokens,
            grad_norm2=grad_norm2 if grads else None,
            ds_sums=ds_sums,
            qk_sums=qk_sums,
            probes=probes,
            nonfinite=nonfinite,
            noise=noise,
        )
        total = reduce(trainer, packed)
        return total, total[HEAD_FIELDS.index("grad_norm2")], None

    # ------------------------------------------------------------------------------------ verdicts

    def await_verdict(self, record: StepRecord) -> None:
        """Queue a step whose verdict comes :data:`VERDICT_LAG` steps later: its signals start on their way to the
        host without waiting."""
        record.start_copy(self._copies)
        self.pending.append(record)

    def due(self, until: int | None) -> Iterator[StepRecord]:
        """The pending steps up to step ``until`` (``None``: all of them), oldest first, each taken off the queue as
        it is handed out."""
        while self.pending and (until is None or self.pending[0].step <= until):
            record = self.pending.popleft()
            self.verdict_waits += not record.ready()
            yield record

    def drop_pending(self) -> list[StepRecord]:
        """Take every pending step off the queue, unjudged (a step before them was undone)."""
        dropped = list(self.pending)
        self.pending.clear()
        return dropped

    def signals(self, trainer: pl.Trainer, record: StepRecord) -> StepSignals:
        """The policy's view of one step, from its reduced vector (its ``tokens``: the step's, every rank's)."""
        sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
        head, layers = self.layout.unpack(record.host_values(), sharded_grads=sharded)
        loss, grad_norm = head["loss"], head["grad_norm"]
        if not any(value is not None and not math.isfinite(value) for value in (loss, grad_norm)):
            # The layers' flags (taken with the step's signals, any rank's counts) say where a divergence started;
            # a flag that made nothing non-finite is moot.
            for name, signals in layers.items():
                if signals.nonfinite:
                    layers[name] = dataclasses.replace(signals, nonfinite=False)
        if record.precisions:
            # A verdict that lands after the verdict of an earlier step changed a layer's precision
            # (check_before_step=False) finds that layer measured at the old precision: it says nothing about the
            # new one, and acting on it would turn a lever a second time for what the first turn already answered.
            stale = [
                name
                for (name, layer), ran in zip(self.layers.items(), record.precisions, strict=True)
                if layer.precision is not ran and layer.precision != ran  # the same object, mostly: no field compare
            ]
            for name in stale:
                layers[name] = dataclasses.replace(
                    layers[name], ds_rel_err=None, qk_rel_err=None, probe=None, noise_ratio_ran=None
                )
        return StepSignals(
            step=record.step,
            loss=loss,
            grad_norm=grad_norm,
            layers=layers,
            grad_scaler=record.grad_scaler,
            tokens=int(head["tokens"]),
        )


def step_tokens(record: StepRecord) -> int:
    """The tokens of a step (every rank's), from its reduced vector."""
    return int(record.host_values()[HEAD_FIELDS.index("tokens")])
