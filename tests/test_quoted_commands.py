"""Every command the README, docs/, benchmarks/'s pages and the result files quote runs as written: each
``python -m benchmarks.<area>.<tool>`` (or ``examples.<name>``) answers ``--help``, and a script quoted by its path
exists, unless it is retired (``benchmarks/results/retired.md`` names the commit that holds it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MODULE = re.compile(r"python3? -m ((?:benchmarks|examples)(?:\.\w+)+)")
SCRIPT = re.compile(r"(?:python3?|bash) ((?:benchmarks|examples)/[\w/.-]+\.(?:py|sh))\b")
#: The GPU-verification record is rewritten only by a GPU run; until the next one it names the command of its time.
RECORD = RESULTS / "gpu-verified.json"


def quoting_files() -> list[Path]:
    pages = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").rglob("*.md"))]
    pages += sorted((REPO / "benchmarks").rglob("*.md")) + sorted((REPO / "benchmarks").glob("*.sh"))
    return pages + sorted(RESULTS.glob("*.json"))


def quoted_text(path: Path) -> str:
    """A page's text, or a result file's commands (the header's and its parts')."""
    if path.suffix != ".json":
        return path.read_text()
    commands: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            commands.extend(v for k, v in node.items() if k == "command" and isinstance(v, str))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(path.read_text()))
    return "\n".join(commands)


QUOTES = {path: quoted_text(path) for path in quoting_files()}
QUOTED_MODULES = {module for text in QUOTES.values() for module in MODULE.findall(text)}
#: Quoted modules that ``results/retired.md`` names by their file: their result pages keep the command of their time.
RETIRED_PAGE = (RESULTS / "retired.md").read_text()
RETIRED = {m for m in QUOTED_MODULES if f"`{m.replace('.', '/')}.py`" in RETIRED_PAGE}
MODULES = sorted(QUOTED_MODULES - RETIRED)


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """``python -m <module> --help`` for every quoted module, started side by side, in a user's environment (the
    suite's TRITON_INTERPRET=1 is not one: the compile checks refuse it)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    running = {
        module: subprocess.Popen([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, **pipes)
        for module in MODULES
    }
    done = {}
    for module, process in running.items():
        out, err = process.communicate(timeout=600)
        done[module] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def test_the_pages_quote_the_entry_points() -> None:
    assert {"benchmarks.kernels.gpu_verify", "benchmarks.kernels.speed", "examples.pretrain"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_a_quoted_module_answers_help(module: str, helps: dict[str, subprocess.CompletedProcess]) -> None:
    done = helps[module]
    assert done.returncode == 0 and "usage:" in done.stdout, f"python -m {module} --help:\n{done.stderr[-2000:]}"


def test_a_retired_module_is_gone_from_the_tree() -> None:
    """Retirement exempts a quoted module from answering ``--help`` only once its file has left the tree."""
    assert [m for m in sorted(RETIRED) if (REPO / f"{m.replace('.', '/')}.py").exists()] == []


def test_a_script_quoted_by_its_path_exists_or_is_retired() -> None:
    retired = RETIRED_PAGE
    missing = []
    for path, text in QUOTES.items():
        for script in SCRIPT.findall(text):
            name = script.split("/")[-1]
            if (REPO / script).is_file() or f"`{script}`" in retired or f"`{name}`" in retired or path == RECORD:
                continue
            missing.append(f"{path.relative_to(REPO)}: {script}")
    assert not missing, "quoted scripts that are neither in the tree nor in results/retired.md:\n" + "\n".join(missing)
