"""benchmarks/overhead.py and benchmarks/controller_thresholds.py run at tiny sizes on CPU and write result
files in the format of /work/shared/RESULTS.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import controller_thresholds  # noqa: E402  (benchmarks/ is not a package)
import overhead  # noqa: E402

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
    assert saved["rows"][0]["overhead"] == 0.0
    table = out.with_suffix(".md").read_text()
    assert "| callback, defaults | 3 |" in table and "Defaults rebuilt from the breakdown" in table


def test_controller_thresholds_runs_small(tmp_path) -> None:
    signals, calm = controller_thresholds.main(["--seq", "64", "--steps", "20", "--out-dir", str(tmp_path)])
    assert signals["kind"] == "accuracy" and calm["kind"] == "training"
    rows = {(r["inputs"], r["label"], r["tensor"]): r for r in signals["rows"]}
    assert rows[("normal sigma=1", "full", "ds_rel_err")]["rel_l2"] is None  # full mode leaves the buffer alone
    assert 0 < rows[("normal sigma=1", "base", "ds_rel_err")]["rel_l2"] < 0.2
    assert rows[("normal sigma=1", "full", "dQ")]["cos"] > 0.9999
    assert len(calm["rows"]) == 20 and all(r["train_loss"] > 0 for r in calm["rows"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 4 and all(n.startswith(("accuracy-cpu-", "training-cpu-")) for n in names)


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
    from overhead_profile import ProfilerWindow

    window = ProfilerWindow(start_step=5, steps=10)
    with pytest.raises(RuntimeError, match="steps 5 to 14 were not all run"):
        window.per_step()
