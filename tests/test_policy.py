"""PrecisionPolicy: tables of signals in, decisions out. No torch, no Lightning: plain numbers."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
from sage_lightning.kernels import AttentionPrecision

from sage_lightning.policy import (
    LayerSignals,
    LowBitShare,
    PolicyConfig,
    PrecisionPolicy,
    Rung,
    SignalRequest,
    StepOutcome,
    StepSignals,
    runs_low_bit,
)

BASE = AttentionPrecision()
DS_BF16 = BASE.replace(ds="bf16")
NAMES = ("blocks.0.attn", "blocks.1.attn", "blocks.2.attn")
CALM = 100
NAN = math.nan


def make(layers: int = 1, accumulate: int = 1, base: AttentionPrecision = BASE, **config) -> PrecisionPolicy:
    config.setdefault("calm_steps", CALM)
    config.setdefault("noise_ratio_high", None)  # the noise ratio's rules: tests/test_noise.py
    return PrecisionPolicy(
        {name: base for name in NAMES[:layers]}, accumulate_grad_batches=accumulate, config=PolicyConfig(**config)
    )


def signals(step: int, loss: float | None = 2.0, grad_norm: float | None = 1.0, **layers: LayerSignals) -> StepSignals:
    """Layer keyword arguments name layers by index: l0, l1, l2."""
    return StepSignals(
        step=step, loss=loss, grad_norm=grad_norm, layers={NAMES[int(k[1:])]: v for k, v in layers.items()}
    )


def probe(o: float = 0.9999, dq: float = 0.999, dk: float = 0.999, dv: float = 0.999) -> dict:
    """Probe metrics; each rel_l2 is what its cosine implies for equal norms, sqrt(2 (1 - cos))."""
    cosines = {"O": o, "dQ": dq, "dK": dk, "dV": dv}
    return {name: {"cos": cos, "rel_l2": math.sqrt(max(0.0, 2 * (1 - cos)))} for name, cos in cosines.items()}


# ----------------------------------------------------------------------------------------- per-layer triggers


@pytest.mark.parametrize(
    ("measurements", "escalated_at"),
    [
        ([0.3, 0.3], 10),  # two in a row above 0.2: next backward rung (smooth_q is skipped)
        ([0.3, 0.1, 0.3], None),  # the streak is broken
        ([0.21, 0.25, 0.05], 10),
        ([0.2, 0.2, 0.2], None),  # at the threshold is not above it
        ([0.05, 0.3, 0.3, 0.3], 20),
    ],
)
def test_ds_rel_err_escalates_to_ds_bf16_after_patience(measurements: list[float], escalated_at: int | None) -> None:
    policy = make()
    steps = []
    for i, err in enumerate(measurements):
        outcome = policy.decide(signals(10 * i, l0=LayerSignals(ds_rel_err=err)))
        assert outcome.action == "step"
        steps += [d.step for d in outcome.decisions]
    if escalated_at is None:
        assert steps == [] and policy.precision(NAMES[0]) == BASE
    else:
        assert steps == [escalated_at]
        assert policy.precision(NAMES[0]) == DS_BF16
        assert policy.rung(NAMES[0]) == "ds_bf16" and policy.level(NAMES[0]) == 4
        decision = policy.decide(signals(1000, l0=LayerSignals(ds_rel_err=0.5)))  # dS runs bf16: rule is moot
        assert decision.decisions == ()


@pytest.mark.parametrize(
    ("path", "measured", "rung", "reason"),
    [
        ([], {"probe": probe(o=0.99)}, "smooth_q", "probe O cos 0.99000 < probe_o_cos_min 0.995"),
        ([], {"probe": probe(o=0.99), "ds_rel_err": 0.3}, "smooth_q", "probe O cos"),  # O is the forward's
        # dK rel_l2 0.447: a dS error of 0.3 explains it (>= 0.5 x 0.447): dS to bf16 ...
        ([], {"probe": probe(dk=0.9), "ds_rel_err": 0.3}, "ds_bf16", "which dS's INT8 error explains"),
        # ... a dS error of 0.02 does not: the error comes from the forward (sigma=10 inputs look like this).
        ([], {"probe": probe(dk=0.9), "ds_rel_err": 0.02}, "smooth_q", "beyond dS's INT8 error"),
        ([], {"probe": probe(dq=0.96, dk=0.95), "ds_rel_err": 0.25}, "ds_bf16", "probe dK cos 0.95000"),
        ([], {"probe": probe(dk=0.9)}, "ds_bf16", "ds_rel_err not measured"),  # no evidence: dS, the usual suspect
        # dV does not use dS: its own product goes to bf16, nothing else changes.
        ([], {"probe": probe(dv=0.9), "ds_rel_err": 0.3}, "dv_bf16", "dV does not use dS"),
        ([], {"probe": probe()}, "base", None),
        ([], {"probe": probe(o=0.996, dq=0.971)}, "base", None),  # just inside both thresholds
        # Already Q-smoothed and the forward still poor: the scores' product in bf16, then full.
        ([{"probe": probe(o=0.99)}], {"probe": probe(o=0.99)}, "qk_bf16", "probe O cos"),
        ([{"probe": probe(o=0.99)}, {"probe": probe(o=0.99)}], {"probe": probe(o=0.99)}, "full", "probe O cos"),
        # dS already bf16 and dQ still poor: the forward's first rung.
        ([{"ds_rel_err": 0.3}, {"ds_rel_err": 0.3}], {"probe": probe(dq=0.9)}, "smooth_q", "already in high precision"),
        # Catastrophic readings (a wrong kernel, not noise) go straight to the rung that removes them.
        ([], {"probe": probe(dq=NAN), "ds_rel_err": 0.3}, "full", "probe dQ cos non-finite < probe_catastrophic_cos"),
        ([], {"probe": probe(dv=-0.9)}, "full", "probe dV cos -0.90000 < probe_catastrophic_cos 0.5: catastrophic"),
        ([{"probe": probe(dv=0.9)}], {"probe": probe(o=0.2)}, "full", "probe O cos 0.20000"),
    ],
)
def test_probe_points_at_forward_or_backward(path: list[dict], measured: dict, rung: str, reason: str | None) -> None:
    policy = make()
    for i, earlier in enumerate(path):
        policy.decide(signals(i, l0=LayerSignals(**earlier)))
    outcome = policy.decide(signals(50, l0=LayerSignals(**measured)))
    assert policy.rung(NAMES[0]) == rung
    if reason is None:
        assert outcome.decisions == ()
    else:
        assert reason in outcome.decisions[-1].reason
    if rung == "full" and path:
        # Only the rungs taken are on the path, in the order taken (none passed over): stepping down retraces them.
        expected = ["smooth_q", "qk_bf16", "full"] if path[0]["probe"]["O"]["cos"] < 0.995 else ["dv_bf16", "full"]
        assert policy.state_dict()["layers"][NAMES[0]]["path"] == expected


def test_layers_are_decided_independently() -> None:
    policy = make(layers=3, ds_rel_err_patience=1)
    outcome = policy.decide(
        signals(0, l0=LayerSignals(ds_rel_err=0.05), l1=LayerSignals(ds_rel_err=0.4), l2=LayerSignals(probe=probe()))
    )
    assert [(d.layer, d.old, d.new) for d in outcome.decisions] == [(NAMES[1], BASE.short_name, DS_BF16.short_name)]
    assert policy.precisions() == {NAMES[0]: BASE, NAMES[1]: DS_BF16, NAMES[2]: BASE}


# ------------------------------------------------------------------------------------------- FP8 products


FP8_DS = BASE.replace(ds="fp8")
FP8_PV = BASE.replace(pv="fp8")
#: The default ladder with a rung for O = P V tried first for the forward.
PV_LADDER = (Rung("pv_bf16", {"pv": "bf16"}, scope="forward", fixes=("forward",)), *PolicyConfig().ladder)


@pytest.mark.parametrize("base", [FP8_DS, AttentionPrecision.all_fp8()], ids=["fp8_ds", "all_fp8"])
def test_an_fp8_ds_escalates_to_bf16_like_an_int8_one(base: AttentionPrecision) -> None:
    policy = make(base=base)
    assert policy.decide(signals(0, l0=LayerSignals(ds_rel_err=0.3))).decisions == ()
    (decision,) = policy.decide(signals(10, l0=LayerSignals(ds_rel_err=0.3))).decisions
    assert policy.precision(NAMES[0]) == base.replace(ds="bf16") and policy.rung(NAMES[0]) == "ds_bf16"
    assert (decision.old, decision.new) == (base.short_name, base.replace(ds="bf16").short_name)
    assert "ds" in base.fp8_products and "ds" not in policy.precision(NAMES[0]).fp8_products
    assert policy.decide(signals(20, l0=LayerSignals(ds_rel_err=0.5))).decisions == ()  # dS runs bf16: moot


@pytest.mark.parametrize(
    ("measured", "rung", "reason"),
    [
        ({"probe": probe(dk=0.9), "ds_rel_err": 0.3}, "ds_bf16", "which dS's FP8 error explains"),
        ({"probe": probe(dk=0.9), "ds_rel_err": 0.02}, "smooth_q", "beyond dS's FP8 error"),
    ],
)
def test_the_probe_blames_an_fp8_ds_as_it_does_an_int8_one(measured: dict, rung: str, reason: str) -> None:
    policy = make(base=FP8_DS)
    (decision,) = policy.decide(signals(0, l0=LayerSignals(**measured))).decisions
    assert policy.rung(NAMES[0]) == rung and reason in decision.reason


def test_an_fp8_qk_is_raised_by_the_forward_health_signal() -> None:
    base = BASE.replace(qk="fp8")
    policy = make(base=base)
    policy.decide(signals(0, l0=LayerSignals(qk_rel_err=0.17)))
    (decision,) = policy.decide(signals(1, l0=LayerSignals(qk_rel_err=0.17))).decisions
    assert policy.precision(NAMES[0]) == base.replace(qk="bf16") and "its block's FP8 scale" in decision.reason


@pytest.mark.parametrize("base", [FP8_PV, BASE], ids=["fp8_pv", "int8_pv"])
def test_a_forward_trigger_raises_a_low_bit_pv_where_the_ladder_has_the_rung(base: AttentionPrecision) -> None:
    policy = make(base=base, ladder=PV_LADDER)
    (decision,) = policy.decide(signals(0, l0=LayerSignals(probe=probe(o=0.99)))).decisions
    assert policy.rung(NAMES[0]) == "pv_bf16" and policy.precision(NAMES[0]) == base.replace(pv="bf16")
    assert decision.new == base.replace(pv="bf16").short_name


def test_a_pv_rung_is_passed_over_where_pv_already_runs_bf16() -> None:
    policy = make(base=BASE.replace(pv="bf16"), ladder=PV_LADDER)
    policy.decide(signals(0, l0=LayerSignals(probe=probe(o=0.99))))
    assert policy.rung(NAMES[0]) == "smooth_q"


def test_the_default_ladder_has_no_pv_rung_so_an_fp8_pv_forward_goes_smooth_q_qk_bf16_full() -> None:
    policy = make(base=FP8_PV)
    for step in range(3):
        policy.decide(signals(step, l0=LayerSignals(probe=probe(o=0.99))))
    assert policy.state_dict()["layers"][NAMES[0]]["path"] == ["smooth_q", "qk_bf16", "full"]


def test_a_divergence_no_layer_is_blamed_for_raises_fp8_ds_too() -> None:
    policy = PrecisionPolicy(
        {NAMES[0]: FP8_DS, NAMES[1]: BASE, NAMES[2]: DS_BF16.replace(pv="fp8")}, config=PolicyConfig(calm_steps=CALM)
    )
    outcome = policy.decide(signals(7, loss=NAN, grad_norm=NAN))
    assert outcome.action == "rollback"
    assert [policy.rung(name) for name in NAMES] == ["ds_bf16", "ds_bf16", "base"]  # the last has no low-bit dS
    assert all("INT8 or FP8 dS" in d.reason for d in outcome.decisions[1:])


# ------------------------------------------------------------------------------ stepping down: hysteresis, backoff


def escalated(policy: PrecisionPolicy, step: int = 0) -> None:
    policy.decide(signals(step, l0=LayerSignals(ds_rel_err=0.3)))
    policy.decide(signals(step + 1, l0=LayerSignals(ds_rel_err=0.3)))
    assert policy.rung(NAMES[0]) == "ds_bf16"


@pytest.mark.parametrize(
    ("step", "ds_rel_err", "stepped_down"),
    [
        (1 + CALM - 1, 0.05, False),  # calm period not over
        (1 + CALM, 0.05, True),  # over, and dS error below ds_rel_err_low
        (1 + CALM, 0.15, False),  # hysteresis: between low (0.1) and high (0.2) keeps the rung
        (1 + CALM, None, False),  # no measurement since the change: no evidence
        (1 + 3 * CALM, 0.099, True),
    ],
)
def test_step_down_needs_calm_and_low_error(step: int, ds_rel_err: float | None, stepped_down: bool) -> None:
    policy = make()
    escalated(policy)
    outcome = policy.decide(signals(step, l0=LayerSignals(ds_rel_err=ds_rel_err)))
    assert (policy.rung(NAMES[0]) == "base") is stepped_down
    if stepped_down:
        (decision,) = outcome.decisions
        assert decision.old == DS_BF16.short_name and decision.new == BASE.short_name
        assert f"ds_rel_err {ds_rel_err:.4g} < ds_rel_err_low 0.1" in decision.reason
        # The faster setting is checked on the very next step, so a relapse meets the backoff.
        assert policy.signals_wanted(step + 1) == SignalRequest(ds_stats=True, probe=True)


def test_backoff_doubles_the_calm_period_after_a_quick_relapse() -> None:
    policy = make(max_backoff=2)
    escalated(policy, step=0)
    policy.decide(signals(1 + CALM, l0=LayerSignals(ds_rel_err=0.05)))  # steps down at 101
    assert policy.rung(NAMES[0]) == "base"
    relapse = 110
    policy.decide(signals(relapse, l0=LayerSignals(ds_rel_err=0.3)))
    outcome = policy.decide(signals(relapse + 1, l0=LayerSignals(ds_rel_err=0.3)))
    assert f"calm period now {2 * CALM}" in outcome.decisions[0].reason
    # One calm period is no longer enough; two are.
    assert policy.decide(signals(relapse + 1 + CALM, l0=LayerSignals(ds_rel_err=0.05))).decisions == ()
    assert policy.decide(signals(relapse + 1 + 2 * CALM, l0=LayerSignals(ds_rel_err=0.05))).decisions != ()
    # Backoff is capped at max_backoff: 2**2 calm periods at most.
    for cycle in range(5):
        start = 10_000 * (cycle + 1)
        policy.decide(signals(start, l0=LayerSignals(ds_rel_err=0.3)))
        policy.decide(signals(start + 1, l0=LayerSignals(ds_rel_err=0.3)))
        policy.decide(signals(start + 1 + 4 * CALM, l0=LayerSignals(ds_rel_err=0.05)))
        assert policy.rung(NAMES[0]) == "base"
        policy.decide(signals(start + 2 + 4 * CALM, l0=LayerSignals(ds_rel_err=0.3)))
        policy.decide(signals(start + 3 + 4 * CALM, l0=LayerSignals(ds_rel_err=0.3)))
        policy.decide(signals(start + 3 + 8 * CALM, l0=LayerSignals(ds_rel_err=0.05)))
        assert policy.rung(NAMES[0]) == "base"
    assert policy.state_dict()["layers"][NAMES[0]]["backoff"]["level"] == 2


def test_full_rung_steps_down_on_time_alone() -> None:
    """In "full" mode there is no dS statistic to wait for: the calm period is the evidence."""
    policy = make()
    policy.decide(signals(0, loss=NAN, l0=LayerSignals(nonfinite=True)))
    assert policy.rung(NAMES[0]) == "full"
    assert policy.decide(signals(CALM - 1)).decisions == ()
    (decision,) = policy.decide(signals(CALM)).decisions
    # Straight to full, no rung passed over on the way: one step down is back at the base.
    assert decision.new == BASE.short_name and policy.rung(NAMES[0]) == "base"


# ------------------------------------------------------------------------------------ divergence and skipped steps


@pytest.mark.parametrize(
    ("layers", "rungs", "reason"),
    [
        # The layer that produced a non-finite output from finite inputs goes straight to full precision.
        (
            {"l1": LayerSignals(nonfinite=True)},
            ["base", "full", "base"],
            "non-finite attention output from finite inputs",
        ),
        # Non-finite dS in l0 and l1, finite in l2: it started in l1, the first layer the backward reaches.
        (
            {
                "l0": LayerSignals(ds_rel_err=NAN),
                "l1": LayerSignals(ds_rel_err=NAN),
                "l2": LayerSignals(ds_rel_err=0.1),
            },
            ["base", "ds_bf16", "base"],
            "dS non-finite here and finite in blocks.2.attn",
        ),
        # Non-finite everywhere: it may come from after every attention layer (the loss), nothing is pinned.
        (
            {f"l{i}": LayerSignals(ds_rel_err=NAN) for i in range(3)},
            ["ds_bf16", "ds_bf16", "ds_bf16"],
            "no layer flagged",
        ),
        # Nothing flagged: every layer whose dS is still INT8 moves up one backward rung.
        ({}, ["ds_bf16", "ds_bf16", "ds_bf16"], "no layer flagged"),
    ],
)
def test_non_finite_loss_rolls_back_and_escalates_where_it_started(layers: dict, rungs: list[str], reason: str) -> None:
    policy = make(layers=3)
    outcome = policy.decide(signals(7, loss=NAN, grad_norm=NAN, **layers))
    assert outcome.action == "rollback"
    assert outcome.decisions[0].lever == "rollback" and "loss is nan" in outcome.decisions[0].reason
    assert [policy.rung(name) for name in NAMES] == rungs
    assert all(reason in d.reason for d in outcome.decisions[1:])
    # Everything is measured on the next step, to localise a relapse.
    assert policy.signals_wanted(8) == SignalRequest(ds_stats=True, probe=True)


@pytest.mark.parametrize(
    ("accumulate", "floor", "expected"),
    [(4, 1, 2), (3, 1, 1), (2, 2, 2), (4, None, 4), (1, 1, 1)],
)
def test_tokens_per_step_lever_when_no_ds_is_left_in_int8(accumulate: int, floor: int | None, expected: int) -> None:
    policy = make(layers=2, accumulate=accumulate, base=DS_BF16, min_accumulate_grad_batches=floor)
    outcome = policy.decide(signals(5, loss=NAN))
    assert outcome.action == "rollback"
    assert policy.accumulate_grad_batches == expected
    levers = [d.lever for d in outcome.decisions]
    assert levers == (["rollback", "accumulate_grad_batches"] if expected != accumulate else ["rollback"])


def test_tokens_per_step_come_back_after_calm_with_backoff() -> None:
    policy = make(layers=1, accumulate=4, base=DS_BF16)
    policy.decide(signals(0, loss=NAN))
    policy.decide(signals(1, loss=NAN))
    assert policy.accumulate_grad_batches == 1
    assert policy.decide(signals(CALM)).decisions == ()
    (up,) = policy.decide(signals(1 + CALM)).decisions
    assert (up.lever, up.old, up.new) == ("accumulate_grad_batches", "1", "2")
    # A divergence right after raising it: halved again, and the calm period doubles.
    policy.decide(signals(2 + CALM, loss=NAN))
    assert policy.accumulate_grad_batches == 1
    assert policy.decide(signals(2 + 2 * CALM)).decisions == ()
    assert policy.decide(signals(2 + 3 * CALM)).decisions[0].new == "2"
    assert policy.decide(signals(2 + 4 * CALM)).decisions == ()  # its own backoff: 2 * CALM between raises
    assert policy.decide(signals(2 + 5 * CALM)).decisions[0].new == "4"
    assert policy.decide(signals(2 + 9 * CALM)).decisions == ()  # never above the run's own setting


def calm_losses(policy: PrecisionPolicy, count: int = 16) -> None:
    for step in range(count):
        policy.decide(signals(step, loss=2.0 + 0.01 * (-1) ** step, grad_norm=1.0 + 0.01 * (-1) ** step))


@pytest.mark.parametrize(
    ("loss", "grad_norm", "action", "armed"),
    [
        (2.0, 1.0, "step", (False, False)),
        (2.1, 1.0, "step", (True, False)),  # soft loss spike (z 6.7): measure dS next step
        (2.0, 1.2, "step", (True, False)),  # soft gradient-norm spike (z 13.5)
        (2.0, 1.1, "step", (False, False)),  # z 6.7: below grad_norm_spike_z 10
        (2.4, 1.0, "skip", (True, False)),  # hard loss spike (z 27), a one-off: skip the step, measure dS next
    ],
)
def test_spikes(loss: float, grad_norm: float, action: str, armed: tuple[bool, bool]) -> None:
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    calm_losses(policy)
    outcome = policy.decide(signals(16, loss=loss, grad_norm=grad_norm))
    assert outcome.action == action
    assert policy.signals_wanted(17) == SignalRequest(*armed)
    if action == "skip":
        reason = outcome.decisions[0].reason
        assert "loss_hard_spike_z 20" in reason and "a one-off, skipped" in reason
        assert outcome.skip_cause == "loss_spike" and policy.rung(NAMES[0]) == "base"


def soft_run(
    policy: PrecisionPolicy, steps: range, measured: frozenset[int] = frozenset(), grad_norm: float = 1.2
) -> list[int]:
    """Decide ``steps`` with a gradient norm that keeps rising from ``grad_norm`` (a soft reading on each, z over 10
    against the calm window), dS measured on the steps in ``measured``; the steps after them that want dS."""
    wanted = []
    for i, step in enumerate(steps):
        layers = {"l0": LayerSignals(ds_rel_err=0.05)} if step in measured else {}
        outcome = policy.decide(signals(step, loss=2.0, grad_norm=grad_norm + 0.2 * i, **layers))
        assert outcome.grad_norm.level == "soft" and outcome.action == "step"
        if policy.signals_wanted(step + 1).ds_stats:
            wanted.append(step + 1)
    return wanted


def test_a_run_of_soft_readings_arms_the_ds_statistics_once() -> None:
    """A sustained rise reads soft on every step: the first arms dS for the next step, the rest do not (each
    dS-statistics step costs about +27% of a step on the GPU; an H200 run armed 20 of 50 steps this way)."""
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    calm_losses(policy)
    # Step 17 measures what step 16 armed; 18 to 23 read soft again and arm nothing.
    assert soft_run(policy, range(16, 24), measured=frozenset({17})) == [17]
    # An arm not yet answered stays armed (a verdict may land a step late), the run goes on: still only one.
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    calm_losses(policy)
    assert soft_run(policy, range(16, 20)) == [17, 18]  # 17 unmeasured: the arm waits one step, then expires
    assert not policy.signals_wanted(20).ds_stats


def test_a_soft_episode_after_a_calm_step_arms_again() -> None:
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    calm_losses(policy)
    assert soft_run(policy, range(16, 20), measured=frozenset({17})) == [17]
    assert policy.decide(signals(20, loss=2.0, grad_norm=1.0)).grad_norm.level == "none"  # calm: the episode ends
    assert not policy.signals_wanted(21).ds_stats
    assert policy.decide(signals(21, loss=2.0, grad_norm=5.0)).grad_norm.level == "soft"  # a new spike
    assert policy.signals_wanted(22).ds_stats


def test_hard_spikes_and_skips_arm_the_ds_statistics_inside_a_soft_run() -> None:
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    calm_losses(policy)
    assert soft_run(policy, range(16, 19), measured=frozenset({17})) == [17]
    assert policy.decide(signals(19, loss=200.0, grad_norm=1.8)).action == "skip"  # hard loss spike
    assert policy.signals_wanted(20).ds_stats
    # Soft after the hard one, which was no soft reading: a new episode, which arms; its next step does not.
    assert soft_run(policy, range(20, 22), measured=frozenset({20, 21}), grad_norm=3.0) == [21]
    assert policy.decide(signals(22, loss=2.0, grad_norm=NAN)).action == "skip"  # non-finite gradients
    assert policy.signals_wanted(23).ds_stats


def test_the_cadence_measures_inside_a_soft_run() -> None:
    policy = make(ds_stats_every_n_steps=10, probe_every_n_steps=1000)
    calm_losses(policy)
    assert soft_run(policy, range(16, 26), measured=frozenset({17, 20})) == [17, 20]


def test_a_soft_episode_survives_a_checkpoint() -> None:
    """Saved mid-episode, the resumed policy keeps not arming; a state saved before the key existed loads as
    after a calm step (the next soft reading arms)."""
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    calm_losses(policy)
    soft_run(policy, range(16, 20), measured=frozenset({17}))
    state = policy.state_dict()
    assert state["last_step_soft"] is True
    resumed = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert resumed.decide(signals(20, loss=2.0, grad_norm=2.0)).grad_norm.level == "soft"
    assert not resumed.signals_wanted(21).ds_stats
    older = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    older.load_state_dict({k: v for k, v in state.items() if k != "last_step_soft"})
    assert older.state_dict()["last_step_soft"] is False
    older.decide(signals(20, loss=2.0, grad_norm=2.0))
    assert older.signals_wanted(21).ds_stats


def test_non_finite_gradients_skip_then_roll_back() -> None:
    policy = make(max_consecutive_skips=3)
    assert policy.decide(signals(0, grad_norm=NAN)).action == "skip"
    assert policy.signals_wanted(1) == SignalRequest(ds_stats=True, probe=False)  # to find where it started
    assert [policy.decide(signals(s, grad_norm=NAN)).action for s in (1, 2)] == ["skip", "rollback"]
    # A finite step in between resets the count.
    actions = [policy.decide(signals(s, grad_norm=g)).action for s, g in ((3, NAN), (4, 1.0), (5, NAN), (6, NAN))]
    assert actions == ["skip", "step", "skip", "skip"]
    # With a GradScaler (fp16), non-finite gradients are routine overflow that the scaler skips itself.
    scaled = StepSignals(step=7, loss=2.0, grad_norm=math.inf, grad_scaler=True)
    assert [policy.decide(scaled).action for _ in range(5)] == ["step"] * 5


def test_skip_with_non_finite_ds_escalates_its_origin() -> None:
    policy = make(layers=2)
    outcome = policy.decide(signals(3, grad_norm=NAN, l0=LayerSignals(ds_rel_err=NAN), l1=LayerSignals(ds_rel_err=0.1)))
    assert outcome.action == "skip"
    assert [(d.lever, d.layer) for d in outcome.decisions] == [("optimizer_step", None), ("precision", NAMES[0])]


def test_no_loss_this_step_is_not_a_divergence() -> None:
    assert make().decide(signals(0, loss=None, grad_norm=None)).action == "step"


# ------------------------------------------------------------------------------------------ cadence, ladder, base


@pytest.mark.parametrize(
    ("step", "wanted"),
    [(0, (True, True)), (5, (False, False)), (10, (True, False)), (100, (True, True)), (30, (True, False))],
)
def test_signal_cadence(step: int, wanted: tuple[bool, bool]) -> None:
    policy = make(ds_stats_every_n_steps=10, probe_every_n_steps=100)
    assert policy.signals_wanted(step) == SignalRequest(*wanted)
    # A probe step measures dS too, to attribute what the probe finds.
    assert make(ds_stats_every_n_steps=7, probe_every_n_steps=5).signals_wanted(5) == SignalRequest(True, True)


def test_base_with_ds_bf16_skips_that_rung() -> None:
    policy = make(base=DS_BF16)
    assert policy.decide(signals(0, l0=LayerSignals(ds_rel_err=0.9))).decisions == ()  # nothing INT8 to fix
    policy.decide(signals(1, l0=LayerSignals(probe=probe(dk=0.5))))  # dS is bf16: the forward's error
    assert policy.precision(NAMES[0]) == DS_BF16.replace(smooth_q=True)
    policy.decide(signals(2, l0=LayerSignals(probe=probe(dk=0.5))))
    assert policy.precision(NAMES[0]) == DS_BF16.replace(smooth_q=True, qk="bf16")
    policy.decide(signals(3, l0=LayerSignals(probe=probe(dk=0.5))))
    assert policy.precision(NAMES[0]).mode == "full"
    assert policy.state_dict()["layers"][NAMES[0]]["path"] == ["smooth_q", "qk_bf16", "full"]


def test_custom_ladder() -> None:
    ladder = (Rung("dv_bf16", {"dv": "bf16"}, scope="backward"), Rung("ds_bf16", {"ds": "bf16"}, scope="backward"))
    policy = make(ladder=ladder, ds_rel_err_patience=1)
    policy.decide(signals(0, l0=LayerSignals(ds_rel_err=0.5)))
    assert policy.precision(NAMES[0]) == BASE.replace(dv="bf16")
    explained = LayerSignals(probe=probe(dk=0.1), ds_rel_err=0.9)  # dK rel_l2 1.34, half of it explained
    policy.decide(signals(1, l0=explained))
    assert policy.precision(NAMES[0]) == BASE.replace(dv="bf16", ds="bf16")
    # At the top, nothing is left: no decision, no error; and no forward rung in this ladder.
    assert policy.decide(signals(2, l0=explained)).decisions == ()
    assert policy.decide(signals(3, l0=LayerSignals(probe=probe(o=0.5)))).decisions == ()


# ------------------------------------------------------------------------------------------------- checkpoints


def scripted(step: int) -> StepSignals:
    """A run with a bit of everything: measurements, a spike, a divergence, a relapse."""
    loss = 2.0 + 0.01 * (-1) ** step
    if step == 40:
        loss = 2.1
    if step == 60:
        loss = NAN
    layers = {}
    if step % 10 == 0:
        layers = {"l0": LayerSignals(ds_rel_err=0.3 if 20 <= step <= 40 else 0.05), "l1": LayerSignals(ds_rel_err=0.05)}
    if step == 80:
        layers["l1"] = LayerSignals(probe=probe(o=0.95), ds_rel_err=0.05)
    return signals(step, loss=loss, grad_norm=1.0, **layers)


def test_a_restored_policy_decides_as_the_uninterrupted_one() -> None:
    config = dict(layers=2, accumulate=4, calm_steps=30)
    uninterrupted = make(**config)
    first, resumed = make(**config), make(**config)
    expected = [uninterrupted.decide(scripted(s)).decisions for s in range(300)]
    got = [first.decide(scripted(s)).decisions for s in range(150)]
    resumed.load_state_dict(first.state_dict())
    got += [resumed.decide(scripted(s)).decisions for s in range(150, 300)]
    assert got == expected
    assert sum(len(d) for d in expected) >= 6  # the script does cause decisions
    assert resumed.precisions() == uninterrupted.precisions()


def test_load_state_dict_refuses_another_model() -> None:
    state = make(layers=2).state_dict()
    with pytest.raises(ValueError, match="do not match the model's"):
        make(layers=3).load_state_dict(state)
    state = make(layers=1).state_dict()
    state["layers"][NAMES[0]]["path"] = ["nope"]
    with pytest.raises(ValueError, match="rungs \\['nope'\\]"):
        make(layers=1).load_state_dict(state)


# -------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"ds_rel_err_high": 0.1, "ds_rel_err_low": 0.1}, "ds_rel_err_low"),
        ({"ds_rel_err_high": -1.0}, "ds_rel_err_high"),
        ({"probe_o_cos_min": 1.5}, "probe_o_cos_min"),
        ({"calm_steps": 0}, "calm_steps"),
        ({"ds_stats_every_n_steps": 2.5}, "ds_stats_every_n_steps"),
        ({"loss_spike_z": 20.0, "loss_hard_spike_z": 10.0}, "loss_hard_spike_z"),
        ({"spike_min_history": 100}, "spike_min_history"),
        ({"min_accumulate_grad_batches": 0}, "min_accumulate_grad_batches"),
        ({"ladder": ()}, "ladder"),
        ({"ladder": (Rung("a", {"ds": "bf16"}), Rung("a", {"dv": "bf16"}))}, "unique"),
        ({"max_backoff": -1}, "max_backoff"),
    ],
)
def test_config_errors_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        PolicyConfig(**kwargs)
    assert "received" in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", {"ds": "bf16"}), "name"),
        (("x", {"ds": "fp4"}), "refused"),
        (("x", {"nope": 1}), "unknown AttentionPrecision fields"),
        (("x", {}), "non-empty mapping"),
        (("x", {"ds": "bf16"}, "sideways"), "scope"),
    ],
)
def test_rung_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Rung(*args)


def test_policy_argument_errors() -> None:
    with pytest.raises(ValueError, match="layers must be a non-empty mapping"):
        PrecisionPolicy({})
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        PrecisionPolicy({"a": BASE}, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="unknown layers"):
        make().decide(StepSignals(step=0, loss=1.0, layers={"ghost": LayerSignals()}))


def test_decision_reads_as_a_sentence() -> None:
    policy = make(ds_rel_err_patience=1)
    (decision,) = policy.decide(signals(3, l0=LayerSignals(ds_rel_err=0.25))).decisions
    assert str(decision) == (
        "step 3: blocks.0.attn precision: sagebwd:int8=qk,pv,dv,ds;smooth_k -> sagebwd:int8=qk,pv,dv;smooth_k "
        "(ds_rel_err 0.25 > ds_rel_err_high 0.2 (1 measurements in a row))"
    )


def test_policy_module_is_pure() -> None:
    """The policy takes numbers and returns decisions: no torch, Lightning or Triton import in it."""
    package = Path(__file__).resolve().parent.parent / "sage_lightning"
    for path in [*sorted((package / "policy").glob("*.py")), package / "detectors.py"]:
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"torch", "lightning", "pytorch_lightning", "triton"}, path.name


def test_importing_the_policy_imports_neither_torch_nor_lightning() -> None:
    code = (
        "import sys, sage_lightning.policy as p; p.PrecisionPolicy({'a': p.vocabulary.AttentionPrecision()}); "
        "print(sorted(m for m in ('torch', 'lightning', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------- attn_qat layers

QAT = AttentionPrecision(mode="attn_qat")
DROPIN = QAT.replace(qat_backward="dropin")


@pytest.mark.parametrize(
    ("measured", "escalated", "reason"),
    [
        # FP4's usual error (O about 0.98 on N(0, 1) inputs) is what QAT trains through: below SageBwd's
        # thresholds, above attn_qat's.
        (LayerSignals(probe=probe(o=0.98, dq=0.97, dk=0.97, dv=0.98)), False, None),
        (LayerSignals(probe=probe(o=0.94)), True, "probe O cos 0.94000 < attn_qat_probe_o_cos_min 0.95"),
        (LayerSignals(probe=probe(dk=0.85)), True, "probe dK cos 0.85000 < attn_qat_probe_grad_cos_min 0.9"),
        (LayerSignals(probe=probe(dv=0.8)), True, "(the FP4 forward's error)"),
        # No INT8 dS in attn_qat mode: a dS statistic (not collected there) triggers nothing.
        (LayerSignals(ds_rel_err=0.9), False, None),
        (LayerSignals(nonfinite=False), False, None),
    ],
)
@pytest.mark.parametrize("base", [QAT, DROPIN], ids=["matched", "dropin"])
def test_attn_qat_layer_falls_back_to_full_on_its_probe(
    base: AttentionPrecision, measured: LayerSignals, escalated: bool, reason: str | None
) -> None:
    policy = make(base=base, ds_rel_err_patience=1)
    outcome = policy.decide(signals(0, l0=measured))
    if not escalated:
        assert outcome.decisions == () and policy.precision(NAMES[0]) == base
        return
    (decision,) = outcome.decisions
    assert (decision.old, decision.new) == (base.short_name, "full") and reason in decision.reason
    # smooth_q, qk_bf16, ds_bf16, dv_bf16 change nothing that runs in attn_qat mode: full is the only rung.
    assert policy.rung(NAMES[0]) == "full" and policy.level(NAMES[0]) == 6
    assert policy.state_dict()["layers"][NAMES[0]]["path"] == ["full"]
    # The calm period alone brings it back, to the very base (the drop-in variant stays the drop-in variant).
    (back,) = policy.decide(signals(CALM)).decisions
    assert (back.old, back.new) == ("full", base.short_name) and policy.precision(NAMES[0]) == base


@pytest.mark.parametrize(
    ("layers", "rungs"),
    [
        # Nothing flagged: INT8 dS moves up one backward rung, an attn_qat layer to full precision.
        ({}, ["ds_bf16", "full", "full"]),
        # The attn_qat layer that returned a non-finite output goes to full; the others stay.
        ({"l1": LayerSignals(nonfinite=True)}, ["base", "full", "base"]),
    ],
)
def test_divergence_with_attn_qat_layers(layers: dict, rungs: list[str]) -> None:
    policy = PrecisionPolicy({NAMES[0]: BASE, NAMES[1]: QAT, NAMES[2]: DROPIN}, config=PolicyConfig(calm_steps=CALM))
    outcome = policy.decide(signals(3, loss=NAN, **layers))
    assert outcome.action == "rollback"
    assert [policy.rung(name) for name in NAMES] == rungs
    assert all(d.new in ("full", DS_BF16.short_name) for d in outcome.decisions[1:])


def test_attn_qat_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match=r"attn_qat_probe_o_cos_min must be in \(0, 1\]; received 1.5"):
        PolicyConfig(attn_qat_probe_o_cos_min=1.5)
    with pytest.raises(ValueError, match="attn_qat_probe_grad_cos_min"):
        PolicyConfig(attn_qat_probe_grad_cos_min=0)


# ------------------------------------------------------------------- issue 16: response, budget, proportion


def test_a_wrong_dv_goes_straight_to_full_and_every_escalation_is_checked_by_a_probe() -> None:
    """Issue 16, case 1: main's wrong dV read cosine -0.90 in every layer; the controller moved each layer to
    smooth_q (which cannot change dV) and reached full only 500 steps later."""
    policy = make(layers=3)
    wrong = LayerSignals(probe=probe(dv=-0.9), ds_rel_err=0.05)
    outcome = policy.decide(signals(0, l0=wrong, l1=wrong, l2=wrong))
    assert [policy.rung(name) for name in NAMES] == ["full"] * 3
    assert all("catastrophic" in d.reason for d in outcome.decisions)

    # A dV that is poor but not broken goes to the rung that fixes dV, and is checked on the very next step ...
    policy = make()
    (first,) = policy.decide(signals(7, l0=LayerSignals(probe=probe(dv=0.9)))).decisions
    assert policy.rung(NAMES[0]) == "dv_bf16" and "dV does not use dS" in first.reason
    assert policy.signals_wanted(8) == SignalRequest(ds_stats=True, probe=True)
    # ... where, still poor, it escalates further, saying the first rung did not help.
    (second,) = policy.decide(signals(8, l0=LayerSignals(probe=probe(dv=0.9)))).decisions
    assert policy.rung(NAMES[0]) == "full" and "the escalation at step 7 did not fix it" in second.reason
    # Fixed: the check passes, nothing more happens and nothing stays armed.
    assert policy.decide(signals(9, l0=LayerSignals(probe=probe(), ds_rel_err=0.05))).decisions == ()
    assert policy.signals_wanted(10) == SignalRequest(ds_stats=False, probe=False)


def test_an_armed_signal_waits_for_a_step_that_measures_it() -> None:
    """With check_before_step=False the verdict of step s lands after step s + 1 started: the arm must survive."""
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    policy.decide(signals(3, l0=LayerSignals(probe=probe(o=0.99))))  # escalates, arms step 4
    policy.decide(signals(4))  # step 4 was already running without the probe
    assert policy.signals_wanted(5) == SignalRequest(ds_stats=True, probe=True)
    policy.decide(signals(5, l0=LayerSignals(probe=probe(), ds_rel_err=0.05)))
    assert policy.signals_wanted(6) == SignalRequest(ds_stats=False, probe=False)


def test_a_persistent_fault_stops_after_a_bounded_number_of_rollbacks() -> None:
    """Issue 16, case 2: a NaN loss on every step from step 30 rolled back on every step until max_steps."""
    policy = make(layers=2, accumulate=4, max_rollbacks=3)
    calm_losses(policy, 30)
    actions = []
    for step in range(30, 60):
        outcome = policy.decide(signals(step, loss=NAN, grad_norm=NAN))
        actions.append(outcome.action)
        if outcome.action == "stop":
            break
    # Rollback 1 moves dS to bf16, 2 and 3 halve the tokens per step; the 4th finds nothing left: stop.
    assert actions == ["rollback", "rollback", "rollback", "stop"]
    (stop,) = outcome.decisions
    assert (stop.lever, stop.old, stop.new) == ("stop", "training", "stopped")
    assert "max_rollbacks 3" in stop.reason and "loss is nan" in stop.reason
    assert "blocks.0.attn precision" in stop.reason and "accumulate_grad_batches 4 -> 2" in stop.reason
    assert "2 -> 1" in stop.reason


def test_progress_between_rollbacks_refills_the_budget() -> None:
    policy = make(layers=1, base=DS_BF16, max_rollbacks=1, progress_steps=5, min_accumulate_grad_batches=None)
    assert policy.decide(signals(0, loss=NAN)).action == "rollback"
    for step in range(1, 6):
        assert policy.decide(signals(step)).action == "step"
    assert policy.rollbacks_without_progress == 0
    # Budget full again: one more rollback is allowed; the next, with no lever left and no progress, stops.
    assert [policy.decide(signals(s, loss=NAN)).action for s in (6, 7)] == ["rollback", "stop"]


def test_a_budget_of_zero_stops_at_the_first_divergence_no_lever_answers() -> None:
    policy = make(base=DS_BF16.replace(mode="full"), max_rollbacks=0, min_accumulate_grad_batches=None)
    assert policy.decide(signals(0, loss=NAN)).action == "stop"


def test_a_one_off_spike_is_skipped_a_repeated_one_rolls_back() -> None:
    """Issue 16, case 3: one loss spike x100 rolled back ~31 steps; the run without the callback ended better."""
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000, spike_repeat_steps=10)
    calm_losses(policy)
    assert policy.decide(signals(16, loss=200.0)).action == "skip"
    assert [policy.decide(signals(s)).action for s in range(17, 27)] == ["step"] * 10
    assert policy.decide(signals(27, loss=200.0)).action == "skip"  # 11 steps later: another one-off
    outcome = policy.decide(signals(30, loss=200.0))  # 3 steps later: repeated
    assert outcome.action == "rollback"
    assert "again within spike_repeat_steps 10 of step 27" in outcome.decisions[0].reason


def test_an_outlier_in_q_escalates_the_scores_not_ds() -> None:
    """Issue 16, case 6: one q entry of 300 spoils its block (O cosine 0.963) while ds_rel_err stays at 0.04;
    qk_rel_err reads 0.17 (0.013 healthy): after the patience, the scores' product goes to bf16."""
    policy = make()
    outlier = LayerSignals(ds_rel_err=0.04, qk_rel_err=0.17)
    assert policy.decide(signals(0, l0=outlier)).decisions == ()
    (decision,) = policy.decide(signals(25, l0=outlier)).decisions
    assert policy.rung(NAMES[0]) == "qk_bf16" and policy.precision(NAMES[0]) == BASE.replace(qk="bf16")
    assert "qk_rel_err 0.17 > qk_rel_err_high 0.1 (2 measurements in a row)" in decision.reason
    # Healthy readings leave it alone; the rung is left after calm and a low reading, measured in bf16 too.
    assert policy.decide(signals(26, l0=LayerSignals(qk_rel_err=0.013, ds_rel_err=0.04))).decisions == ()
    assert policy.decide(signals(25 + CALM, l0=LayerSignals(qk_rel_err=0.07))).decisions == ()  # hysteresis
    (down,) = policy.decide(signals(26 + CALM, l0=LayerSignals(qk_rel_err=0.013))).decisions
    assert down.new == BASE.short_name and "qk_rel_err 0.013 < qk_rel_err_low 0.05" in down.reason


def test_an_arm_nothing_can_answer_expires_after_one_more_step() -> None:
    """A layer in full precision has no dS to measure: the arm must not keep the statistics on forever."""
    policy = make(ds_stats_every_n_steps=1000, probe_every_n_steps=1000)
    policy.decide(signals(3, loss=NAN, l0=LayerSignals(nonfinite=True)))  # to full; arms step 4
    policy.decide(signals(4, l0=LayerSignals(probe=probe())))  # probed, no dS (full precision)
    assert policy.signals_wanted(5) == SignalRequest(ds_stats=True, probe=False)  # a verdict may land a step late
    policy.decide(signals(5))
    assert policy.signals_wanted(6) == SignalRequest(ds_stats=False, probe=False)


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_a_decision_fits_the_terminal_it_is_printed_in(width: int) -> None:
    from sage_lightning.policy import Decision

    decision = Decision(
        step=305, layer="model.blocks.3.attn", lever="precision", old=BASE.short_name, new=DS_BF16.short_name,
        reason="ds_rel_err 0.071 > ds_rel_err_high 0.06 (2 measurements in a row); the probe read dV cos 0.9992",
    )  # fmt: skip
    text = decision.console_text(width, "AdaptivePrecision: ")
    lines = text.splitlines()
    assert lines[0].startswith("AdaptivePrecision: step 305:")
    longest_word = max(len(word) for word in str(decision).split())
    assert all(len(line) <= max(width, longest_word + 4) for line in lines), text
    # Nothing lost or reordered: the same words as the one-line form, with "because" before the reason.
    assert text.split() == ["AdaptivePrecision:", *str(decision).replace(" (", " because ", 1)[:-1].split()]


# ------------------------------------------------------------------------ verdicts of steps applied before them


@pytest.mark.parametrize(
    ("action", "cause", "on_device", "expected", "added"),
    [
        ("step", None, False, "step", None),
        ("skip", "nonfinite_gradients", True, "skip", None),
        ("skip", "nonfinite_gradients", False, "undone", "rollback"),
        ("skip", "loss_spike", False, "step", "optimizer_step"),
        ("skip", "loss_spike", True, "step", "optimizer_step"),
        ("rollback", None, False, "undone", None),
        ("stop", None, False, "stop", None),
    ],
)
def test_a_verdict_after_its_step_was_applied_keeps_skips_or_undoes_it(action, cause, on_device, expected, added):
    """check_before_step=False: the device skipped non-finite gradients only where it was told to; a one-off loss
    spike already applied is kept; anything else that should not have been applied is undone by a rollback."""
    outcome = StepOutcome(action=action, decisions=(), loss=None, grad_norm=None, skip_cause=cause)
    after = make().after_the_step(outcome, step=7, skipped_on_device=on_device)
    assert after.action == expected
    assert [d.lever for d in after.decisions] == ([] if added is None else [added])
    assert all(d.step == 7 and d.layer is None for d in after.decisions)


def test_the_low_bit_share_counts_layers_still_on_their_base_fast_path() -> None:
    policy = PrecisionPolicy({"a": BASE, "b": BASE, "c": BASE.replace(mode="full")})
    assert policy.low_bit_layers([BASE, DS_BF16, BASE.replace(mode="full")]) == 1
    assert runs_low_bit(BASE, BASE.replace(dp="fp8")) and not runs_low_bit(BASE, BASE.replace(qk="bf16"))
    assert runs_low_bit(BASE, BASE.replace(ds="fp8")) and not runs_low_bit(BASE.replace(ds="fp8"), DS_BF16)
    share = LowBitShare()
    assert share.fraction == 1.0  # before the first step
    share.count(layers=3, low_bit=1)
    share.count(layers=3, low_bit=2)
    assert (share.layer_steps, share.low_bit_layer_steps, share.fraction) == (6, 3, 0.5)
