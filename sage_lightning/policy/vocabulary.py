"""The policy's vocabulary: what it is told (signals), what it can change (rungs), what it says (decisions)."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

from sage_lightning.detectors import SpikeReading
from sage_lightning.policy._precision import AttentionPrecision

#: What part of attention a rung changes: the forward products, the backward ones, or both.
SCOPES: tuple[str, ...] = ("forward", "backward", "both")
#: What the policy can blame a layer's error on, i.e. what a rung can fix: the forward as a whole (``"forward"``:
#: the probe's O, or dQ/dK beyond dS's error), the INT8 operands of the scores (``"qk"``: ``qk_rel_err``, an
#: outlier spoiling its block's scale), dS's INT8 error (``"ds"``: dQ and dK), or dV's INT8 product (``"dv"``: it
#: does not use dS).
CAUSES: tuple[str, ...] = ("forward", "qk", "ds", "dv")
#: What a :class:`Decision` changes.
LEVERS: tuple[str, ...] = ("precision", "accumulate_grad_batches", "optimizer_step", "rollback", "stop")
#: What the callback does with the optimizer step a :class:`StepOutcome` is about.
ACTIONS: tuple[str, ...] = ("step", "skip", "rollback", "stop")
#: Probe tensors of the backward pass (``"O"`` is the forward's).
PROBE_GRADIENTS: tuple[str, ...] = ("dQ", "dK", "dV")
#: Probe tensors in the order the callback packs them: the forward's output, then the gradients.
PROBE_TENSORS: tuple[str, ...] = ("O", *PROBE_GRADIENTS)

_SCOPE_FIXES = {"forward": ("forward", "qk"), "backward": ("ds", "dv"), "both": CAUSES}


@dataclass(frozen=True)
class Rung:
    """One step up a layer's precision ladder: fields of :class:`AttentionPrecision` to change.

    Args:
        name: a short label, unique in the ladder (logged with every decision).
        changes: ``AttentionPrecision`` fields and their new values, e.g. ``{"ds": "bf16"}`` (kept as a sorted
            tuple of pairs, so the rung stays immutable and hashable).
        scope: ``"forward"``, ``"backward"`` or ``"both"``: the part of attention the change affects.
        fixes: the causes of error (:data:`CAUSES`) the rung answers; a layer blamed for one goes to the first
            rung, in ladder order, that fixes it. ``None``: from ``scope`` (forward: ``("forward", "qk")``;
            backward: ``("ds", "dv")``; both: every cause).

    Raises:
        ValueError: an empty name, an unknown scope or cause, or changes ``AttentionPrecision`` refuses.

    Example::

        from sage_lightning.policy import Rung

        Rung("ds_bf16", {"ds": "bf16"}, scope="backward", fixes=("ds",))
    """

    name: str
    changes: Mapping[str, object] | tuple[tuple[str, object], ...]
    scope: str = "both"
    fixes: tuple[str, ...] | None = None

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
        fixes = _SCOPE_FIXES[self.scope] if self.fixes is None else self.fixes
        if isinstance(fixes, str) or not isinstance(fixes, (list, tuple)) or not fixes or set(fixes) - set(CAUSES):
            raise ValueError(
                f"Rung {self.name!r}: fixes must be a non-empty tuple of causes from {CAUSES} or None; "
                f"received {self.fixes!r}."
            )
        object.__setattr__(self, "fixes", tuple(fixes))

    @property
    def fields(self) -> dict[str, object]:
        """The changed fields and their values."""
        return dict(self.changes)

    def apply(self, precision: AttentionPrecision) -> AttentionPrecision:
        """``precision`` with this rung's changes."""
        return precision.replace(**self.fields)


@dataclass(frozen=True)
class LayerSignals:
    """What was measured about one attention layer during one optimizer step (reduced across ranks).

    Attributes:
        ds_rel_err: ``sqrt(sum err^2 / sum dS^2)`` of the score gradient's INT8 quantization, or ``None`` when
            not measured this step; NaN when dS itself was non-finite.
        probe: ``{"O": {"cos": .., "rel_l2": ..}, "dQ": {...}, "dK": {...}, "dV": {...}}`` against
            full-precision attention, or ``None`` when not probed this step.
        nonfinite: the layer returned a non-finite output from finite inputs (where a divergence starts).
        qk_rel_err: the forward's quantization health: the INT8 error of the scores' operands Q' and K', per row
            (:mod:`sage_lightning.forward_health`), or ``None`` when not measured this step.
        noise_ratio: the error the layer's base precision puts into its gradients over those gradients' own
            sampling noise at the step's tokens per step (:mod:`sage_lightning.noise`), or ``None`` when not
            measured this step.
        noise_ratio_ran: the same for the precision the layer ran in during the step (``noise_ratio`` where that
            is the base).
        noise_scale: the gradient noise scale of the layer's gradients in sequences, from the same measurement
            (:func:`sage_lightning.noise.noise_scale`), or ``None`` where the measurement did not resolve one.
        noise_scale_ratio: the step's sequences (every micro-batch, every rank) over ``noise_scale``: how many noise
            scales one step averages, what ``PolicyConfig.noise_scale_ratio_high`` is compared with; ``None`` where
            there is no scale.
    """

    ds_rel_err: float | None = None
    probe: Mapping[str, Mapping[str, float]] | None = None
    nonfinite: bool = False
    qk_rel_err: float | None = None
    noise_ratio: float | None = None
    noise_ratio_ran: float | None = None
    noise_scale: float | None = None
    noise_scale_ratio: float | None = None


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
        tokens: the step's tokens, every micro-batch's on every rank, or ``None`` when not counted.
    """

    step: int
    loss: float | None
    grad_norm: float | None = None
    layers: Mapping[str, LayerSignals] = field(default_factory=dict)
    grad_scaler: bool = False
    tokens: int | None = None


@dataclass(frozen=True)
class SignalRequest:
    """Which optional signals the policy wants measured during an optimizer step (``noise``: quantization error
    against gradient noise, :mod:`sage_lightning.noise`)."""

    ds_stats: bool
    probe: bool
    noise: bool = False


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

    def console_text(self, width: int = 80, prefix: str = "") -> str:
        """The decision for a terminal ``width`` columns wide: where and what changed, then the reason, indented,
        every line within ``width`` where the words allow (a word longer than a line is not broken).

        Args:
            width: the terminal's columns.
            prefix: put before the first line (e.g. ``"AdaptivePrecision: "``).

        Example::

            print(decision.console_text(80, "AdaptivePrecision: "))
            # AdaptivePrecision: step 20: model.blocks.3.attn precision:
            #     sagebwd:int8=qk,pv,dv,ds;smooth_k -> sagebwd:int8=qk,pv,dv;smooth_k
            #   because ds_rel_err 0.071 > ds_rel_err_high 0.06 (2 measurements in a row)
        """
        wrap = dict(width=max(width, 20), break_long_words=False, break_on_hyphens=False)
        head = f"{prefix}step {self.step}: {self.layer or 'global'} {self.lever}:"
        lines = textwrap.wrap(f"{head} {self.old} -> {self.new}", subsequent_indent="    ", **wrap)
        lines += textwrap.wrap(f"because {self.reason}", initial_indent="  ", subsequent_indent="    ", **wrap)
        return "\n".join(lines)


@dataclass(frozen=True)
class StepOutcome:
    """What to do with one optimizer step.

    Attributes:
        action: ``"step"`` (apply it), ``"skip"`` (leave parameters and optimizer state as they are),
            ``"rollback"`` (restore the last snapshot, then skip) or ``"stop"`` (restore the last snapshot and
            end training: the rollback budget is spent and no lever is left; the stop decision says what was
            tried).
        decisions: every change taken at this step, in the order taken.
        loss: the loss spike detector's reading (``None`` when the loss was not finite).
        grad_norm: the gradient-norm spike detector's reading (``None`` when not measured or not finite).
        skip_cause: for ``"skip"``: ``"nonfinite_gradients"`` (applying the step would spoil the weights) or
            ``"loss_spike"`` (a one-off hard spike with finite gradients: skipped where it can be, harmless to
            keep where it was already applied).
    """

    action: str
    decisions: tuple[Decision, ...]
    loss: SpikeReading | None
    grad_norm: SpikeReading | None
    skip_cause: str | None = None


def is_number(value: object) -> bool:
    """A real number that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None, owner: str = "PolicyConfig"
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int in range."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{owner}: {name} must be an int {bound}; received {value!r}.")
