"""The controller's policy: signals in, decisions out, each with its reason.

Pure Python (no torch, no Lightning, no Triton): :class:`PrecisionPolicy` takes the numbers of one optimizer
step (:class:`StepSignals`) and returns what to do (:class:`StepOutcome`); the Lightning callback
(:class:`sage_lightning.AdaptivePrecision`) measures the signals, reduces them across ranks and carries the
decisions out. So every rule here is tested with tables of signals, and every rank that feeds it the same
reduced numbers takes the same decisions.

The levers:

* per layer, a ladder of rungs climbed one at a time from the layer's base :class:`AttentionPrecision`
  (default: ``smooth_q`` only when the forward is implicated, then ``ds="bf16"``, then ``mode="full"``;
  a rung that changes nothing that runs is passed over, so an ``attn_qat`` layer's only rung is ``full``);
* globally, ``accumulate_grad_batches`` (tokens per optimizer step), lowered only when a divergence cannot be
  pinned on any attention setting, and raised back after a calm period;
* per step, skipping an optimizer step whose gradients are non-finite, and rolling back to the last
  snapshot on a non-finite loss or a hard loss spike.

Thresholds and their measurements: ``docs/controller.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sage_lightning.detectors import SpikeDetector, SpikeReading
from sage_lightning.kernels.precision import AttentionPrecision

#: What part of attention a rung changes: the forward products, the backward ones, or both.
SCOPES: tuple[str, ...] = ("forward", "backward", "both")
#: What a :class:`Decision` changes.
LEVERS: tuple[str, ...] = ("precision", "accumulate_grad_batches", "optimizer_step", "rollback")
#: What the callback does with the optimizer step a :class:`StepOutcome` is about.
ACTIONS: tuple[str, ...] = ("step", "skip", "rollback")
#: Probe tensors of the backward pass (``"O"`` is the forward's).
PROBE_GRADIENTS: tuple[str, ...] = ("dQ", "dK", "dV")


@dataclass(frozen=True)
class Rung:
    """One step up a layer's precision ladder: fields of :class:`AttentionPrecision` to change.

    Args:
        name: a short label, unique in the ladder (logged with every decision).
        changes: ``AttentionPrecision`` fields and their new values, e.g. ``{"ds": "bf16"}`` (kept as a sorted
            tuple of pairs, so the rung stays immutable and hashable).
        scope: ``"forward"``, ``"backward"`` or ``"both"``: the part of attention the change affects. A
            ``"forward"`` rung is taken only when a signal implicates the forward (the probe's O); signals
            about the backward skip it.

    Raises:
        ValueError: an empty name, an unknown scope, or changes ``AttentionPrecision`` refuses.

    Example::

        from sage_lightning.policy import Rung

        Rung("ds_bf16", {"ds": "bf16"}, scope="backward")
    """

    name: str
    changes: Mapping[str, object] | tuple[tuple[str, object], ...]
    scope: str = "both"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Rung: name must be a non-empty string; received {self.name!r}.")
        if self.scope not in SCOPES:
            raise ValueError(f"Rung {self.name!r}: scope must be one of {SCOPES}; received {self.scope!r}.")
        try:
            changes = dict(self.changes)
        except (TypeError, ValueError):
            changes = {}
        if not changes:
            raise ValueError(
                f"Rung {self.name!r}: changes must be a non-empty mapping of AttentionPrecision fields, "
                f'e.g. {{"ds": "bf16"}}; received {self.changes!r}.'
            )
        fields = {f.name for f in dataclasses.fields(AttentionPrecision)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ValueError(
                f"Rung {self.name!r}: changes name unknown AttentionPrecision fields {unknown}; "
                f"the fields are {sorted(fields)}."
            )
        try:
            AttentionPrecision().replace(**changes)
        except ValueError as err:
            raise ValueError(f"Rung {self.name!r}: changes {changes!r} are refused: {err}") from err
        object.__setattr__(self, "changes", tuple(sorted(changes.items())))

    @property
    def fields(self) -> dict[str, object]:
        """The changed fields and their values."""
        return dict(self.changes)

    def apply(self, precision: AttentionPrecision) -> AttentionPrecision:
        """``precision`` with this rung's changes."""
        return precision.replace(**self.fields)


#: The design's ladder: Q-smoothing where the forward is implicated, then dS in bf16, then full precision.
DEFAULT_LADDER: tuple[Rung, ...] = (
    Rung("smooth_q", {"smooth_q": True}, scope="forward"),
    Rung("ds_bf16", {"ds": "bf16"}, scope="backward"),
    Rung("full", {"mode": "full"}, scope="both"),
)


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and cadences of :class:`PrecisionPolicy`; ``docs/controller.md`` gives the measurement behind
    every default.

    Args:
        ladder: the rungs a layer climbs, lowest first.
        ds_stats_every_n_steps: measure every layer's dS quantization error on optimizer steps that are a
            multiple of this (free on the others).
        probe_every_n_steps: compare every layer with full-precision attention on one micro-batch of the
            optimizer steps that are a multiple of this.
        ds_rel_err_high: a layer whose ``ds_rel_err`` exceeds this, ``ds_rel_err_patience`` measurements in a
            row while its dS runs in INT8, moves to the next backward rung.
        ds_rel_err_low: a rung that changed ``ds`` is left (stepping down) only when the latest ``ds_rel_err``
            is below this (hysteresis: below ``ds_rel_err_high``).
        ds_rel_err_patience: consecutive measurements above ``ds_rel_err_high`` needed to escalate.
        probe_o_cos_min: a probe whose O cosine is below this implicates the forward (the next rung,
            ``smooth_q`` included).
        probe_grad_cos_min: a probe whose dQ, dK or dV cosine is below this escalates the layer: on the
            backward's rungs when dS's INT8 error explains it, on the forward's otherwise.
        ds_explains_ratio: dS's INT8 error explains a poor dQ or dK when ``ds_rel_err`` is at least this
            fraction of their relative L2 error (dQ and dK inherit dS's error one for one).
        attn_qat_probe_o_cos_min: ``probe_o_cos_min`` for a layer in ``mode="attn_qat"``, whose simulated FP4
            is meant to differ from full precision (quantization-aware training absorbs it): the O cosine below
            which FP4 has lost the layer's attention, and the layer goes to full precision.
        attn_qat_probe_grad_cos_min: ``probe_grad_cos_min`` for a layer in ``mode="attn_qat"``.
        calm_steps: optimizer steps a layer stays on a rung, with no trigger, before stepping down one rung;
            each re-escalation soon after a step down doubles it (backoff).
        max_backoff: the calm period grows to at most ``calm_steps * 2**max_backoff``.
        spike_window: values the loss and gradient-norm spike detectors look back over.
        spike_min_history: values they need before flagging anything.
        loss_spike_z: robust z-score of the per-step loss above which it is a (soft) spike: the next step
            measures the dS statistics.
        loss_hard_spike_z: robust z-score above which the loss is a hard spike: roll back and escalate.
        grad_norm_spike_z: robust z-score of the gradient norm above which it is a (soft) spike.
        spike_rel_floor: the detectors' spread is at least this fraction of the median.
        max_consecutive_skips: non-finite gradients this many steps in a row count as a divergence (roll back
            and escalate) instead of one more skipped step.
        min_accumulate_grad_batches: the lowest ``accumulate_grad_batches`` the tokens-per-step lever may set;
            ``None`` turns the lever off.

    Raises:
        ValueError: a value out of range; the message names the argument, the value and what works.

    Example::

        from sage_lightning.policy import PolicyConfig

        config = PolicyConfig(ds_rel_err_high=0.15, ds_rel_err_low=0.08, calm_steps=1000)
    """

    ladder: tuple[Rung, ...] = DEFAULT_LADDER
    ds_stats_every_n_steps: int = 25
    probe_every_n_steps: int = 5000
    ds_rel_err_high: float = 0.2
    ds_rel_err_low: float = 0.1
    ds_rel_err_patience: int = 2
    probe_o_cos_min: float = 0.995
    probe_grad_cos_min: float = 0.97
    ds_explains_ratio: float = 0.5
    attn_qat_probe_o_cos_min: float = 0.95
    attn_qat_probe_grad_cos_min: float = 0.9
    calm_steps: int = 1000
    max_backoff: int = 4
    spike_window: int = 64
    spike_min_history: int = 16
    loss_spike_z: float = 6.0
    loss_hard_spike_z: float = 20.0
    grad_norm_spike_z: float = 10.0
    spike_rel_floor: float = 0.005
    max_consecutive_skips: int = 3
    min_accumulate_grad_batches: int | None = 1

    def __post_init__(self) -> None:
        ladder = tuple(self.ladder) if isinstance(self.ladder, (list, tuple)) else self.ladder
        if not isinstance(ladder, tuple) or not ladder or not all(isinstance(r, Rung) for r in ladder):
            raise ValueError(f"PolicyConfig: ladder must be a non-empty sequence of Rung; received {self.ladder!r}.")
        names = [r.name for r in ladder]
        if len(set(names)) != len(names):
            raise ValueError(f"PolicyConfig: ladder rung names must be unique; received {names}.")
        object.__setattr__(self, "ladder", ladder)
        for name in (
            "ds_stats_every_n_steps",
            "probe_every_n_steps",
            "ds_rel_err_patience",
            "calm_steps",
            "max_consecutive_skips",
        ):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("max_backoff", self.max_backoff, minimum=0, maximum=30)
        _check_int("spike_window", self.spike_window, minimum=3)
        _check_int("spike_min_history", self.spike_min_history, minimum=3, maximum=self.spike_window)
        if self.min_accumulate_grad_batches is not None:
            _check_int("min_accumulate_grad_batches", self.min_accumulate_grad_batches, minimum=1)
        for name in ("ds_rel_err_high", "ds_rel_err_low", "loss_spike_z", "loss_hard_spike_z", "grad_norm_spike_z"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"PolicyConfig: {name} must be a positive finite number; received {value!r}.")
        if self.ds_rel_err_low >= self.ds_rel_err_high:
            raise ValueError(
                f"PolicyConfig: ds_rel_err_low must be below ds_rel_err_high ({self.ds_rel_err_high}) so decisions "
                f"do not flap; received {self.ds_rel_err_low!r}."
            )
        if self.loss_hard_spike_z <= self.loss_spike_z:
            raise ValueError(
                f"PolicyConfig: loss_hard_spike_z must be above loss_spike_z ({self.loss_spike_z}); "
                f"received {self.loss_hard_spike_z!r}."
            )
        for name in (
            "probe_o_cos_min",
            "probe_grad_cos_min",
            "ds_explains_ratio",
            "attn_qat_probe_o_cos_min",
            "attn_qat_probe_grad_cos_min",
        ):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value <= 1:
                raise ValueError(f"PolicyConfig: {name} must be in (0, 1]; received {value!r}.")
        if not _is_number(self.spike_rel_floor) or not 0 <= self.spike_rel_floor < 1:
            raise ValueError(f"PolicyConfig: spike_rel_floor must be in [0, 1); received {self.spike_rel_floor!r}.")


@dataclass(frozen=True)
class LayerSignals:
    """What was measured about one attention layer during one optimizer step (reduced across ranks).

    Attributes:
        ds_rel_err: ``sqrt(sum err^2 / sum dS^2)`` of the score gradient's INT8 quantization, or ``None`` when
            not measured this step; NaN when dS itself was non-finite.
        probe: ``{"O": {"cos": .., "rel_l2": ..}, "dQ": {...}, "dK": {...}, "dV": {...}}`` against
            full-precision attention, or ``None`` when not probed this step.
        nonfinite: the layer returned a non-finite output from finite inputs (where a divergence starts).
    """

    ds_rel_err: float | None = None
    probe: Mapping[str, Mapping[str, float]] | None = None
    nonfinite: bool = False


@dataclass(frozen=True)
class StepSignals:
    """What was measured during one optimizer step, reduced across ranks.

    Attributes:
        step: the optimizer step's index (``trainer.global_step`` before it runs).
        loss: the step's loss: the mean of its micro-batches' losses (``training_step``'s value, before
            Lightning divides it by ``accumulate_grad_batches``), over every rank; ``None`` when no micro-batch
            returned a loss (``training_step`` returned ``None``).
        grad_norm: total 2-norm of the gradients about to be applied, or ``None`` when not measured.
        layers: per layer, by name.
        grad_scaler: an AMP ``GradScaler`` skips steps with non-finite gradients itself (fp16), so those are
            routine overflow, not divergence.
    """

    step: int
    loss: float | None
    grad_norm: float | None = None
    layers: Mapping[str, LayerSignals] = field(default_factory=dict)
    grad_scaler: bool = False


@dataclass(frozen=True)
class SignalRequest:
    """Which optional signals the policy wants measured during an optimizer step."""

    ds_stats: bool
    probe: bool


@dataclass(frozen=True)
class Decision:
    """One change the controller made, with its reason.

    Attributes:
        step: the optimizer step the decision was taken at.
        layer: the attention layer's name, or ``None`` for a global lever.
        lever: one of :data:`LEVERS`.
        old: the setting before (e.g. an ``AttentionPrecision.short_name``).
        new: the setting after.
        reason: the signal and threshold that caused it.
    """

    step: int
    layer: str | None
    lever: str
    old: str
    new: str
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.layer or 'global'} {self.lever}: {self.old} -> {self.new} ({self.reason})"


@dataclass(frozen=True)
class StepOutcome:
    """What to do with one optimizer step.

    Attributes:
        action: ``"step"`` (apply it), ``"skip"`` (leave parameters and optimizer state as they are) or
            ``"rollback"`` (restore the last snapshot, then skip).
        decisions: every change taken at this step, in the order taken.
        loss: the loss spike detector's reading (``None`` when the loss was not finite).
        grad_norm: the gradient-norm spike detector's reading (``None`` when not measured or not finite).
    """

    action: str
    decisions: tuple[Decision, ...]
    loss: SpikeReading | None
    grad_norm: SpikeReading | None


@dataclass
class _LayerState:
    base: AttentionPrecision
    path: list[int] = field(default_factory=list)  # ladder indices taken, lowest first; stepping down pops
    last_change: int | None = None
    last_step_down: int | None = None
    backoff: int = 0
    ds_high_streak: int = 0
    last_ds_rel_err: float | None = None
    last_ds_step: int | None = None


class PrecisionPolicy:
    """Decides, step by step, every attention layer's precision, the tokens per step, and what to do with a step.

    Escalation (per layer, one rung per trigger, forward-only rungs only for forward triggers):

    * ``ds_rel_err > ds_rel_err_high`` for ``ds_rel_err_patience`` measurements in a row, while the layer's dS
      runs in INT8: next backward rung;
    * probe O cosine ``< probe_o_cos_min``: the forward, so the next rung, ``smooth_q`` included;
    * probe dQ or dK cosine ``< probe_grad_cos_min``: the next backward rung when ``ds_rel_err`` explains it
      (at least ``ds_explains_ratio`` of their relative error, dS still INT8), the forward's otherwise; a poor
      dV is the forward's (it does not use dS);
    * a layer in ``mode="attn_qat"`` (no INT8 dS, no dS statistics) is probed against its own thresholds,
      ``attn_qat_probe_o_cos_min`` and ``attn_qat_probe_grad_cos_min``: any poor tensor is the FP4 forward's.

    Divergence (roll back to the last snapshot, then escalate): a non-finite loss, a hard loss spike, or
    non-finite gradients ``max_consecutive_skips`` steps in a row. The escalation goes to where it started:
    layers that returned non-finite outputs from finite inputs go to the top rung; else the last layer (in
    module order, so the first the backward reaches) whose dS was non-finite, a later layer's being finite,
    goes up one backward rung; else every layer whose dS still runs in INT8 goes up one backward rung (dS is
    the dominant INT8 error), and every layer in ``mode="attn_qat"`` goes to its next rung (full precision);
    else the tokens per step are halved. Single non-finite gradients skip the step.

    Stepping down (one rung, hysteresis and backoff): after ``calm_steps * 2**backoff`` steps on a rung with no
    trigger, and, for a rung that changed ``ds``, a ``ds_rel_err`` below ``ds_rel_err_low`` measured since.
    ``backoff`` grows by one when a layer escalates again within its calm period after a step down. Halved
    tokens per step double back the same way, up to the setting the run started with.

    Args:
        layers: every attention layer's name and base precision, in module order.
        accumulate_grad_batches: the run's ``accumulate_grad_batches`` (the ceiling of the tokens lever).
        config: thresholds and cadences; :class:`PolicyConfig` defaults when ``None``.

    Raises:
        ValueError: no layers, a base that is not an ``AttentionPrecision``, or a bad
            ``accumulate_grad_batches``.

    Example::

        from sage_lightning.kernels import AttentionPrecision
        from sage_lightning.policy import LayerSignals, PrecisionPolicy, StepSignals

        policy = PrecisionPolicy({"blocks.0.attn": AttentionPrecision()})
        for step in (0, 25):
            outcome = policy.decide(
                StepSignals(step=step, loss=2.0, layers={"blocks.0.attn": LayerSignals(ds_rel_err=0.3)})
            )
        print(outcome.decisions[0])   # ... precision: sagebwd:... -> ... (ds_rel_err 0.3 > ds_rel_err_high 0.2 ...)
        print(policy.precision("blocks.0.attn").ds)   # "bf16"
    """

    def __init__(
        self,
        layers: Mapping[str, AttentionPrecision],
        *,
        accumulate_grad_batches: int = 1,
        config: PolicyConfig | None = None,
    ) -> None:
        if not isinstance(layers, Mapping) or not layers:
            raise ValueError(
                "PrecisionPolicy: layers must be a non-empty mapping of layer name to AttentionPrecision "
                f"(convert the model's attention first); received {layers!r}."
            )
        for name, base in layers.items():
            if not isinstance(base, AttentionPrecision):
                raise ValueError(
                    f"PrecisionPolicy: layers[{name!r}] must be an AttentionPrecision; received {type(base).__name__}."
                )
        _check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1, owner="PrecisionPolicy")
        if config is not None and not isinstance(config, PolicyConfig):
            raise ValueError(
                f"PrecisionPolicy: config must be a PolicyConfig or None; received {type(config).__name__}."
            )
        self.config = config or PolicyConfig()
        self._layers = {name: _LayerState(base=base) for name, base in layers.items()}
        self._start_accumulate = accumulate_grad_batches
        self._accumulate = accumulate_grad_batches
        self._accumulate_last_change: int | None = None
        self._accumulate_last_raise: int | None = None
        self._accumulate_backoff = 0
        self._consecutive_skips = 0
        self._armed: dict[str, int] = {}
        cfg = self.config
        self._loss_detector = SpikeDetector(
            window=cfg.spike_window,
            min_history=cfg.spike_min_history,
            soft_z=cfg.loss_spike_z,
            hard_z=cfg.loss_hard_spike_z,
            rel_floor=cfg.spike_rel_floor,
        )
        self._grad_norm_detector = SpikeDetector(
            window=cfg.spike_window,
            min_history=cfg.spike_min_history,
            soft_z=cfg.grad_norm_spike_z,
            rel_floor=cfg.spike_rel_floor,
        )

    # ------------------------------------------------------------------ what the callback reads

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The layers, in module order."""
        return tuple(self._layers)

    @property
    def accumulate_grad_batches(self) -> int:
        """The ``accumulate_grad_batches`` the policy wants (the callback applies it at an aligned batch)."""
        return self._accumulate

    def precision(self, layer: str) -> AttentionPrecision:
        """The precision ``layer`` should run at now."""
        state = self._layer(layer)
        return self._precision_of(state.base, state.path)

    def precisions(self) -> dict[str, AttentionPrecision]:
        """Every layer's precision, by name."""
        return {name: self.precision(name) for name in self._layers}

    def level(self, layer: str) -> int:
        """How far up the ladder ``layer`` is: 0 at its base, ``i + 1`` on ``config.ladder[i]``."""
        path = self._layer(layer).path
        return path[-1] + 1 if path else 0

    def rung(self, layer: str) -> str:
        """The name of the rung ``layer`` is on (``"base"`` at its base)."""
        path = self._layer(layer).path
        return self.config.ladder[path[-1]].name if path else "base"

    def signals_wanted(self, step: int) -> SignalRequest:
        """Which optional signals to measure during optimizer step ``step``.

        The cadences of the config, plus the dS statistics on the step after a spike or a skipped step, and
        both signals on the step after a rollback or a step down. A probe step also measures dS, to attribute
        what the probe finds.

        Example::

            policy.signals_wanted(25)   # SignalRequest(ds_stats=True, probe=False) with the defaults
        """
        cfg = self.config
        return SignalRequest(
            ds_stats=step % cfg.ds_stats_every_n_steps == 0
            or step % cfg.probe_every_n_steps == 0
            or self._armed.get("ds_stats") == step,
            probe=step % cfg.probe_every_n_steps == 0 or self._armed.get("probe") == step,
        )

    # ------------------------------------------------------------------ the decision

    def decide(self, signals: StepSignals) -> StepOutcome:
        """Everything to do about one optimizer step, from its reduced signals.

        Args:
            signals: the step's signals; ``signals.layers`` may omit layers with nothing measured.

        Returns:
            The :class:`StepOutcome`: the action for this step and the decisions taken (already applied to
            the policy's state: :meth:`precision` and :attr:`accumulate_grad_batches` return the new values).

        Raises:
            ValueError: signals about a layer the policy does not know.

        Example::

            outcome = policy.decide(StepSignals(step=3, loss=float("nan")))
            outcome.action   # "rollback"
        """
        unknown = sorted(set(signals.layers) - set(self._layers))
        if unknown:
            raise ValueError(
                f"PrecisionPolicy.decide: signals for unknown layers {unknown}; known: {self.layer_names}."
            )
        step = signals.step
        layers = {name: signals.layers.get(name, LayerSignals()) for name in self._layers}
        for name, measured in layers.items():
            if measured.ds_rel_err is not None and math.isfinite(measured.ds_rel_err):
                state = self._layers[name]
                state.last_ds_rel_err, state.last_ds_step = float(measured.ds_rel_err), step

        decisions: list[Decision] = []
        loss_reading: SpikeReading | None = None
        grad_reading: SpikeReading | None = None
        grads_finite = signals.grad_norm is None or math.isfinite(signals.grad_norm)
        divergence: str | None = None
        action = "step"

        if signals.loss is not None and not math.isfinite(signals.loss):
            divergence = f"loss is {signals.loss}"
        elif not grads_finite and signals.grad_scaler:
            # fp16 overflow: the GradScaler skips this step and lowers its scale; routine, not a divergence.
            if signals.loss is not None:
                loss_reading = self._loss_detector.update(signals.loss)
        elif not grads_finite:
            self._consecutive_skips += 1
            if self._consecutive_skips >= self.config.max_consecutive_skips:
                divergence = f"gradient norm {signals.grad_norm} for {self._consecutive_skips} steps in a row"
            else:
                action = "skip"
                decisions.append(
                    Decision(step, None, "optimizer_step", "apply", "skip", f"gradient norm is {signals.grad_norm}")
                )
                decisions += self._escalate_backward_origin(layers, step)
                self._arm(step + 1, "ds_stats")
        else:
            self._consecutive_skips = 0
            if signals.loss is not None:
                loss_reading = self._loss_detector.update(signals.loss)
            if loss_reading is not None and loss_reading.level == "hard":
                divergence = (
                    f"loss {signals.loss:.4g} spiked: robust z {loss_reading.z:.1f} > loss_hard_spike_z "
                    f"{self.config.loss_hard_spike_z:g} (window median {loss_reading.median:.4g})"
                )
            else:
                if signals.grad_norm is not None:
                    grad_reading = self._grad_norm_detector.update(signals.grad_norm)
                readings = (loss_reading, grad_reading)
                if any(reading is not None and reading.level == "soft" for reading in readings):
                    # A spike is not pinned on any layer yet: measure dS next step and let the layer rules act
                    # on evidence. Not the probe: it costs about ten steps (float64 attention per layer), and
                    # early training's growing gradient norm can flag many steps in a row.
                    self._arm(step + 1, "ds_stats")

        if divergence is not None:
            action = "rollback"
            self._consecutive_skips = 0
            decisions.append(Decision(step, None, "rollback", f"step {step}", "last snapshot", divergence))
            decisions += self._escalate_divergence(layers, step, divergence)
            self._arm(step + 1, "ds_stats", "probe")
        elif action == "step":
            decisions += self._layer_rules(layers, step)
            decisions += self._accumulate_step_up(step)
        return StepOutcome(action=action, decisions=tuple(decisions), loss=loss_reading, grad_norm=grad_reading)

    # ------------------------------------------------------------------ rules

    def _layer_rules(self, layers: Mapping[str, LayerSignals], step: int) -> list[Decision]:
        cfg = self.config
        decisions: list[Decision] = []
        for name, measured in layers.items():
            state = self._layers[name]
            current = self.precision(name)
            scope, reason = None, ""
            if measured.ds_rel_err is not None and current.mode == "sagebwd" and current.ds == "int8":
                err = measured.ds_rel_err
                if math.isfinite(err) and err > cfg.ds_rel_err_high:
                    state.ds_high_streak += 1
                    if state.ds_high_streak >= cfg.ds_rel_err_patience:
                        scope = "backward"
                        reason = (
                            f"ds_rel_err {err:.4g} > ds_rel_err_high {cfg.ds_rel_err_high:g} "
                            f"({state.ds_high_streak} measurements in a row)"
                        )
                elif math.isfinite(err):
                    state.ds_high_streak = 0
            if scope is None and measured.probe:
                scope, reason = self._probe_trigger(measured.probe, state, current)
            if scope is not None:
                decision = self._escalate(name, scope, step, reason)
                if decision is not None:
                    decisions.append(decision)
                    continue
            decision = self._step_down(name, step)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def _probe_trigger(
        self, probe: Mapping[str, Mapping[str, float]], state: _LayerState, current: AttentionPrecision
    ) -> tuple[str | None, str]:
        """Which part of attention the probe implicates (``None``: neither), with the reason.

        O is the forward's output. dQ and dK carry dS's INT8 error one for one (the accuracy harness: dS alone
        in INT8 gives dQ a relative error equal to dS's), so when their error is well beyond the measured
        ``ds_rel_err``, the excess comes from the forward's INT8 products (S, then P), which ``ds="bf16"``
        cannot fix. dV does not use dS at all.
        """
        cfg = self.config
        if current.mode == "attn_qat":
            return self._attn_qat_probe_trigger(probe)
        o_cos = _probe_cos(probe, "O")
        if o_cos is not None and o_cos < cfg.probe_o_cos_min:
            return "forward", f"probe O cos {o_cos:.5f} < probe_o_cos_min {cfg.probe_o_cos_min:g}"
        poor = [(t, c) for t in PROBE_GRADIENTS if (c := _probe_cos(probe, t)) is not None]
        poor = [(t, c) for t, c in poor if c < cfg.probe_grad_cos_min]
        if not poor:
            return None, ""
        tensor, cos = min(poor, key=lambda item: item[1])
        reason = f"probe {tensor} cos {cos:.5f} < probe_grad_cos_min {cfg.probe_grad_cos_min:g}"
        if tensor == "dV":
            return "forward", reason + " (dV does not use dS: its error comes from P)"
        rel_l2 = _probe_rel_l2(probe, tensor)
        err = state.last_ds_rel_err
        if current.mode == "sagebwd" and current.ds == "int8":
            if err is None or rel_l2 is None or err >= cfg.ds_explains_ratio * rel_l2:
                return "backward", reason + f", which dS's INT8 error explains (ds_rel_err {_fmt(err)})"
        return "forward", reason + (
            f", beyond dS's INT8 error (ds_rel_err {_fmt(err)} < ds_explains_ratio {cfg.ds_explains_ratio:g} x "
            f"rel_l2 {_fmt(rel_l2)}): the forward's error"
            if current.mode == "sagebwd" and current.ds == "int8"
            else " with dS already in high precision: the forward's error"
        )

    def _attn_qat_probe_trigger(self, probe: Mapping[str, Mapping[str, float]]) -> tuple[str | None, str]:
        """An ``attn_qat`` layer's probe: every error is its FP4 forward's (Q, K, V and P quantized; the backward's
        products run in bf16), measured against the looser thresholds FP4 attention is held to."""
        cfg = self.config
        o_cos = _probe_cos(probe, "O")
        if o_cos is not None and o_cos < cfg.attn_qat_probe_o_cos_min:
            return "forward", f"probe O cos {o_cos:.5f} < attn_qat_probe_o_cos_min {cfg.attn_qat_probe_o_cos_min:g}"
        poor = [(t, c) for t in PROBE_GRADIENTS if (c := _probe_cos(probe, t)) is not None]
        poor = [(t, c) for t, c in poor if c < cfg.attn_qat_probe_grad_cos_min]
        if not poor:
            return None, ""
        tensor, cos = min(poor, key=lambda item: item[1])
        return "forward", (
            f"probe {tensor} cos {cos:.5f} < attn_qat_probe_grad_cos_min {cfg.attn_qat_probe_grad_cos_min:g} "
            "(the FP4 forward's error)"
        )

    def _escalate_backward_origin(self, layers: Mapping[str, LayerSignals], step: int) -> list[Decision]:
        """A non-finite dS starts in one layer and flows to every layer the backward reaches after it, i.e. the
        layers before it in module order: the last flagged layer is where it started, provided a later layer
        was measured finite. When the last measured layer is flagged too, the non-finite gradient may come
        from after every attention layer (the loss, the head): nothing is pinned on attention."""
        measured = [(n, m.ds_rel_err) for n, m in layers.items() if m.ds_rel_err is not None]
        flagged = [i for i, (_, err) in enumerate(measured) if not math.isfinite(err)]
        if not flagged or flagged[-1] == len(measured) - 1:
            return []
        origin, clean = measured[flagged[-1]][0], measured[flagged[-1] + 1][0]
        reason = f"dS non-finite here and finite in {clean}, the layer after it: the backward's NaN starts here"
        decision = self._escalate(origin, "backward", step, reason)
        return [decision] if decision is not None else []

    def _escalate_divergence(self, layers: Mapping[str, LayerSignals], step: int, cause: str) -> list[Decision]:
        forward = [name for name, m in layers.items() if m.nonfinite]
        if forward:
            reason = f"{cause}; non-finite attention output from finite inputs"
            return [d for d in (self._escalate(name, "top", step, reason) for name in forward) if d is not None]
        backward = self._escalate_backward_origin(layers, step)
        if backward:
            return backward
        # Nothing points at one layer. dS is SageBwd's dominant INT8 error (the study; our accuracy harness), so
        # every layer whose dS is still INT8 moves up one backward rung, the forward staying fast. A layer in
        # attn_qat mode has no rung but full precision; the drop-in variant's backward is the known unstable one.
        reason = f"{cause}; no layer flagged, so every layer with INT8 dS or FP4 attention moves up"
        decisions = []
        for name in self._layers:
            current = self.precision(name)
            if (current.mode == "sagebwd" and current.ds == "int8") or current.mode == "attn_qat":
                decision = self._escalate(name, "backward", step, reason)
                if decision is not None:
                    decisions.append(decision)
        if decisions:
            return decisions
        return self._accumulate_step_down(step, cause)

    def _escalate(self, name: str, scope: str, step: int, reason: str) -> Decision | None:
        """Move ``name`` to the next rung that serves ``scope`` (``"top"``: the highest rung); ``None`` when no
        rung above changes anything."""
        state = self._layers[name]
        ladder = self.config.ladder
        start = state.path[-1] + 1 if state.path else 0
        current = self._precision_of(state.base, state.path)
        new_path = list(state.path)
        precision = current
        candidates: list[int] = []
        for index in range(start, len(ladder)):
            rung = ladder[index]
            if rung.apply(precision).short_name == precision.short_name:
                # This rung changes nothing that runs from here: ds already bf16 in the base, or a SageBwd field
                # of a layer in attn_qat mode (short_name names exactly what runs).
                continue
            candidates.append(index)
            precision = rung.apply(precision)
        if not candidates:
            return None
        if scope == "top":
            target = candidates[-1]
        else:
            serving = [i for i in candidates if ladder[i].scope in (scope, "both")]
            if not serving:
                return None
            target = serving[0]
        # Rungs passed on the way are kept (so stepping down retraces them), except forward-only ones, which
        # are only for signals that implicate the forward.
        new_path += [i for i in candidates if i < target and ladder[i].scope != "forward"] + [target]
        if state.last_step_down is not None and step - state.last_step_down < self._calm_period(state):
            state.backoff = min(state.backoff + 1, self.config.max_backoff)
            reason += f"; again within the calm period after a step down, calm period now {self._calm_period(state)}"
        state.path = new_path
        state.last_change = step
        state.ds_high_streak = 0
        new = self._precision_of(state.base, state.path)
        return Decision(step, name, "precision", current.short_name, new.short_name, reason)

    def _step_down(self, name: str, step: int) -> Decision | None:
        state = self._layers[name]
        if not state.path or state.last_change is None:
            return None
        period = self._calm_period(state)
        calm_for = step - state.last_change
        if calm_for < period:
            return None
        top = self.config.ladder[state.path[-1]]
        reason = f"calm for {calm_for} steps >= {period}"
        if "ds" in top.fields:
            measured_since = state.last_ds_step is not None and state.last_ds_step > state.last_change
            if not measured_since or state.last_ds_rel_err >= self.config.ds_rel_err_low:
                return None
            reason += f", ds_rel_err {state.last_ds_rel_err:.4g} < ds_rel_err_low {self.config.ds_rel_err_low:g}"
        old = self._precision_of(state.base, state.path)
        state.path.pop()
        state.last_change = step
        state.last_step_down = step
        state.ds_high_streak = 0
        # Check the faster setting at once: a relapse is then caught on the next step, within the calm period,
        # where it doubles the layer's backoff.
        self._arm(step + 1, "ds_stats", "probe")
        return Decision(step, name, "precision", old.short_name, self.precision(name).short_name, reason)

    def _accumulate_step_down(self, step: int, cause: str) -> list[Decision]:
        floor = self.config.min_accumulate_grad_batches
        if floor is None or self._accumulate <= floor:
            return []
        old = self._accumulate
        if self._accumulate_last_raise is not None and step - self._accumulate_last_raise < self._accumulate_period():
            self._accumulate_backoff = min(self._accumulate_backoff + 1, self.config.max_backoff)
        # Halving keeps the new window a divisor of the old one, so the change can land at the next step.
        self._accumulate = max(floor, old // 2)
        self._accumulate_last_change = step
        reason = (
            f"{cause}; every attention layer already has dS in high precision, so tokens per step go down "
            "(the SageBwd study: fewer tokens per step close the gap to full precision)"
        )
        return [Decision(step, None, "accumulate_grad_batches", str(old), str(self._accumulate), reason)]

    def _accumulate_step_up(self, step: int) -> list[Decision]:
        if self._accumulate >= self._start_accumulate or self._accumulate_last_change is None:
            return []
        period = self._accumulate_period()
        calm_for = step - self._accumulate_last_change
        if calm_for < period:
            return []
        old = self._accumulate
        self._accumulate = min(self._start_accumulate, old * 2)
        self._accumulate_last_change = step
        self._accumulate_last_raise = step
        reason = f"calm for {calm_for} steps >= {period}"
        return [Decision(step, None, "accumulate_grad_batches", str(old), str(self._accumulate), reason)]

    # ------------------------------------------------------------------ helpers

    def _calm_period(self, state: _LayerState) -> int:
        return self.config.calm_steps * 2**state.backoff

    def _accumulate_period(self) -> int:
        return self.config.calm_steps * 2**self._accumulate_backoff

    def _arm(self, step: int, *signals: str) -> None:
        for signal in signals:
            self._armed[signal] = step

    def _precision_of(self, base: AttentionPrecision, path: Sequence[int]) -> AttentionPrecision:
        precision = base
        for index in path:
            precision = self.config.ladder[index].apply(precision)
        return precision

    def _layer(self, name: str) -> _LayerState:
        try:
            return self._layers[name]
        except KeyError:
            raise KeyError(f"PrecisionPolicy: no layer {name!r}; known: {self.layer_names}.") from None

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Every counter, path and detector window: a policy loaded from it decides as this one would.

        Example::

            restored = PrecisionPolicy(layers, config=config)
            restored.load_state_dict(policy.state_dict())
        """
        ladder = self.config.ladder
        return {
            "layers": {
                name: {
                    "path": [ladder[i].name for i in state.path],
                    "last_change": state.last_change,
                    "last_step_down": state.last_step_down,
                    "backoff": state.backoff,
                    "ds_high_streak": state.ds_high_streak,
                    "last_ds_rel_err": state.last_ds_rel_err,
                    "last_ds_step": state.last_ds_step,
                }
                for name, state in self._layers.items()
            },
            "start_accumulate": self._start_accumulate,
            "accumulate": self._accumulate,
            "accumulate_last_change": self._accumulate_last_change,
            "accumulate_last_raise": self._accumulate_last_raise,
            "accumulate_backoff": self._accumulate_backoff,
            "consecutive_skips": self._consecutive_skips,
            "armed": dict(self._armed),
            "loss_detector": self._loss_detector.state_dict(),
            "grad_norm_detector": self._grad_norm_detector.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            ValueError: the saved layers or rungs do not match this policy's (a different model or ladder).
        """
        saved, known = set(state["layers"]), set(self._layers)
        if saved != known:
            raise ValueError(
                f"PrecisionPolicy.load_state_dict: the checkpoint's layers {sorted(saved)} do not match the model's "
                f"{sorted(known)}; resume with the model the checkpoint was saved from."
            )
        index = {rung.name: i for i, rung in enumerate(self.config.ladder)}
        for name, layer_state in state["layers"].items():
            missing = [r for r in layer_state["path"] if r not in index]
            if missing:
                raise ValueError(
                    f"PrecisionPolicy.load_state_dict: layer {name!r} is on rungs {missing} that this ladder "
                    f"({list(index)}) does not have; resume with the ladder the checkpoint was saved with."
                )
            target = self._layers[name]
            target.path = [index[r] for r in layer_state["path"]]
            target.last_change = layer_state["last_change"]
            target.last_step_down = layer_state["last_step_down"]
            target.backoff = layer_state["backoff"]
            target.ds_high_streak = layer_state["ds_high_streak"]
            target.last_ds_rel_err = layer_state["last_ds_rel_err"]
            target.last_ds_step = layer_state["last_ds_step"]
        self._start_accumulate = state["start_accumulate"]
        self._accumulate = state["accumulate"]
        self._accumulate_last_change = state["accumulate_last_change"]
        self._accumulate_last_raise = state["accumulate_last_raise"]
        self._accumulate_backoff = state["accumulate_backoff"]
        self._consecutive_skips = state["consecutive_skips"]
        self._armed = dict(state["armed"])
        self._loss_detector.load_state_dict(state["loss_detector"])
        self._grad_norm_detector.load_state_dict(state["grad_norm_detector"])


def _probe_cos(probe: Mapping[str, Mapping[str, float]], tensor: str) -> float | None:
    metrics = probe.get(tensor)
    if not metrics or "cos" not in metrics:
        return None
    value = float(metrics["cos"])
    # A NaN cosine (the layer's output was non-finite) is as bad as it gets.
    return value if math.isfinite(value) else -1.0


def _probe_rel_l2(probe: Mapping[str, Mapping[str, float]], tensor: str) -> float | None:
    value = probe.get(tensor, {}).get("rel_l2")
    return float(value) if value is not None and math.isfinite(value) else None


def _fmt(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.4g}"


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _check_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None, owner: str = "PolicyConfig"
) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{owner}: {name} must be an int {bound}; received {value!r}.")
