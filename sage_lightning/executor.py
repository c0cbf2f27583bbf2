"""The executor: carries out the policy's verdict on each optimizer step, between optimizer steps.

For a step whose signals the pipeline (:mod:`sage_lightning.pipeline`) has read, it asks the policy
(:class:`~sage_lightning.policy.PrecisionPolicy`) what to do, then does it: skips the step (its gradients dropped,
or on the device by a fused optimizer), rolls back to the last in-memory snapshot (:mod:`sage_lightning.snapshots`),
takes the snapshots, moves each layer to the precision the policy wants, counts what happened (:class:`Tally`),
reports it (console, :mod:`sage_lightning.tensorboard`), and stops a run whose divergence outlasted the rollback
budget with :class:`TrainingDiverged`. It decides nothing: the actions are the policy's (``"step"``, ``"skip"``,
``"rollback"``, ``"stop"``, and ``"undone"`` for a step applied before its verdict:
:meth:`PrecisionPolicy.after_the_step`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from sage_lightning import tensorboard
from sage_lightning.layer import AttentionLayerState
from sage_lightning.pipeline import StepPipeline, step_tokens
from sage_lightning.policy import Decision, LowBitShare, PrecisionPolicy, StepOutcome, StepSignals
from sage_lightning.precision_image import LevelHistory
from sage_lightning.signals import StepRecord
from sage_lightning.snapshots import Snapshots

__all__ = ["StepExecutor", "Tally", "TrainingDiverged", "drop_gradients"]


class TrainingDiverged(RuntimeError):
    """``AdaptivePrecision`` stopped training: a divergence persisted after the rollback budget was spent and no
    lever was left. The message says what was tried and where the last good weights were saved.

    Attributes:
        decision: the stop decision (its reason lists what was tried).
        checkpoint: the path of the checkpoint holding the last good weights.

    Example::

        try:
            trainer.fit(model)
        except TrainingDiverged as stop:
            model = MyModel.load_from_checkpoint(stop.checkpoint)   # the last good weights, and their precisions
    """

    def __init__(self, message: str, decision: Decision, checkpoint: str) -> None:
        super().__init__(message)
        self.decision = decision
        self.checkpoint = checkpoint


def drop_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """No gradient, no update: torch optimizers skip parameters whose ``.grad`` is ``None`` (moments, step counters
    and weight decay included); a GradScaler, if any, already recorded its inf checks."""
    for parameter in parameters:
        parameter.grad = None


@dataclasses.dataclass
class Tally:
    """What a run's verdicts add up to; :class:`~sage_lightning.AdaptivePrecision` shows each under the same name
    (``low_bit``: :attr:`~sage_lightning.AdaptivePrecision.int8_fraction`) and its checkpoints keep them."""

    history: list[Decision] = dataclasses.field(default_factory=list)
    tokens_seen: int = 0
    tokens_per_step: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    low_bit: LowBitShare = dataclasses.field(default_factory=LowBitShare)

    def state_dict(self) -> dict[str, Any]:
        """The counts, under the keys of ``AdaptivePrecision.state_dict``."""
        return {
            "history": [dataclasses.asdict(decision) for decision in self.history],
            "tokens_seen": self.tokens_seen,
            "tokens_per_step": self.tokens_per_step,
            "layer_steps": self.low_bit.layer_steps,
            "int8_layer_steps": self.low_bit.low_bit_layer_steps,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (checked already: ``checks.check_state``)."""
        self.history = [Decision(**decision) for decision in state["history"]]
        self.tokens_seen = int(state["tokens_seen"])
        self.tokens_per_step = int(state["tokens_per_step"])
        self.low_bit.layer_steps = int(state["layer_steps"])
        self.low_bit.low_bit_layer_steps = int(state["int8_layer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.rollbacks = int(state["rollbacks"])


class StepExecutor:
    """Verdicts, skips, rollbacks, snapshots and the stop, for one controlled run.

    Example::

        executor = StepExecutor(pipeline)
        executor.start(trainer, pl_module, policy, saved=None, check_first=True)   # the first snapshot
        executor.conclude(trainer, pl_module, record, applied=False, verbose=True, every=50, last_good_checkpoint=None)
    """

    def __init__(self, pipeline: StepPipeline) -> None:
        self.snapshots = Snapshots()
        self.tally = Tally()
        #: Every layer's level over the steps of this fit (the precision picture).
        self.level_history: LevelHistory | None = None
        self._policy: PrecisionPolicy | None = None
        self._pipeline = pipeline

    def start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        policy: PrecisionPolicy,
        saved: Mapping[str, Any] | None,
        *,
        check_first: bool,
    ) -> None:
        """Begin a fit deciding with ``policy`` on the pipeline's steps: every layer at the policy's precision; the
        checkpoint's snapshots (``saved``) or a first one; spare buffers for the candidates a step taken ahead of its
        verdict keeps (``check_first=False``)."""
        self._policy = policy
        self.apply_precisions()
        if saved is not None:
            # The uninterrupted run's snapshot (and candidate): a rollback lands where it would have.
            self.snapshots.load_state_dict(saved)
        else:
            self.snapshots.candidates = []
            self.snapshots.take(trainer, pl_module)
        if not check_first:
            self.snapshots.allocate_spare(trainer, pl_module)

    def before_optimizer_step(self, trainer: pl.Trainer) -> None:
        """Call before the optimizer step writes the parameters."""
        if trainer.strategy.root_device.type == "cuda":
            # The snapshot's copies must read the parameters before this step writes them.
            self.snapshots.wait_before_write(trainer.strategy.root_device)

    def skip_on_device(self, optimizer: Optimizer, grad_norm2: torch.Tensor, scaler: Any) -> bool:
        """Tell a fused optimizer to skip the step on the device when its gradients are non-finite (as a GradScaler
        tells it), so such a step is skipped without waiting for its verdict; whether it was told."""
        if scaler is not None or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        # A 0-dim float32 flag, as GradScaler hands it (fused Adam/AdamW subtract it from their 0-dim steps):
        # 0 * norm^2 is 0 for a finite norm and NaN for an infinite or NaN one, which becomes 1.
        optimizer.found_inf = grad_norm2.mul(0.0).nan_to_num_(nan=1.0).float()
        return True

    def apply_precisions(self) -> None:
        """Move every layer to the precision the policy wants for it now."""
        for name, layer in self._layers.items():
            wanted = self._require_policy().precision(name)
            if layer.precision is not wanted and layer.precision != wanted:
                layer.precision = wanted

    def conclude(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        record: StepRecord,
        *,
        applied: bool,
        verbose: bool,
        every: int,
        last_good_checkpoint: str | None,
    ) -> StepOutcome:
        """Decide about one step and carry it out; print its decisions (``verbose``) and log it (the quiet steps'
        scalars every ``every`` steps).

        ``applied=False``: before the step's optimizer step (``check_before_step``): a skip or a rollback drops
        its gradients. ``applied=True``: ``VERDICT_LAG`` steps later; a step that should not have been applied is
        undone by restoring the snapshot, unless the device already skipped it or it is harmless to keep (a one-off
        loss spike with finite gradients). The returned action is then ``"undone"``.

        Raises:
            TrainingDiverged: the policy stopped the run; the last good weights are saved in ``last_good_checkpoint``
                (``None``: ``<trainer.default_root_dir>/sage-last-good.ckpt``).
        """
        policy, tally = self._require_policy(), self.tally
        signals = self._pipeline.signals(trainer, record)
        tokens = signals.tokens
        tally.tokens_per_step = tokens
        tally.tokens_seen += tokens
        outcome = policy.decide(signals)
        if applied:
            outcome = policy.after_the_step(outcome, step=record.step, skipped_on_device=record.skipped_on_device)
        if outcome.action in ("rollback", "undone", "stop"):
            self.snapshots.restore(trainer, pl_module)
            tally.rollbacks += outcome.action != "stop"
        if not applied and outcome.action in ("skip", "rollback", "stop"):
            drop_gradients(self._pipeline.parameters)
        tally.skipped_steps += outcome.action == "skip"
        self.apply_precisions()
        tally.low_bit.count(len(self._layers), record.ran_int8)
        tally.history.extend(outcome.decisions)
        if verbose and outcome.decisions:  # the terminal's width asked only when there is something to print
            width = shutil.get_terminal_size().columns
            for decision in outcome.decisions:
                rank_zero_info(decision.console_text(width, "AdaptivePrecision: "))
        self._log_step(trainer, signals, outcome, every)
        self.snapshots.settle(record.step, undone=outcome.action in ("undone", "stop"))
        if outcome.action == "stop":
            self._stop(trainer, outcome.decisions[-1], last_good_checkpoint)
        return outcome

    def conclude_pending(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, until: int | None, **settings: Any
    ) -> bool:
        """Decide, in order, about every pending step up to step ``until`` (``None``: all of them); ``settings``:
        :meth:`conclude`'s.

        Returns:
            Whether one was undone (the weights went back to the snapshot). The pending steps after it are dropped
            unjudged: their updates were made from the undone weights (and were overwritten by the restore); their
            tokens and layer-steps were spent all the same.
        """
        for record in self._pipeline.due(until):
            if self.conclude(trainer, pl_module, record, applied=True, **settings).action == "undone":
                for dropped in self._pipeline.drop_pending():
                    self.tally.tokens_seen += step_tokens(dropped)
                    self.tally.low_bit.count(len(self._layers), dropped.ran_int8)
                return True
        return False

    def start_picture(self, trainer: pl.Trainer) -> None:
        """The precision picture starts at this fit's first step (a resumed fit draws from its checkpoint's step on)."""
        policy, step = self._require_policy(), trainer.global_step
        self.level_history = LevelHistory(list(self._layers), start=step)
        self.level_history.record(step, {name: policy.level(name) for name in self._layers})
        tensorboard.log_precision_legend(trainer, [rung.name for rung in policy.config.ladder], self._layers)
        tensorboard.log_precision_image(trainer, self.level_history, step, self._colours())

    def end_picture(self, trainer: pl.Trainer) -> None:
        """The precision picture to the run's last step."""
        if self.level_history is not None and self._policy is not None:
            last = max(trainer.global_step - 1, self.level_history.start)
            tensorboard.log_precision_image(trainer, self.level_history, last, self._colours())

    def after_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, action: str, *, pending: bool, every: int
    ) -> None:
        """After an optimizer step whose verdict was ``action`` (``"pending"``: on its way): the skip flags cleared,
        a snapshot every ``every`` steps (a candidate, ahead of the verdict, while ``pending``)."""
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf  # used by this step only
        if not self.snapshots.reserved:
            self.snapshots.reserve(trainer)  # after the first step, where the optimizers' state appears
        if trainer.global_step % every == 0:
            if action == "step":
                self.snapshots.take(trainer, pl_module)
            elif action == "pending" and pending:
                # Ahead of the step's verdict: kept apart until the verdict says the step was good.
                self.snapshots.take(trainer, pl_module, candidate=True)

    def _stop(self, trainer: pl.Trainer, decision: Decision, last_good_checkpoint: str | None) -> NoReturn:
        """Save the last good weights (restored already) and end training with :class:`TrainingDiverged`."""
        path = last_good_checkpoint or os.path.join(trainer.default_root_dir, "sage-last-good.ckpt")
        self._pipeline.drop_pending()
        trainer.save_checkpoint(path)  # every rank calls it (the decision is the same on all): it synchronises
        raise TrainingDiverged(
            f"AdaptivePrecision stopped training at step {decision.step}: {decision.reason}. The last good weights "
            f"(the snapshot of step {self.snapshots.step}) are saved in {path}. Look for the cause in the data or "
            "the model (the decisions are in AdaptivePrecision.history and TensorBoard's sage/decisions), or give the "
            "controller more room: PolicyConfig(max_rollbacks=...), a longer ladder, min_accumulate_grad_batches.",
            decision,
            path,
        )

    def _log_step(self, trainer: pl.Trainer, signals: StepSignals, outcome: StepOutcome, every: int) -> None:
        policy, tally = self._require_policy(), self.tally
        tensorboard.log_step(
            trainer,
            signals,
            outcome,
            levels={name: policy.level(name) for name in self._layers},
            counters={
                "tokens_per_step": tally.tokens_per_step,
                "tokens_seen": tally.tokens_seen,
                "int8_fraction": tally.low_bit.fraction,
                "tokens/accumulate_grad_batches": trainer.accumulate_grad_batches,
                "skipped_steps": tally.skipped_steps,
                "rollbacks": tally.rollbacks,
                "rollbacks_without_progress": policy.rollbacks_without_progress,
            },
            every=every,
            history=self.level_history,
            colours=self._colours(),
        )

    def _colours(self) -> int:
        """How many levels the picture colours: the base and each rung of the ladder."""
        return len(self._require_policy().config.ladder) + 1

    @property
    def _layers(self) -> dict[str, AttentionLayerState]:
        return self._pipeline.layers

    def _require_policy(self) -> PrecisionPolicy:
        if self._policy is None:
            raise RuntimeError("AdaptivePrecision: the policy is built in on_train_start; this hook ran before it.")
        return self._policy
