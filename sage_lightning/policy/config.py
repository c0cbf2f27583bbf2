"""The policy's thresholds, cadences, budgets and ladder: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sage_lightning.policy.vocabulary import Rung, check_int, is_number

#: The rung reserved for the tokens-per-step rule (``PolicyConfig.ds_tokens_per_step_high``) and the noise-scale rule
#: (``PolicyConfig.noise_scale_ratio_high``), which the other rules pass over: dS in FP8 e4m3, which closed SageBwd's
#: loss gap at 131K tokens per step (``docs/controller.md``, Tokens per step). The two rules take it where
#: ``PolicyConfig.large_step_rung`` is ``None`` and the ladder has it (else their first rung that changes ``ds``
#: alone); the callback drops it on GPUs without FP8 (compute capability below 8.9) and gives the rules ``ds_bf16`` on
#: Hopper, where bf16 dS runs faster.
TOKENS_RUNG = "ds_fp8"

#: The design's rungs, one per cause and full precision for anything: Q-smoothing, then the scores' product in bf16
#: for the forward (the latter also for a spoiled Q'/K' block scale, which smoothing cannot remove), dS in FP8 (taken
#: by the tokens-per-step and noise-scale rules alone), dS in bf16 for dQ and dK, dV's product in bf16 for dV, then
#: full precision. A layer goes to the first rung, in this order, that fixes what it is blamed for; a catastrophic
#: reading goes straight to ``full``.
DEFAULT_LADDER: tuple[Rung, ...] = (
    Rung("smooth_q", {"smooth_q": True}, scope="forward", fixes=("forward",)),
    Rung("qk_bf16", {"qk": "bf16"}, scope="forward", fixes=("forward", "qk")),
    Rung(TOKENS_RUNG, {"ds": "fp8"}, scope="backward", fixes=("ds",)),
    Rung("ds_bf16", {"ds": "bf16"}, scope="backward", fixes=("ds",)),
    Rung("dv_bf16", {"dv": "bf16"}, scope="backward", fixes=("dv",)),
    Rung("full", {"mode": "full"}, scope="both"),
)


#: The noise ratio's rule is off by default: on the evidence matrix its readings did not separate the groups where
#: low-bit attention costs loss from those where it does not (``docs/controller.md``, Noise ratio). Turn it on with
#: ``noise_ratio_high`` (0.2 and ``noise_ratio_low`` 0.1 are what the matrix's controller runs used).
NOISE_RATIO_HIGH: float | None = None
NOISE_RATIO_LOW = 0.1
#: Tokens per optimizer step from which a layer's INT8 dS moves to :data:`TOKENS_RUNG`: between the matrix's 16K
#: (SageBwd fixed inside full precision's margin in both seeds) and 131K (outside in both seeds, with and without
#: QK-norm, at heads of 64 and 128; FP8 dS inside in three of four runs), ``docs/controller.md``, Tokens per step.
DS_TOKENS_PER_STEP_HIGH: int | None = 65_536
#: The noise-scale rule is off by default: calibrated on one observing run per side (device run 27: 0.44 with
#: ``noise_scale_from_step`` at twice the warm-up) and trained with in run 28, where it decided as the tokens-per-step
#: rule does and needed the run's warm-up, which the callback cannot read (``docs/controller.md``, Noise scale).
NOISE_SCALE_RATIO_HIGH: float | None = None


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds and cadences of :class:`PrecisionPolicy`; ``docs/controller.md`` gives the measurement behind
    every default.

    Args:
        ladder: the rungs a layer can take, in the order they are tried for a cause (:data:`CAUSES`).
        ds_stats_every_n_steps: measure every layer's dS quantization error on optimizer steps that are a
            multiple of this (free on the others).
        probe_every_n_steps: compare every layer with full-precision attention on one micro-batch of the
            optimizer steps that are a multiple of this.
        ds_rel_err_high: a layer whose ``ds_rel_err`` exceeds this, ``ds_rel_err_patience`` measurements in a
            row while its dS runs low-bit (INT8 or FP8), moves to the next backward rung. ``ds_rel_err`` is
            INT8's error whatever dS runs in (the kernels measure it so), so for an FP8 dS it stands in for FP8's.
        ds_rel_err_low: a rung that changed ``ds`` is left (stepping down) only when the latest ``ds_rel_err``
            is below this (hysteresis: below ``ds_rel_err_high``).
        ds_rel_err_patience: consecutive measurements above ``ds_rel_err_high`` needed to escalate.
        qk_rel_err_high: a layer whose ``qk_rel_err`` (the INT8 error of the scores' operands, per row) exceeds
            this, ``qk_rel_err_patience`` measurements in a row while its scores run low-bit (INT8 or FP8), moves to
            the rung that fixes ``"qk"`` (``qk_bf16``). Measured for INT8 also when the scores run FP8.
        qk_rel_err_low: a rung that changed ``qk`` is left only when the latest ``qk_rel_err`` is below this.
        qk_rel_err_patience: consecutive measurements above ``qk_rel_err_high`` needed to escalate.
        probe_o_cos_min: a probe whose O cosine is below this implicates the forward (its next rung that fixes
            ``"forward"``: ``smooth_q``, then ``full``).
        probe_grad_cos_min: a probe whose dQ, dK or dV cosine is below this escalates the layer: a poor dV to
            the rung that fixes dV (``dv_bf16``), a poor dQ or dK to the one that fixes dS when dS's INT8 error
            explains it, to the forward's otherwise.
        probe_catastrophic_cos: a probe cosine (any tensor) below this, or a non-finite one, is catastrophic (a
            wrong kernel, not quantization noise): the layer goes straight to the top rung (``full``).
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
            measures the dS statistics, if the step before it read no soft spike (a run of them arms once).
        loss_hard_spike_z: robust z-score above which the loss is a hard spike: roll back and escalate.
        grad_norm_spike_z: robust z-score of the gradient norm above which it is a (soft) spike (arms the dS
            statistics as a soft loss spike does).
        spike_rel_floor: the detectors' spread is at least this fraction of the median.
        max_consecutive_skips: non-finite gradients this many steps in a row count as a divergence (roll back
            and escalate) instead of one more skipped step.
        spike_repeat_steps: a hard loss spike is skipped as a one-off, unless another came within this many steps
            before it: then it is a divergence (roll back and escalate).
        max_rollbacks: rollbacks without progress the run may take; one more divergence, with no lever left to
            turn, stops training (the callback keeps the last good weights in a checkpoint and raises).
        progress_steps: applied optimizer steps in a row after a rollback that count as progress: the rollback
            budget is then full again.
        min_accumulate_grad_batches: the lowest ``accumulate_grad_batches`` the tokens-per-step lever may set;
            ``None`` turns the lever off.
        noise_every_n_steps: measure each layer's quantization error against gradient noise
            (:mod:`sage_lightning.noise`) on optimizer steps that are a multiple of this.
        noise_ratio_high: a layer whose noise ratio (the error its low-bit products put into its gradients over
            those gradients' sampling noise at the run's tokens per step) exceeds this, ``noise_patience``
            measurements in a row, moves dS to the next rung that raises it (``ds_bf16``); where dS is already
            high, tokens per step go down. ``None`` (the default) turns the measurement and the rule off:
            experimental, its threshold is not calibrated yet (``docs/controller.md``, Noise ratio).
        noise_ratio_low: a rung that changed ``ds`` is left only when the latest noise ratio of the layer's base
            precision is below this (hysteresis), and tokens per step come back up only when every layer's latest
            reading is.
        noise_patience: consecutive measurements above ``noise_ratio_high`` needed to act.
        noise_sequences: the most sequences of one micro-batch the noise measurement keeps (at least 2; it needs
            micro-batches of two sequences or more).
        ds_tokens_per_step_high: from this many tokens per optimizer step (every rank's micro-batches, as the
            callback's ``tokens_fn`` counts them), every layer whose dS runs in INT8 moves to ``large_step_rung``
            and stays there while the steps are this large: SageBwd's pretraining gap at large tokens per step,
            which FP8 and bf16 dS close (``docs/controller.md``, Tokens per step). A rule on the run, not on a
            measurement. ``None`` turns it off.
        noise_scale_ratio_high: a layer whose step holds more than this many times its gradient noise scale (the
            step's sequences over :func:`sage_lightning.noise.noise_scale`, measured with the noise ratio every
            ``noise_every_n_steps``), ``noise_patience`` measurements in a row, moves its INT8 dS to
            ``large_step_rung``, as the tokens-per-step rule does, and stays there while the reading is at or over
            ``noise_scale_ratio_low``: the tokens-per-step rule with a threshold that follows the model, where the
            step's sampling noise has become small beside INT8 dS's error. ``None`` (the default) turns it off:
            its threshold is this model's (0.44, ``docs/controller.md``, Noise scale, with how to calibrate yours).
        noise_scale_ratio_low: the reading under which the noise-scale rule releases the rung (stepping down then
            waits for the calm period and a low ``ds_rel_err``, as every ``ds`` rung); ``None``: half of
            ``noise_scale_ratio_high``.
        noise_scale_from_step: the first optimizer step whose reading counts toward the noise-scale rule. Early in
            training the noise scale is a few sequences (the gradient is mostly signal), so every step reads as
            large, at 16K tokens per step as at 131K: start it after the learning-rate warm-up (the calibration
            used twice the warm-up). Readings before it are still recorded.
        large_step_rung: the rung the tokens-per-step and noise-scale rules take, by name: a rung of the ladder
            that changes ``ds`` alone. ``None`` (the default): the cheapest measured on the fit's device, which the
            callback picks (:func:`sage_lightning.checks.for_device`): ``ds_bf16`` on Hopper, whose kernels run bf16
            dS's backward 1.20-1.29x as fast as FP8 dS's on an H100 (``docs/controller.md``, Which dS rung) and
            forward+backward 1.05-1.13x as fast as INT8 dS's on an H200 from N=2048 (``docs/performance.md``);
            ``ds_fp8`` on other GPUs with FP8 and on the CPU; ``ds_bf16`` without FP8.

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
    qk_rel_err_high: float = 0.1
    qk_rel_err_low: float = 0.05
    qk_rel_err_patience: int = 2
    probe_o_cos_min: float = 0.995
    probe_grad_cos_min: float = 0.97
    probe_catastrophic_cos: float = 0.5
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
    spike_repeat_steps: int = 10
    max_rollbacks: int = 3
    progress_steps: int = 50
    min_accumulate_grad_batches: int | None = 1
    noise_every_n_steps: int = 25
    noise_ratio_high: float | None = NOISE_RATIO_HIGH
    noise_ratio_low: float = NOISE_RATIO_LOW
    noise_patience: int = 2
    noise_sequences: int = 16
    ds_tokens_per_step_high: int | None = DS_TOKENS_PER_STEP_HIGH
    noise_scale_ratio_high: float | None = NOISE_SCALE_RATIO_HIGH
    noise_scale_ratio_low: float | None = None
    noise_scale_from_step: int = 0
    large_step_rung: str | None = None

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
            "qk_rel_err_patience",
            "calm_steps",
            "max_consecutive_skips",
            "spike_repeat_steps",
            "progress_steps",
            "noise_every_n_steps",
            "noise_patience",
        ):
            check_int(name, getattr(self, name), minimum=1)
        check_int("noise_sequences", self.noise_sequences, minimum=2)
        check_int("noise_scale_from_step", self.noise_scale_from_step, minimum=0)
        tokens = self.ds_tokens_per_step_high
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(
                f"PolicyConfig: ds_tokens_per_step_high must be an int >= 1 or None (off); received {tokens!r}."
            )
        if self.noise_ratio_high is not None:
            for name in ("noise_ratio_high", "noise_ratio_low"):
                value = getattr(self, name)
                if not is_number(value) or not math.isfinite(value) or value <= 0:
                    raise ValueError(
                        f"PolicyConfig: {name} must be a positive finite number"
                        + (" or None (off)" if name == "noise_ratio_high" else "")
                        + f"; received {value!r}."
                    )
            if self.noise_ratio_low >= self.noise_ratio_high:
                raise ValueError(
                    f"PolicyConfig: noise_ratio_low must be below noise_ratio_high ({self.noise_ratio_high}) so "
                    f"decisions do not flap; received {self.noise_ratio_low!r}."
                )
        self._check_noise_scale_ratio()
        ds_alone = [rung.name for rung in ladder if set(rung.fields) == {"ds"}]
        if self.large_step_rung is not None and self.large_step_rung not in ds_alone:
            raise ValueError(
                f"PolicyConfig: large_step_rung must name a rung of the ladder that changes ds alone ({ds_alone}) "
                f"or be None (the cheapest on the fit's device); received {self.large_step_rung!r}."
            )
        check_int("max_backoff", self.max_backoff, minimum=0, maximum=30)
        check_int("max_rollbacks", self.max_rollbacks, minimum=0)
        check_int("spike_window", self.spike_window, minimum=3)
        check_int("spike_min_history", self.spike_min_history, minimum=3, maximum=self.spike_window)
        if self.min_accumulate_grad_batches is not None:
            check_int("min_accumulate_grad_batches", self.min_accumulate_grad_batches, minimum=1)
        for name in (
            "ds_rel_err_high",
            "ds_rel_err_low",
            "qk_rel_err_high",
            "qk_rel_err_low",
            "loss_spike_z",
            "loss_hard_spike_z",
            "grad_norm_spike_z",
        ):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"PolicyConfig: {name} must be a positive finite number; received {value!r}.")
        if self.ds_rel_err_low >= self.ds_rel_err_high:
            raise ValueError(
                f"PolicyConfig: ds_rel_err_low must be below ds_rel_err_high ({self.ds_rel_err_high}) so decisions "
                f"do not flap; received {self.ds_rel_err_low!r}."
            )
        if self.qk_rel_err_low >= self.qk_rel_err_high:
            raise ValueError(
                f"PolicyConfig: qk_rel_err_low must be below qk_rel_err_high ({self.qk_rel_err_high}) so decisions "
                f"do not flap; received {self.qk_rel_err_low!r}."
            )
        if self.loss_hard_spike_z <= self.loss_spike_z:
            raise ValueError(
                f"PolicyConfig: loss_hard_spike_z must be above loss_spike_z ({self.loss_spike_z}); "
                f"received {self.loss_hard_spike_z!r}."
            )
        for name in (
            "probe_o_cos_min",
            "probe_grad_cos_min",
            "probe_catastrophic_cos",
            "ds_explains_ratio",
            "attn_qat_probe_o_cos_min",
            "attn_qat_probe_grad_cos_min",
        ):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value <= 1:
                raise ValueError(f"PolicyConfig: {name} must be in (0, 1]; received {value!r}.")
        if self.probe_catastrophic_cos >= min(self.probe_grad_cos_min, self.probe_o_cos_min):
            raise ValueError(
                "PolicyConfig: probe_catastrophic_cos must be below probe_grad_cos_min and probe_o_cos_min "
                f"({self.probe_grad_cos_min}, {self.probe_o_cos_min}); received {self.probe_catastrophic_cos!r}."
            )
        if not is_number(self.spike_rel_floor) or not 0 <= self.spike_rel_floor < 1:
            raise ValueError(f"PolicyConfig: spike_rel_floor must be in [0, 1); received {self.spike_rel_floor!r}.")

    def _check_noise_scale_ratio(self) -> None:
        """Validate the noise-scale rule's thresholds and set the low one's default (half the high one)."""
        high, low = self.noise_scale_ratio_high, self.noise_scale_ratio_low
        if high is None:
            if low is not None:
                raise ValueError(
                    f"PolicyConfig: noise_scale_ratio_low ({low!r}) needs noise_scale_ratio_high, which is None (the "
                    "rule is off); set both, or noise_scale_ratio_high alone (low is then half of it)."
                )
            return
        for name, value in (("noise_scale_ratio_high", high), ("noise_scale_ratio_low", low)):
            if value is not None and (not is_number(value) or not math.isfinite(value) or value <= 0):
                raise ValueError(
                    f"PolicyConfig: {name} must be a positive finite number"
                    + (" or None (off)" if name == "noise_scale_ratio_high" else " or None (half of the high one)")
                    + f"; received {value!r}."
                )
        if low is None:
            object.__setattr__(self, "noise_scale_ratio_low", high / 2)
        elif low >= high:
            raise ValueError(
                f"PolicyConfig: noise_scale_ratio_low must be below noise_scale_ratio_high ({high}) so decisions do "
                f"not flap; received {low!r}."
            )
