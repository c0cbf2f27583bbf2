"""Kernel work parked in ``benchmarks/pending/`` (patches waiting for a device session) still applies to main.

A parked patch that no longer applies costs a device session its first call; this finds it on the CPU, when main
changes under it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCHES = sorted((REPO / "benchmarks" / "pending").glob("*.patch"))


def test_every_parked_patch_is_listed_in_the_pending_readme() -> None:
    readme = (REPO / "benchmarks" / "pending" / "README.md").read_text()
    assert [p.name for p in PATCHES if f"`{p.name}`" not in readme] == []


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patches")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_parked_patch_applies_to_this_tree(patch: Path) -> None:
    done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr}"


def test_the_device_script_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "pending" / "check_patch.sh")], check=True)
