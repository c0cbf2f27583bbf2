r"""
Adaptive Precision
^^^^^^^^^^^^^^^^^^

Watch the signals that predict trouble in SageBwd attention training and turn the precision levers per layer,
between optimizer steps.

"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from sage_lightning import tensorboard
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import AttentionLayerState, attention_layers
from sage_lightning.policy import (
    PROBE_GRADIENTS,
    Decision,
    LayerSignals,
    PolicyConfig,
    PrecisionPolicy,
    SignalRequest,
    StepOutcome,
    StepSignals,
)

#: Probe tensors, in the order they are packed for the cross-rank reduction.
_PROBE_TENSORS: tuple[str, ...] = ("O", *PROBE_GRADIENTS)
#: Per layer: err2, norm2, has_ds, (unused), has_probe, then (cos, rel_l2) per probe tensor.
_LAYER_WIDTH = 5 + 2 * len(_PROBE_TENSORS)
#: Head of the packed vector: loss sum, micro-batches, tokens, squared gradient norm, has_grads.
_HEAD_WIDTH = 5


class AdaptivePrecision(Callback):
    r"""Adapt every SageBwd attention layer's precision to the signals of training, and survive divergences.

    Each optimizer step, the callback gathers the step's signals (the loss per optimizer step, the gradient
    norm, non-finite values; every ``ds_stats_every_n_steps`` the per-layer dS quantization error, every
    ``probe_every_n_steps`` a comparison of each layer with full-precision attention), reduces them across
    ranks with one all-reduce, and asks a :class:`~sage_lightning.policy.PrecisionPolicy` what to do. Between
    optimizer steps it then:

    * moves layers up or down their precision ladder (``smooth_q`` -> ``ds="bf16"`` -> ``mode="full"``);
    * skips an optimizer step whose gradients are non-finite (the gradients are dropped, so the optimizer
      leaves parameters and its state alone; with fp16 AMP the ``GradScaler`` already does this and the
      callback lets it);
    * on a non-finite loss or a hard loss spike, restores the last in-memory snapshot of model and optimizer
      (taken every ``snapshot_every_n_steps`` on CPU), skips the step, and escalates where the divergence
      started;
    * changes ``trainer.accumulate_grad_batches`` (tokens per step) at the first batch where the old and the
      new accumulation windows both start, so no step mixes gradients of two settings.

    Every decision is kept in :attr:`history`, logged with its reason as a TensorBoard text event
    (``sage/decisions``) and the signals as ``sage/`` scalars (see :mod:`sage_lightning.tensorboard`); the
    progress bar shows ``int8_share`` and ``tokens_per_step``. The state (every layer's precision, the policy's
    counters and detectors, the tokens setting) is saved in checkpoints, so a resumed run decides as the
    uninterrupted one would.

    The model must have SageBwd attention layers (``SageAttentionMixin`` or ``convert_to_sage_attention``) and
    use automatic optimization.

    Args:
        config: the policy's thresholds and cadences; :class:`~sage_lightning.policy.PolicyConfig` defaults
            when ``None`` (``docs/controller.md`` gives the measurement behind each).
        snapshot_every_n_steps: optimizer steps between in-memory snapshots (model and optimizer state, on CPU)
            a divergence rolls back to. One is also taken when training starts.
        tokens_fn: ``tokens_fn(batch) -> int``, the tokens in one micro-batch on one rank. The default counts
            the elements of the batch if it is a tensor, of ``batch["input_ids"]`` or the first tensor value of
            a mapping, or of the first tensor of a list or tuple (token ids shaped ``[batch, seq]``).
        log_every_n_steps: optimizer steps between scalar logs when nothing happens (steps with a decision, a
            spike or a measurement are always logged); the Trainer's ``log_every_n_steps`` when ``None``.
        progress_bar: show ``int8_share`` and ``tokens_per_step`` in the progress bar.
        verbose: print every decision (rank 0).
        check_before_step: ``True``: read each step's signals before its optimizer step, so a step with
            non-finite gradients is skipped outright. That takes one host sync per step, which leaves the GPU
            idle while the host launches the optimizer step and the next forward (``benchmarks/overhead.py``
            measures it). ``False``: read them one step later without waiting. Decisions land one step later; a
            step with non-finite gradients is still skipped on the device by fused optimizers
            (``torch.optim.AdamW(..., fused=True)``), as under a GradScaler, and undone by a rollback with other
            optimizers; a loss spike or NaN loss rolls back one more step. Snapshots are then taken ahead of their
            step's verdict, so two are kept in host memory. ``None`` (default): ``False`` when every optimizer
            can skip a step on the device (fused Adam, AdamW, SGD, Adagrad) and there is no GradScaler,
            ``True`` otherwise.

    Raises:
        ValueError: an argument of the wrong type or out of range; the message names it, the value received
            and what works.
        MisconfigurationException: at the start of training, when the model has no SageBwd attention layer,
            uses manual optimization, or the Trainer also has a ``GradientAccumulationScheduler``.

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
    ) -> None:
        super().__init__()
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
        ):
            if not isinstance(value, bool):
                raise ValueError(f"AdaptivePrecision: {name} must be True or False; received {value!r}.")
        if check_before_step is not None and not isinstance(check_before_step, bool):
            raise ValueError(
                "AdaptivePrecision: check_before_step must be True, False or None (decide from the optimizers); "
                f"received {check_before_step!r}."
            )
        self.config = config or PolicyConfig()
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.tokens_fn = tokens_fn or count_tokens
        self.log_every_n_steps = log_every_n_steps
        self.progress_bar = progress_bar
        self.verbose = verbose
        self.check_before_step = check_before_step

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
        self._bases: dict[str, AttentionPrecision] = {}
        self._pending_state: dict[str, Any] | None = None
        self._applied_accumulate: int | None = None
        self._snapshot: dict[str, Any] | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._snapshot_copied: torch.cuda.Event | None = None
        # Without the check before the step: the snapshot taken ahead of its step's verdict, and the host buffers
        # of the one it replaced or would have replaced (reused by the next).
        self._candidate: dict[str, Any] | None = None
        self._spare: dict[str, Any] | None = None
        self._check_first = True
        # The optimizer step being accumulated: opened by its first micro-batch, closed by the optimizer step.
        self._window_open = False
        self._request = SignalRequest(ds_stats=False, probe=False)
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0
        self._window_tokens = 0
        self._last_action: str | None = None
        self._pending: _StepRecord | None = None

    # ---------------------------------------------------------------------------------------------- reading

    @property
    def policy(self) -> PrecisionPolicy | None:
        """The policy deciding for this run; ``None`` before training starts."""
        return self._policy

    @property
    def int8_fraction(self) -> float:
        """Share of layer-steps so far that ran low-bit: their layer's base precision is SageBwd (or Attn-QAT)
        and every product it runs in INT8 still did. A layer whose base precision is full counts as not low-bit
        (a run that starts in ``mode="full"`` shows 0). 1 before the first step."""
        return self._int8_layer_steps / self._layer_steps if self._layer_steps else 1.0

    def precisions(self) -> dict[str, AttentionPrecision]:
        """Every controlled layer's current precision, by name (empty before training starts)."""
        return self._policy.precisions() if self._policy is not None else {}

    # ------------------------------------------------------------------------------------------------ hooks

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
        state, self._pending_state = self._pending_state, None
        if state is None:
            self._bases = {name: layer.precision for name, layer in layers.items()}
            start_accumulate = trainer.accumulate_grad_batches
        else:
            self._bases = {name: AttentionPrecision(**fields) for name, fields in state["bases"].items()}
            start_accumulate = state["policy"]["start_accumulate"]
        self._policy = PrecisionPolicy(self._bases, accumulate_grad_batches=start_accumulate, config=config)
        if state is not None:
            self._policy.load_state_dict(state["policy"])
            trainer.accumulate_grad_batches = state["accumulate_grad_batches"]
        self._applied_accumulate = trainer.accumulate_grad_batches
        self._apply_precisions()
        self._window_open = False
        self._pending = None if state is None else _StepRecord.from_state(state.get("pending"))
        self._check_first = self.check_before_step
        if self._check_first is None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self._check_first = scaler is not None or not all(
                getattr(optimizer, "_step_supports_amp_scaling", False) for optimizer in trainer.optimizers
            )
        self._candidate = None
        self._take_snapshot(trainer, pl_module)
        if not self._check_first:
            # The second set of host buffers, allocated now rather than in the middle of training (pinning a
            # gigabyte of host memory takes a while).
            self._take_snapshot(trainer, pl_module, candidate=True)
            self._spare, self._candidate = self._candidate, None
        tensorboard.log_layout(trainer)

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
        if self._snapshot_copied is not None:
            # The snapshot's copies must read the parameters before this step writes them.
            torch.cuda.current_stream(trainer.strategy.root_device).wait_event(self._snapshot_copied)
            self._snapshot_copied = None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        step = _StepRecord(
            step=trainer.global_step,
            packed=self._pack(trainer, pl_module, scaler),
            request=self._request,
            grad_scaler=scaler is not None,
            ran_int8=sum(self._runs_low_bit(name) for name in self._layers),
        )
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
            # A 0-dim float32 flag, as GradScaler hands it (fused Adam/AdamW subtract it from their 0-dim steps).
            optimizer.found_inf = (~torch.isfinite(step.packed[3])).to(torch.float32).reshape(())
            step.skipped_on_device = True
        step.start_copy()
        previous, self._pending = self._pending, step
        self._last_action = "pending"
        if previous is not None and self._conclude(trainer, pl_module, previous, applied=True).action == "undone":
            # The parameters went back to the snapshot: this step's gradients belong to the undone ones, so the
            # step is dropped (its tokens and layer-steps were spent all the same).
            self._pending = None
            for parameter in pl_module.parameters():
                parameter.grad = None
            self.tokens_seen += int(step.host_values()[2])
            self._layer_steps += len(self._layers)
            self._int8_layer_steps += step.ran_int8

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
        if trainer.global_step % self.snapshot_every_n_steps == 0:
            if action == "step":
                self._take_snapshot(trainer, pl_module)
            elif action == "pending" and self._pending is not None:
                # Ahead of the step's verdict (next step): kept apart until the verdict says the step was good.
                self._take_snapshot(trainer, pl_module, candidate=True)
        if self.progress_bar:
            pl_module.log("int8_share", self.int8_fraction, prog_bar=True, logger=False)
            pl_module.log("tokens_per_step", float(self.tokens_per_step), prog_bar=True, logger=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:  # the last step's verdict, still on its way
            pending, self._pending = self._pending, None
            self._conclude(trainer, pl_module, pending, applied=True)

    # ----------------------------------------------------------------------------------------- checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._policy is None:
            return dict(self._pending_state or {})
        return {
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
            # Without the check before the step, the last step's verdict is still on its way: the resumed run
            # concludes it first, as the uninterrupted one would have.
            "pending": None if self._pending is None else self._pending.state(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.history = [Decision(**decision) for decision in state_dict["history"]]
        self.tokens_seen = state_dict["tokens_seen"]
        self.tokens_per_step = state_dict["tokens_per_step"]
        self._layer_steps = state_dict["layer_steps"]
        self._int8_layer_steps = state_dict["int8_layer_steps"]
        self.skipped_steps = state_dict["skipped_steps"]
        self.rollbacks = state_dict["rollbacks"]
        # The layers are known only once training starts (the mixin swaps them in configure_model): the policy
        # state is applied then, before the first step.
        self._pending_state = dict(state_dict)
        self._policy = None

    # ---------------------------------------------------------------------------------------------- signals

    def _open_window(self, step: int) -> None:
        self._request = self._require_policy().signals_wanted(step)
        for layer in self._layers.values():
            layer.collect_stats = self._request.ds_stats
            if self._request.probe:
                layer.arm_probe()
        self._loss_sum = None
        self._micro_batches = 0
        self._window_tokens = 0
        self._window_open = True

    def _pack(self, trainer: pl.Trainer, pl_module: pl.LightningModule, scaler: Any) -> torch.Tensor:
        """The step's raw signals in one float64 vector on the device, summed across ranks (one all-reduce)."""
        device = trainer.strategy.root_device
        zero = torch.zeros((), device=device, dtype=torch.float64)
        if self._loss_sum is None:
            loss_sum = zero
        else:
            loss_sum = self._loss_sum.to(torch.float64) * trainer.accumulate_grad_batches
            if scaler is not None:
                loss_sum = loss_sum / scaler.get_scale()
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        grad_norm2 = torch.nn.utils.get_total_norm(grads).to(torch.float64).square() if grads else zero
        head = torch.stack(
            [
                loss_sum.to(device),
                zero + self._micro_batches,
                zero + self._window_tokens,
                grad_norm2.to(device),
                zero + (1.0 if grads else 0.0),
            ]
        )
        count = len(self._layers)
        if self._request.ds_stats:
            # The sums stay on the device: no host sync for them, on this step or any.
            none = torch.zeros(2, dtype=torch.float32, device=device)
            taken = [layer.take_ds_stats_on_device() for layer in self._layers.values()]
            sums = torch.stack([none if t is None else t.to(device) for t in taken]).to(torch.float64)
            has_ds = (sums != 0).any(dim=1, keepdim=True).to(torch.float64)
        else:
            sums = torch.zeros(count, 2, dtype=torch.float64, device=device)
            has_ds = torch.zeros(count, 1, dtype=torch.float64, device=device)
        if self._request.probe:
            # The probe's metrics are host numbers (the probe itself waited for the device): one copy.
            rows: list[list[float]] = []
            for layer in self._layers.values():
                probe = layer.take_probe()
                row = [0.0, float(probe is not None)]
                for tensor in _PROBE_TENSORS:
                    metrics = probe.get(tensor, {}) if probe is not None else {}
                    row += [float(metrics.get("cos", 0.0)), float(metrics.get("rel_l2", 0.0))]
                rows.append(row)
            rest = torch.tensor(rows, dtype=torch.float64, device=device)
        else:
            rest = torch.zeros(count, _LAYER_WIDTH - 3, dtype=torch.float64, device=device)
        block = torch.cat([sums, has_ds, rest], dim=1).flatten()
        return trainer.strategy.reduce(torch.cat([head, block]), reduce_op="sum")

    def _signals(self, trainer: pl.Trainer, record: _StepRecord, total: list[float]) -> StepSignals:
        """The policy's view of one step, from the reduced vector (raw sums divided here)."""
        loss_total, micro_batches, tokens, grad_norm2_total, grad_ranks = total[:_HEAD_WIDTH]
        self.tokens_per_step = int(tokens)
        self.tokens_seen += int(tokens)
        layers: dict[str, LayerSignals] = {}
        for i, name in enumerate(self._layers):
            row = total[_HEAD_WIDTH + i * _LAYER_WIDTH : _HEAD_WIDTH + (i + 1) * _LAYER_WIDTH]
            err2, norm2, ds_ranks, _, probe_ranks = row[:5]
            ds_rel_err = None
            if ds_ranks > 0:
                ds_rel_err = math.sqrt(err2 / norm2) if norm2 > 0 else (0.0 if err2 == 0 else math.nan)
                if not (math.isfinite(err2) and math.isfinite(norm2)):
                    ds_rel_err = math.nan
            probe_mean = None
            if probe_ranks > 0:
                probe_mean = {
                    tensor: {"cos": row[5 + 2 * j] / probe_ranks, "rel_l2": row[6 + 2 * j] / probe_ranks}
                    for j, tensor in enumerate(_PROBE_TENSORS)
                }
            layers[name] = LayerSignals(ds_rel_err=ds_rel_err, probe=probe_mean)
        # DDP all-reduces gradients before on_before_optimizer_step, so every rank holds the same norm: the mean
        # over the ranks that had gradients is that norm (and a NaN on any rank stays NaN).
        grad_norm = math.sqrt(grad_norm2_total / grad_ranks) if grad_ranks > 0 else None
        loss = loss_total / micro_batches if micro_batches > 0 else None
        if any(value is not None and not math.isfinite(value) for value in (loss, grad_norm)):
            # Where did it start? Each layer's flag costs a host sync, so they are read only when it matters;
            # every rank takes this branch (the reduced values agree), so the second all-reduce is matched.
            device = trainer.strategy.root_device
            flags = torch.tensor([float(layer.take_nonfinite()) for layer in self._layers.values()], device=device)
            flags = trainer.strategy.reduce(flags, reduce_op="sum").tolist()
            layers = {
                name: dataclasses.replace(signals, nonfinite=flag > 0)
                for (name, signals), flag in zip(layers.items(), flags, strict=True)
            }
        elif record.request.ds_stats or record.request.probe:
            # A flag that made nothing non-finite is moot; clear it now and then, so a later divergence is not
            # pinned on a layer by a stale flag.
            for layer in self._layers.values():
                layer.take_nonfinite()
        return StepSignals(
            step=record.step, loss=loss, grad_norm=grad_norm, layers=layers, grad_scaler=record.grad_scaler
        )

    def _conclude(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: _StepRecord, *, applied: bool
    ) -> StepOutcome:
        """Decide about one step and carry it out.

        ``applied=False``: before the step's optimizer step (``check_before_step``): a skip or a rollback drops
        its gradients. ``applied=True``: one step later; a step that should not have been applied is undone by
        restoring the snapshot, unless the device already skipped it. The returned action is then ``"undone"``.
        """
        signals = self._signals(trainer, record, record.host_values())
        outcome = self._require_policy().decide(signals)
        decisions = list(outcome.decisions)
        action = outcome.action
        skipped = outcome.action == "skip" and (not applied or record.skipped_on_device)
        if outcome.action == "rollback" or (outcome.action == "skip" and not skipped):
            self._restore_snapshot(trainer, pl_module)
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
            action = "undone" if applied else "rollback"
        if not applied and outcome.action in ("skip", "rollback"):
            # No gradient, no update: torch optimizers skip parameters whose .grad is None (moments, step
            # counters and weight decay included); a GradScaler, if any, already recorded its inf checks.
            for parameter in pl_module.parameters():
                parameter.grad = None
        self.skipped_steps += skipped
        self._apply_precisions()
        self._layer_steps += len(self._layers)
        self._int8_layer_steps += record.ran_int8
        self.history.extend(decisions)
        if self.verbose:
            for decision in decisions:
                rank_zero_info(f"AdaptivePrecision: {decision}")
        self._log_step(trainer, signals, dataclasses.replace(outcome, decisions=tuple(decisions)))
        if self._candidate is not None and self._candidate["step"] == record.step + 1:
            # The snapshot taken after this step: good where the step stands, dropped where it was undone.
            if action == "undone":
                self._spare, self._candidate = self._candidate, None
            else:
                self._spare, self._snapshot, self._candidate = self._snapshot, self._candidate, None
        return dataclasses.replace(outcome, action=action, decisions=tuple(decisions))

    # ---------------------------------------------------------------------------------------------- actions

    def _apply_precisions(self) -> None:
        policy = self._require_policy()
        for name, layer in self._layers.items():
            wanted = policy.precision(name)
            if layer.precision != wanted:
                layer.precision = wanted

    def _on_fast_path(self, name: str) -> bool:
        """Whether the layer runs its base precision's mode with every base INT8 product still in INT8 (an
        attn_qat layer has no INT8 products: it is on its fast path while still in attn_qat mode)."""
        base, now = self._bases[name], self._layers[name].precision
        return now.mode == base.mode and set(base.int8_products) <= set(now.int8_products)

    def _runs_low_bit(self, name: str) -> bool:
        """Whether the layer runs low-bit now: a base precision with low-bit work, still on its fast path."""
        return self._bases[name].mode != "full" and self._on_fast_path(name)

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, candidate: bool = False) -> None:
        """Copy model and optimizer state to host memory, overlapping the next forward and backward on CUDA.

        ``candidate``: keep it apart from the last good snapshot (in the spare buffers) until its step's verdict.
        """
        if candidate:
            previous = self._spare or {}
            self._spare = None
        else:
            previous = self._snapshot or {}
        device = trainer.strategy.root_device

        def copy() -> dict[str, Any]:
            # Into the previous snapshot's buffers (pinned host memory for CUDA tensors), without waiting:
            # allocating and page-faulting fresh host memory each time cost more than the copies.
            return {
                "step": trainer.global_step,
                "model": _copy_to_host(pl_module.state_dict(), previous.get("model")),
                "optimizers": _copy_to_host(
                    [optimizer.state_dict() for optimizer in trainer.optimizers], previous.get("optimizers")
                ),
            }

        if device.type != "cuda":
            self._keep_snapshot(copy(), candidate)
            return
        # On a side stream, the copies overlap the next forward and backward (which only read the parameters);
        # the next optimizer step, the first writer, waits for them (on_before_optimizer_step).
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._copy_stream):
            self._keep_snapshot(copy(), candidate)
        self._snapshot_copied = torch.cuda.Event()
        self._snapshot_copied.record(self._copy_stream)

    def _keep_snapshot(self, snapshot: dict[str, Any], candidate: bool) -> None:
        if candidate:
            self._candidate = snapshot
        else:
            self._snapshot = snapshot

    def _restore_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        snapshot = self._snapshot
        assert snapshot is not None, "on_train_start takes the first snapshot"
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the snapshot's copies to host memory were not waited for
        pl_module.load_state_dict(snapshot["model"])
        for optimizer, saved in zip(trainer.optimizers, snapshot["optimizers"], strict=True):
            # Keep the schedule's current hyperparameters (lr, ...): only parameters and moments go back.
            hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            # A fresh copy: load_state_dict keeps tensors already on the right device as the optimizer's own
            # state (CPU training) and would update the snapshot in place, spoiling it for the next rollback.
            optimizer.load_state_dict(_copy_to_host(saved, None))
            for group, values in zip(optimizer.param_groups, hyper, strict=True):
                group.update(values)

    # ---------------------------------------------------------------------------------------------- logging

    def _log_step(self, trainer: pl.Trainer, signals: StepSignals, outcome: StepOutcome) -> None:
        step = signals.step
        every = self.log_every_n_steps or max(1, trainer.log_every_n_steps)
        metrics: dict[str, float] = {}
        measured = False
        for name, layer in signals.layers.items():
            if layer.ds_rel_err is not None:
                metrics[f"sage/ds_rel_err/{name}"] = layer.ds_rel_err
                measured = True
            if layer.probe is not None:
                for tensor, values in layer.probe.items():
                    metrics[f"sage/probe/{tensor}_cos/{name}"] = values["cos"]
                    metrics[f"sage/probe/{tensor}_rel_l2/{name}"] = values["rel_l2"]
                measured = True
        spiking = (outcome.loss is not None and outcome.loss.level != "none") or (
            outcome.grad_norm is not None and outcome.grad_norm.level != "none"
        )
        if measured or spiking or outcome.decisions or step % every == 0:
            policy = self._require_policy()
            for name in self._layers:
                metrics[f"sage/level/{name}"] = float(policy.level(name))
            metrics["sage/tokens_per_step"] = float(self.tokens_per_step)
            metrics["sage/tokens_seen"] = float(self.tokens_seen)
            metrics["sage/int8_fraction"] = self.int8_fraction
            metrics["sage/accumulate_grad_batches"] = float(trainer.accumulate_grad_batches)
            metrics["sage/skipped_steps"] = float(self.skipped_steps)
            metrics["sage/rollbacks"] = float(self.rollbacks)
            if signals.loss is not None:
                metrics["sage/loss"] = signals.loss
            if signals.grad_norm is not None:
                metrics["sage/grad_norm"] = signals.grad_norm
            if outcome.loss is not None:
                metrics["sage/spike/loss"] = float(("none", "soft", "hard").index(outcome.loss.level))
                if outcome.loss.z is not None:
                    metrics["sage/spike/loss_z"] = outcome.loss.z
            if outcome.grad_norm is not None:
                metrics["sage/spike/grad_norm"] = float(outcome.grad_norm.level != "none")
                if outcome.grad_norm.z is not None:
                    metrics["sage/spike/grad_norm_z"] = outcome.grad_norm.z
        tensorboard.log_scalars(trainer, metrics, step)
        tensorboard.log_decisions(trainer, outcome.decisions, step)

    def _require_policy(self) -> PrecisionPolicy:
        if self._policy is None:
            raise RuntimeError("AdaptivePrecision: the policy is built in on_train_start; this hook ran before it.")
        return self._policy


@dataclasses.dataclass
class _StepRecord:
    """One optimizer step's reduced signals on their way to the host, with what its verdict needs."""

    step: int
    packed: torch.Tensor
    request: SignalRequest
    grad_scaler: bool
    ran_int8: int
    skipped_on_device: bool = False
    _copied: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Copy the signals to (pinned) host memory without waiting; :meth:`host_values` waits if needed."""
        if self.packed.is_cuda:
            self.packed = self.packed.to("cpu", non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of a step whose verdict is pending (waits for its signals)."""
        return {
            "step": self.step,
            "values": self.host_values(),
            "request": dataclasses.asdict(self.request),
            "grad_scaler": self.grad_scaler,
            "ran_int8": self.ran_int8,
            "skipped_on_device": self.skipped_on_device,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> _StepRecord | None:
        """The record :meth:`state` kept, or ``None``."""
        if state is None:
            return None
        return cls(
            step=state["step"],
            packed=torch.tensor(state["values"], dtype=torch.float64),
            request=SignalRequest(**state["request"]),
            grad_scaler=state["grad_scaler"],
            ran_int8=state["ran_int8"],
            skipped_on_device=state["skipped_on_device"],
        )

    def host_values(self) -> list[float]:
        if self._copied is not None:
            self._copied.synchronize()
        return self.packed.tolist()


def count_tokens(batch: Any) -> int:
    """The default ``tokens_fn``: elements of the batch's token-id tensor.

    A tensor counts as itself; a mapping by ``"input_ids"`` or else its first tensor value; a list or tuple by
    its first tensor.

    Raises:
        ValueError: no tensor found; pass ``AdaptivePrecision(tokens_fn=...)``.

    Example::

        count_tokens({"input_ids": torch.zeros(8, 1024, dtype=torch.long)})   # 8192
    """
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"].numel()
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = []
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.numel()
    raise ValueError(
        f"AdaptivePrecision: cannot count the tokens of a batch of type {type(batch).__name__}; pass "
        "AdaptivePrecision(tokens_fn=lambda batch: ...) returning the tokens of one micro-batch."
    )


def _copy_to_host(value: Any, buffers: Any) -> Any:
    """A copy of ``value`` with every tensor copied to host memory, reusing ``buffers`` (a previous result of
    the same structure) where shapes and dtypes match. Copies from CUDA go to pinned memory and do not block.
    """
    if isinstance(value, torch.Tensor):
        source = value.detach()
        reusable = isinstance(buffers, torch.Tensor) and buffers.shape == source.shape
        if reusable and buffers.dtype == source.dtype:
            target = buffers
        else:
            target = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
        target.copy_(source, non_blocking=source.is_cuda)
        return target
    if isinstance(value, dict):
        buffers = buffers if isinstance(buffers, dict) else {}
        return {key: _copy_to_host(item, buffers.get(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        buffers = buffers if isinstance(buffers, (list, tuple)) and len(buffers) == len(value) else [None] * len(value)
        items = [_copy_to_host(item, buffer) for item, buffer in zip(value, buffers, strict=True)]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AdaptivePrecision: {name} must be an int >= 1; received {value!r}.")
