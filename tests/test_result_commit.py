"""The commit a result file records (``benchmarks.result_file.commit``): ``$GIT_COMMIT`` first, else HEAD, marked
``+dirty`` when the tracked files differ from it (a device copy once carried a stale ``.git`` and every file
written there named the wrong commit)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import result_file

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git reads the commit")


def _repo(tmp_path: Path) -> str:
    run = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    run("add", "a.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return run("rev-parse", "HEAD").stdout.strip()


def test_the_environment_names_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert result_file.commit() == "abc1234"


@needs_git
def test_head_is_marked_dirty_when_tracked_files_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sha = _repo(tmp_path)
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.setattr(result_file, "REPO", tmp_path)
    (tmp_path / "untracked.txt").write_text("not part of the code\n")
    assert result_file.commit() == sha
    (tmp_path / "a.txt").write_text("two\n")
    assert result_file.commit() == sha + "+dirty"


def test_no_repository_gives_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.setattr(result_file, "REPO", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert result_file.commit() == "unknown"
