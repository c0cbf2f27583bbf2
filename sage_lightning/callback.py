r"""
Adaptive Precision
^^^^^^^^^^^^^^^^^^

Watch the signals that predict trouble in SageBwd attention training and turn the precision levers per layer,
between optimizer steps. The hooks live here; the signals' vector (:mod:`sage_lightning.signals`), the snapshots
(:mod:`sage_lightning.snapshots`) and every TensorBoard tag (:mod:`sage_lightning.tensorboard`) have modules of
their own, and only the policy (:mod:`sage_lightning.policy`) authors decisions.

"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import shutil
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from sage_lightning import tensorboard
from sage_lightning.console import attention_summary, quiet_lightning_noise, resume_instructions
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import AttentionLayerState, attention_layers, take_nonfinite_flags
from sage_lightning.layer_checkpoint import CHECKPOINT_KEY, checkpoint_file_problem
from sage_lightning.mixin import SageAttentionMixin
from sage_lightning.policy import (
    Decision,
    PolicyConfig,
    PrecisionPolicy,
    SignalRequest,
    StepOutcome,
    StepSignals,
)
from sage_lightning.precision_image import LevelHistory
from sage_lightning.signals import (
    HEAD_FIELDS,
    PREVIOUS_LAYER_WIDTH,
    VERDICT_LAG,
    HostCopies,
    SignalLayout,
    StepRecord,
    count_tokens,
    reduce,
    squared_grad_norm,
)
from sage_lightning.snapshots import Snapshots

__all__ = ["AdaptivePrecision", "TrainingDiverged", "count_tokens"]

#: The version of :meth:`AdaptivePrecision.state_dict`'s layout.
STATE_VERSION = 3
_STATE_KEYS = (
    "version",
    "policy",
    "bases",
    "accumulate_grad_batches",
    "history",
    "tokens_seen",
    "tokens_per_step",
    "layer_steps",
    "int8_layer_steps",
    "skipped_steps",
    "rollbacks",
    "pending",
    "snapshots",
)


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
        if unexpected:
            # Python's own refusal ("unexpected keyword argument") would not say where thresholds live.
            name = next(iter(unexpected))
            raise TypeError(_unknown_argument_message(name, unexpected[name]))
        if config is not None and not isinstance(config, PolicyConfig):
            raise ValueError(
                "AdaptivePrecision: config must be a sage_lightning.PolicyConfig or None; "
                f"received {type(config).__name__}."
            )
        _check_positive_int("snapshot_every_n_steps", snapshot_every_n_steps)
        if log_every_n_steps is not None:
            _check_positive_int("log_every_n_steps", log_every_n_steps)
        if tokens_fn is not None and not callable(tokens_fn):
            raise ValueError(
                "AdaptivePrecision: tokens_fn must be a callable batch -> number of tokens, or None; "
                f"received {type(tokens_fn).__name__}."
            )
        for name, value in (
            ("progress_bar", progress_bar),
            ("verbose", verbose),
            ("snapshot_in_checkpoint", snapshot_in_checkpoint),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"AdaptivePrecision: {name} must be True or False; received {value!r}.")
        if check_before_step is not None and not isinstance(check_before_step, bool):
            raise ValueError(
                "AdaptivePrecision: check_before_step must be True, False or None (decide from the optimizers); "
                f"received {check_before_step!r}."
            )
        if last_good_checkpoint is not None and not isinstance(last_good_checkpoint, (str, os.PathLike)):
            raise ValueError(
                "AdaptivePrecision: last_good_checkpoint must be a path (str or os.PathLike) or None; "
                f"received {type(last_good_checkpoint).__name__}."
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

        #: Every decision taken, oldest first (restored from checkpoints).
        self.history: list[Decision] = []
        self.tokens_seen = 0
        self.tokens_per_step = 0
        self.skipped_steps = 0
        self.rollbacks = 0
        self._layer_steps = 0
        self._int8_layer_steps = 0

        self._policy: PrecisionPolicy | None = None
        self._layers: dict[str, AttentionLayerState] = {}
        # The module's parameters, listed once per fit: walking the module tree for the gradients on every step cost
        # about 0.1 ms of host time (8 blocks, 83 parameters). Emptied when the fit ends, so that a callback kept for
        # its history keeps no model alive.
        self._parameters: list[torch.nn.Parameter] = []
        self._level_history: LevelHistory | None = None
        self._layout = SignalLayout(())
        self._bases: dict[str, AttentionPrecision] = {}
        self._pending_state: dict[str, Any] | None = None
        self._module_warned = False
        self._applied_accumulate: int | None = None
        self._snapshots = Snapshots()
        self._check_first = True
        # The optimizer step being accumulated: opened by its first micro-batch, closed by the optimizer step.
        self._window_open = False
        self._request = SignalRequest(ds_stats=False, probe=False)
        # The first step of a fit runs the dS-statistics kernel variant even when the policy does not ask, so its
        # compilation and autotuning happen with the first step's, not as a stall later (its sums are dropped).
        self._warm_up = False
        self._discard_stats = False
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0
        self._window_tokens = 0
        self._last_action: str | None = None
        # Steps whose verdict is on its way (check_before_step=False), oldest first: at most VERDICT_LAG.
        self._pending: deque[StepRecord] = deque()
        self._verdict_waits = 0
        self._copies = HostCopies()
        # The layers' precisions as the last step ran them, and how many ran low-bit: recounted only when a
        # precision changed (the count walks every product of every layer).
        self._ran: tuple[tuple[AttentionPrecision, ...], int] = ((), 0)

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
        return self._int8_layer_steps / self._layer_steps if self._layer_steps else 1.0

    @property
    def verdict_waits(self) -> int:
        """How many verdicts (``check_before_step=False``) found their step's signals not yet on the host
        :data:`~sage_lightning.signals.VERDICT_LAG` steps later and waited for them: on a GPU the host then ran
        further ahead of the device than the lag; 0 on the CPU. ``benchmarks/overhead.py`` records it."""
        return self._verdict_waits

    @property
    def snapshot_step(self) -> int | None:
        """The optimizer step of the snapshot a rollback would restore now; ``None`` before training starts."""
        return self._snapshots.step

    def precisions(self) -> dict[str, AttentionPrecision]:
        """Every controlled layer's current precision, by name (empty before training starts)."""
        return self._policy.precisions() if self._policy is not None else {}

    @property
    def hparams(self) -> dict[str, Any]:
        """The controller's settings as plain values, as the loggers get them under ``"adaptive_precision"``
        (``hparams.yaml``, TensorBoard's HParams): every :class:`~sage_lightning.policy.PolicyConfig` field under
        ``config`` (the ladder as its rung names) and the arguments that change what the callback does.

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
            tensorboard.log_hyperparams(trainer, self.hparams)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "AdaptivePrecision needs automatic optimization (it skips and rolls back optimizer steps "
                "and changes accumulate_grad_batches); set `self.automatic_optimization = True`."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise MisconfigurationException(
                "AdaptivePrecision sets accumulate_grad_batches itself; remove the GradientAccumulationScheduler "
                "callback, or turn the tokens lever off with PolicyConfig(min_accumulate_grad_batches=None) and "
                "use the scheduler without AdaptivePrecision's tokens lever."
            )
        layers = attention_layers(pl_module)
        if not layers:
            raise MisconfigurationException(
                "AdaptivePrecision found no SageBwd attention layer in the model; add SageAttentionMixin to the "
                "LightningModule (`class MyModel(SageAttentionMixin, LightningModule)`) or call "
                "sage_lightning.convert_to_sage_attention(model) before fitting."
            )
        config = self.config
        if trainer.strategy.handles_gradient_accumulation and config.min_accumulate_grad_batches is not None:
            rank_zero_warn(
                f"AdaptivePrecision: {type(trainer.strategy).__name__} accumulates gradients itself, so the "
                "tokens-per-step lever is off for this run (precision levers still work)."
            )
            config = dataclasses.replace(config, min_accumulate_grad_batches=None)
        self._layers = layers
        self._ran = ((), 0)  # this fit's bases decide what counts as low-bit
        self._parameters = list(pl_module.parameters())
        self._layout = SignalLayout(tuple(layers))
        state, self._pending_state = self._pending_state, None
        if state is None:
            self._bases = {name: layer.precision for name, layer in layers.items()}
        else:
            self._bases = self._checkpoint_bases(state, pl_module)
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
        self._apply_precisions()
        self._window_open = False
        self._warm_up = True
        self._pending = deque()
        for saved in [] if state is None else state["pending"]:
            self._pending.append(StepRecord.from_state(saved))
        self._check_first = self.check_before_step
        if self._check_first is None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self._check_first = scaler is not None or not all(
                getattr(optimizer, "_step_supports_amp_scaling", False) for optimizer in trainer.optimizers
            )
        if state is not None and state.get("snapshots") is not None:
            # The uninterrupted run's snapshot (and candidate): a rollback lands where it would have.
            self._snapshots.load_state_dict(state["snapshots"])
        else:
            self._snapshots.candidates = []
            self._snapshots.take(trainer, pl_module)
        if not self._check_first:
            self._snapshots.allocate_spare(trainer, pl_module)
        if trainer.global_step > 0:
            # Resumed: what the interrupted run logged from here on is logged again, from the oldest verdict the
            # checkpoint still had pending (its scalars are logged when it is concluded, now again).
            tensorboard.purge_from(trainer, min((record.step for record in self._pending), default=trainer.global_step))
        tensorboard.log_layout(trainer)
        # The picture starts at this fit's first step (a resumed fit draws from its checkpoint's step on).
        policy = self._require_policy()
        self._level_history = LevelHistory(list(self._layers), start=trainer.global_step)
        self._level_history.record(trainer.global_step, {name: policy.level(name) for name in self._layers})
        tensorboard.log_precision_legend(trainer, [rung.name for rung in policy.config.ladder], self._layers)
        tensorboard.log_precision_image(trainer, self._level_history, trainer.global_step, self._levels())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        policy = self._require_policy()
        if not self._window_open:
            target, current = policy.accumulate_grad_batches, trainer.accumulate_grad_batches
            # Lightning zeroes gradients at batch_idx % accumulate == 0 and steps after (batch_idx + 1) %
            # accumulate == 0, so a change is clean only where a window of the old and of the new setting both
            # start; halving lands at once, doubling within one old window.
            if target != current and batch_idx % current == 0 and batch_idx % target == 0:
                trainer.accumulate_grad_batches = target
                self._applied_accumulate = target
            self._open_window(trainer.global_step)
        self._window_tokens += int(self.tokens_fn(batch))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Lightning hands over training_step's loss divided by accumulate_grad_batches (and, with fp16 AMP,
        # multiplied by the GradScaler's scale); both are undone once per step, in on_before_optimizer_step.
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._micro_batches += 1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._require_policy()
        if trainer.strategy.root_device.type == "cuda":
            # The snapshot's copies must read the parameters before this step writes them.
            self._snapshots.wait_before_write(trainer.strategy.root_device)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        collecting = self._request.ds_stats or self._discard_stats
        packed, grad_norm2, short_head = self._pack(trainer, pl_module, scaler)
        precisions = tuple(layer.precision for layer in self._layers.values())
        if precisions != self._ran[0]:
            self._ran = (precisions, sum(self._runs_low_bit(name) for name in self._layers))
        step = StepRecord(
            step=trainer.global_step,
            packed=packed,
            request=self._request,
            grad_scaler=scaler is not None,
            ran_int8=self._ran[1],
            precisions=precisions,
            short_head=short_head,
        )
        if collecting:
            for layer in self._layers.values():
                layer.collect_stats = False
        self._window_open = False
        if self._check_first:
            outcome = self._conclude(trainer, pl_module, step, applied=False)
            self._last_action = outcome.action
            return
        if scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False):
            # Fused optimizers skip a step on the device when told so (as a GradScaler tells them): a step with
            # non-finite gradients is skipped without waiting for its verdict.
            # A 0-dim float32 flag, as GradScaler hands it (fused Adam/AdamW subtract it from their 0-dim steps):
            # 0 * norm^2 is 0 for a finite norm and NaN for an infinite or NaN one, which becomes 1.
            optimizer.found_inf = grad_norm2.mul(0.0).nan_to_num_(nan=1.0).float()
            step.skipped_on_device = True
        step.start_copy(self._copies)
        self._pending.append(step)
        self._last_action = "pending"
        # The verdicts due now: a fixed lag, the same on every rank whatever its device's pace, so every rank
        # decides the same at the same step (its copy is almost always done by then; if not, the read waits).
        if self._conclude_pending(trainer, pl_module, until=step.step - VERDICT_LAG):
            # The parameters went back to the snapshot: this step's gradients belong to the undone ones.
            for parameter in self._parameters:
                parameter.grad = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._last_action is None:
            return  # still accumulating
        action, self._last_action = self._last_action, None
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf  # used by this step only
        if not self._snapshots.reserved:
            self._snapshots.reserve(trainer)  # after the first step, where the optimizers' state appears
        if trainer.global_step % self.snapshot_every_n_steps == 0:
            if action == "step":
                self._snapshots.take(trainer, pl_module)
            elif action == "pending" and self._pending:
                # Ahead of the step's verdict: kept apart until the verdict says the step was good.
                self._snapshots.take(trainer, pl_module, candidate=True)
        if self.progress_bar:
            # Host tensors: LightningModule.log turns a number into a tensor on the module's device, a copy from
            # pageable host memory that synchronises the stream (and the progress bar reads it back with .item()).
            pl_module.log("int8_share", torch.tensor(self.int8_fraction), prog_bar=True, logger=False)
            pl_module.log("tokens_per_step", torch.tensor(float(self.tokens_per_step)), prog_bar=True, logger=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._conclude_pending(trainer, pl_module, until=None)  # the last steps' verdicts, still on their way
        self._parameters = []
        if self._level_history is not None and self._policy is not None:  # the picture to the run's last step
            last = max(trainer.global_step - 1, self._level_history.start)
            tensorboard.log_precision_image(trainer, self._level_history, last, self._levels())
        if self.verbose:  # a run that went well says so: what ran on SageBwd, what did not and why
            rank_zero_info(attention_summary(pl_module, self))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._parameters = []  # a fit that failed (TrainingDiverged included) ends here instead of on_train_end
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
            "history": [dataclasses.asdict(decision) for decision in self.history],
            "tokens_seen": self.tokens_seen,
            "tokens_per_step": self.tokens_per_step,
            "layer_steps": self._layer_steps,
            "int8_layer_steps": self._int8_layer_steps,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            # Without the check before the step, the last steps' verdicts are still on their way: the resumed run
            # concludes them at the steps the uninterrupted one would have.
            "pending": [record.state() for record in self._pending],
            # What a rollback returns to, and its step: without it a resumed run would roll back to where it resumed.
            "snapshots": self._snapshots.state_dict() if self.snapshot_in_checkpoint else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        state_dict = _upgrade_state(state_dict)
        _check_state(state_dict)
        self.history = [Decision(**decision) for decision in state_dict["history"]]
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.tokens_per_step = int(state_dict["tokens_per_step"])
        self._layer_steps = int(state_dict["layer_steps"])
        self._int8_layer_steps = int(state_dict["int8_layer_steps"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.rollbacks = int(state_dict["rollbacks"])
        # The layers are known only once training starts (the mixin swaps them in configure_model): the policy
        # state is applied then, before the first step.
        self._pending_state = dict(state_dict)
        self._policy = None

    def _checkpoint_bases(
        self, state: Mapping[str, Any], pl_module: pl.LightningModule
    ) -> dict[str, AttentionPrecision]:
        """The checkpoint's base precisions, checked against the model's layers; a warning where the configured start
        differs (the checkpoint's is kept, so the resumed run decides as the uninterrupted one)."""
        saved, known = list(state["bases"]), list(self._layers)
        if set(saved) != set(known):
            raise MisconfigurationException(
                f"AdaptivePrecision: the checkpoint's controller state is for attention layers {saved}, this model "
                f"has {known} (only in the checkpoint: {sorted(set(saved) - set(known))}; only in the model: "
                f"{sorted(set(known) - set(saved))}). Resume with the model the checkpoint was saved from, or fit "
                "this model without ckpt_path (load the weights with model.load_state_dict(..., strict=False))."
            )
        bases = {name: AttentionPrecision(**state["bases"][name]) for name in known}
        if isinstance(pl_module, SageAttentionMixin):
            # The mixin restored the layers from the checkpoint (and warned, where it found its entry): what was
            # configured is sage_precision.
            configured = dict.fromkeys(known, pl_module.sage_precision or AttentionPrecision())
        else:
            configured = {name: layer.precision for name, layer in self._layers.items()}
        differ = [name for name in known if configured[name] != bases[name] and not self._module_warned]
        if differ:
            first = differ[0]
            rank_zero_warn(
                f"AdaptivePrecision: the configured starting precision of {differ} ({configured[first].short_name} "
                f"for {first!r}) differs from the checkpoint's ({bases[first].short_name}); the run resumes from the "
                "checkpoint's, with its escalations. To start from the configured precision, fit without ckpt_path "
                "and load the weights alone."
            )
        return bases

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The mixin restores the layers from its own entry and warns about a changed sage_precision itself.
        self._module_warned = isinstance(pl_module, SageAttentionMixin) and CHECKPOINT_KEY in checkpoint

    # ---------------------------------------------------------------------------------------------- signals

    def _open_window(self, step: int) -> None:
        self._request = self._require_policy().signals_wanted(step)
        self._discard_stats = self._warm_up and not self._request.ds_stats
        self._warm_up = False
        for layer in self._layers.values():
            layer.collect_stats = self._request.ds_stats or self._discard_stats
            if self._request.probe:
                layer.arm_probe()
            if self._request.noise:
                layer.arm_noise(self._require_policy().config.noise_sequences)
        self._loss_sum = None
        self._micro_batches = 0
        self._window_tokens = 0
        self._window_open = True

    def _pack(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any
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
        grads = [grad for parameter in self._parameters if (grad := parameter.grad) is not None]
        grad_norm2 = squared_grad_norm(grads) if grads else torch.zeros((), dtype=torch.float32, device=device)
        if grad_norm2.device != device:  # gradients held elsewhere than the training device (a model split by hand)
            grad_norm2 = grad_norm2.to(device)
        nonfinite = take_nonfinite_flags(list(self._layers.values()), device)
        measures = self._request.ds_stats or self._discard_stats or self._request.probe or self._request.noise
        if trainer.world_size == 1 and not measures:
            # The usual step: only what the device holds goes to the host; no reduction on one process.
            short = self._layout.pack_short(loss_sum, grad_norm2, nonfinite)
            return short, grad_norm2, (self._micro_batches, self._window_tokens, bool(grads))
        ds_sums = qk_sums = None
        if self._request.ds_stats or self._discard_stats:
            # The sums stay on the device: no host sync for them, on this step or any.
            ds_sums = [layer.take_ds_stats_on_device() for layer in self._layers.values()]
            qk_sums = [layer.take_forward_stats_on_device() for layer in self._layers.values()]
            if self._discard_stats:
                ds_sums, qk_sums, self._discard_stats = None, None, False
        probes = [layer.take_probe() for layer in self._layers.values()] if self._request.probe else None
        noise = None
        if self._request.noise:
            noise = [layer.take_noise(self._bases[name]) for name, layer in self._layers.items()]
        packed = self._layout.pack(
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

    def _signals(self, trainer: pl.Trainer, record: StepRecord, total: list[float]) -> StepSignals:
        """The policy's view of one step, from the reduced vector."""
        sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
        head, layers = self._layout.unpack(total, sharded_grads=sharded)
        self.tokens_per_step = int(head["tokens"])
        self.tokens_seen += int(head["tokens"])
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
                for (name, layer), ran in zip(self._layers.items(), record.precisions, strict=True)
                if layer.precision is not ran and layer.precision != ran  # the same object, mostly: no field compare
            ]
            for name in stale:
                layers[name] = dataclasses.replace(
                    layers[name], ds_rel_err=None, qk_rel_err=None, probe=None, noise_ratio_ran=None
                )
        return StepSignals(
            step=record.step, loss=loss, grad_norm=grad_norm, layers=layers, grad_scaler=record.grad_scaler
        )

    # ---------------------------------------------------------------------------------------------- actions

    def _conclude(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepRecord, *, applied: bool
    ) -> StepOutcome:
        """Decide about one step and carry it out.

        ``applied=False``: before the step's optimizer step (``check_before_step``): a skip or a rollback drops
        its gradients. ``applied=True``: ``VERDICT_LAG`` steps later; a step that should not have been applied is
        undone by restoring the snapshot, unless the device already skipped it or it is harmless to keep (a one-off
        loss spike with finite gradients). The returned action is then ``"undone"``.
        """
        signals = self._signals(trainer, record, record.host_values())
        outcome = self._require_policy().decide(signals)
        decisions = list(outcome.decisions)
        action = outcome.action
        # On the device, a fused optimizer skipped the step only if its gradients were non-finite.
        on_device = record.skipped_on_device and outcome.skip_cause == "nonfinite_gradients"
        skipped = outcome.action == "skip" and (not applied or on_device)
        if outcome.action == "skip" and not skipped and outcome.skip_cause == "loss_spike":
            # Already applied and its gradients finite: undoing it would cost a rollback, more than the spike.
            action = "step"
            decisions.append(
                Decision(
                    record.step,
                    None,
                    "optimizer_step",
                    "skip",
                    "kept",
                    "applied before its verdict (check_before_step=False) with finite gradients: kept, since a "
                    "rollback would cost more than the one-off spike",
                )
            )
        elif outcome.action in ("rollback", "stop") or (outcome.action == "skip" and not skipped):
            self._snapshots.restore(trainer, pl_module)
            if outcome.action != "stop":
                self.rollbacks += 1
            if outcome.action == "skip":
                decisions.append(
                    Decision(
                        record.step,
                        None,
                        "rollback",
                        f"step {record.step}",
                        "last snapshot",
                        "its non-finite gradients were applied (check_before_step=False and an optimizer that "
                        "cannot skip on the device)",
                    )
                )
            if applied and outcome.action != "stop":
                action = "undone"
        if not applied and outcome.action in ("skip", "rollback", "stop"):
            # No gradient, no update: torch optimizers skip parameters whose .grad is None (moments, step
            # counters and weight decay included); a GradScaler, if any, already recorded its inf checks.
            for parameter in self._parameters:
                parameter.grad = None
        self.skipped_steps += skipped
        self._apply_precisions()
        self._layer_steps += len(self._layers)
        self._int8_layer_steps += record.ran_int8
        self.history.extend(decisions)
        if self.verbose and decisions:  # the terminal's width asked only when there is something to print
            width = shutil.get_terminal_size().columns
            for decision in decisions:
                rank_zero_info(decision.console_text(width, "AdaptivePrecision: "))
        final = dataclasses.replace(outcome, action=action, decisions=tuple(decisions))
        self._log_step(trainer, signals, final)
        self._snapshots.settle(record.step, undone=action in ("undone", "stop"))
        if outcome.action == "stop":
            self._stop(trainer, decisions[-1])
        return final

    def _conclude_pending(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, until: int | None) -> bool:
        """Decide, in order, about every pending step up to step ``until`` (``None``: all of them).

        Returns:
            Whether one was undone (the weights went back to the snapshot). The pending steps after it are dropped
            unjudged: their updates were made from the undone weights (and were overwritten by the restore); their
            tokens and layer-steps were spent all the same.
        """
        while self._pending and (until is None or self._pending[0].step <= until):
            record = self._pending.popleft()
            self._verdict_waits += not record.ready()
            if self._conclude(trainer, pl_module, record, applied=True).action == "undone":
                while self._pending:
                    dropped = self._pending.popleft()
                    self.tokens_seen += int(dropped.host_values()[HEAD_FIELDS.index("tokens")])
                    self._layer_steps += len(self._layers)
                    self._int8_layer_steps += dropped.ran_int8
                return True
        return False

    def _stop(self, trainer: pl.Trainer, decision: Decision) -> None:
        """Save the last good weights (restored already) and end training with :class:`TrainingDiverged`."""
        path = self.last_good_checkpoint or os.path.join(trainer.default_root_dir, "sage-last-good.ckpt")
        self._pending.clear()
        trainer.save_checkpoint(path)  # every rank calls it (the decision is the same on all): it synchronises
        raise TrainingDiverged(
            f"AdaptivePrecision stopped training at step {decision.step}: {decision.reason}. The last good weights "
            f"(the snapshot of step {self._snapshots.step}) are saved in {path}. Look for the cause in the data or "
            "the model (the decisions are in AdaptivePrecision.history and TensorBoard's sage/decisions), or give the "
            "controller more room: PolicyConfig(max_rollbacks=...), a longer ladder, min_accumulate_grad_batches.",
            decision,
            path,
        )

    def _apply_precisions(self) -> None:
        policy = self._require_policy()
        for name, layer in self._layers.items():
            wanted = policy.precision(name)
            if layer.precision is not wanted and layer.precision != wanted:
                layer.precision = wanted

    def _on_fast_path(self, name: str) -> bool:
        """Whether the layer runs its base precision's mode with every low-bit product of its base (INT8 or FP8)
        still in that format (an attn_qat layer has no low-bit products: it is on its fast path while still in
        attn_qat mode). A base with FP8 products is on its fast path while they run FP8, not only its INT8 ones."""
        base, now = self._bases[name], self._layers[name].precision
        low_bit = (*base.int8_products, *base.fp8_products)
        return now.mode == base.mode and all(getattr(now, product) == getattr(base, product) for product in low_bit)

    def _runs_low_bit(self, name: str) -> bool:
        """Whether the layer runs low-bit now: a base precision with low-bit work (attn_qat, or SageBwd with an INT8
        or FP8 product), still on its fast path."""
        base = self._bases[name]
        has_low_bit = base.mode == "attn_qat" or bool(base.int8_products or base.fp8_products)
        return has_low_bit and self._on_fast_path(name)

    # ---------------------------------------------------------------------------------------------- logging

    def _log_step(self, trainer: pl.Trainer, signals: StepSignals, outcome: StepOutcome) -> None:
        policy = self._require_policy()
        levels = {name: policy.level(name) for name in self._layers}
        metrics = tensorboard.step_metrics(
            signals,
            outcome,
            levels=levels,
            counters={
                "tokens_per_step": self.tokens_per_step,
                "tokens_seen": self.tokens_seen,
                "int8_fraction": self.int8_fraction,
                "tokens/accumulate_grad_batches": trainer.accumulate_grad_batches,
                "skipped_steps": self.skipped_steps,
                "rollbacks": self.rollbacks,
                "rollbacks_without_progress": policy.rollbacks_without_progress,
            },
            every=self.log_every_n_steps or max(1, trainer.log_every_n_steps),
        )
        tensorboard.log_scalars(trainer, metrics, signals.step)
        tensorboard.log_decisions(trainer, outcome.decisions, signals.step)
        if self._level_history is not None and self._level_history.record(signals.step, levels):
            tensorboard.log_precision_image(trainer, self._level_history, signals.step, self._levels())

    def _levels(self) -> int:
        """How many levels the picture colours: the base and each rung of the ladder."""
        return len(self._require_policy().config.ladder) + 1

    def _require_policy(self) -> PrecisionPolicy:
        if self._policy is None:
            raise RuntimeError("AdaptivePrecision: the policy is built in on_train_start; this hook ran before it.")
        return self._policy


#: The callback's own arguments, for the message about a name that is not one of them.
_INIT_ARGUMENTS = tuple(
    name
    for name, parameter in inspect.signature(AdaptivePrecision.__init__).parameters.items()
    if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
)


def _upgrade_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A controller state saved by the previous layout (version 2) in this version's (3); any other as it is.

    Version 2 kept one pending verdict and one snapshot candidate (verdicts one step late), and its signal vectors
    had no per-layer non-finite flag. Its pending record becomes a list of one whose vector gains a 0 flag per layer
    (version 2 read the flags from the layers when the verdict came and did not save them, so a non-finite step
    pending at the checkpoint is judged without knowing which layer started it), with its layers' precisions during
    the step unknown (the check for stale measurements skips it); its candidate becomes a list of one. The resumed
    run concludes that step at its new lag, one step later than version 2 would have.
    """
    if not isinstance(state, Mapping) or state.get("version") != 2:
        return state
    upgraded = dict(state, version=STATE_VERSION)
    pending = state.get("pending")
    if (
        isinstance(pending, Mapping)
        and isinstance(pending.get("values"), list)
        and isinstance(state.get("bases"), Mapping)
    ):
        # Version 2's layer rows: the next layout's (PREVIOUS_LAYER_WIDTH, which unpack reads) less the flag.
        values, head, width = list(pending["values"]), len(HEAD_FIELDS), PREVIOUS_LAYER_WIDTH - 1
        expected = head + len(state["bases"]) * width
        if len(values) != expected:
            raise ValueError(
                f"AdaptivePrecision.load_state_dict: the checkpoint's pending verdict (layout version 2) holds "
                f"{len(values)} signal values; one of {len(state['bases'])} layers holds {expected}. The state was not "
                "written by AdaptivePrecision.state_dict(): fit without ckpt_path and load the weights alone."
            )
        rows = [values[head + i * width : head + (i + 1) * width] + [0.0] for i in range(len(state["bases"]))]
        upgraded["pending"] = [dict(pending, values=values[:head] + [v for row in rows for v in row], precisions=[])]
    elif pending is None:
        upgraded["pending"] = []
    snapshots = state.get("snapshots")
    if isinstance(snapshots, Mapping) and "candidate" in snapshots:
        candidate = snapshots["candidate"]
        upgraded["snapshots"] = {"good": snapshots.get("good"), "candidates": [] if candidate is None else [candidate]}
    return upgraded


def _check_state(state: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` that says what is wrong with a checkpoint's controller state."""
    where = "AdaptivePrecision.load_state_dict"
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: the state must be a dict from state_dict(); received {type(state).__name__}.")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"{where}: the checkpoint's controller state has version {state.get('version')!r}; this version of "
            f"sage-lightning reads version {STATE_VERSION}. Resume with the version that saved it, or fit without "
            "ckpt_path and load the weights alone."
        )
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"{where}: the checkpoint's controller state lacks {missing} (it has {sorted(state)}); it was not "
            "written by AdaptivePrecision.state_dict()."
        )
    bases = state["bases"]
    if not isinstance(bases, Mapping) or not bases or not all(isinstance(b, Mapping) for b in bases.values()):
        raise ValueError(
            f"{where}: 'bases' must map each layer name to its AttentionPrecision fields; received {bases!r}."
        )
    for name, fields in bases.items():
        try:
            AttentionPrecision(**fields)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: the base precision of layer {name!r} is refused: {error}") from None
    for key in ("tokens_seen", "tokens_per_step", "layer_steps", "int8_layer_steps", "skipped_steps", "rollbacks"):
        if isinstance(state[key], bool) or not isinstance(state[key], int):
            raise ValueError(f"{where}: {key!r} must be an int; received {state[key]!r}.")
    if not isinstance(state["history"], list) or not all(isinstance(d, Mapping) for d in state["history"]):
        raise ValueError(f"{where}: 'history' must be a list of decisions (dicts); received {state['history']!r}.")
    if not isinstance(state["pending"], list) or not all(isinstance(r, Mapping) for r in state["pending"]):
        raise ValueError(
            f"{where}: 'pending' must be a list of pending steps (dicts, oldest first); received {state['pending']!r}."
        )


def _unknown_argument_message(name: str, value: object) -> str:
    """What to say about ``AdaptivePrecision(name=value)`` when ``name`` is not one of its arguments: a
    :class:`~sage_lightning.PolicyConfig` field is shown in ``PolicyConfig``, anything else gets the closest names."""
    fields = [field.name for field in dataclasses.fields(PolicyConfig)]
    if name in fields:
        return (
            f"AdaptivePrecision: {name} is a threshold or cadence of the policy, not an argument of the callback; "
            f"received {name}={value!r}. Thresholds live in PolicyConfig: "
            f"AdaptivePrecision(PolicyConfig({name}={value!r}))."
        )
    close = difflib.get_close_matches(name, [*_INIT_ARGUMENTS, *fields], n=1, cutoff=0.6)
    hint = ""
    if close and close[0] in fields:
        hint = f" Did you mean the PolicyConfig field {close[0]!r}: AdaptivePrecision(PolicyConfig({close[0]}=...))?"
    elif close:
        hint = f" Did you mean {close[0]!r}?"
    return (
        f"AdaptivePrecision: unexpected argument {name}={value!r}.{hint} It takes {', '.join(_INIT_ARGUMENTS)}; "
        "thresholds and cadences go in its config, a PolicyConfig."
    )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AdaptivePrecision: {name} must be an int >= 1; received {value!r}.")
