"""The GPU-verification record of ``kernels/``: its digest, and what makes a committed record void.

``python -m benchmarks.kernels.gpu_verify`` proves the kernels on an H100 or H200 and writes
``benchmarks/results/gpu-verified.json`` with the digest of every file under ``kernels/``; ``tests/test_gpu_record.py``
recomputes it in CI and fails when the files differ or a check failed: a kernel change lands only with its GPU run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.result_file import REPO, RESULTS
from sage_lightning.gpu_record import SUMMARY, digest, kernel_files, recorded_summary, summary_of

KERNELS = REPO / "kernels"
RECORD = RESULTS / "gpu-verified.json"
#: The checks a record must hold, each passed (``gpu_verify``'s parts).
REQUIRED_CHECKS = ("kernel_tests", "agreement", "accuracy", "training_parity")
#: What to run when the record is void: on a machine with an H100 or H200, from the repository root.
VERIFY_COMMAND = "GIT_COMMIT=$(git rev-parse HEAD) python -m benchmarks.kernels.gpu_verify"


def changed_files(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """``"changed: x"``, ``"added: x"``, ``"removed: x"`` for each file that differs between two listings."""
    lines = [f"changed: {p}" for p in recorded if p in current and recorded[p] != current[p]]
    lines += [f"added: {p}" for p in current if p not in recorded]
    lines += [f"removed: {p}" for p in recorded if p not in current]
    return lines


def check_record(record_path: Path = RECORD, kernels: Path = KERNELS) -> list[str]:
    """What voids the record for the kernels at ``kernels``; an empty list when the record vouches for them."""
    how = f"Run `{VERIFY_COMMAND}` on an H100 or H200 and commit {RECORD.relative_to(REPO)}."
    try:
        record: dict[str, Any] = json.loads(record_path.read_text())
    except FileNotFoundError:
        return [f"no GPU-verification record at {record_path}. {how}"]
    except (OSError, ValueError) as error:
        return [f"the GPU-verification record {record_path} is unreadable ({error}). {how}"]
    problems = []
    current = kernel_files(kernels)
    if record.get("kernels_digest") != digest(current):
        changes = changed_files(record.get("kernels_files", {}), current) or ["(the digest differs)"]
        problems.append(
            f"kernels/ differs from the files verified on the GPU ({record.get('device')}, {record.get('date')}, "
            f"commit {str(record.get('commit'))[:12]}):\n  " + "\n  ".join(changes) + f"\n{how}"
        )
    checks = {check.get("name"): check for check in record.get("checks", [])}
    for name in REQUIRED_CHECKS:
        if name not in checks:
            problems.append(f"the GPU-verification record has no {name!r} check. {how}")
        elif checks[name].get("passed") is not True:
            problems.append(f"the GPU-verification record's {name!r} check failed: {checks[name].get('summary')}")
    if record.get("passed") is not True and not problems:
        problems.append(f"the GPU-verification record says it did not pass. {how}")
    if record_path == RECORD and recorded_summary() != summary_of(record):
        problems.append(f"{SUMMARY.relative_to(REPO)} is not the record's summary: run python -m {__spec__.name}")
    return problems


def main(argv: list[str] | None = None) -> None:
    """After a new record is committed: write its summary into the package (what ``python -m sage_lightning``
    compares the installed kernels with), then list what still voids the record."""
    argparse.ArgumentParser(description=main.__doc__).parse_args(argv)
    SUMMARY.write_text(json.dumps(summary_of(json.loads(RECORD.read_text())), indent=2) + "\n")
    print(f"wrote {SUMMARY.relative_to(REPO)}", *check_record(), sep="\n")


if __name__ == "__main__":
    main()
