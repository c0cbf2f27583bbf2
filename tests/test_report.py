"""``python -m sage_lightning``: the report a user pastes into a bug report (issue 38), and the GPU record's summary
that ships with the package for it."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import tomllib
import torch
from sage_lightning.kernels import use_backend

import sage_lightning
from sage_lightning import gpu_record, report

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "benchmarks" / "results" / "gpu-verified.json"


def test_the_report_on_the_cpu_names_versions_device_paths_and_the_record(capsys):
    assert report.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"sage-lightning {sage_lightning.__version__} from ")
    text = "\n".join(lines)
    # The installed distribution's version: PyPI's CUDA wheels say 2.11.0 where torch.__version__ says 2.11.0+cu130.
    assert f"torch {importlib.metadata.version('torch')}" in text and "triton " in text and "lightning " in text
    assert "device     none with CUDA: every call runs the PyTorch reference" in text
    assert "kernels    every precision runs the PyTorch reference here" in text
    assert lines[-1].startswith("verified   ")
    assert len(lines) <= 40  # one screen


def test_the_kernel_table_lists_every_precision_with_its_kernels_and_reasons():
    with use_backend("triton"):
        table = report.kernel_table(torch.device("cpu"))
    names = [name for name, _ in report.precisions()]
    assert names[0] == "default (INT8)" and "rung ds_bf16" in names and "attn_qat()" in names
    rows = [line.split() for line in table if line.startswith("  ") and not line.startswith("  [")]
    by_name = {}
    for row in rows:
        by_name.setdefault(row[0] if row[0] != "rung" else f"rung {row[1]}", []).append(row)
    assert len(by_name["default"]) == len(report.HEAD_DIMS)
    assert by_name["default"][0][2:5] == ["triton_forward", "triton_dkdv", "triton_dq"]
    assert by_name["rung full"][0][2:5] == ["sdpa", "sdpa", "sdpa"]
    assert any("[1] cpu tensors: the Hopper kernels run on compute capability 9.0 GPUs only" in line for line in table)


def test_python_dash_m_and_the_console_script_are_the_report():
    done = subprocess.run([sys.executable, "-m", "sage_lightning", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "bug report" in done.stdout
    done = subprocess.run([sys.executable, "-m", "sage_lightning", "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"sage-lightning": "sage_lightning.report:main"}


def test_the_shipped_summary_is_the_committed_gpu_records():
    # gpu_verify writes both; a record committed without its summary would make every install say "NO".
    record = json.loads(RECORD.read_text())
    assert gpu_record.recorded_summary() == gpu_record.summary_of(record)


def test_the_verification_line_says_yes_only_for_the_recorded_files(tmp_path, monkeypatch):
    summary = gpu_record.recorded_summary()
    monkeypatch.setattr(gpu_record, "installed_digest", lambda: summary["kernels_digest"])
    assert gpu_record.verification_line().startswith("yes: digest ")
    monkeypatch.setattr(gpu_record, "installed_digest", lambda: "0" * 64)
    assert gpu_record.verification_line().startswith("NO: the installed kernels (digest 000000000000)")
    assert gpu_record.recorded_summary(tmp_path / "missing.json") is None
    monkeypatch.setattr(gpu_record, "recorded_summary", lambda: None)
    assert gpu_record.verification_line().startswith("unknown: no GPU-record summary")


def test_the_digest_is_over_paths_and_contents(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    first = gpu_record.digest(gpu_record.kernel_files(tmp_path))
    (tmp_path / "a.py").rename(tmp_path / "b.py")
    assert gpu_record.digest(gpu_record.kernel_files(tmp_path)) != first
    assert list(gpu_record.kernel_files(tmp_path)) == ["b.py"]
