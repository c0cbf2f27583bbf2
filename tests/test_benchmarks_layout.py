"""benchmarks/ stays a package of focused tools (issue 39): no path edits, no private imports, within its budget."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"


def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]


def test_no_file_edits_the_import_path() -> None:
    edit = re.compile("sys" + r"\.path\b")  # spelled in two parts: this file names it without using it
    found = [p.relative_to(REPO) for p in python_files("benchmarks", "examples", "tests") if edit.search(p.read_text())]
    assert not found, f"the import path is edited in {found}: run tools as python -m from the repository root instead"


def test_no_module_imports_another_ones_private_names() -> None:
    private = re.compile(r"^\s*from (?:benchmarks|examples)\.[\w.]+ import [^\n]*\b_[a-z]\w*", re.M)
    found = [
        p.relative_to(REPO) for p in python_files("benchmarks", "examples", "tests") if private.search(p.read_text())
    ]
    assert not found, f"private names imported in {found}"


def test_benchmarks_stays_within_its_budget() -> None:
    lengths = {p.relative_to(REPO): len(p.read_text().splitlines()) for p in python_files("benchmarks")}
    assert max(lengths.values()) <= 500, sorted(lengths.items(), key=lambda item: -item[1])[:3]
    assert sum(lengths.values()) <= 5500, sum(lengths.values())
    assert len((BENCHMARKS / "NOTES.md").read_text().splitlines()) <= 400
