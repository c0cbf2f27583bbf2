"""The Makefile's install: TORCH_SPEC takes pip's arguments (an index too), and a changed torch choice reinstalls.

Run against a stand-in ``python`` that records its pip commands, so nothing is downloaded or installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAKE_PYTHON = """#!/bin/sh
# "-m venv DIR" makes DIR/bin/python (this script); anything else is recorded, one bracketed argument at a time.
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi
for a in "$@"; do printf '[%s]' "$a"; done >> "$LOG"; echo >> "$LOG"
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tmp_path


def make_install(project: Path, *variables: str) -> list[str]:
    """Run ``make install`` with ``variables`` and return the pip commands it ran."""
    log = project / "pip.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(
        ["make", "-s", "install", "PYTHON=./fakepy", *variables],
        cwd=project,
        env={"PATH": "/usr/bin:/bin", "LOG": str(log)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_cpu_build_by_one_variable_with_an_index(project: Path) -> None:
    cpu = "TORCH_SPEC=torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert make_install(project, cpu) == [
        "[-m][pip][install][--force-reinstall][--no-deps][torch==2.13.0][--index-url]"
        "[https://download.pytorch.org/whl/cpu]",
        "[-m][pip][install][torch==2.13.0][--index-url][https://download.pytorch.org/whl/cpu]",
        "[-m][pip][install][-e][.[dev,hf,examples]]",
    ]
    assert make_install(project, cpu) == []  # the same choice again: nothing to do
    assert make_install(project) == []  # no choice: keep the torch .venv has


def test_a_changed_torch_choice_reinstalls(project: Path) -> None:
    assert make_install(project) == ["[-m][pip][install][-e][.[dev,hf,examples]]"]  # pip picks torch
    assert make_install(project, "TORCH_SPEC=torch==2.13.0") == [
        "[-m][pip][install][--force-reinstall][--no-deps][torch==2.13.0]",
        "[-m][pip][install][torch==2.13.0]",
        "[-m][pip][install][-e][.[dev,hf,examples]]",
    ]
    stamp = (project / ".venv" / ".sage-lightning-installed").stat().st_mtime
    os.utime(project / "pyproject.toml", (stamp + 1, stamp + 1))  # a changed project reinstalls it, not torch
    assert make_install(project, "TORCH_SPEC=torch==2.13.0") == ["[-m][pip][install][-e][.[dev,hf,examples]]"]
