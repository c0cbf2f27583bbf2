"""The controller keeps its parts apart (issue 41): the callback is a thin Lightning adapter, hooks only; the step
pipeline, the executor and the checks have modules of their own; only the policy authors decisions."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sage_lightning"


def test_the_callback_stays_a_thin_adapter() -> None:
    lines = len((PACKAGE / "callback.py").read_text().splitlines())
    assert lines <= 450, f"callback.py has {lines} lines: the pipeline, executor or checks belong in their modules"
    for part in ("pipeline.py", "executor.py", "checks.py"):
        assert (PACKAGE / part).is_file(), part


def test_only_the_policy_authors_decisions() -> None:
    authored = re.compile(r"\bDecision\((?!\*\*)")  # Decision(**saved) restores a checkpoint's, it authors nothing
    found = [
        path.relative_to(PACKAGE)
        for path in sorted(PACKAGE.rglob("*.py"))
        if "policy" not in path.relative_to(PACKAGE).parts and authored.search(path.read_text())
    ]
    assert not found, f"decisions authored outside sage_lightning/policy: {found}"
