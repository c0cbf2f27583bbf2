"""The README's performance table, generated from the latest committed speed result (and end-to-end training run).

It rewrites README.md between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->`` from the ``speed-*.json``
(not ``diagnostic``) whose commit is the newest in this repository's history (else by ``date``) and the latest
``training-*-e2e*.json``: ratios to SDPA's backends of the same run, against issue #4's bars.

Example::

    python -m benchmarks.training.readme_perf            # rewrite README.md's table
    python -m benchmarks.training.readme_perf --check    # exit 1 when README.md's table is not the generated one
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.result_file import REPO, RESULTS
from benchmarks.training import results_doc  # the evidence page's table of a speed group, tokens/s and peak memory

README = REPO / "README.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
#: Issue #4's bars: SageBwd over SDPA cuDNN.
FWD_BAR, FWD_BWD_BAR = 1.7, 1.3


def _commit_time(sha: str) -> int | None:
    """Committer time of ``sha`` in this repository, or ``None`` when git does not know it."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "show", "-s", "--format=%ct", sha], capture_output=True, text=True, check=False
    )
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else None


def _recency(path: Path, header: dict) -> tuple:
    """Sort key: newest measured commit first, then date, then name (so ties resolve the same way everywhere)."""
    when = _commit_time(header.get("commit", "")) if header.get("commit") else None
    return (header.get("date", ""), when or 0, path.name)


def latest(pattern: str, results: Path = RESULTS, keep: object = None) -> tuple[Path, dict] | None:
    """The latest result file matching ``pattern`` (a glob in ``results``) whose JSON passes ``keep``."""
    found = []
    for path in results.glob(pattern):
        data = json.loads(path.read_text())
        if keep is None or keep(data):
            found.append((_recency(path, data), path, data))
    if not found:
        return None
    _, path, data = max(found, key=lambda item: item[0])
    return path, data


def is_speed_run(data: dict) -> bool:
    """A ``kernels.speed`` result of main's code: speed rows with ``pass``, SageBwd and SDPA's cuDNN and flash
    backends all timed (the table's columns) at heads of 64 and 128 (its rows; a run of one kernel's head dim, kept
    for a note, is not), and not marked ``diagnostic`` (a run of code that is not main's, kept for a note)."""
    rows = [row for row in data.get("rows", []) if "pass" in row]
    impls, dims = {row.get("impl") for row in rows}, {row.get("head_dim") for row in rows}
    full = {"sage", "sdpa_cudnn", "sdpa_flash"} <= impls and {64, 128} <= dims
    return data.get("kind") == "speed" and full and not data.get("diagnostic")


def speed_table(path: Path, data: dict) -> list[str]:
    """Markdown lines: one row per (D, N, causal) of the file, SageBwd against cuDNN and flash."""
    rows = {
        (r["impl"], r["pass"], r["head_dim"], r["seq"], r["causal"]): r for r in data["rows"] if "pass" in r
    }  # fmt: skip
    shapes = sorted({key[2:] for key in rows if key[0] == "sage"})
    lines = [
        f"{data['device']}, {data['date']}, commit `{data['commit'][:10]}`, "
        f"[{path.name}](benchmarks/results/{path.name}) (`{data['command']}`). bf16 inputs, "
        f"{_tokens(data)} tokens per call; TFLOPS of the median time; ratios over SDPA in the same run "
        f"(bars: forward {FWD_BAR}x cuDNN, forward+backward {FWD_BWD_BAR}x).",
        "",
        "| D | N | causal | SageBwd fwd TFLOPS | fwd / cuDNN | fwd / flash | SageBwd fwd+bwd TFLOPS "
        "| fwd+bwd / cuDNN | fwd+bwd / flash | peak MiB SageBwd / cuDNN |",
        "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for head_dim, seq, causal in shapes:
        cells = []
        for pass_ in ("fwd", "fwd+bwd"):
            sage = rows.get(("sage", pass_, head_dim, seq, causal))
            cudnn = rows.get(("sdpa_cudnn", pass_, head_dim, seq, causal))
            flash = rows.get(("sdpa_flash", pass_, head_dim, seq, causal))
            cells.append(f"{sage['tflops']:.0f}" if sage else "")
            cells.append(f"{cudnn['ms'] / sage['ms']:.2f}" if sage and cudnn else "")
            cells.append(f"{flash['ms'] / sage['ms']:.2f}" if sage and flash else "")
        both = [rows.get((impl, "fwd+bwd", head_dim, seq, causal)) for impl in ("sage", "sdpa_cudnn")]
        peaks = [r.get("peak_mem_mb") if r else None for r in both]
        cells.append(" / ".join(f"{p:.0f}" for p in peaks) if None not in peaks else "")
        lines.append(f"| {head_dim} | {seq} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
    return lines


def _tokens(data: dict) -> str:
    sage = next(r for r in data["rows"] if r.get("impl") == "sage" and "pass" in r)
    return f"{sage['batch'] * sage['seq']:,}".replace(",", " ") if sage["batch"] * sage["seq"] else "?"


def e2e_lines(results: Path = RESULTS) -> list[str]:
    """Markdown lines for the end-to-end training throughput, or a line saying it is not measured yet."""
    found = latest("training-*-e2e*.json", results)
    if found is None:
        return [
            "End-to-end training throughput of the example model at sequence 4096 against SDPA cuDNN: not measured "
            "yet (`benchmarks/gpu_evidence.sh`, its group e2e-seq4096)."
        ]
    path, data = found
    lines = [
        f"End to end ({data['device']}, {data['date']}, commit `{data['commit'][:10]}`, "
        f"[{path.name}](benchmarks/results/{path.name}), `{data['command']}`):",
        "",
    ]
    return lines + results_doc.speed_table(data)


def generate(results: Path = RESULTS) -> str:
    """The text that goes between the README's markers."""
    found = latest("speed-*.json", results, keep=is_speed_run)
    lines = [f"<!-- generated by python -m {__spec__.name} from benchmarks/results/; do not edit by hand -->", ""]
    lines += speed_table(*found) if found else ["No speed result committed yet (`python -m benchmarks.kernels.speed`)."]
    lines += [""] + e2e_lines(results)
    return "\n".join(lines) + "\n"


def replace_between_markers(readme: str, text: str) -> str:
    """``readme`` with what lies between the markers replaced by ``text``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ValueError(f"README.md must hold one {START} ... {END} pair, in that order")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{text}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) README.md's performance table; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's table is out of date")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results must be a folder of result files; received {str(args.results)!r}")
    current = README.read_text()
    wanted = replace_between_markers(current, generate(args.results))
    if args.check:
        if wanted != current:
            print(f"{README} is out of date: run python -m benchmarks.training.readme_perf", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
