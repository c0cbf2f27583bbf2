"""The GPU gate: ``kernels/`` must be the files that ``benchmarks.kernels.gpu_verify`` proved on a GPU, every check
passed.

The interpreter passed a backward whose dV was wrong on every H100 and H200 (0fd6d4e); from then on a change to
``kernels/`` lands only with the GPU-verification record of the same files (``benchmarks/results/gpu-verified.json``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.kernels.gpu_record import KERNELS, RECORD, REQUIRED_CHECKS, VERIFY_COMMAND, check_record

REPO = Path(__file__).resolve().parent.parent


def test_kernels_are_the_files_verified_on_the_gpu():
    problems = check_record()
    assert not problems, "\n".join(problems)


def test_the_record_shows_what_it_proved():
    record = json.loads(RECORD.read_text())
    assert record["passed"] is True and ("H100" in record["device"] or "H200" in record["device"])
    checks = {check["name"]: check for check in record["checks"]}
    assert set(REQUIRED_CHECKS) <= set(checks)
    assert checks["kernel_tests"]["failed_tests"] == [] and checks["kernel_tests"]["tests"] > 50
    # The dV that 0fd6d4e broke, against float64, N=4096, D=128 (issue #13's acceptance).
    assert checks["accuracy"]["cos"]["smooth_k=True"]["dV"] >= 0.999
    assert abs(checks["training_parity"]["gap"]) <= checks["training_parity"]["tolerance"]
    assert all(row["passed"] for row in record["rows"]) and len(record["rows"]) >= 600


def _copy_kernels(tmp_path: Path) -> Path:
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return copy


def test_one_changed_byte_in_kernels_voids_the_record(tmp_path):
    kernels = _copy_kernels(tmp_path)
    target = kernels / "backward.py"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    problems = check_record(RECORD, kernels)
    assert len(problems) == 1
    assert "changed: backward.py" in problems[0] and VERIFY_COMMAND in problems[0]


def test_a_file_added_or_removed_voids_the_record(tmp_path):
    kernels = _copy_kernels(tmp_path)
    (kernels / "forward.py").unlink()
    (kernels / "hopper.py").write_text("# new\n")
    (kernels / "__pycache__").mkdir()
    (kernels / "__pycache__" / "ops.cpython-311.pyc").write_bytes(b"\0")  # byte-code is not source: ignored
    (problem,) = check_record(RECORD, kernels)
    assert "removed: forward.py" in problem and "added: hopper.py" in problem and ".pyc" not in problem


def test_a_failed_or_missing_check_voids_the_record(tmp_path):
    record = json.loads(RECORD.read_text())
    record["checks"][0]["passed"] = False
    record["checks"] = record["checks"][:-1]
    path = tmp_path / "gpu-verified.json"
    path.write_text(json.dumps(record))
    problems = check_record(path)
    assert any(f"{REQUIRED_CHECKS[0]!r} check failed" in p for p in problems)
    assert any(f"no {REQUIRED_CHECKS[-1]!r} check" in p for p in problems)


def test_a_missing_or_unreadable_record_is_named(tmp_path):
    assert "no GPU-verification record" in check_record(tmp_path / "none.json")[0]
    (tmp_path / "bad.json").write_text("{")
    assert "unreadable" in check_record(tmp_path / "bad.json")[0]


def test_gpu_verify_refuses_bad_limits_by_name(capsys):
    from benchmarks.kernels.gpu_verify import TIME_LIMIT_S, parse_args

    assert parse_args([]).time_limit == TIME_LIMIT_S
    assert parse_args(["--time-limit", "800"]).time_limit == 800
    for argv in (["--time-limit", "30"], ["--test-workers", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--time-limit (>= 60 s)" in capsys.readouterr().err
