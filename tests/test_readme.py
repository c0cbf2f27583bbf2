"""The README (and the docs pages it sends to) as a user reads them: examples run, commands run as written, the
figures match the committed results they name, and every link leads somewhere."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from benchmarks.training import readme_perf

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """The commands of a shell block: comments dropped, continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_the_two_commands() -> None:
    first_block = blocks(README, "bash")[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]


def test_readme_states_the_two_lines() -> None:
    (example,) = blocks(README, "python")
    assert re.search(r"class \w+\(SageAttentionMixin, L\.LightningModule\)", example)
    assert "callbacks=[AdaptivePrecision()]" in example


def test_the_two_lines_say_what_ran_and_not_what_lightning_tells_everyone(
    caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    """The README's snippet ends with the one line that shows SageBwd ran; Lightning's litlogger tip and its LeafSpec
    deprecation warning (nothing a user can act on) are gone."""
    import logging

    from sage_lightning import console

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)  # as in a fresh process: no filter from an earlier test
        for dropped in [f for f in logger.filters if isinstance(f, console._DropLitLoggerTip)]:
            logger.removeFilter(dropped)
    (example,) = blocks(README, "python")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        exec(compile(example, str(README), "exec"), {})
    printed = [record.getMessage() for record in caplog.records]
    summary = "AdaptivePrecision: 1 of 1 attention layer ran SageBwd (4 calls, none sent to SDPA), 0 decisions, "
    assert [line for line in printed if line.startswith(summary)], printed
    assert not [line for line in printed if "litlogger" in line]
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]


@pytest.mark.parametrize("page", [README, DOCS / "usage.md"], ids=lambda p: p.name)
def test_python_examples_run(page: Path) -> None:
    found = blocks(page, "python")
    assert found
    for block in found:
        exec(compile(block, str(page), "exec"), {})


@pytest.mark.parametrize("page", [README, DOCS / "example.md"], ids=lambda p: p.name)
def test_shell_commands_run_as_written_after_make(page: Path) -> None:
    """Every ``bash`` command is a make target or a program in .venv/bin (``sh`` blocks are for other projects)."""
    targets = set(re.findall(r"(?m)^([a-z]+):", (REPO / "Makefile").read_text()))
    venv_bin = Path(sys.executable).parent  # .venv/bin under `make test`
    found = [command for block in blocks(page, "bash") for command in commands(block)]
    assert found
    for command in found:
        words = shlex.split(command)
        if words[0] == "make":
            assert words[1] in targets, command
            continue
        assert words[0].startswith(".venv/bin/"), f"{command!r}: not runnable without activating .venv"
        assert (venv_bin / words[0].removeprefix(".venv/bin/")).is_file(), command
        for word in words[1:]:
            if re.fullmatch(r"(examples|benchmarks)/[\w/.-]+\.(py|yaml)", word):
                assert (REPO / word).is_file(), f"{command!r}: {word} does not exist"


def test_the_install_lines_name_this_package_the_same_everywhere() -> None:
    """README and docs/usage.md give the same install commands (no published package), for this project's name and
    extras, in pip's requirement syntax."""
    pyproject = (REPO / "pyproject.toml").read_text()
    name = re.search(r'(?m)^name = "([^"]+)"', pyproject).group(1)
    extras_table = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"(?m)^(\w+) = \[", extras_table))
    installs = {}
    for page in (README, DOCS / "usage.md"):
        installs[page.name] = [b for b in blocks(page, "sh") if "pip install" in b]
        assert len(installs[page.name]) == 1, f"{page.name}: one install block"
    assert installs["README.md"] == installs["usage.md"]
    requirements = re.findall(r'pip install "([^"]+)"', installs["README.md"][0])
    assert len(requirements) == 2
    from_git, from_clone = requirements
    match = re.fullmatch(r"([\w-]+)\[(\w+)\] @ git\+<repository URL>", from_git)  # PEP 508: name[extra] @ url
    assert match and match.group(1) == name and match.group(2) in extras, from_git
    match = re.fullmatch(r"/path/to/([\w-]+)\[(\w+)\]", from_clone)
    assert match and match.group(1) == name and match.group(2) in extras, from_clone
    assert "pip install sage-lightning" not in README.read_text()  # not on PyPI


def test_every_link_leads_to_a_file() -> None:
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}, which is missing"


def _speed_ratios(data: dict) -> tuple[float, float]:
    rows = {(r["impl"], r["pass"], r["head_dim"], r["seq"], r["causal"]): r for r in data["rows"] if "pass" in r}
    ratios = [
        rows[("sdpa_cudnn", *key[1:])]["ms"] / row["ms"] for key, row in rows.items() if key[:2] == ("sage", "fwd+bwd")
    ]
    return min(ratios), max(ratios)


def _final_val_loss(data: dict, attention: str) -> float:
    rows = [row for row in data["rows"] if row["attention"] == attention and row.get("val_loss") is not None]
    return max(rows, key=lambda row: row["step"])["val_loss"]


def test_performance_line_matches_the_files_it_links() -> None:
    text = (DOCS / "performance.md").read_text()
    line = text.split("<!-- perf-line:", 1)[1].split("\n\n", 1)[0]
    speed_name = re.search(r"\(\.\./(benchmarks/results/speed-[^)]+\.json)\)", line).group(1)
    training_name = re.search(r"\(\.\./(benchmarks/results/training-[^)]+\.json)\)", line).group(1)
    latest_speed, _ = readme_perf.latest("speed-*.json", keep=readme_perf.is_speed_run)
    assert Path(speed_name).name == latest_speed.name, "the performance line names an older speed result"

    low, high = _speed_ratios(json.loads((REPO / speed_name).read_text()))
    assert f"at {low:.2f}-{high:.2f}x the speed of SDPA's cuDNN backend" in line
    training = json.loads((REPO / training_name).read_text())
    speed = {run["attention"]: run["tokens_per_s"] for run in training["summary"]}
    assert f"at {speed['sage'] / speed['full']:.2f}x the tokens per second" in " ".join(line.split())
    sage, full = _final_val_loss(training, "sage"), _final_val_loss(training, "full")
    assert f"to a validation loss of {sage:.3f} against {full:.3f}" in " ".join(line.split())


def test_example_training_table_matches_its_file() -> None:
    text = (DOCS / "example.md").read_text()
    name = re.search(r"\(\.\./(benchmarks/results/training-h[0-9]+-[^)]+-small\.json)\)", text).group(1)
    summary = {run["attention"]: run for run in json.loads((REPO / name).read_text())["summary"]}
    for label, attention in (("SageBwd", "sage"), ("full precision", "full")):
        assert f"| {label} | {summary[attention]['tokens_per_s']:,.0f} |" in text


def test_the_readme_speed_line_is_the_performance_pages() -> None:
    """The README's one honest line repeats docs/performance.md's figures (which the test above checks)."""
    perf = " ".join((DOCS / "performance.md").read_text().split("<!-- perf-line:", 1)[1].split("\n\n", 1)[0].split())
    line = " ".join(README.read_text().split("<!-- speed-line:", 1)[1].split("\n\n", 1)[0].split())
    ratios = re.search(r"at (\d\.\d\d-\d\.\d\d)x the speed of SDPA's cuDNN backend", perf).group(1)
    assert f"forward+backward runs at {ratios}x PyTorch's cuDNN attention" in line
    losses = re.search(r"to a validation loss of (\d\.\d+) against (\d\.\d+)", perf).groups()
    assert f"validation loss of {losses[0]} against full precision's {losses[1]}" in line
    assert "(docs/performance.md)" in line


def test_the_first_screen_shows_the_two_lines_in_short_paragraphs() -> None:
    first = README.read_text().splitlines()[:40]
    text = "\n".join(first)
    assert "class LM(SageAttentionMixin, L.LightningModule)" in text
    assert "callbacks=[AdaptivePrecision()]" in text
    paragraph = 0
    for line in first:
        paragraph = paragraph + 1 if line.strip() and not line.startswith(("#", "```")) else 0
        assert paragraph <= 8, f"a paragraph of more than 8 lines in the README's first 40 lines, at {line!r}"
