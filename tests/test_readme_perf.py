"""README.md's performance table is generated from the latest committed result, and kept in sync by CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.training import readme_perf

REPO = Path(__file__).resolve().parent.parent


def _speed_file(folder: Path, name: str, date: str, sage_ms: float, **extra: object) -> None:
    rows = []
    for impl, ms in (("sage", sage_ms), ("sdpa_cudnn", 2.0), ("sdpa_flash", 3.0)):
        for pass_, head_dim in ((p, d) for p in ("fwd", "fwd+bwd") for d in (64, 128)):  # the table's two head dims
            rows.append(dict(impl=impl, **{"pass": pass_}, batch=4, heads=16, kv_heads=16, seq=4096,
                             head_dim=head_dim, causal=False, ms=ms, tflops=100.0 / ms,
                             peak_mem_mb=400.0 + 10 * ms if pass_ == "fwd+bwd" else None))  # fmt: skip
    header = dict(kind="speed", device="NVIDIA H200", date=date, commit="0" * 40, command="python x", versions={})
    (folder / name).write_text(json.dumps({**header, **extra, "rows": rows}))


def test_readme_table_is_up_to_date() -> None:
    """The committed README shows exactly what the committed results give (run readme_perf.py if not)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.training.readme_perf", "--check"], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_latest_result_by_date_and_ratios(tmp_path: Path) -> None:
    _speed_file(tmp_path, "speed-h200-20261120.json", "2026-11-20", sage_ms=4.0)
    _speed_file(tmp_path, "speed-h200-20261122.json", "2026-11-22", sage_ms=1.0)
    # Newer, but of code that is not main's: never the README's source.
    _speed_file(tmp_path, "speed-h200-20261124-branch.json", "2026-11-24", sage_ms=0.5, diagnostic=True)
    (tmp_path / "speed-h200-20261123-probe.json").write_text(json.dumps({"kind": "speed", "date": "2026-11-23",
                                                                          "rows": [{"impl": "sage"}]}))  # fmt: skip
    text = readme_perf.generate(tmp_path)
    assert "speed-h200-20261122.json" in text and "probe" not in text and "branch" not in text
    # cuDNN 2 ms, flash 3 ms, SageBwd 1 ms: 2.00x and 3.00x, forward and forward+backward; peak memory 410 / 420.
    assert "| 128 | 4096 | no | 100 | 2.00 | 3.00 | 100 | 2.00 | 3.00 | 410 / 420 |" in text
    assert "not measured yet" in text


def test_readme_without_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="perf-table:start"):
        readme_perf.replace_between_markers("# no table here\n", "x")


def test_results_folder_must_exist(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.training.readme_perf", "--check", "--results",
                           str(tmp_path / "missing")], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "--results must be a folder of result files; received" in done.stderr
