r"""
Adaptive Precision
^^^^^^^^^^^^^^^^^^

Watch the signals that predict trouble in SageBwd attention training and turn the precision levers per layer,
between optimizer steps. The hooks live here, and only the hooks: the step pipeline (accumulation window, packing,
reduction across ranks, delayed verdicts: :mod:`sage_lightning.pipeline`), the executor (skip, rollback, snapshots,
stop: :mod:`sage_lightning.executor`), the checks of arguments, fit and checkpoint state
(:mod:`sage_lightning.checks`) and every TensorBoard tag (:mod:`sage_lightning.tensorboard`) have modules of their
own, and only the policy (:mod:`sage_lightning.policy`) authors decisions and counts the low-bit share.

"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from sage_lightning import tensorboard
from sage_lightning.checks import (
    STATE_VERSION,
    check_arguments,
    check_fit,
    check_state,
    checkpoint_bases,
    fit_hparams,
    upgrade_state,
)
from sage_lightning.console import attention_summary, quiet_lightning_noise, resume_instructions
from sage_lightning.executor import StepExecutor, TrainingDiverged, drop_gradients
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer_checkpoint import CHECKPOINT_KEY, checkpoint_file_problem
from sage_lightning.mixin import SageAttentionMixin
from sage_lightning.pipeline import VERDICT_LAG, StepPipeline, judge_before_step
from sage_lightning.policy import Decision, PolicyConfig, PrecisionPolicy, SignalRequest
from sage_lightning.signals import count_tokens

__all__ = ["STATE_VERSION", "AdaptivePrecision", "TrainingDiverged", "count_tokens"]


class _Tallied:
    """An attribute of :class:`AdaptivePrecision` kept in its executor's :class:`~sage_lightning.executor.Tally`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, controller: AdaptivePrecision | None, owner: type | None = None) -> Any:
        return self if controller is None else getattr(controller._executor.tally, self.name)

    def __set__(self, controller: AdaptivePrecision, value: Any) -> None:
        setattr(controller._executor.tally, self.name, value)


class AdaptivePrecision(Callback):
    r"""Adapt every SageBwd attention layer's precision to the signals of training, and survive divergences.

    Each optimizer step, the callback gathers the step's signals (the loss per optimizer step, the gradient
    norm, non-finite values; every ``ds_stats_every_n_steps`` the per-layer dS quantization error, every
    ``probe_every_n_steps`` a comparison of each layer with full-precision attention), reduces them across
    ranks with one all-reduce, and asks a :class:`~sage_lightning.policy.PrecisionPolicy` what to do. Between
    optimizer steps it then:

    * moves each layer to the rung that fixes what its signals blame (``smooth_q`` for the forward, ``ds="bf16"``
      for dS, ``dv="bf16"`` for dV, ``mode="full"`` for anything and straight away for a catastrophic probe
      reading), checks every escalation with a probe on the next step, and steps down after calm periods;
    * skips an optimizer step whose gradients are non-finite (the gradients are dropped, so the optimizer
      leaves parameters and its state alone; with fp16 AMP the ``GradScaler`` already does this and the
      callback lets it);
    * skips the step of a one-off hard loss spike; on a non-finite loss or repeated hard spikes, restores the
      last in-memory snapshot of model and optimizer (taken every ``snapshot_every_n_steps`` on CPU), skips the
      step, and escalates where the divergence started;
    * when the rollback budget is spent (``PolicyConfig.max_rollbacks`` rollbacks without progress) and no lever
      is left, restores the last snapshot, saves it as a checkpoint (``last_good_checkpoint``) and stops training
      with :class:`TrainingDiverged`, whose message says what was tried;
    * changes ``trainer.accumulate_grad_batches`` (tokens per step) at the first batch where the old and the
      new accumulation windows both start, so no step mixes gradients of two settings.

    When training ends it prints one line on what ran (layers served by SageBwd, calls sent to SDPA and why,
    decisions, low-bit share: :func:`~sage_lightning.attention_summary`); after Ctrl-C, where and how to resume
    (:func:`~sage_lightning.console.resume_instructions`). A resumed fit marks its restart in TensorBoard, so the
    steps the interrupted run logged after the checkpoint are shown once
    (:func:`~sage_lightning.tensorboard.purge_from`).

    Every decision is kept in :attr:`history`, logged with its reason as a TensorBoard text event
    (``sage/decisions``) and the signals as ``sage/`` scalars (see :mod:`sage_lightning.tensorboard`); the
    progress bar shows ``int8_share`` and ``tokens_per_step``. The controller's settings (:attr:`hparams`) join the
    module's hyperparameters in every logger, under ``adaptive_precision``. The state (every layer's precision, the
    policy's counters and detectors, the tokens setting, the snapshot a rollback returns to and its step) is saved
    in checkpoints, so a resumed run decides, and rolls back, as the uninterrupted one would. Each layer's precision is
    also saved with the module (``SageAttentionMixin``'s checkpoint hooks), so it survives a resume without the
    callback.

    The model must have SageBwd attention layers (``SageAttentionMixin`` or ``convert_to_sage_attention``) and
    use automatic optimization.

    Args:
        config: the policy's thresholds and cadences; :class:`~sage_lightning.policy.PolicyConfig` defaults
            when ``None`` (``docs/controller.md`` gives the measurement behind each).
        snapshot_every_n_steps: optimizer steps between in-memory snapshots (model and optimizer state, on CPU)
            a divergence rolls back to. One is also taken when training starts.
        snapshot_in_checkpoint: save the snapshot in checkpoints (one more copy of the model and optimizer state
            in each file), so a resumed run rolls back to the same weights as the uninterrupted one. ``False``:
            smaller checkpoints, and a resumed run's first snapshot is taken when it starts.
        last_good_checkpoint: where to save the last good weights when the controller stops a run; ``None``:
            ``<trainer.default_root_dir>/sage-last-good.ckpt``.
        tokens_fn: ``tokens_fn(batch) -> int``, the tokens in one micro-batch on one rank. The default counts
            the elements of the batch if it is a tensor, of ``batch["input_ids"]`` or the first tensor value of
            a mapping, or of the first tensor of a list or tuple (token ids shaped ``[batch, seq]``).
        log_every_n_steps: optimizer steps between scalar logs when nothing happens (steps with a decision, a
            spike or a measurement are always logged); the Trainer's ``log_every_n_steps`` when ``None``.
        progress_bar: show ``int8_share`` and ``tokens_per_step`` in the progress bar.
        verbose: print every decision, and when training ends one line on what ran (rank 0;
            :func:`~sage_lightning.attention_summary` gives that line too).
        check_before_step: ``True``: read each step's signals before its optimizer step, so a step with
            non-finite gradients is skipped outright. That takes one host sync per step, which leaves the GPU
            idle while the host launches the optimizer step and the next forward (``benchmarks/overhead.py``
            measures it). ``False``: the signals of step ``t`` are copied to pinned host memory without waiting
            and read at step ``t + 2`` (:data:`~sage_lightning.signals.VERDICT_LAG`), on every rank, when the copy
            is long done: no host sync on any step that does not probe or roll back. Decisions about step ``t`` then
            take effect from step ``t + 3`` instead of ``t + 1``; a step with non-finite gradients is still
            skipped on the device by fused optimizers (``torch.optim.AdamW(..., fused=True)``), as under a
            GradScaler, and undone by a rollback with other optimizers; a NaN loss or a repeated loss spike rolls
            back two more steps. Snapshots are then taken ahead of their step's verdict, so the good one and one
            candidate (two with ``snapshot_every_n_steps=1``) are kept in host memory. ``None`` (default):
            ``False`` when every optimizer can skip a step on the device (fused Adam, AdamW, SGD, Adagrad) and there
            is no GradScaler, ``True`` otherwise.

    Raises:
        TypeError: an argument the callback does not take; a :class:`~sage_lightning.PolicyConfig` field (a
            threshold such as ``ds_rel_err_high``) is named with the call that sets it,
            ``AdaptivePrecision(PolicyConfig(ds_rel_err_high=0.1))``.
        ValueError: an argument of the wrong type or out of range; the message names it, the value received
            and what works. From ``load_state_dict``: a checkpoint state this callback did not write.
        MisconfigurationException: at the start of training, when the model has no SageBwd attention layer,
            uses manual optimization, the Trainer also has a ``GradientAccumulationScheduler``, or the checkpoint's
            attention layers are not the model's.
        TrainingDiverged: the rollback budget is spent and no lever is left.

    Example::

        import lightning as L
        from sage_lightning import AdaptivePrecision, PolicyConfig

        controller = AdaptivePrecision(PolicyConfig(ds_rel_err_high=0.2), snapshot_every_n_steps=200)
        trainer = L.Trainer(callbacks=[controller], accumulate_grad_batches=4)
        trainer.fit(model)          # a LightningModule with SageAttentionMixin
        for decision in controller.history:
            print(decision)

    .. note:: What the rollback does not rewind: the data (the steps since the snapshot are not replayed), the
        learning-rate schedule (the current learning rate is kept) and ``trainer.global_step``. Optimizers that
        change parameters without a gradient (``p.grad is None``) would still move on a skipped step; every
        ``torch.optim`` optimizer leaves them alone.
    """

    #: Every decision taken, oldest first (restored from checkpoints).
    history: list[Decision] = _Tallied()  # type: ignore[assignment]
    #: Tokens seen so far and in the last concluded optimizer step (every rank's); optimizer steps skipped and
    #: rollbacks so far.
    tokens_seen: int = _Tallied()  # type: ignore[assignment]
    tokens_per_step: int = _Tallied()  # type: ignore[assignment]
    skipped_steps: int = _Tallied()  # type: ignore[assignment]
    rollbacks: int = _Tallied()  # type: ignore[assignment]

    def __init__(
        self,
        config: PolicyConfig | None = None,
        *,
        snapshot_every_n_steps: int = 100,
        tokens_fn: Callable[[Any], int] | None = None,
        log_every_n_steps: int | None = None,
        progress_bar: bool = True,
        verbose: bool = True,
        check_before_step: bool | None = None,
        snapshot_in_checkpoint: bool = True,
        last_good_checkpoint: str | os.PathLike | None = None,
        **unexpected: Any,
    ) -> None:
        super().__init__()
        check_arguments(
            AdaptivePrecision.__init__,
            unexpected,
            config=config,
            snapshot_every_n_steps=snapshot_every_n_steps,
            tokens_fn=tokens_fn,
            log_every_n_steps=log_every_n_steps,
            progress_bar=progress_bar,
            verbose=verbose,
            check_before_step=check_before_step,
            snapshot_in_checkpoint=snapshot_in_checkpoint,
            last_good_checkpoint=last_good_checkpoint,
        )
        # Made before the Trainer, which prints Lightning's litlogger tip: the run's console keeps what matters.
        quiet_lightning_noise()
        self.config = config or PolicyConfig()
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.tokens_fn = tokens_fn or count_tokens
        self.log_every_n_steps = log_every_n_steps
        self.progress_bar = progress_bar
        self.verbose = verbose
        self.check_before_step = check_before_step
        self.snapshot_in_checkpoint = snapshot_in_checkpoint
        self.last_good_checkpoint = None if last_good_checkpoint is None else os.fspath(last_good_checkpoint)

        self._policy: PrecisionPolicy | None = None
        self._pipeline = StepPipeline()
        self._executor = StepExecutor(self._pipeline)
        self._bases: dict[str, AttentionPrecision] = {}
        self._pending_state: dict[str, Any] | None = None
        self._module_warned = False
        self._applied_accumulate: int | None = None
        self._check_first = True
        self._last_action: str | None = None

    # ---------------------------------------------------------------------------------------------- reading

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The policy deciding for this run; ``None`` before training starts."""
        return self._policy

    @property
    def int8_fraction(self) -> float:
        """Share of layer-steps so far that ran low-bit: their layer's base precision is SageBwd (or Attn-QAT)
        and every product it runs in INT8 or FP8 still did, in that format. A layer whose base precision is full,
        or SageBwd with every product in bf16, counts as not low-bit (a run that starts in ``mode="full"`` shows
        0). 1 before the first step. (Named for INT8, the default; FP8 products count the same.)"""
        return self._executor.tally.low_bit.fraction

    @property
    def verdict_waits(self) -> int:
        """How many verdicts (``check_before_step=False``) found their step's signals not yet on the host
        :data:`~sage_lightning.signals.VERDICT_LAG` steps later and waited for them: on a GPU the host then ran
        further ahead of the device than the lag; 0 on the CPU. ``benchmarks/overhead.py`` records it."""
        return self._pipeline.verdict_waits

    @property
    def snapshot_step(self) -> int | None:
        """The optimizer step of the snapshot a rollback would restore now; ``None`` before training starts."""
        return self._executor.snapshots.step

    @property
    def _request(self) -> SignalRequest:
        """The optional signals the optimizer step being accumulated measures."""
        return self._pipeline.request

    def precisions(self) -> dict[str, AttentionPrecision]:
        """Every controlled layer's current precision, by name (empty before training starts)."""
        return self._policy.precisions() if self._policy is not None else {}

    @property
    def hparams(self) -> dict[str, Any]:
        """The controller's settings as plain values, logged under ``"adaptive_precision"`` (``hparams.yaml``,
        TensorBoard's HParams): every :class:`~sage_lightning.policy.PolicyConfig` field under ``config`` (the ladder
        as its rung names; the fit GPU's in the logs) and the arguments that change what the callback does.

        Example::

            AdaptivePrecision(PolicyConfig(ds_rel_err_high=0.15)).hparams["config"]["ds_rel_err_high"]   # 0.15
        """
        config = {field.name: getattr(self.config, field.name) for field in dataclasses.fields(self.config)}
        config["ladder"] = [rung.name for rung in self.config.ladder]
        return {
            "config": config,
            "snapshot_every_n_steps": self.snapshot_every_n_steps,
            "snapshot_in_checkpoint": self.snapshot_in_checkpoint,
            "check_before_step": self.check_before_step,
            "log_every_n_steps": self.log_every_n_steps,
        }

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # setup runs before Lightning logs the module's hyperparameters, whose first call to a TensorBoardLogger
            # writes the HParams session TensorBoard shows: the settings must be in it (tensorboard.log_hyperparams).
            tensorboard.log_hyperparams(trainer, fit_hparams(self.hparams, self.config, trainer.strategy.root_device))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers, config = check_fit(trainer, pl_module, self.config)
        state, self._pending_state = self._pending_state, None
        self._pipeline.start(layers, list(pl_module.parameters()), [] if state is None else state["pending"])
        if state is None:
            self._bases = {name: layer.precision for name, layer in layers.items()}
        else:
            self._bases = checkpoint_bases(state, layers, pl_module, module_warned=self._module_warned)
        self._policy = PrecisionPolicy(
            self._bases, accumulate_grad_batches=trainer.accumulate_grad_batches, config=config
        )
        if state is not None:
            try:
                self._policy.load_state_dict(state["policy"])
            except ValueError as error:
                raise ValueError(f"AdaptivePrecision: the checkpoint's controller state is refused: {error}") from error
            trainer.accumulate_grad_batches = state["accumulate_grad_batches"]
        self._applied_accumulate = trainer.accumulate_grad_batches
        self._check_first = judge_before_step(trainer, self.check_before_step)
        saved = None if state is None else state.get("snapshots")
        self._executor.start(trainer, pl_module, self._policy, saved, check_first=self._check_first)
        if trainer.global_step > 0:
            # Resumed: what the interrupted run logged from here on is logged again, from the oldest verdict the
            # checkpoint still had pending (its scalars are logged when it is concluded, now again).
            oldest = min((record.step for record in self._pipeline.pending), default=trainer.global_step)
            tensorboard.purge_from(trainer, oldest)
        tensorboard.log_layout(trainer)
        self._executor.start_picture(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        policy = self._require_policy()
        if not self._pipeline.window_open:
            target, current = policy.accumulate_grad_batches, trainer.accumulate_grad_batches
            # Lightning zeroes gradients at batch_idx % accumulate == 0 and steps after (batch_idx + 1) %
            # accumulate == 0, so a change is clean only where a window of the old and of the new setting both
            # start; halving lands at once, doubling within one old window.
            if target != current and batch_idx % current == 0 and batch_idx % target == 0:
                trainer.accumulate_grad_batches = target
                self._applied_accumulate = target
            self._pipeline.open_window(policy, trainer.global_step)
        self._pipeline.add_tokens(int(self.tokens_fn(batch)))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._pipeline.add_loss(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        policy = self._require_policy()
        self._executor.before_optimizer_step(trainer)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        step, grad_norm2 = self._pipeline.close_window(trainer, policy, scaler)
        if self._check_first:
            self._last_action = self._executor.conclude(
                trainer, pl_module, step, applied=False, **self._settings(trainer)
            ).action
            return
        step.skipped_on_device = self._executor.skip_on_device(optimizer, grad_norm2, scaler)
        self._pipeline.await_verdict(step)
        self._last_action = "pending"
        # The verdicts due now: a fixed lag, the same on every rank whatever its device's pace, so every rank
        # decides the same at the same step (its copy is almost always done by then; if not, the read waits).
        if self._conclude_pending(trainer, pl_module, until=step.step - VERDICT_LAG):
            # The parameters went back to the snapshot: this step's gradients belong to the undone ones.
            drop_gradients(self._pipeline.parameters)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._last_action is None:
            return  # still accumulating
        action, self._last_action = self._last_action, None
        self._executor.after_step(
            trainer, pl_module, action, pending=bool(self._pipeline.pending), every=self.snapshot_every_n_steps
        )
        if self.progress_bar:
            # Host tensors: LightningModule.log turns a number into a tensor on the module's device, a copy from
            # pageable host memory that synchronises the stream (and the progress bar reads it back with .item()).
            pl_module.log("int8_share", torch.tensor(self.int8_fraction), prog_bar=True, logger=False)
            pl_module.log("tokens_per_step", torch.tensor(float(self.tokens_per_step)), prog_bar=True, logger=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._conclude_pending(trainer, pl_module, until=None)  # the last steps' verdicts, still on their way
        self._pipeline.end()
        self._executor.end_picture(trainer)
        if self.verbose:  # a run that went well says so: what ran on SageBwd, what did not and why
            rank_zero_info(attention_summary(pl_module, self))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._pipeline.end()  # a fit that failed (TrainingDiverged included) ends here instead of on_train_end
        # An empty or truncated checkpoint fails in PyTorch's unpickler (EOFError: Ran out of input), which names no
        # file; Lightning sets ckpt_path just before it loads. The error keeps its type, with the file named under it.
        problem = checkpoint_file_problem(trainer.ckpt_path)
        if problem and hasattr(exception, "add_note"):  # Python 3.11+
            exception.add_note(problem)
        if isinstance(exception, KeyboardInterrupt):
            rank_zero_info(resume_instructions(trainer))

    # ----------------------------------------------------------------------------------------- checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._policy is None:
            return dict(self._pending_state or {})
        return {
            "version": STATE_VERSION,
            "policy": self._policy.state_dict(),
            "bases": {name: dataclasses.asdict(base) for name, base in self._bases.items()},
            "accumulate_grad_batches": self._applied_accumulate,
            **self._executor.tally.state_dict(),  # history, tokens, layer-steps, skipped steps, rollbacks
            # Without the check before the step, the last steps' verdicts are still on their way: the resumed run
            # concludes them at the steps the uninterrupted one would have.
            "pending": [record.state() for record in self._pipeline.pending],
            # What a rollback returns to, and its step: without it a resumed run would roll back to where it resumed.
            "snapshots": self._executor.snapshots.state_dict() if self.snapshot_in_checkpoint else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        state_dict = upgrade_state(state_dict)
        check_state(state_dict)
        self._executor.tally.load_state_dict(state_dict)
        # The layers are known only once training starts (the mixin swaps them in configure_model): the policy
        # state is applied then, before the first step.
        self._pending_state = dict(state_dict)
        self._policy = None

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The mixin restores the layers from its own entry and warns about a changed sage_precision itself.
        self._module_warned = isinstance(pl_module, SageAttentionMixin) and CHECKPOINT_KEY in checkpoint

    # ---------------------------------------------------------------------------------------------- verdicts

    def _conclude_pending(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, until: int | None) -> bool:
        return self._executor.conclude_pending(trainer, pl_module, until=until, **self._settings(trainer))

    def _settings(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The arguments that say how a verdict is reported and where a stop saves the last good weights."""
        return {
            "verbose": self.verbose,
            "every": self.log_every_n_steps or max(1, trainer.log_every_n_steps),
            "last_good_checkpoint": self.last_good_checkpoint,
        }

    def _require_policy(self) -> PrecisionPolicy:
        if self._policy is None:
            raise RuntimeError("AdaptivePrecision: the policy is built in on_train_start; this hook ran before it.")
        return self._policy
