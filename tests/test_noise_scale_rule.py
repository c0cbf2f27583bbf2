"""The noise-scale rule: where a step holds many times a layer's gradient noise scale (the step's sequences over
it), the layer's INT8 dS moves to FP8 (the ``ds_fp8`` rung of the tokens-per-step rule) and stays while the reading
stays high. The policy on plain numbers, its settings refused by name, a checkpoint's state, and a Trainer with the
callback on a tiny model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers
from sage_lightning.noise import calibrate_threshold
from sage_lightning.policy import TOKENS_RUNG, LayerSignals, PrecisionPolicy, StepSignals, replay_noise_readings

REPO = Path(__file__).resolve().parent.parent
BASE = AttentionPrecision()
LAYER = "blocks.0.attn"
FP8_DS = BASE.replace(ds="fp8").short_name


def make(**config) -> PrecisionPolicy:
    config = {"noise_scale_ratio_high": 4.0, "ds_tokens_per_step_high": None, "calm_steps": 10, **config}
    return PrecisionPolicy({LAYER: BASE}, config=PolicyConfig(**config))


def reading(step: int, ratio: float | None, *, ds_rel_err: float | None = None, measured: bool = True) -> StepSignals:
    """A step whose noise measurement read ``ratio`` (the step's sequences over the scale; ``None``: no scale)."""
    layer = LayerSignals(
        ds_rel_err=ds_rel_err,
        noise_ratio=0.1 if measured else None,
        noise_ratio_ran=0.1 if measured else None,
        noise_scale=None if ratio is None else 64 / ratio,
        noise_scale_ratio=ratio if measured else None,
    )
    return StepSignals(step=step, loss=2.0, grad_norm=1.0, layers={LAYER: layer})


def test_two_readings_over_the_threshold_move_int8_ds_to_fp8() -> None:
    policy = make()
    assert policy.decide(reading(0, 5.0)).decisions == ()
    (moved,) = policy.decide(reading(25, 8.0)).decisions
    assert (moved.layer, moved.old, moved.new) == (LAYER, BASE.short_name, FP8_DS)
    assert moved.reason.startswith("noise_scale_ratio 8 > noise_scale_ratio_high 4 (2 measurements in a row)")
    assert "(noise scale 8 sequences)" in moved.reason
    assert policy.rung(LAYER) == TOKENS_RUNG
    wanted = policy.signals_wanted(26)
    assert wanted.noise and wanted.probe and wanted.ds_stats  # the new rung is checked on the next step


def test_readings_before_noise_scale_from_step_do_not_count() -> None:
    policy = make(noise_scale_from_step=50)
    for step in (0, 25):  # the warm-up: a scale of a few sequences, every step reads as large
        assert policy.decide(reading(step, 60.0)).decisions == ()
    assert policy.decide(reading(50, 5.0)).decisions == ()  # the first that counts: one in the streak
    assert len(policy.decide(reading(75, 5.0)).decisions) == 1


@pytest.mark.parametrize(
    "ratios",
    [
        [5.0, 3.0, 5.0],  # under the threshold ends the streak
        [5.0, None, 5.0],  # no scale resolved: the mean gradient lost in the noise, a reading under it
        [5.0, math.nan, 4.0],  # not finite: as no scale; at the threshold is not over it
    ],
)
def test_broken_streaks_and_readings_at_the_threshold_decide_nothing(ratios: list[float | None]) -> None:
    policy = make()
    for step, ratio in enumerate(ratios):
        assert policy.decide(reading(step, ratio)).decisions == ()
    assert policy.precision(LAYER).ds == "int8"


def test_a_step_without_the_measurement_leaves_the_streak_as_it_was() -> None:
    policy = make()
    policy.decide(reading(0, 5.0))
    assert policy.decide(reading(1, None, measured=False)).decisions == ()
    assert len(policy.decide(reading(2, 5.0)).decisions) == 1


def test_layers_whose_ds_is_not_int8_are_left_alone() -> None:
    for base in (BASE.replace(ds="bf16"), BASE.replace(ds="fp8"), AttentionPrecision(mode="attn_qat")):
        policy = PrecisionPolicy({LAYER: base}, config=PolicyConfig(noise_scale_ratio_high=4.0, noise_patience=1))
        assert policy.decide(reading(0, 50.0)).decisions == ()


def test_the_rung_holds_while_the_reading_stays_high_and_steps_down_after_it_falls() -> None:
    policy = make(noise_patience=1)
    policy.decide(reading(0, 8.0))
    # Calm for longer than calm_steps, dS error far under ds_rel_err_low: held while the reading is >= low (2).
    for step in range(1, 40):
        assert policy.decide(reading(step, 2.0, ds_rel_err=0.01)).decisions == ()
    assert policy.precision(LAYER).ds == "fp8"
    (down,) = policy.decide(reading(40, 1.5, ds_rel_err=0.01)).decisions
    assert (down.old, down.new) == (FP8_DS, BASE.short_name) and down.reason.startswith("calm for")


def test_both_fp8_rules_share_the_rung_and_the_hold() -> None:
    policy = make(noise_patience=1, ds_tokens_per_step_high=1000)
    layers = {LAYER: LayerSignals(noise_ratio=0.1, noise_ratio_ran=0.1, noise_scale=8.0, noise_scale_ratio=8.0)}
    (moved,) = policy.decide(StepSignals(step=0, loss=2.0, layers=layers, tokens=4096)).decisions
    assert moved.reason.startswith("noise_scale_ratio 8") and policy.rung(LAYER) == TOKENS_RUNG
    # The scale's reading falls, the steps stay large: the tokens rule still holds the rung.
    quiet = {LAYER: LayerSignals(ds_rel_err=0.01, noise_ratio=0.1, noise_ratio_ran=0.1, noise_scale_ratio=0.5)}
    for step in range(1, 40):
        assert policy.decide(StepSignals(step=step, loss=2.0, layers=quiet, tokens=4096)).decisions == ()


def test_the_measurement_runs_when_the_rule_is_on_and_not_by_default() -> None:
    assert PolicyConfig().noise_scale_ratio_high is None
    assert not PrecisionPolicy({LAYER: BASE}).signals_wanted(0).noise
    policy = make(noise_every_n_steps=10)
    assert policy.signals_wanted(10).noise and not policy.signals_wanted(11).noise
    assert PolicyConfig(noise_scale_ratio_high=4.0).noise_scale_ratio_low == 2.0  # half of high, unless given


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"noise_scale_ratio_high": 0}, r"noise_scale_ratio_high must be a positive finite number or None \(off\)"),
        ({"noise_scale_ratio_high": math.inf}, r"noise_scale_ratio_high must be a positive .*; received inf"),
        ({"noise_scale_ratio_high": "8"}, r"noise_scale_ratio_high must be a positive .*; received '8'"),
        ({"noise_scale_ratio_high": 4.0, "noise_scale_ratio_low": -1}, r"noise_scale_ratio_low must be a positive"),
        ({"noise_scale_ratio_high": 4.0, "noise_scale_ratio_low": 4.0}, r"noise_scale_ratio_low must be below "),
        ({"noise_scale_ratio_low": 1.0}, r"noise_scale_ratio_low \(1.0\) needs noise_scale_ratio_high, which is None"),
        ({"noise_scale_from_step": -1}, r"noise_scale_from_step must be an int >= 0; received -1"),
        ({"noise_scale_from_step": 7.5}, r"noise_scale_from_step must be an int >= 0; received 7.5"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**settings)


def test_the_streak_and_reading_survive_a_checkpoint_and_older_states_resume() -> None:
    policy = make()
    policy.decide(reading(0, 5.0))
    restored = make()
    restored.load_state_dict(policy.state_dict())
    assert len(restored.decide(reading(1, 5.0)).decisions) == 1  # the streak's first reading came back
    state = make().state_dict()
    for key in ("noise_scale_high_streak", "last_noise_scale_ratio"):
        del state["layers"][LAYER][key]
    older = make()
    older.load_state_dict(state)
    assert older.state_dict() == make().state_dict()


def test_a_trainer_measures_the_scale_and_the_controller_moves_ds_on_it(tmp_path) -> None:
    torch.manual_seed(0)
    config = PolicyConfig(
        noise_scale_ratio_high=1e-6,
        noise_every_n_steps=1,
        noise_patience=1,
        ds_tokens_per_step_high=None,
        probe_every_n_steps=1000,
    )
    controller = AdaptivePrecision(config, verbose=False)
    model = TinyLM()
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6, logger=logger), callbacks=[controller])
    trainer.fit(model, token_loader(6, batch_size=4))
    readings = list(controller.policy.noise_readings)
    # Each reading: step, layer, noise ratios, the scale, and the step's 4 sequences over it.
    resolved = [r for r in readings if r[4] is not None]
    assert resolved and all(r[5] == pytest.approx(4 / r[4]) for r in resolved)
    moved = [d for d in controller.history if d.lever == "precision"]
    assert moved and all(d.reason.startswith("noise_scale_ratio ") and d.new == FP8_DS for d in moved)
    first = {d.layer: d.step for d in moved}
    for name, layer in attention_layers(model).items():
        resolved_at = min(r[0] for r in resolved if r[1] == name)
        assert first[name] == resolved_at and layer.precision.ds == "fp8"
    accumulator = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert any(t.startswith("sage/noise_scale_ratio/") for t in accumulator.Tags()["scalars"])


def test_the_threshold_is_calibrated_from_the_readings_sixth_entries() -> None:
    quiet = [0.5, None, 1.0, 1.5, 2.0]  # steps over the scale at 16K tokens per step; None: no scale resolved
    threshold, why = calibrate_threshold(quiet, [[12.0, None, 16.0, 8.0]], name="noise_scale_ratio_high")
    assert threshold == pytest.approx(math.sqrt(1.925 * 12.0))
    assert why.startswith("noise_scale_ratio_high = sqrt(1.925 x 12.000)")
    assert calibrate_threshold([None], [[None]], name="noise_scale_ratio_high")[0] is None


def run_27_readings() -> dict[str, list[list]]:
    """Device run 27's observing runs' noise readings, by group (``noise-scale-large``: 131K tokens per step;
    ``noise-scale-small``: 16K), from the committed result file."""
    path = REPO / "benchmarks/results/training-h200-20261127-noise-scale.json"
    return {s["group"]: s["noise_readings"] for s in json.loads(path.read_text())["summary"]}


def test_device_run_27s_readings_calibrate_the_rule_and_it_separates_them() -> None:
    """The calibration docs/controller.md reports, from the committed observing runs: readings from twice the
    warm-up on (131K: 39 steps, 16K: 312), 16K's 95th percentile against 131K's median. With that threshold the
    rule moves every layer at 131K tokens per step (where INT8 dS has a loss gap) and none at 16K (where it has
    none); counted from step 0 instead, it would move 16K's layers in the warm-up."""
    runs = run_27_readings()
    large, small = runs["noise-scale-large"], runs["noise-scale-small"]
    threshold, why = calibrate_threshold(
        [r[5] for r in small if r[0] >= 624], [[r[5] for r in large if r[0] >= 78]], name="noise_scale_ratio_high"
    )
    assert why == "noise_scale_ratio_high = sqrt(0.224 x 0.862) = 0.440 (3.84x)"
    rule = {"noise_scale_ratio_high": round(threshold, 2), "ds_tokens_per_step_high": None}
    loud = replay_noise_readings(large, PolicyConfig(**rule, noise_scale_from_step=78))
    assert len({d.layer for d in loud}) == len(loud) == 8 and {d.step for d in loud} == {125}
    assert all(d.new == FP8_DS and d.reason.startswith("noise_scale_ratio ") for d in loud)
    assert replay_noise_readings(small, PolicyConfig(**rule, noise_scale_from_step=624)) == []
    early = replay_noise_readings(small, PolicyConfig(**rule))  # the warm-up's readings move every layer at 16K
    assert len(early) == 8 and max(d.step for d in early) <= 100


def test_a_replay_takes_older_readings_and_the_noise_ratio_rule() -> None:
    older = [(0, LAYER, 0.9, 0.9), (25, LAYER, 1.2, 1.2), (50, LAYER, 1.3, 1.3)]  # no scale recorded
    (moved,) = replay_noise_readings(older, PolicyConfig(noise_ratio_high=1.0, ds_tokens_per_step_high=None))
    assert (moved.step, moved.new) == (50, BASE.replace(ds="bf16").short_name)
    assert replay_noise_readings(older, PolicyConfig(noise_scale_ratio_high=4.0, ds_tokens_per_step_high=None)) == []


@pytest.mark.parametrize(
    ("readings", "config", "message"),
    [
        ([], {"noise_scale_ratio_high": 1.0}, "readings is empty"),
        ([(0, LAYER, 0.1)], {"noise_scale_ratio_high": 1.0}, r"readings\[0\] is \(0, 'blocks.0.attn', 0.1\)"),
        ([(0, LAYER, "x", 0.1)], {"noise_scale_ratio_high": 1.0}, r"readings\[0\] must hold an int step and numbers"),
        ([(0, LAYER, 0.1, 0.1)], {"noise_ratio_high": None}, "config turns no noise rule on"),
    ],
)
def test_a_replay_refuses_what_it_cannot_read(readings: list, config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replay_noise_readings(readings, PolicyConfig(**config))


def test_a_replay_refuses_precisions_without_a_layer_the_readings_name() -> None:
    with pytest.raises(ValueError, match="precisions lacks layers the readings name"):
        replay_noise_readings([(0, LAYER, 0.1, 0.1)], PolicyConfig(noise_ratio_high=1.0), {"other": BASE})


def test_controller_md_calibration_recipe_runs_on_device_run_27s_readings(capsys: pytest.CaptureFixture) -> None:
    """docs/controller.md's recipe for calibrating the rule on one's own model, on the committed observing runs."""
    page = (REPO / "docs/controller.md").read_text()
    (recipe,) = re.findall(r"```python\n(from sage_lightning.noise import calibrate_threshold.*?)```", page, re.S)
    runs = run_27_readings()
    scope = {"quiet_run": runs["noise-scale-small"], "loud_run": runs["noise-scale-large"]}
    exec(compile(recipe, "docs/controller.md", "exec"), {**scope, "quiet_warmup": 312, "loud_warmup": 39})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 8 and all(line.startswith("125 model.blocks.") for line in printed)
