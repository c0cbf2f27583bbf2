"""benchmarks.controller.overhead runs at tiny sizes on CPU and writes result files in the format of
/work/shared/RESULTS.md."""

from __future__ import annotations

import gc
import json
import time
import weakref

import pytest

from benchmarks.controller import overhead

HEADER = {"kind", "device", "date", "commit", "command", "versions", "rows"}
TINY = ["--device", "cpu", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32", "--batch", "2"]


def test_overhead_runs_with_tiny_flags(tmp_path) -> None:
    out = tmp_path / "overhead.json"
    argv = [*TINY, "--steps", "3", "--breakdown-steps", "2", "--warmup", "1", "--precision", "32-true"]
    result = overhead.main([*argv, "--repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result)) and set(saved) == HEADER and saved["kind"] == "overhead"
    assert [row["what"] for row in saved["rows"]] == list(overhead.SETTINGS)
    for row in saved["rows"]:
        assert row["step_ms"] > 0 and row["baseline_step_ms"] > 0 and len(row["round_step_ms"]) == 1
        assert row["steps"] == (3 if overhead.SETTINGS[row["what"]][1] else 2)
        assert row["round_verdict_waits"] == [0]  # on the CPU the signals are on the host at once
        assert len(row["round_baseline_step_ms"]) == 1 and row["round_alloc_retries"] == [0]
        assert len(row["round_gc_ms"]) == 1 and row["round_gc_ms"][0] >= 0
        if row["what"] != overhead.BASELINE:  # every measured step's time, to find which steps are slow
            (each,) = row["round_step_durations_ms"]
            assert len(each) == row["steps"] and all(ms > 0 for ms in each)
    assert saved["rows"][0]["overhead"] == 0.0
    table = out.with_suffix(".md").read_text()
    assert "| callback, defaults | 3 |" in table and "\n\nThe defaults' hooks on the host" in table
    # The controller's own host time per step, from the hook clock: none without it, some with it.
    rows = {row["what"]: row for row in saved["rows"]}
    assert rows["no callback"]["round_hook_host_ms"] == [{}]
    clock = rows["callback, defaults"]["round_hook_host_ms"][0]
    assert 0 < clock["median_ms"] <= clock["mean_ms"] * 3 and "on_before_optimizer_step" in clock["by_hook_ms"]
    for row in saved["rows"][1:]:  # the baseline's row is the median of its runs: no steps of its own
        (slowest,) = row["round_slowest_steps"]
        assert 1 <= len(slowest) <= overhead.SLOWEST and all(entry["step"] >= 1 for entry in slowest)
        assert [entry["step"] for entry in slowest] == sorted(entry["step"] for entry in slowest)
    assert "The defaults' hooks on the host" in table and "Slowest steps of the first round" in table


def test_the_hook_clock_charges_each_hook_to_its_optimizer_step() -> None:
    """on_train_batch_end runs after the optimizer step moved global_step on: it still counts for its own step."""
    from benchmarks.controller.overhead_timing import HookClock

    class Trainer:
        global_step = 0

    class Slow:
        def on_train_batch_start(self, trainer, *args):  # noqa: ANN001, ANN201
            time.sleep(0.002)

        def on_before_optimizer_step(self, trainer, *args):  # noqa: ANN001, ANN201
            time.sleep(0.004)

        def on_train_batch_end(self, trainer, *args):  # noqa: ANN001, ANN201
            time.sleep(0.001)

    callback, trainer = Slow(), Trainer()
    clock = HookClock(callback)
    for step in range(3):
        callback.on_train_batch_start(trainer, None, None, 0)
        callback.on_before_optimizer_step(trainer, None, None)
        trainer.global_step = step + 1
        callback.on_train_batch_end(trainer, None, None, None, 0)
    per_step = clock.per_step(skip=1)
    assert sorted(per_step) == [1, 2]
    assert per_step[2]["on_before_optimizer_step"] >= 4 and per_step[2]["on_train_batch_end"] >= 1
    summary = clock.summary(skip=0)
    assert summary["median_ms"] >= 7 and set(summary["by_hook_ms"]) == {
        "on_train_batch_start",
        "on_before_optimizer_step",
        "on_train_batch_end",
    }


def test_the_tokens_rule_is_off_in_every_setting() -> None:
    """At 131K tokens per step the tokens-per-step rule would change dS's format at step 0: every setting turns it
    off, so the settings differ from the baseline by the hooks alone (the rule's own price: docs/controller.md)."""
    for label, (factory, _) in overhead.SETTINGS.items():
        if factory is not None:
            config = factory().config
            assert config.ds_tokens_per_step_high is None and config.noise_scale_ratio_high is None, label


def test_overhead_records_each_round_s_median_step_and_decisions(tmp_path, monkeypatch) -> None:
    """A run that escalates is not a calm run: its decisions are in the row, as is each round's median step."""
    from sage_lightning import AdaptivePrecision, PolicyConfig

    impossible = PolicyConfig(probe_every_n_steps=1, probe_grad_cos_min=0.999999, probe_o_cos_min=0.999999)
    settings = {
        "no callback": overhead.SETTINGS["no callback"],
        "callback, defaults": (lambda: AdaptivePrecision(impossible, progress_bar=False, verbose=False), True),
    }
    monkeypatch.setattr(overhead, "SETTINGS", settings)
    monkeypatch.setattr(overhead, "format_table", lambda result: "table")
    out = tmp_path / "overhead.json"
    argv = [*TINY, "--steps", "3", "--breakdown-steps", "2", "--warmup", "1", "--precision", "32-true"]
    rows = {row["what"]: row for row in overhead.main([*argv, "--repeats", "1", "--out", str(out)])["rows"]}
    assert rows["no callback"]["round_decisions"] == [[]]
    escalated = rows["callback, defaults"]["round_decisions"][0]
    assert escalated and all("precision" in decision for decision in escalated)
    for row in rows.values():
        assert len(row["round_median_step_ms"]) == 1 and row["round_median_step_ms"][0] > 0
    assert json.loads(out.read_text())["rows"][1]["round_decisions"] == [escalated]


def test_overhead_profiles_where_the_time_goes(tmp_path, monkeypatch) -> None:
    """``--profile-steps``: the baseline, the defaults and the dS statistics on every step, profiled; each names its
    operators' time per step, and the callback's hooks carry their host time (none for the baseline)."""
    monkeypatch.setattr(overhead, "format_table", lambda result: "table")
    out = tmp_path / "overhead.json"
    argv = [*TINY, "--steps", "2", "--breakdown-steps", "1", "--warmup", "1", "--precision", "32-true"]
    result = overhead.main([*argv, "--repeats", "1", "--profile-steps", "2", "--out", str(out)])
    profile = json.loads(out.read_text())["profile"]
    assert profile == json.loads(json.dumps(result["profile"]))
    assert list(profile) == ["no callback", "callback, defaults", "callback, dS statistics every step"]
    assert all(
        found["steps"] == 2 and found["device_ms"] and found["device_ms_total"] > 0 for found in profile.values()
    )
    assert profile["no callback"]["host_ms"] == {}
    hooks = profile["callback, dS statistics every step"]["host_ms"]
    assert {"on_before_optimizer_step", "on_train_batch_end"} <= set(hooks) and all(ms > 0 for ms in hooks.values())
    assert "kernels that add most" in out.with_suffix(".md").read_text()


def test_a_profile_window_the_run_never_reaches_says_so() -> None:
    from benchmarks.controller.overhead_profile import ProfilerWindow

    window = ProfilerWindow(start_step=5, steps=10)
    with pytest.raises(RuntimeError, match="steps 5 to 14 were not all run"):
        window.per_step()


def test_each_setting_is_paired_with_the_baseline_runs_around_it(tmp_path, monkeypatch) -> None:
    """Each round runs a baseline before, between and after the settings (the order reversed every other round), each
    as long as its longer neighbour; a setting's overhead is against the mean of the two baseline runs beside it, so a
    machine that slows down steadily over the rounds shows no overhead."""
    ran = []
    drift = iter(range(1, 100))

    def run_once(args, label, data, window=None, steps=None):  # noqa: ANN001, ANN202
        steps = steps or (args.steps if overhead.SETTINGS[label][1] else args.breakdown_steps)
        ran.append((label, steps))
        ms = float(next(drift))  # every run 1 ms slower than the one before
        return overhead.Run(ms, ms, steps, [])

    base, defaults, off = "no callback", "callback, defaults", "callback, signals and snapshots off"
    monkeypatch.setattr(overhead, "SETTINGS", {label: overhead.SETTINGS[label] for label in (base, defaults, off)})
    monkeypatch.setattr(overhead, "run_once", run_once)
    monkeypatch.setattr(overhead, "format_table", lambda result: "table")
    argv = [*TINY, "--steps", "5", "--breakdown-steps", "2", "--repeats", "2", "--out", str(tmp_path / "o.json")]
    rows = {row["what"]: row for row in overhead.main(argv)["rows"]}
    assert ran == [(base, 5), (defaults, 5), (base, 5), (off, 2), (base, 2)] + [
        (base, 2),
        (off, 2),
        (base, 5),
        (defaults, 5),
        (base, 5),
    ]
    assert rows[defaults]["round_baseline_step_ms"] == [2.0, 9.0] and rows[off]["round_baseline_step_ms"] == [4.0, 7.0]
    assert rows[defaults]["overhead"] == rows[off]["overhead"] == rows[base]["overhead"] == 0.0
    assert rows[base]["round_step_ms"] == [3.0, 8.0] and rows[base]["steps"] == 5


def test_a_run_starts_with_the_earlier_runs_collected() -> None:
    """A Trainer and its model hold each other in reference cycles: what an earlier run left is collected before the
    next starts, and the collector's time during the run is measured."""
    from benchmarks.controller.overhead_timing import isolated

    class Run:
        pass

    earlier = Run()
    earlier.trainer = earlier  # a cycle, as Trainer and LightningModule make
    left = weakref.ref(earlier)
    del earlier
    with isolated("cpu") as costs:
        assert left() is None
        garbage = Run()
        garbage.cycle = garbage
        del garbage
        gc.collect()
    assert costs.gc_ms > 0 and costs.alloc_retries == 0


def test_skipped_settings_are_left_out_and_the_noise_settings_run(tmp_path) -> None:
    out = tmp_path / "overhead.json"
    kept = ["no callback", "callback, defaults, noise ratio every 25 steps", "callback, noise ratio every step"]
    skips = [arg for label in overhead.SETTINGS if label not in kept for arg in ("--skip", label)]
    argv = [*TINY, "--steps", "3", "--breakdown-steps", "2", "--warmup", "1", "--precision", "32-true", *skips]
    saved = overhead.main([*argv, "--repeats", "1", "--out", str(out)])
    assert [row["what"] for row in saved["rows"]] == kept
    assert all(row["round_decisions"] == [[]] for row in saved["rows"])  # measured, never acted on
    assert "The defaults' hooks" not in out.with_suffix(".md").read_text()  # its setting was skipped
    with pytest.raises(SystemExit):
        overhead.parse_args([*TINY, "--skip", "no callback"])  # the baseline cannot be left out
