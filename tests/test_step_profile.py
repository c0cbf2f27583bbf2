"""``benchmarks/step_profile.py`` (the GPU's busy share of a training step) on the CPU: it trains the tiny config
through its profiled window and writes one row per run; bad window sizes are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "step_profile.py"


def test_it_profiles_each_run_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    runs = ["--runs", "sage:controller=off", "full:controller=off"]
    window = ["--start", "1", "--steps", "2", "--set", "data.seq_len=64"]
    command = [sys.executable, str(SCRIPT), "--config", "examples/configs/tiny.yaml", *runs, *window, "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kind"] == "overhead" and "--steps 2" in result["command"]
    assert [row["what"] for row in result["rows"]] == ["sage-fixed", "full"]
    for row in result["rows"]:
        assert row["steps"] == 2 and row["step_ms"] > 0 and row["device_ms"] > 0 and row["top_kernels_ms"]
    assert "| sage-fixed |" in done.stdout


def test_an_empty_window_is_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "0"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--start and --steps must be at least 1; received 15 and 0" in done.stderr
