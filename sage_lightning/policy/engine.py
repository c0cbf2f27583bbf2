"""``PrecisionPolicy``: the one place decisions are authored, from the numbers of one optimizer step."""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sage_lightning.detectors import SpikeDetector, SpikeReading
from sage_lightning.policy._precision import LOW_BIT_FORMATS, AttentionPrecision
from sage_lightning.policy.backoff import Backoff
from sage_lightning.policy.config import TOKENS_RUNG, PolicyConfig
from sage_lightning.policy.share import runs_low_bit
from sage_lightning.policy.tokens import TokensLever
from sage_lightning.policy.vocabulary import (
    CAUSES,
    PROBE_GRADIENTS,
    PROBE_TENSORS,
    Decision,
    LayerSignals,
    Rung,
    SignalRequest,
    StepOutcome,
    StepSignals,
    check_int,
)

#: The version of :meth:`PrecisionPolicy.state_dict`'s layout; a checkpoint with another is refused by name.
STATE_VERSION = 2
#: How many noise readings :attr:`PrecisionPolicy.noise_readings` keeps.
NOISE_READINGS_KEPT = 100_000
#: One entry of :attr:`PrecisionPolicy.noise_readings`: step, layer, noise ratio at the base precision and at the one
#: that ran, gradient noise scale (sequences), the step's sequences over that scale.
NoiseReading = tuple[int, str, float | None, float | None, float | None, float | None]


@dataclass
class _LayerState:
    base: AttentionPrecision
    backoff: Backoff
    path: list[int] = field(default_factory=list)  # ladder indices taken, in the order taken; stepping down pops
    ds_high_streak: int = 0
    last_ds_rel_err: float | None = None
    last_ds_step: int | None = None
    qk_high_streak: int = 0
    last_qk_rel_err: float | None = None
    last_qk_step: int | None = None
    # The step of the last escalation, until a probe after it has read the layer: a probe that still fails says so.
    unverified_since: int | None = None
    # The noise ratio's streak over its threshold and its latest readings (base precision, the one that ran).
    noise_high_streak: int = 0
    last_noise_ratio: float | None = None
    last_noise_ratio_ran: float | None = None
    last_noise_step: int | None = None
    # The noise-scale rule's streak over its threshold and its latest reading (None: the scale was not resolved).
    noise_scale_high_streak: int = 0
    last_noise_scale_ratio: float | None = None

    def state_dict(self, ladder: Sequence[Rung]) -> dict[str, Any]:
        """Every field but the base (the callback keeps the bases), the path by rung name, the backoff's counters."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("base", "backoff", "path")}
        return {**state, "path": [ladder[i].name for i in self.path], "backoff": self.backoff.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], ladder: Sequence[Rung], where: str) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming ``where`` for a malformed state."""
        # The noise fields came later: a checkpoint from before them resumes with none measured.
        state = {**_NOISE_DEFAULTS, **state} if isinstance(state, Mapping) else state
        _require_keys(state, [f.name for f in fields(self) if f.name != "base"], where)
        path = state["path"]
        if not isinstance(path, (list, tuple)) or not all(isinstance(r, str) for r in path):
            raise ValueError(f"{where} has path {path!r}; it must be a list of rung names, e.g. ['ds_bf16'].")
        index = {rung.name: i for i, rung in enumerate(ladder)}
        missing = [r for r in path if r not in index]
        if missing:
            raise ValueError(
                f"{where} is on rungs {missing} that this ladder ({list(index)}) does not have; resume with the "
                "ladder the checkpoint was saved with."
            )
        for f in fields(self):
            if f.name not in ("base", "backoff", "path"):
                setattr(self, f.name, state[f.name])
        self.path = [index[r] for r in path]
        self.backoff.load_state_dict(state["backoff"])


class PrecisionPolicy:
    """Decides, step by step, every attention layer's precision, the tokens per step, and what to do with a step.

    Escalation, per layer, to the first rung (in ladder order, not yet taken, changing what runs) that fixes what
    the layer is blamed for (:data:`~sage_lightning.policy.CAUSES`):

    * ``ds_rel_err > ds_rel_err_high`` for ``ds_rel_err_patience`` measurements in a row, while the layer's dS
      runs in INT8: ``"ds"`` (``ds_bf16``);
    * ``qk_rel_err > qk_rel_err_high`` (the scores' INT8 operands, per row) for ``qk_rel_err_patience``
      measurements in a row, while the layer's scores run in INT8: ``"qk"`` (``qk_bf16``);
    * probe O cosine ``< probe_o_cos_min``: ``"forward"`` (``smooth_q``, then ``qk_bf16``, then ``full``);
    * probe dQ or dK cosine ``< probe_grad_cos_min``: ``"ds"`` when ``ds_rel_err`` explains it (at least
      ``ds_explains_ratio`` of their relative error, dS still INT8), ``"forward"`` otherwise; a poor dV is
      ``"dv"`` (``dv_bf16``: dV does not use dS);
    * any probe cosine ``< probe_catastrophic_cos``, or non-finite: straight to the top rung (``full``);
    * a layer in ``mode="attn_qat"`` is probed against ``attn_qat_probe_o_cos_min`` and
      ``attn_qat_probe_grad_cos_min``; its only rung is ``full``;
    * the noise ratio (the error the precision that ran puts into the layer's gradients over their sampling noise,
      :mod:`sage_lightning.noise`) ``> noise_ratio_high`` for ``noise_patience`` measurements in a row: the next
      rung that changes ``ds`` alone (``ds_bf16``); where no such rung is left, tokens per step are halved;
    * tokens per step (:attr:`StepSignals.tokens`) at or over ``ds_tokens_per_step_high``: every layer whose dS runs
      in INT8 takes ``large_step_rung`` (where ``None``, :data:`~sage_lightning.policy.config.TOKENS_RUNG`,
      ``ds_fp8``, which no rule but this one and the next takes), held while the steps stay that large;
    * the step's sequences over the layer's gradient noise scale (:attr:`LayerSignals.noise_scale_ratio`) over
      ``noise_scale_ratio_high`` for ``noise_patience`` measurements in a row from ``noise_scale_from_step`` on,
      while the layer's dS runs in INT8:
      the same rung, held while the reading stays at or over ``noise_scale_ratio_low``.

    Every escalation arms a probe (and the dS statistics) on the next step: if the new rung did not fix the
    reading, the layer escalates again, and the reason says so.

    Steps: non-finite gradients are skipped (``max_consecutive_skips`` in a row are a divergence); a one-off hard
    loss spike is skipped; a non-finite loss, or a hard spike within ``spike_repeat_steps`` of the last, is a
    divergence: roll back to the last snapshot, then escalate where it started (layers that returned non-finite
    outputs from finite inputs to the top rung; else the last layer whose dS was non-finite with a later layer's
    finite; else every layer whose dS still runs in INT8; else the tokens per step are halved). After
    ``max_rollbacks`` rollbacks without ``progress_steps`` good steps in between, a divergence that no lever can
    answer any more stops the run (action ``"stop"``, its decision listing what was tried).

    Stepping down (one rung, hysteresis and backoff, :class:`~sage_lightning.policy.Backoff`): after
    ``calm_steps * 2**backoff`` steps on a rung with no trigger, and, for a rung that changed ``ds``, a
    ``ds_rel_err`` below ``ds_rel_err_low`` measured since. Halved tokens per step double back the same way.

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
        check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1, owner="PrecisionPolicy")
        if config is not None and not isinstance(config, PolicyConfig):
            raise ValueError(
                f"PrecisionPolicy: config must be a PolicyConfig or None; received {type(config).__name__}."
            )
        self.config = cfg = config or PolicyConfig()
        self._layers = {name: _LayerState(base=base, backoff=self._backoff()) for name, base in layers.items()}
        self._tokens = TokensLever(accumulate_grad_batches, cfg.min_accumulate_grad_batches, self._backoff())
        self._consecutive_skips = 0
        self._last_hard_spike: int | None = None
        self._armed: dict[str, int] = {}
        # Whether the last step decided had a soft loss or gradient-norm reading: a soft run arms dS only once.
        self._last_step_soft = False
        # The latest step's tokens (every rank's): the tokens-per-step rule's reading, not checkpointed (every
        # verdict brings it again before a rung could step down).
        self._last_tokens: int | None = None
        # TOKENS_RUNG, which the rules but the two large-step ones pass over.
        named = [i for i, rung in enumerate(cfg.ladder) if rung.name == TOKENS_RUNG]
        self._reserved_rung = named[0] if named else None
        ds_alone = [i for i, rung in enumerate(cfg.ladder) if set(rung.fields) == {"ds"}]
        chosen = [i for i, rung in enumerate(cfg.ladder) if rung.name == cfg.large_step_rung]
        large_rules = cfg.ds_tokens_per_step_high is not None or cfg.noise_scale_ratio_high is not None
        # The two large-step rules' rung: large_step_rung, else TOKENS_RUNG, else the first that changes ds alone;
        # fixed with the config, None where both rules are off or the ladder has no such rung.
        self._large_step_target = (chosen or named or ds_alone or [None])[0] if large_rules else None
        # Whether the noise measurement runs: either rule on its readings is on.
        self._noise_on = cfg.noise_ratio_high is not None or cfg.noise_scale_ratio_high is not None
        # The rollback budget: rollbacks since the last stretch of progress_steps good steps, and what they tried.
        self._rollbacks_without_progress = 0
        self._good_steps = 0
        self._tried: list[str] = []
        #: Every noise measurement, ``(step, layer, base ratio, ratio of the precision that ran, noise scale, the
        #: step's sequences over it)``, oldest first (the last ``NOISE_READINGS_KEPT``): what the thresholds are
        #: calibrated on. Not checkpointed.
        self.noise_readings: collections.deque[NoiseReading] = collections.deque(maxlen=NOISE_READINGS_KEPT)
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

    def _backoff(self) -> Backoff:
        return Backoff(calm_steps=self.config.calm_steps, max_backoff=self.config.max_backoff)

    # ------------------------------------------------------------------ what the callback reads

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The layers, in module order."""
        return tuple(self._layers)

    @property
    def accumulate_grad_batches(self) -> int:
        """The ``accumulate_grad_batches`` the policy wants (the callback applies it at an aligned batch)."""
        return self._tokens.value

    @property
    def rollbacks_without_progress(self) -> int:
        """Rollbacks since the last ``progress_steps`` good steps in a row (the budget's count)."""
        return self._rollbacks_without_progress

    def base(self, layer: str) -> AttentionPrecision:
        """The precision ``layer`` started from (stepping down never goes below it)."""
        return self._layer(layer).base

    def precision(self, layer: str) -> AttentionPrecision:
        """The precision ``layer`` should run at now."""
        state = self._layer(layer)
        return self._precision_of(state.base, state.path)

    def precisions(self) -> dict[str, AttentionPrecision]:
        """Every layer's precision, by name."""
        return {name: self.precision(name) for name in self._layers}

    def level(self, layer: str) -> int:
        """Where ``layer`` is: 0 at its base, ``i + 1`` on ``config.ladder[i]`` (the rung it took last)."""
        path = self._layer(layer).path
        return path[-1] + 1 if path else 0

    def rung(self, layer: str) -> str:
        """The name of the rung ``layer`` took last (``"base"`` at its base)."""
        path = self._layer(layer).path
        return self.config.ladder[path[-1]].name if path else "base"

    def low_bit_layers(self, precisions: Sequence[AttentionPrecision]) -> int:
        """How many layers run low-bit (:func:`~sage_lightning.policy.share.runs_low_bit` against their base) at
        ``precisions``, each layer's precision in module order: what a step adds to the low-bit share."""
        return sum(runs_low_bit(state.base, now) for state, now in zip(self._layers.values(), precisions, strict=True))

    def signals_wanted(self, step: int) -> SignalRequest:
        """Which optional signals to measure during optimizer step ``step``.

        The cadences of the config, plus the dS statistics on the step after a hard spike or a skipped step and
        on the step after the first of a run of soft spikes, and both signals on the step after a rollback, an
        escalation or a step down. An armed signal stays wanted until a step measures it, so a verdict that lands
        a step late (``check_before_step=False``) still gets its measurement. A probe step also measures dS, to
        attribute what the probe finds.

        Soft spikes arm once per episode: a step whose loss or gradient-norm reading is soft arms the dS
        statistics for the next step only when the step decided before it had no soft reading. A fresh spike gets
        its attribution measurement on the next step; a sustained rise (early training's growing gradient norm
        reads soft on many steps in a row) gets that one measurement and then the cadence's, not one on every step
        (each costs about a quarter of a step's device time). A calm step ends the episode; the next soft reading
        arms again.

        Example::

            policy.signals_wanted(25)   # SignalRequest(ds_stats=True, probe=False) with the defaults
        """
        cfg = self.config

        def armed(signal: str) -> bool:
            return signal in self._armed and self._armed[signal] <= step

        probe = step % cfg.probe_every_n_steps == 0 or armed("probe")
        noise = self._noise_on and (step % cfg.noise_every_n_steps == 0 or armed("noise"))
        return SignalRequest(
            ds_stats=step % cfg.ds_stats_every_n_steps == 0 or probe or armed("ds_stats"), probe=probe, noise=noise
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
        if signals.tokens is not None:
            self._last_tokens = signals.tokens
        self._disarm_measured(layers, step)
        for name, measured in layers.items():
            state = self._layers[name]
            if measured.ds_rel_err is not None and math.isfinite(measured.ds_rel_err):
                state.last_ds_rel_err, state.last_ds_step = float(measured.ds_rel_err), step
            if measured.qk_rel_err is not None and math.isfinite(measured.qk_rel_err):
                state.last_qk_rel_err, state.last_qk_step = float(measured.qk_rel_err), step
            if measured.noise_ratio is not None:
                state.last_noise_ratio, state.last_noise_step = measured.noise_ratio, step
                state.last_noise_ratio_ran = measured.noise_ratio_ran
                state.last_noise_scale_ratio = measured.noise_scale_ratio
                self.noise_readings.append(
                    (
                        step,
                        name,
                        measured.noise_ratio,
                        measured.noise_ratio_ran,
                        measured.noise_scale,
                        measured.noise_scale_ratio,
                    )
                )

        decisions: list[Decision] = []
        loss_reading: SpikeReading | None = None
        grad_reading: SpikeReading | None = None
        grads_finite = signals.grad_norm is None or math.isfinite(signals.grad_norm)
        divergence: str | None = None
        action, skip_cause = "step", None

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
                action, skip_cause = "skip", "nonfinite_gradients"
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
                spike = (
                    f"loss {signals.loss:.4g} spiked: robust z {loss_reading.z:.1f} > loss_hard_spike_z "
                    f"{self.config.loss_hard_spike_z:g} (window median {loss_reading.median:.4g})"
                )
                last, self._last_hard_spike = self._last_hard_spike, step
                repeat = self.config.spike_repeat_steps
                if last is not None and step - last <= repeat:
                    divergence = f"{spike}, again within spike_repeat_steps {repeat} of step {last}"
                else:
                    # One spike is one bad batch: dropping its step costs one step, a rollback all since the snapshot.
                    action, skip_cause = "skip", "loss_spike"
                    reason = f"{spike}: a one-off, skipped (another within {repeat} steps rolls back)"
                    decisions.append(Decision(step, None, "optimizer_step", "apply", "skip", reason))
                    self._arm(step + 1, "ds_stats")
            else:
                if signals.grad_norm is not None:
                    grad_reading = self._grad_norm_detector.update(signals.grad_norm)
                if _soft(loss_reading, grad_reading) and not self._last_step_soft:
                    # A spike is not pinned on any layer yet: measure dS next step and let the layer rules act
                    # on evidence. Only on the first soft step of a run: early training's growing gradient norm
                    # can flag many steps in a row, and a dS-statistics step costs about +27% of a step's device
                    # time (H200, 32K tokens per step); the cadence measures again within a long run. Not the
                    # probe: it costs about ten steps (float64 attention per layer).
                    self._arm(step + 1, "ds_stats")

        self._last_step_soft = _soft(loss_reading, grad_reading)
        if divergence is not None:
            self._consecutive_skips = 0
            self._good_steps = 0
            self._rollbacks_without_progress += 1
            escalations = self._escalate_divergence(layers, step, divergence)
            if self._rollbacks_without_progress > self.config.max_rollbacks and not escalations:
                action = "stop"
                decisions.append(Decision(step, None, "stop", "training", "stopped", self._stop_reason(divergence)))
            else:
                action = "rollback"
                decisions.append(Decision(step, None, "rollback", f"step {step}", "last snapshot", divergence))
                decisions += escalations
                self._tried += [
                    f"step {d.step}: {d.layer or 'global'} {d.lever} {d.old} -> {d.new}" for d in escalations
                ]
                self._arm(step + 1, "ds_stats", "probe")
        elif action == "step":
            self._count_progress()
            decisions += self._layer_rules(layers, step)
            decisions += self._noise_rules(layers, step, decisions)
            decisions += self._noise_scale_rule(layers, step, decisions)
            decisions += self._tokens_rule(step, decisions)
            if not self._noise_holds_tokens():
                decisions += self._tokens.raise_after_calm(step)
        return StepOutcome(
            action=action, decisions=tuple(decisions), loss=loss_reading, grad_norm=grad_reading, skip_cause=skip_cause
        )

    def after_the_step(self, outcome: StepOutcome, *, step: int, skipped_on_device: bool) -> StepOutcome:
        """The verdict :meth:`decide` gave, for a step whose optimizer step was applied before it
        (``check_before_step=False``: the verdict lands ``VERDICT_LAG`` steps later).

        A step the device skipped (a fused optimizer told of its non-finite gradients) stays ``"skip"``; a one-off
        loss spike with finite gradients is kept (``"step"``: undoing it would cost a rollback, more than the
        spike); any other step that should not have been applied is ``"undone"``: the snapshot is restored (a
        ``"skip"`` of non-finite gradients says so in a rollback decision). ``"stop"`` stays ``"stop"``.

        Example::

            outcome = policy.decide(signals)
            policy.after_the_step(outcome, step=signals.step, skipped_on_device=False).action   # e.g. "undone"
        """
        decisions, action = list(outcome.decisions), outcome.action
        on_device = skipped_on_device and outcome.skip_cause == "nonfinite_gradients"
        if outcome.action == "skip" and not on_device and outcome.skip_cause == "loss_spike":
            action = "step"
            decisions.append(
                Decision(
                    step,
                    None,
                    "optimizer_step",
                    "skip",
                    "kept",
                    "applied before its verdict (check_before_step=False) with finite gradients: kept, since a "
                    "rollback would cost more than the one-off spike",
                )
            )
        elif outcome.action == "rollback" or (outcome.action == "skip" and not on_device):
            action = "undone"
            if outcome.action == "skip":
                decisions.append(
                    Decision(
                        step,
                        None,
                        "rollback",
                        f"step {step}",
                        "last snapshot",
                        "its non-finite gradients were applied (check_before_step=False and an optimizer that "
                        "cannot skip on the device)",
                    )
                )
        return replace(outcome, action=action, decisions=tuple(decisions))

    def _count_progress(self) -> None:
        self._good_steps += 1
        if self._good_steps >= self.config.progress_steps:
            self._rollbacks_without_progress = 0
            self._tried = []

    def _stop_reason(self, divergence: str) -> str:
        cfg = self.config
        tried = "; ".join(self._tried) if self._tried else "nothing: no lever was left to turn"
        return (
            f"{divergence}; {self._rollbacks_without_progress} divergences without {cfg.progress_steps} good steps "
            f"in between, over the budget of max_rollbacks {cfg.max_rollbacks}, and no lever left. Tried: {tried}"
        )

    def _disarm_measured(self, layers: Mapping[str, LayerSignals], step: int) -> None:
        measured = {
            "ds_stats": any(m.ds_rel_err is not None for m in layers.values()),
            "probe": any(m.probe is not None for m in layers.values()),
            "noise": any(m.noise_ratio is not None for m in layers.values()),
        }
        for signal, seen in measured.items():
            # Measured, or the step after the armed one was decided without it (a layer in full precision has no dS
            # to measure): the step after the decision that armed it has opened with the arm by then (a verdict lands
            # at most VERDICT_LAG = 2 steps late), so the arm has had its chance.
            if signal in self._armed and (seen and self._armed[signal] <= step or self._armed[signal] < step):
                del self._armed[signal]

    # ------------------------------------------------------------------ rules

    def _layer_rules(self, layers: Mapping[str, LayerSignals], step: int) -> list[Decision]:
        cfg = self.config
        decisions: list[Decision] = []
        for name, measured in layers.items():
            state = self._layers[name]
            current = self.precision(name)
            cause, reason = None, ""
            if measured.ds_rel_err is not None and _low_bit(current, "ds"):
                reason = _streak(state, "ds", measured.ds_rel_err, cfg.ds_rel_err_high, cfg.ds_rel_err_patience, "")
                cause = "ds" if reason else None
            if cause is None and measured.qk_rel_err is not None and _low_bit(current, "qk"):
                note = f": an outlier spoils its block's {current.qk.upper()} scale"
                reason = _streak(state, "qk", measured.qk_rel_err, cfg.qk_rel_err_high, cfg.qk_rel_err_patience, note)
                cause = "qk" if reason else None
            if measured.probe:
                probe_cause, probe_reason = self._probe_trigger(measured.probe, state, current)
                if probe_cause is not None and (cause is None or probe_cause == "top"):
                    cause, reason = probe_cause, probe_reason
                if state.unverified_since is not None:
                    if probe_cause is not None:
                        reason += f"; the escalation at step {state.unverified_since} did not fix it"
                    state.unverified_since = None
            if cause is not None:
                decision = self._escalate(name, cause, step, reason)
                if decision is not None:
                    decisions.append(decision)
                    continue
            decision = self._step_down(name, step)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def _noise_rules(self, layers: Mapping[str, LayerSignals], step: int, taken: Sequence[Decision]) -> list[Decision]:
        """Quantization error against gradient noise: a layer whose reading (at the precision it ran in) stays over
        ``noise_ratio_high`` for ``noise_patience`` measurements moves dS up its ladder (the rungs that change
        ``ds`` alone, in ladder order); once no layer so flagged has such a rung left, tokens per step go down
        (once per streak: the lever's own calm period decides when they come back)."""
        cfg = self.config
        if cfg.noise_ratio_high is None:
            return []
        moved = {d.layer for d in taken}
        decisions: list[Decision] = []
        stuck: list[str] = []
        for name, measured in layers.items():
            ratio = measured.noise_ratio_ran
            state = self._layers[name]
            if ratio is None or name in moved:
                continue
            note = ": its gradients' quantization error outweighs their sampling noise at this many tokens per step"
            reason = _streak(state, "noise", ratio, cfg.noise_ratio_high, cfg.noise_patience, note, "noise_ratio")
            if not reason:
                continue
            decision = self._escalate(name, "ds", step, reason, alone=True)
            if decision is None:
                stuck.append(f"{name} {reason}")
            else:
                decisions.append(decision)
        if stuck:
            for name in layers:
                self._layers[name].noise_high_streak = 0
            more = f" (and {len(stuck) - 1} more)" if len(stuck) > 1 else ""
            decisions += self._tokens.lower(step, stuck[0] + more)
        return decisions

    def _noise_scale_rule(
        self, layers: Mapping[str, LayerSignals], step: int, taken: Sequence[Decision]
    ) -> list[Decision]:
        """The step's sequences over the layer's gradient noise scale above ``noise_scale_ratio_high`` for
        ``noise_patience`` measurements in a row: the layer's INT8 dS takes the large-step rung
        (``_large_step_target``), which :meth:`_step_down` holds while the reading stays at or over
        ``noise_scale_ratio_low``. A measurement that resolved no scale (the mean gradient lost in the noise: a scale
        beyond what the capture can tell) counts as a reading under the threshold; one before
        ``noise_scale_from_step`` does not count."""
        cfg = self.config
        if cfg.noise_scale_ratio_high is None or self._large_step_target is None or step < cfg.noise_scale_from_step:
            return []
        moved = {d.layer for d in taken}
        decisions = []
        for name, measured in layers.items():
            if measured.noise_ratio is None or name in moved:  # not measured this step (or already moved)
                continue
            state, ratio = self._layers[name], measured.noise_scale_ratio
            if ratio is None or not math.isfinite(ratio):  # no scale resolved: under the threshold
                state.noise_scale_high_streak = 0
                continue
            scale = "" if measured.noise_scale is None else f" (noise scale {measured.noise_scale:.4g} sequences)"
            note = f"{scale}: the step's sampling noise is small beside INT8 dS's error"
            high, patience = cfg.noise_scale_ratio_high, cfg.noise_patience
            reason = _streak(state, "noise_scale", ratio, high, patience, note, "noise_scale_ratio")
            decision = self._to_large_step_rung(name, step, reason) if reason else None
            if decision is not None:
                decisions.append(decision)
        return decisions

    def _scale_holds(self, state: _LayerState) -> bool:
        """Whether the layer's latest noise-scale reading is at or over ``noise_scale_ratio_low`` (its large-step
        rung stays)."""
        low, ratio = self.config.noise_scale_ratio_low, state.last_noise_scale_ratio
        return self.config.noise_scale_ratio_high is not None and ratio is not None and ratio >= low

    def _tokens_rule(self, step: int, taken: Sequence[Decision]) -> list[Decision]:
        """Tokens per step at or over ``ds_tokens_per_step_high``: every layer whose dS runs in INT8 takes the
        large-step rung (``_large_step_target``), which :meth:`_step_down` then holds while the steps stay that
        large."""
        if self._large_step_target is None or not self._tokens_hold():
            return []
        moved = {d.layer for d in taken}
        reason = (
            f"{self._last_tokens:,} tokens per step >= ds_tokens_per_step_high {self.config.ds_tokens_per_step_high:,}"
            ": at this many tokens per step INT8 dS costs validation loss that FP8 or bf16 dS does not"
        )
        decisions = [self._to_large_step_rung(name, step, reason) for name in self._layers if name not in moved]
        return [decision for decision in decisions if decision is not None]

    def _to_large_step_rung(self, name: str, step: int, reason: str) -> Decision | None:
        """Move ``name`` to the large-step rules' rung (``_large_step_target``) where its dS runs in INT8 (SageBwd)
        and it is not on that rung already (no precision to rebuild, each step); ``None`` where it does not move."""
        state, current = self._layers[name], self.precision(name)
        if self._large_step_target in state.path or current.mode != "sagebwd" or current.ds != "int8":
            return None
        return self._escalate(name, "ds", step, reason, target=self._large_step_target)

    def _tokens_hold(self) -> bool:
        """Whether the latest step had ``ds_tokens_per_step_high`` tokens or more (the rule is on)."""
        high = self.config.ds_tokens_per_step_high
        return high is not None and self._last_tokens is not None and self._last_tokens >= high

    def _noise_holds_tokens(self) -> bool:
        """Whether a layer's latest noise ratio (at the precision it ran in) is still at or over
        ``noise_ratio_low``: tokens per step then stay down."""
        low = self.config.noise_ratio_low
        return self.config.noise_ratio_high is not None and any(
            state.last_noise_ratio_ran is not None and state.last_noise_ratio_ran >= low
            for state in self._layers.values()
        )

    def _probe_trigger(
        self, probe: Mapping[str, Mapping[str, float]], state: _LayerState, current: AttentionPrecision
    ) -> tuple[str | None, str]:
        """What the probe blames (a cause, ``"top"`` for a catastrophic reading, ``None``: nothing), and why.

        O is the forward's output. dQ and dK carry dS's INT8 error one for one (the accuracy harness: dS alone
        in INT8 gives dQ a relative error equal to dS's), so when their error is well beyond the measured
        ``ds_rel_err``, the excess comes from the forward's INT8 products (S, then P), which ``ds="bf16"``
        cannot fix. dV does not use dS at all.
        """
        cfg = self.config
        worst = _worst_cos(probe, PROBE_TENSORS, cfg.probe_catastrophic_cos)
        if worst is not None:
            tensor, cos = worst
            shown = "non-finite" if cos == -1.0 and not _finite_cos(probe, tensor) else f"{cos:.5f}"
            return "top", (
                f"probe {tensor} cos {shown} < probe_catastrophic_cos {cfg.probe_catastrophic_cos:g}: "
                "catastrophic, straight to the top rung"
            )
        if current.mode == "attn_qat":
            return self._attn_qat_probe_trigger(probe)
        o_cos = _probe_cos(probe, "O")
        if o_cos is not None and o_cos < cfg.probe_o_cos_min:
            return "forward", f"probe O cos {o_cos:.5f} < probe_o_cos_min {cfg.probe_o_cos_min:g}"
        worst = _worst_cos(probe, PROBE_GRADIENTS, cfg.probe_grad_cos_min)
        if worst is None:
            return None, ""
        tensor, cos = worst
        reason = f"probe {tensor} cos {cos:.5f} < probe_grad_cos_min {cfg.probe_grad_cos_min:g}"
        if tensor == "dV":
            return "dv", reason + " (dV does not use dS: its error comes from its own INT8 product of P and dO)"
        rel_l2 = _probe_rel_l2(probe, tensor)
        err = state.last_ds_rel_err
        if _low_bit(current, "ds"):
            ds_format = current.ds.upper()
            if err is None or rel_l2 is None or err >= cfg.ds_explains_ratio * rel_l2:
                return "ds", reason + f", which dS's {ds_format} error explains (ds_rel_err {_fmt(err)})"
            return "forward", reason + (
                f", beyond dS's {ds_format} error (ds_rel_err {_fmt(err)} < ds_explains_ratio "
                f"{cfg.ds_explains_ratio:g} x rel_l2 {_fmt(rel_l2)}): the forward's error"
            )
        return "forward", reason + " with dS already in high precision: the forward's error"

    def _attn_qat_probe_trigger(self, probe: Mapping[str, Mapping[str, float]]) -> tuple[str | None, str]:
        """An ``attn_qat`` layer's probe: every error is its FP4 forward's (Q, K, V and P quantized; the backward's
        products run in bf16), measured against the looser thresholds FP4 attention is held to."""
        cfg = self.config
        o_cos = _probe_cos(probe, "O")
        if o_cos is not None and o_cos < cfg.attn_qat_probe_o_cos_min:
            return "forward", f"probe O cos {o_cos:.5f} < attn_qat_probe_o_cos_min {cfg.attn_qat_probe_o_cos_min:g}"
        worst = _worst_cos(probe, PROBE_GRADIENTS, cfg.attn_qat_probe_grad_cos_min)
        if worst is None:
            return None, ""
        tensor, cos = worst
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
        decision = self._escalate(origin, "ds", step, reason)
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
        # every layer whose dS is still low-bit (INT8 or FP8) moves to the rung that fixes it, the forward staying
        # fast. A layer in attn_qat mode has no rung but full precision; the drop-in variant's backward is the known
        # unstable one.
        reason = f"{cause}; no layer flagged, so every layer with INT8 or FP8 dS or FP4 attention moves up"
        decisions = []
        for name in self._layers:
            current = self.precision(name)
            if _low_bit(current, "ds") or current.mode == "attn_qat":
                decision = self._escalate(name, "ds", step, reason)
                if decision is not None:
                    decisions.append(decision)
        if decisions:
            return decisions
        return self._tokens.lower(step, cause)

    def _escalate(
        self, name: str, cause: str, step: int, reason: str, *, alone: bool = False, target: int | None = None
    ) -> Decision | None:
        """Move ``name`` to the first rung, in ladder order, not taken yet, that changes what runs and fixes
        ``cause`` (``"top"``: the rung that fixes every cause, else the last; ``alone``: only a rung that changes
        that product's field and nothing else, as the noise rule wants; ``target``: that rung only, as the two
        large-step rules want; the others pass over :data:`TOKENS_RUNG`); ``None`` when there is none."""
        state = self._layers[name]
        ladder = self.config.ladder
        current = self._precision_of(state.base, state.path)
        # A rung changes nothing when what runs (short_name) stays the same: ds already bf16 in the base, or a
        # SageBwd field of a layer in attn_qat mode.
        candidates = [
            i
            for i, rung in enumerate(ladder)
            if i not in state.path and rung.apply(current).short_name != current.short_name
        ]
        if target is not None:
            candidates = [target] if target in candidates else []
        else:
            candidates = [i for i in candidates if i != self._reserved_rung]
        if cause == "top":
            complete = [i for i in candidates if set(ladder[i].fixes) == set(CAUSES)]
            serving = complete[-1:] or candidates[-1:]
        else:
            serving = [i for i in candidates if cause in ladder[i].fixes]
        if alone:
            serving = [i for i in serving if set(ladder[i].fields) == {cause}]
        if not serving:
            return None
        target = serving[0]
        if state.backoff.tighten(step):
            reason += f"; again within the calm period after a step down, calm period now {state.backoff.period}"
        state.path.append(target)
        state.ds_high_streak = state.qk_high_streak = state.noise_high_streak = 0
        state.unverified_since = step
        # Check the new rung on the next step: if it did not help, the probe escalates again.
        self._arm(step + 1, "ds_stats", "probe", *(("noise",) if self._noise_on else ()))
        new = self._precision_of(state.base, state.path)
        return Decision(step, name, "precision", current.short_name, new.short_name, reason)

    def _step_down(self, name: str, step: int) -> Decision | None:
        state = self._layers[name]
        if not state.path or not state.backoff.ready(step):
            return None
        top = self.config.ladder[state.path[-1]]
        if state.path[-1] == self._large_step_target and (self._tokens_hold() or self._scale_holds(state)):
            return None  # the tokens-per-step or the noise-scale rule would take it again at once
        reason = f"calm for {state.backoff.calm_for(step)} steps >= {state.backoff.period}"
        if "ds" in top.fields:
            measured_since = state.last_ds_step is not None and state.last_ds_step > state.backoff.last_change
            if not measured_since or state.last_ds_rel_err >= self.config.ds_rel_err_low:
                return None
            reason += f", ds_rel_err {state.last_ds_rel_err:.4g} < ds_rel_err_low {self.config.ds_rel_err_low:g}"
            low = self.config.noise_ratio_low
            if self.config.noise_ratio_high is not None and state.last_noise_step is not None:
                # The reading is the base precision's whatever runs: would the rung below still cost loss?
                if state.last_noise_step <= state.backoff.last_change or state.last_noise_ratio >= low:
                    return None
                reason += f", noise_ratio {state.last_noise_ratio:.3g} < noise_ratio_low {low:g}"
        if "qk" in top.fields:
            measured_since = state.last_qk_step is not None and state.last_qk_step > state.backoff.last_change
            if not measured_since or state.last_qk_rel_err >= self.config.qk_rel_err_low:
                return None
            reason += f", qk_rel_err {state.last_qk_rel_err:.4g} < qk_rel_err_low {self.config.qk_rel_err_low:g}"
        old = self._precision_of(state.base, state.path)
        state.path.pop()
        state.backoff.relax(step)
        state.ds_high_streak = state.qk_high_streak = 0
        # Check the faster setting at once: a relapse is then caught on the next step, within the calm period,
        # where it doubles the layer's backoff.
        self._arm(step + 1, "ds_stats", "probe")
        return Decision(step, name, "precision", old.short_name, self.precision(name).short_name, reason)

    # ------------------------------------------------------------------ helpers

    def _arm(self, step: int, *signals: str) -> None:
        for signal in signals:
            self._armed[signal] = min(step, self._armed.get(signal, step))

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
            "version": STATE_VERSION,
            "layers": {name: state.state_dict(ladder) for name, state in self._layers.items()},
            "tokens": self._tokens.state_dict(),
            "consecutive_skips": self._consecutive_skips,
            "last_hard_spike": self._last_hard_spike,
            "armed": dict(self._armed),
            "last_step_soft": self._last_step_soft,
            "rollbacks_without_progress": self._rollbacks_without_progress,
            "good_steps": self._good_steps,
            "tried": list(self._tried),
            "loss_detector": self._loss_detector.state_dict(),
            "grad_norm_detector": self._grad_norm_detector.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            ValueError: a state that is not :meth:`state_dict`'s (another version, missing or malformed entries),
                or whose layers or rungs do not match this policy's (a different model or ladder).
        """
        where = "PrecisionPolicy.load_state_dict"
        _require_keys(state, _POLICY_KEYS, where)
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"{where}: the state has version {state['version']!r}, this policy reads version {STATE_VERSION}; "
                "resume with the sage-lightning version that saved the checkpoint."
            )
        saved, known = set(state["layers"]), set(self._layers)
        if saved != known:
            raise ValueError(
                f"{where}: the checkpoint's layers {sorted(saved)} do not match the model's {sorted(known)} "
                f"(missing from the model: {sorted(saved - known)}; new in the model: {sorted(known - saved)}); "
                "resume with the model the checkpoint was saved from."
            )
        for name, layer_state in state["layers"].items():
            self._layers[name].load_state_dict(layer_state, self.config.ladder, f"{where}: layer {name!r}")
        self._tokens.load_state_dict(state["tokens"])
        self._consecutive_skips = int(state["consecutive_skips"])
        self._last_hard_spike = state["last_hard_spike"]
        self._armed = dict(state["armed"])
        # Came later: a checkpoint from before it resumes as after a calm step (a soft reading next arms dS).
        self._last_step_soft = bool(state.get("last_step_soft", False))
        self._rollbacks_without_progress = int(state["rollbacks_without_progress"])
        self._good_steps = int(state["good_steps"])
        self._tried = list(state["tried"])
        self._loss_detector.load_state_dict(state["loss_detector"])
        self._grad_norm_detector.load_state_dict(state["grad_norm_detector"])


#: The noise fields' defaults (a checkpoint from before them lacks them), read off the dataclass.
_NOISE_DEFAULTS = {f.name: f.default for f in fields(_LayerState) if "noise" in f.name}

_POLICY_KEYS = (
    "version",
    "layers",
    "tokens",
    "consecutive_skips",
    "last_hard_spike",
    "armed",
    "rollbacks_without_progress",
    "good_steps",
    "tried",
    "loss_detector",
    "grad_norm_detector",
)


def _require_keys(state: object, keys: Sequence[str], where: str) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: the state must be a dict from state_dict(); received {type(state).__name__}.")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(
            f"{where}: the state lacks {missing} (it has {sorted(state)}); it was not saved by this version's "
            "state_dict(): resume with the sage-lightning version that saved the checkpoint."
        )


def _soft(*readings: SpikeReading | None) -> bool:
    """Whether any of the step's spike readings is soft."""
    return any(reading is not None and reading.level == "soft" for reading in readings)


def _probe_cos(probe: Mapping[str, Mapping[str, float]], tensor: str) -> float | None:
    metrics = probe.get(tensor)
    if not metrics or "cos" not in metrics:
        return None
    value = float(metrics["cos"])
    # A NaN cosine (the layer's output was non-finite) is as bad as it gets.
    return value if math.isfinite(value) else -1.0


def _worst_cos(
    probe: Mapping[str, Mapping[str, float]], tensors: tuple[str, ...], below: float
) -> tuple[str, float] | None:
    """``(tensor, cosine)`` of the lowest probe cosine under ``below`` among ``tensors`` (the first on a tie), or
    ``None`` when none is under it or measured."""
    found = [(t, c) for t in tensors if (c := _probe_cos(probe, t)) is not None and c < below]
    return min(found, key=lambda item: item[1]) if found else None


def _finite_cos(probe: Mapping[str, Mapping[str, float]], tensor: str) -> bool:
    return math.isfinite(float(probe[tensor]["cos"]))


def _probe_rel_l2(probe: Mapping[str, Mapping[str, float]], tensor: str) -> float | None:
    value = probe.get(tensor, {}).get("rel_l2")
    return float(value) if value is not None and math.isfinite(value) else None


def _low_bit(precision: AttentionPrecision, product: str) -> bool:
    """Whether SageBwd runs ``product`` (``"qk"``, ``"ds"``, ...) of ``precision`` in a low-bit format (INT8 or
    FP8), which the rules raise to bf16; ``False`` in the other modes."""
    return precision.mode == "sagebwd" and getattr(precision, product) in LOW_BIT_FORMATS


def _fmt(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.4g}"


def _streak(
    state: _LayerState, signal: str, err: float, high: float, patience: int, note: str, label: str | None = None
) -> str:
    """Count one reading of ``label`` (``<signal>_rel_err`` by default) into the layer's streak of readings over
    ``high`` (``<signal>_high_streak``; a finite reading at or under it ends the streak, a non-finite one leaves it);
    the reason to escalate once the streak reaches ``patience``, else ``""``."""
    label = label or f"{signal}_rel_err"
    attribute = f"{signal}_high_streak"
    if not math.isfinite(err):
        return ""
    if err <= high:
        setattr(state, attribute, 0)
        return ""
    streak = getattr(state, attribute) + 1
    setattr(state, attribute, streak)
    if streak < patience:
        return ""
    return f"{label} {err:.4g} > {label}_high {high:g} ({streak} measurements in a row){note}"
