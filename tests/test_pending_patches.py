"""Kernel work parked in ``benchmarks/pending/`` (patches waiting for a device session) still applies to main.

A parked patch that no longer applies costs a device session its first call; this finds it on the CPU, when main
changes under it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
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


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patches")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_parked_patch_applied_passes_the_linter(patch: Path, tmp_path: Path) -> None:
    """CI lints the tree: a parked patch, once applied, must not be what fails it (the files it touches, patched in a
    copy, under the repository's ruff settings)."""
    pytest.importorskip("ruff")  # the linter CI runs, from the dev extra
    numstat = subprocess.run(["git", "apply", "--numstat", str(patch)], cwd=REPO, capture_output=True, text=True)
    files = [line.split("\t")[-1] for line in numstat.stdout.splitlines()]
    for name in files:
        if (REPO / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, tmp_path / name)
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True, capture_output=True)
    python = [p for p in files if p.endswith(".py") and (tmp_path / p).is_file()]
    config = ["--config", str(REPO / "pyproject.toml")]
    for check in (["check", *config], ["format", "--check", *config]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *check, *python], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, (
            f"{patch.name}, applied: ruff {check[0]}:\n{done.stdout[-3000:]}{done.stderr[-1000:]}"
        )
