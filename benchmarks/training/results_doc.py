"""docs/results.md from the committed result files: issue #7's evidence, every figure traced to its JSON and command.

Reads, in ``--results`` (default ``benchmarks/results``):

* ``training-*.json`` written by ``pretrain_compare``: the groups of ``--matrix evidence`` (their header
  has ``matrix``; the newest file of each group is used) and the earlier comparisons run on a GPU;
* ``accuracy-*-activations.json`` written by ``attribution``: the per-tensor error of INT8 attention on
  activations captured from a trained checkpoint (rows with ``layer`` and ``inputs`` starting ``activations``);
* ``accuracy-*.json`` of the accuracy harness, for the synthetic-input context of the error attribution.

Draws the figures into ``--images`` (default ``docs/images/results``) with matplotlib where it is installed
(``pip install "sage-lightning[plots]"``; without it the page is written with the tables and says the figures are
missing) and writes ``--doc`` (default ``docs/results.md``): loss curves per group, final validation losses against
full precision with the spread of two full-precision seeds as the noise floor, the controller's record, tokens/s
and peak memory, and the findings set against the SageBwd study's. Every figure and table names the JSON it comes
from and the command that made it (the JSON's header). What has not been measured says so; nothing is filled in.

Only the standard library and matplotlib: no torch, so it runs anywhere the repository is checked out.

Example::

    python -m benchmarks.training.results_doc
    python -m benchmarks.training.results_doc --tracked-only   # only what git tracks: what a commit links to
    python -m benchmarks.training.results_doc --results /tmp/out --doc /tmp/results.md --images /tmp/images
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.result_file import REPO, RESULTS

#: The groups of ``pretrain_compare.py --matrix evidence`` (``evidence_groups`` at its default sizes), in order,
#: with the question each answers. ``tests/test_results_doc.py`` checks the names against the runner's.
EVIDENCE_GROUPS: dict[str, str] = {
    "large-qknorm": "large tokens per step, QK-norm: does SageBwd lag full precision where the study found it did?",
    "small-qknorm": "small tokens per step, QK-norm: does SageBwd match full precision with fewer tokens per step?",
    "large-no-qknorm": "large tokens per step without QK-norm: is QK-norm needed for stability?",
    "e2e-seq4096": "speed at sequence 4096 (issue #4): end-to-end tokens/s and peak memory against SDPA cuDNN",
}
#: How the runs of a group are told apart (from their ``runs`` entry), and how the page names them.
ROLES: dict[str, str] = {
    "full": "full precision",
    "full_seed_b": "full precision, second seed",
    "sage_fixed": "SageBwd fixed (INT8 dS, K-smoothing, no Q-smoothing)",
    "sage_controller": "SageBwd with the controller",
    "sage_no_smooth_k": "SageBwd fixed, K-smoothing off",
    "full_cudnn": "full precision, SDPA cuDNN",
    "full_flash": "full precision, SDPA flash",
}
_COLORS = {
    "full": "black",
    "full_seed_b": "0.55",
    "sage_fixed": "tab:blue",
    "sage_controller": "tab:orange",
    "sage_no_smooth_k": "tab:red",
}
_DECISION = re.compile(
    r"^step (?P<step>\d+): (?P<layer>\S+) (?P<lever>[\w_]+): (?P<old>.*?) -> (?P<new>.*?) \((?P<reason>.*)\)$"
)
#: The command that regenerates this page, and the one that makes the matrix on a GPU.
REGENERATE = "python -m benchmarks.training.results_doc"
GPU_COMMAND = "GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_evidence.sh"


# ------------------------------------------------------------------------------------------------------- reading


def rows_by_run(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A training result's rows by run, each run's sorted by step.

    Files with a ``runs`` list (``pretrain_compare.py`` since the matrix) name each run in the rows' ``run``; in
    older files ``run`` is the file's tag and the attention tells the runs apart.
    """
    key = "run" if "runs" in result else "attention"
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in result.get("rows", []):
        runs.setdefault(row[key], []).append(row)
    return {name: sorted(rows, key=lambda r: r["step"]) for name, rows in runs.items()}


def summaries_by_run(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A training result's ``summary`` entries by run name (the attention in older files)."""
    return {s.get("run", s.get("attention")): s for s in result.get("summary", [])}


def roles(result: dict[str, Any]) -> dict[str, str]:
    """``{role: run name}`` for the runs of a matrix group (keys of :data:`ROLES`), from the runs' settings."""
    found: dict[str, str] = {}
    for spec in result.get("runs", []):
        attention, backend = spec.get("attention"), spec.get("sdpa_backend") or "default"
        if attention == "full":
            role = {"cudnn": "full_cudnn", "flash": "full_flash"}.get(backend)
            role = role or ("full_seed_b" if spec.get("seed") is not None else "full")
        elif attention == "sage" and spec.get("smooth_q") is None and spec.get("seed") is None:
            if spec.get("smooth_k") is False:
                role = "sage_no_smooth_k" if spec.get("controller") is False else None
            else:
                role = "sage_controller" if spec.get("controller") else "sage_fixed"
        else:
            role = None
        if role is not None:
            found.setdefault(role, spec["name"])
    return found


def val_points(rows: Sequence[dict[str, Any]]) -> dict[int, float]:
    """``{step: validation loss}`` of one run's rows."""
    return {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}


def final_val(result: dict[str, Any], run: str, other: str | None = None) -> tuple[int, float] | None:
    """``(step, validation loss)`` at the last validation of ``run`` (and of ``other`` too, when given)."""
    runs = rows_by_run(result)
    mine = val_points(runs.get(run, []))
    steps = set(mine) & set(val_points(runs.get(other, []))) if other is not None else set(mine)
    finite = [s for s in steps if math.isfinite(mine[s])]
    return (max(finite), mine[max(finite)]) if finite else None


def difference(result: dict[str, Any], run: str, reference: str) -> tuple[int, float] | None:
    """``(step, val(run) - val(reference))`` at the last validation both ran."""
    point = final_val(result, run, reference)
    if point is None:
        return None
    step, value = point
    return step, value - val_points(rows_by_run(result)[reference])[step]


def noise_floor(result: dict[str, Any]) -> tuple[int, float] | None:
    """``(step, |val(full) - val(full, second seed)|)``: the spread of two full-precision seeds, or ``None``."""
    found = roles(result)
    if "full" not in found or "full_seed_b" not in found:
        return None
    point = difference(result, found["full_seed_b"], found["full"])
    return None if point is None else (point[0], abs(point[1]))


def decision_records(result: dict[str, Any], run: str) -> list[dict[str, Any]]:
    """The run's decisions as records (``step``, ``layer``, ``lever``, ``old``, ``new``, ``reason``).

    Read from ``decision_log``, or parsed from the text of ``decisions`` in files written before it existed.
    """
    if run in result.get("decision_log", {}):
        return list(result["decision_log"][run])
    records = []
    for text in result.get("decisions", {}).get(run, []):
        match = _DECISION.match(text)
        records.append(
            {**match.groupdict(), "step": int(match["step"])}
            if match
            else {"step": None, "layer": None, "lever": "", "old": "", "new": "", "reason": text}
        )
    return records


def tracked_files(folder: Path) -> set[str]:
    """Names of the files in ``folder`` that git tracks (committed or staged)."""
    done = subprocess.run(["git", "ls-files", "-z", "."], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"results_doc.py: error: --tracked-only needs a git checkout; {folder}: {done.stderr.strip()}")
    return {Path(name).name for name in done.stdout.split("\0") if name}


def load(folder: Path, only: set[str] | None = None) -> dict[str, Any]:
    """The result files the page is made of."""
    matrix: dict[str, tuple[Path, dict[str, Any]]] = {}
    found: dict[str, list[tuple[Path, dict[str, Any]]]] = {
        "earlier": [],
        "activations": [],
        "synthetic": [],
        "smoothing": [],
    }
    for path in sorted(folder.glob("*.json")):
        if only is not None and path.name not in only:
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        kind, rows = result.get("kind"), result.get("rows", [])
        if result.get("diagnostic"):  # a run of code that is not main's (e.g. a known-broken kernel), kept for a note
            continue
        if kind == "training" and result.get("matrix"):
            group = result["matrix"]["group"]
            if group not in matrix or (result["date"], path.name) >= (matrix[group][1]["date"], matrix[group][0].name):
                matrix[group] = (path, result)
        elif kind == "training" and "summary" in result and result.get("device") != "cpu":
            found["earlier"].append((path, result))
        elif kind != "accuracy":
            continue
        elif any(str(r.get("inputs", "")).startswith("activations") for r in rows):
            found["activations"].append((path, result))
        elif any(r.get("label") == "smooth_q" for r in rows):
            found["smoothing"].append((path, result))
        elif any(r.get("path") == "triton" and r.get("setting") == "sagebwd:int8=ds;smooth_k" for r in rows):
            found["synthetic"].append((path, result))
    # The current kernels' file last: ``-triton`` before superseded ``-triton-v1``-style files of the same date.
    found["synthetic"].sort(key=lambda item: (item[1].get("date", ""), item[0].stem.endswith("-triton")))
    return {"matrix": matrix, **found}


# ------------------------------------------------------------------------------------------------------ plotting


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_group(result: dict[str, Any], path: Path) -> bool:
    """Loss curves of every run of a group against tokens seen (left), and each run's validation loss minus full
    precision's with the two seeds' spread shaded (right). ``False`` where matplotlib is missing.
    """
    plt = _pyplot()
    if plt is None:
        return False
    runs, found = rows_by_run(result), roles(result)
    role_of = {name: role for role, name in found.items()}
    figure, (loss_axis, diff_axis) = plt.subplots(1, 2, figsize=(12, 4.2))
    full = found.get("full") or ("full" if "full" in runs else "")  # older files: the run named full
    reference = val_points(runs.get(full, []))
    for name, rows in runs.items():
        color = _COLORS.get(role_of.get(name, ""), None)
        train = [(r["tokens_seen"] / 1e6, r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        val = [(r["tokens_seen"] / 1e6, r["val_loss"], r["step"]) for r in rows if r.get("val_loss") is not None]
        if train:
            (line,) = loss_axis.plot(*zip(*train, strict=True), linewidth=0.8, alpha=0.45, color=color)
            color = line.get_color()
        if val:
            xs, ys, _ = zip(*val, strict=True)
            loss_axis.plot(xs, ys, "o-", markersize=3, color=color, label=f"{name} (val)")
            diffs = [(x, y - reference[s]) for x, y, s in val if s in reference and name != full]
            if diffs:
                diff_axis.plot(*zip(*diffs, strict=True), "o-", markersize=3, color=color, label=name)
    seed_b = val_points(runs.get(found.get("full_seed_b", ""), []))
    band = sorted(
        (runs_tokens(runs, found["full"], s), abs(seed_b[s] - reference[s])) for s in seed_b if s in reference
    )
    if band:
        xs, spread = zip(*band, strict=True)
        diff_axis.fill_between(xs, [-v for v in spread], spread, color="0.85", label="|full - full seed 2|")
    diff_axis.axhline(0.0, color="black", linewidth=0.8)
    loss_axis.set(
        xlabel="tokens seen (millions)", ylabel="loss (nats per token)", title="training (thin) and validation"
    )
    diff_axis.set(xlabel="tokens seen (millions)", ylabel="val loss - full precision's", title="difference to full")
    # The first quarter of a run falls far above the rest: scale the axis to where the runs separate.
    last = max((r["tokens_seen"] for rows in runs.values() for r in rows), default=0)
    tail = [
        r[key]
        for rows in runs.values()
        for r in rows
        for key in ("train_loss", "val_loss")
        if r.get(key) is not None and math.isfinite(r[key]) and r["tokens_seen"] >= 0.25 * last
    ]
    if tail:
        low, high = min(tail), max(tail)
        loss_axis.set_ylim(low - 0.05 * (high - low) - 1e-3, high + 0.05 * (high - low) + 1e-3)
    for axis in (loss_axis, diff_axis):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    title = result.get("matrix", {}).get("title") or Path(result.get("config", "")).name
    figure.suptitle(
        textwrap.fill(f"{title} - {result['device']}, {result['date']}, commit {result['commit']}", 150), fontsize=9
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def runs_tokens(runs: dict[str, list[dict[str, Any]]], run: str, step: int) -> float:
    """Millions of tokens ``run`` had seen at ``step``."""
    return next(r["tokens_seen"] for r in runs[run] if r["step"] == step) / 1e6


# ------------------------------------------------------------------------------------------------------- writing


def _f(value: float | None, digits: int = 4, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a" if value is not None else ""
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _speed(tokens_per_s: float | None) -> str:
    return "" if tokens_per_s is None else f"{tokens_per_s:,.0f}"


def _tokens(count: float) -> str:
    """``12.3M``, ``131K`` or ``256``."""
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.0f}K" if count >= 1e4 else f"{count:,.0f}"


def _link(path: Path, doc: Path) -> str:
    return f"[{path.name}]({os.path.relpath(path, doc.parent)})"


def _source(path: Path, result: dict[str, Any], doc: Path) -> str:
    return (
        f"Data: {_link(path, doc)}, made by `{result['command']}` at commit `{result['commit']}` on "
        f"{result['device']}, {result['date']}."
    )


def model_source(result: dict[str, Any]) -> str:
    """The model of an activation attribution as the page names it: its config and, where recorded, its checkpoint."""
    text = f"`{result.get('config', '')}`"
    checkpoint = result.get("checkpoint") or {}
    if checkpoint.get("name"):
        trained = f", trained with {checkpoint['trained_with']} attention" if checkpoint.get("trained_with") else ""
        text += f", checkpoint `{checkpoint['name']}` (step {checkpoint.get('step', '?')}{trained})"
    return text


def _figure(path: Path, result: dict[str, Any], image: Path, drawn: bool, doc: Path, alt: str) -> list[str]:
    lines = (
        [f"![{alt}]({os.path.relpath(image, doc.parent)})"]
        if drawn
        else [f"*(Figure not drawn: matplotlib is not installed where `{REGENERATE}` ran.)*"]
    )
    return [*lines, "", f"{_source(path, result, doc)} Figure drawn by `{REGENERATE}`.", ""]


def group_table(result: dict[str, Any]) -> list[str]:
    """Final validation loss of each run against full precision, with the noise floor, and each run's speed."""
    found, summaries = roles(result), summaries_by_run(result)
    role_of = {name: role for role, name in found.items()}
    floor = noise_floor(result)
    full = found.get("full")
    lines = [
        "| run | what | steps | tokens | final val loss | vs full precision | vs noise floor | tokens/s | "
        "peak GPU GB | INT8 share of layer-steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spec in result.get("runs", []):
        name = spec["name"]
        s = summaries.get(name, {})
        what = ROLES.get(role_of.get(name, ""), spec.get("attention", ""))
        if s.get("error"):
            lines.append(f"| {name} | {what} | failed: {s['error'][:160]} | | | | | | | |")
            continue
        point = final_val(result, name)
        delta = difference(result, name, full) if full and name != full else None
        ratio = ""
        if delta is not None and floor is not None and floor[1] > 0:
            ratio = f"{abs(delta[1]) / floor[1]:.1f}x"
        int8 = (
            ""
            if s.get("attention") == "full"
            else "1 (no controller)"
            if s.get("int8_fraction") is None
            else f"{s['int8_fraction']:.3f}"
        )
        memory = "" if s.get("peak_memory_gb") is None else f"{s['peak_memory_gb']:.1f}"
        speed = _speed(s.get("tokens_per_s"))
        stopped = " (stopped early)" if s.get("max_steps") and s.get("steps", 0) < s["max_steps"] else ""
        lines.append(
            f"| {name} | {what} | {s.get('steps', '')}{stopped} | {_tokens(s.get('tokens_seen', 0))} | "
            f"{_f(point[1]) if point else 'n/a'} | {_f(delta[1], sign=True) if delta else ''} | {ratio} | {speed} | "
            f"{memory} | {int8} |"
        )
    lines.append("")
    if floor is not None:
        lines.append(
            f"Noise floor: |full - full with the second seed| = {floor[1]:.4f} at step {floor[0]} (one pair of seeds: "
            "a difference of a few times this is a hint, not a measurement of significance)."
        )
    elif not result.get("matrix", {}).get("speed"):
        lines.append("Noise floor: not measured in this group (one seed of full precision).")
    return lines


def controller_record(result: dict[str, Any]) -> list[str]:
    """The controller's decisions, its INT8 share, skips, rollbacks and its cost in tokens/s, per controlled run."""
    summaries, found = summaries_by_run(result), roles(result)
    lines: list[str] = []
    for s in result.get("summary", []):
        name = s.get("run", s.get("attention"))
        if not s.get("controller") or s.get("error") or s.get("attention") == "full":
            continue
        records = decision_records(result, name)
        share = s.get("int8_fraction")
        fixed = summaries.get(found.get("sage_fixed", ""), {})
        cost = ""
        if fixed.get("tokens_per_s") and s.get("tokens_per_s"):
            cost = f"; tokens/s {s['tokens_per_s'] / fixed['tokens_per_s']:.3f}x SageBwd fixed's"
        lines.append(
            f"**{name}**: {len(records)} decision(s); INT8 share of layer-steps {_f(share, 3)}; skipped steps "
            f"{s.get('skipped_steps', 0)}, rollbacks {s.get('rollbacks', 0)}, accumulate_grad_batches at the end "
            f"{s.get('accumulate_grad_batches', '')}{cost}."
        )
        lines += ["", *gap_closed(result, name), ""]
        if records:
            lines += ["| step | layer | lever | from | to | reason |", "|---:|---|---|---|---|---|"]
            lines += [
                f"| {r['step']} | {r['layer'] or 'global'} | {r['lever']} | {r['old']} | {r['new']} | {r['reason']} |"
                for r in records
            ]
            lines.append("")
        else:
            lines += ["It took no decision: every layer trained at its starting precision throughout.", ""]
    return lines


def gap_closed(result: dict[str, Any], run: str) -> list[str]:
    """Whether the controlled run closed SageBwd fixed's gap to full precision, from the group's final validation."""
    found = roles(result)
    if "full" not in found or "sage_fixed" not in found:
        return []
    fixed, adaptive = difference(result, found["sage_fixed"], found["full"]), difference(result, run, found["full"])
    if fixed is None or adaptive is None:
        return []
    point = noise_floor(result)
    floor = None if point is None else point[1]
    text = (
        f"Against full precision at the last validation: SageBwd fixed {verdict(fixed[1], floor)}; with the "
        f"controller {verdict(adaptive[1], floor)}. "
    )
    if floor is None:
        return [text + "No noise floor in this group: no verdict."]
    if fixed[1] <= floor:
        return [text + "SageBwd fixed left no gap beyond the noise, so there was no gap for the controller to close."]
    if adaptive[1] <= floor:
        return [text + "The controller closed the gap to within the noise."]
    return [text + f"The controller did not close the gap (it narrowed it by {fixed[1] - adaptive[1]:+.4f})."]


def speed_table(result: dict[str, Any]) -> list[str]:
    """Tokens/s and peak memory of each run of a speed group, against the cuDNN run of the same file."""
    found, summaries = roles(result), summaries_by_run(result)
    reference = summaries.get(found.get("full_cudnn", ""), {}).get("tokens_per_s")
    lines = [
        "| run | SDPA backend | steps | tokens/s (steady) | vs SDPA cuDNN | peak GPU GB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in result.get("summary", []):
        name = s.get("run", s.get("attention"))
        if s.get("error"):
            lines.append(f"| {name} | | failed: {s['error'][:160]} | | | |")
            continue
        backend = s.get("sdpa_backend", "") if s.get("attention") == "full" else "(SageBwd kernels)"
        ratio = f"{s['tokens_per_s'] / reference:.3f}x" if reference and s.get("tokens_per_s") else ""
        memory = "" if s.get("peak_memory_gb") is None else f"{s['peak_memory_gb']:.1f}"
        lines.append(
            f"| {name} | {backend} | {s.get('steps', '')} | {_speed(s.get('tokens_per_s'))} | {ratio} | {memory} |"
        )
    return lines


def earlier_table(result: dict[str, Any]) -> list[str]:
    """A pre-matrix comparison: each run's final validation loss against the full-precision run of the same file."""
    runs, summaries = rows_by_run(result), summaries_by_run(result)
    full = "full" if "full" in runs else None
    lines = [
        "| run | steps | final val loss | best val loss (step) | vs full precision, final | tokens/s | INT8 share | "
        "decisions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in runs.items():
        s = summaries.get(name, {})
        points = val_points(rows)
        point = final_val(result, name)
        best = min(points.items(), key=lambda item: item[1]) if points else None
        delta = difference(result, name, full) if full and name != full else None
        int8 = "" if s.get("attention") == "full" or s.get("int8_fraction") is None else f"{s['int8_fraction']:.3f}"
        lines.append(
            f"| {name} | {s.get('steps', '')} | {_f(point[1]) if point else 'n/a'} | "
            f"{f'{best[1]:.4f} ({best[0]})' if best else ''} | {_f(delta[1], sign=True) if delta else ''} | "
            f"{_speed(s.get('tokens_per_s'))} | {int8} | {s.get('decisions', '')} |"
        )
    return lines


def attribution_table(result: dict[str, Any]) -> list[str]:
    """Per layer, under the SageBwd defaults: each tensor's cosine to float64 and each INT8 product's share of dQ's
    squared error (that product alone in INT8, from the rows of one-product settings)."""
    rows = [r for r in result["rows"] if str(r.get("inputs", "")).startswith("activations")]
    default = "sagebwd:int8=qk,pv,dv,ds;smooth_k"
    tensors = [t for t in ("O", "P", "dS", "dQ", "dK", "dV") if any(r.get("tensor") == t for r in rows)]
    layers: dict[str, dict[str, Any]] = {}
    for r in rows:
        entry = layers.setdefault(str(r.get("layer_name") or r.get("layer")), {"inputs": r["inputs"]})
        if r.get("setting") == default:
            entry[r.get("tensor")] = r.get("cos")
    lines = [
        f"| layer | {' | '.join(f'{t} cos' for t in tensors)} | share of dQ's squared error, each product alone |",
        "|---|" + "---:|" * len(tensors) + "---|",
    ]
    for layer, values in layers.items():
        shares = dq_error_shares(result, lambda kind, inputs=values["inputs"]: kind == inputs)
        share = ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda item: -item[1]))
        lines.append(f"| {layer} | " + " | ".join(_f(values.get(t), 5) for t in tensors) + f" | {share} |")
    return lines


def dq_error_shares(result: dict[str, Any], inputs: Callable[[str], bool]) -> dict[str, float]:
    """Share of dQ's squared error under SageBwd's defaults that each of its INT8 products gives alone.

    ``rel_l2(dQ)^2`` of the settings ``sagebwd:int8=<product>;smooth_k`` (one product in INT8, the rest bf16) over
    that of ``sagebwd:int8=qk,pv,dv,ds;smooth_k`` (the defaults), each summed over the rows whose ``inputs`` pass
    ``inputs`` (input kinds, or the layers of an activation capture). The shares include the bf16 rounding every
    setting has, so they can sum to more than one.
    """
    total: float = 0.0
    alone: dict[str, float] = {}
    for r in result["rows"]:
        if r.get("tensor") != "dQ" or not inputs(str(r.get("inputs", ""))) or r.get("rel_l2") is None:
            continue
        setting = str(r.get("setting", ""))
        match = re.fullmatch(r"sagebwd:int8=(qk|pv|dv|ds);smooth_k", setting)
        if setting == "sagebwd:int8=qk,pv,dv,ds;smooth_k":
            total += r["rel_l2"] ** 2
        elif match:
            alone[match[1]] = alone.get(match[1], 0.0) + r["rel_l2"] ** 2
    return {product: value / total for product, value in alone.items()} if total > 0 else {}


def verdict(delta: float | None, floor: float | None) -> str:
    """``within the noise floor`` or ``N x the noise floor`` for a validation-loss difference."""
    if delta is None:
        return "not measured yet"
    if floor is None or floor <= 0:
        return f"{delta:+.4f} (no noise floor to compare with)"
    if abs(delta) <= floor:
        return f"{delta:+.4f}, within the noise floor ({floor:.4f})"
    return f"{delta:+.4f}, {abs(delta) / floor:.1f}x the noise floor ({floor:.4f})"


def diverged(result: dict[str, Any], run: str | None) -> str | None:
    """Why ``run`` counts as diverged (non-finite training losses, a rollback by the controller), or ``None``."""
    s = summaries_by_run(result).get(run or "", {})
    if s.get("nonfinite_losses"):
        return f"{s['nonfinite_losses']} non-finite training losses"
    if s.get("rollbacks"):
        return f"{s['rollbacks']} rollback(s) by the controller"
    return None


def _ratio_range(result: dict[str, Any], tensor: str, setting: str, reference: str, key: str = "setting") -> str:
    """``a to b``: the range over input kinds of ``rel_l2(tensor)`` under ``setting`` over that under ``reference``."""
    index = {(r.get(key), r.get("inputs"), r.get("tensor")): r.get("rel_l2") for r in result["rows"]}
    ratios = [
        index[(setting, kind, tensor)] / index[(reference, kind, tensor)]
        for kind in sorted({str(r.get("inputs")) for r in result["rows"]})
        if index.get((setting, kind, tensor)) and index.get((reference, kind, tensor))
    ]
    return f"{min(ratios):.2f} to {max(ratios):.2f}" if ratios else "n/a"


def findings(loaded: dict[str, Any]) -> list[str]:
    """The study's four findings, each set against what the files measured (or ``not measured yet``)."""
    groups = {name: result for name, (_, result) in loaded["matrix"].items()}

    def gap(group: str, role: str = "sage_fixed", reference: str = "full") -> tuple[float | None, str | None]:
        """``(val(role) - val(reference), why not measured)`` at the group's last common validation."""
        result = groups.get(group)
        if result is None:
            return None, "not measured yet"
        found = roles(result)
        for needed in (role, reference):
            error = summaries_by_run(result).get(found.get(needed, ""), {}).get("error")
            if needed not in found or error:
                return None, f"not measured ({ROLES[needed]}: {error or 'no such run'})"
        point = difference(result, found[role], found[reference])
        return (None, "not measured (no common validation)") if point is None else (point[1], None)

    def floor_of(group: str) -> float | None:
        point = noise_floor(groups[group]) if group in groups else None
        return None if point is None else point[1]

    def said(delta: float | None, why: str | None, floor: float | None) -> str:
        return why if delta is None else verdict(delta, floor)

    lines = []
    floor = floor_of("large-qknorm")
    large, large_why = gap("large-qknorm")
    small, small_why = gap("small-qknorm")
    # (i) QK-norm
    text = "**(i) QK-norm is needed for stability at large tokens per step.** "
    no_qk, no_qk_why = gap("large-no-qknorm")
    if "large-no-qknorm" not in groups:
        text += "Not measured yet."
    else:
        result = groups["large-no-qknorm"]
        found = roles(result)
        broke = {role: diverged(result, found.get(role)) for role in ("full", "sage_fixed", "sage_controller")}
        broken = [f"{ROLES[role]}: {why}" for role, why in broke.items() if why]
        text += (
            f"Without QK-norm, SageBwd fixed against full precision: {said(no_qk, no_qk_why, floor)} (the noise floor "
            f"is the QK-norm group's: this group has one seed); with QK-norm {said(large, large_why, floor)}. "
            + (f"Diverged: {'; '.join(broken)}. " if broken else "No run diverged. ")
        )
        if no_qk is None and not broke["sage_fixed"]:
            text += "No verdict."
        elif broke["sage_fixed"] or (floor is not None and no_qk is not None and no_qk > 2 * floor):
            text += "Agrees with the study: without QK-norm SageBwd fell behind or broke down."
        else:
            text += (
                "**Differs from the study**: at this scale SageBwd trained as well without QK-norm as with it. The "
                "study's model is about 9x larger and took 2.1M tokens per step; its instability did not appear here."
            )
    lines += [text, ""]
    # (ii) dS
    text = "**(ii) The error comes mostly from dS.** "
    if loaded["activations"]:
        path, result = loaded["activations"][-1]
        shares = dq_error_shares(result, lambda kind: kind.startswith("activations"))
        if shares:
            top = max(shares, key=shares.get)
            text += (
                f"On real activations ({path.name}: {model_source(result)}, on {result['device']}), {top} alone "
                f"in INT8 gives {shares[top]:.0%} of dQ's squared error "
                f"under the SageBwd defaults ({', '.join(f'{k} {v:.0%}' for k, v in sorted(shares.items()))}). "
                + ("Agrees with the study. " if top == "ds" else "**Differs from the study**: dS is not the largest. ")
            )
        else:
            text += f"{path.name} has no single-product settings to attribute dQ's error with; see its table above."
    else:
        text += "With real activations: not measured yet (benchmarks.training.attribution). "
    if loaded["synthetic"]:
        path, result = loaded["synthetic"][-1]
        narrow = dq_error_shares(result, lambda kind: kind == "normal sigma=1")
        wide = dq_error_shares(result, lambda kind: kind == "normal sigma=4")
        if narrow and wide:
            text += (
                f"On synthetic inputs ({path.name}), dS alone in INT8 gives {narrow.get('ds', 0):.0%} of dQ's squared "
                f"error at N(0, 1) (the INT8 QK^T {narrow.get('qk', 0):.0%}) but {wide.get('ds', 0):.0%} at N(0, 16), "
                f"where the INT8 QK^T gives {wide.get('qk', 0):.0%}: dS dominates only while the scores stay narrow, "
                "which QK-norm helps keep them."
            )
    lines += [text, ""]
    # (iii) tokens per step
    text = "**(iii) Fewer tokens per step let SageBwd match full precision.** "
    floor_small = floor_of("small-qknorm")
    if large is None or small is None:
        text += f"Large tokens per step: {said(large, large_why, floor)}; small: {said(small, small_why, floor_small)}."
    else:
        text += (
            "SageBwd fixed against full precision, the same tokens seen: at large tokens per step "
            f"{verdict(large, floor)}; "
            f"at small {verdict(small, floor_small)}. "
        )
        lag_large = floor is not None and large > floor
        lag_small = floor_small is not None and small > floor_small
        if lag_large and not lag_small:
            text += "Agrees with the study: the gap at large tokens per step closes at small."
        elif not lag_large and not lag_small:
            text += (
                "**Partly differs from the study**: at small tokens per step SageBwd matched full precision, as the "
                "study found, but at large tokens per step it did not lag either (the study's lag was at 2.1M tokens "
                "per step on a 325M model), so this matrix cannot show fewer tokens per step closing a gap."
            )
        elif lag_small and not lag_large:
            text += "**Differs from the study**: the gap shows at small tokens per step, not at large."
        else:
            text += "**Differs from the study**: SageBwd lags full precision at both sizes."
    lines += [text, ""]
    # (iv) K-smoothing
    text = "**(iv) K-smoothing is essential; Q-smoothing helps little.** "
    result = groups.get("large-qknorm")
    off, off_why = gap("large-qknorm", "sage_no_smooth_k", "sage_fixed")
    broke = diverged(result, roles(result).get("sage_no_smooth_k")) if result else None
    text += (
        "In training, K-smoothing off against on (SageBwd fixed, large tokens per step): "
        f"{broke or said(off, off_why, floor)}. "
    )
    if broke or (off is not None and floor is not None and off > 2 * floor):
        text += "Agrees with the study. "
    elif off is not None:
        text += "**Differs from the study**: training without K-smoothing did not fall measurably behind here. "
    if loaded["synthetic"]:
        path, result = loaded["synthetic"][-1]
        text += (
            f"On synthetic inputs ({path.name}) K-smoothing off multiplies dQ's error by "
            f"{_ratio_range(result, 'dQ', 'sagebwd:int8=qk,pv,dv,ds', 'sagebwd:int8=qk,pv,dv,ds;smooth_k')} across the "
            "input kinds (the largest with outlier channels in K). "
        )
    if loaded["smoothing"]:
        path, result = loaded["smoothing"][-1]
        text += (
            f"Q-smoothing was not trained with here; on synthetic inputs ({path.name}) it multiplies O's error by "
            f"{_ratio_range(result, 'O', 'smooth_q', 'base', key='label')} and dQ's by "
            f"{_ratio_range(result, 'dQ', 'smooth_q', 'base', key='label')}: little, as the study found."
        )
    else:
        text += "Q-smoothing: not measured."
    lines += [text, ""]
    return lines


def write_doc(results: Path, doc: Path, images: Path, tracked_only: bool = False) -> str:
    """Draw the figures and write the page; returns its text."""
    loaded = load(results, tracked_files(results) if tracked_only else None)
    lines = [
        "# Evidence: SageBwd at small scale, and the controller (issue #7)",
        "",
        f"Generated by `{REGENERATE}` from the JSON files in `benchmarks/results/`: edit that script, not this page. "
        "Every figure and table names the file it comes from and the command that made it (run from the repository "
        "root with the project's environment active, `source .venv/bin/activate`; on a GPU machine, the Python the "
        "project is installed in).",
        "",
        "The SageBwd study (a 325M LLaMA) found: (i) QK-norm is needed for stability at large tokens per step; "
        "(ii) the error comes mostly from dS; (iii) with fewer tokens per step SageBwd matches full precision in "
        "pretraining; (iv) K-smoothing is essential, Q-smoothing helps little. Below, each is set against what we "
        "measured; where we differ, it says so.",
        "",
        "## The runs and why this size",
        "",
        "`benchmarks/gpu_evidence.sh` runs the whole matrix in one GPU session "
        "(`python -m benchmarks.training.pretrain_compare --matrix evidence --budget-minutes ...`). The model is "
        "`examples/configs/small.yaml` (37M parameters, 8 "
        "layers, width 640, GQA 10/5, sequences of 2048, bf16): the largest of our configs that trains the 15 runs "
        "of the matrix to a few tens of millions of tokens each in about 20 minutes of one H100/H200 (2,000 steps of "
        "32K tokens took 152 s with SageBwd on an H200). Groups: 64 sequences per step (131K tokens) and 8 (16K), "
        "the study's ratio of 8 (2.1M against 260K); full precision twice (seeds 1234 and 1235) for the noise "
        "floor, SageBwd fixed (INT8 dS, K-smoothing, no Q-smoothing, no controller) and SageBwd with the controller "
        "(the config's thresholds), all with the same seed and data order; the same without QK-norm at 131K; "
        "K-smoothing off once at 131K. Every training run sees the same number of tokens, planned from throughputs "
        "measured in the warm-ups so that the matrix fits its time budget; learning-rate warmup is a tenth of each "
        "run and the cosine ends at its last step. Validation: the same 64 held-out sequences at ten points of "
        "every run. The corpus (`CORPUS=site`, the default): the Python sources and text files of the GPU image's "
        "standard library and site-packages, up to 256 MB of byte tokens, so that no run repeats data. After the "
        "matrix, in the same session, `benchmarks.training.attribution` measures the per-tensor error of section 1 on "
        "activations captured from the final model of large-qknorm's first full-precision run, saved by the matrix "
        "with the config it trained with (`--save-checkpoint large-qknorm/full`); every layer, 8 held-out sequences "
        "of 2048.",
        "",
    ]
    if loaded["matrix"]:
        plans = {name: result["matrix"] for name, (_, result) in loaded["matrix"].items()}
        first = next(iter(plans.values()))
        first_result = next(iter(loaded["matrix"].values()))[1]
        corpus = first_result.get("corpus", {})
        per_run = first["plan"].get("tokens_per_run", 0)
        passes = per_run / corpus["tokens"] if corpus.get("tokens") else None
        lines += [
            f"This run's plan: {_tokens(per_run)} tokens per training run; steps per group "
            f"{json.dumps(first['plan'].get('steps', {}))}; budget {first['plan'].get('budget_minutes')} minutes. "
            f"Corpus: {_tokens(corpus.get('tokens') or 0)} tokens"
            + (f" ({corpus['note']})" if corpus.get("note") else "")
            + (
                f"; a training run reads {passes:.0%} of it."
                if passes and passes < 1
                else f"; a training run reads it {passes:.1f} times."
                if passes
                else "."
            ),
            "",
        ]
    else:
        lines += [
            "**Pending: the matrix has not run on a GPU yet.** Every matrix table below reads *not measured yet* "
            f"until `{GPU_COMMAND}` has run and its `training-*-evidence-*.json` files (with its "
            "`accuracy-*-activations.json`, section 1) are committed.",
            "",
        ]

    lines += ["## 1. Error attribution with real activations", ""]
    if loaded["activations"]:
        for path, result in loaded["activations"]:
            markdown = path.with_suffix(".md")
            every = f" Every setting and tensor: {_link(markdown, doc)}." if markdown.is_file() else ""
            lines += [
                f"Model {model_source(result)}; SageBwd defaults (INT8 QK^T, PV, dV, dS; K-smoothing) against "
                f"float64 on the captured q, k, v and dO of each attention layer.{every}",
                "",
                *attribution_table(result),
                "",
                _source(path, result, doc),
                "",
            ]
    else:
        lines += [
            "Not measured yet: `benchmarks.training.attribution` captures activations from a trained checkpoint and "
            "writes "
            f"`accuracy-<device>-<date>-activations.json`; `{GPU_COMMAND}` runs it after the matrix, on the final "
            "model of the matrix's first full-precision run (large-qknorm), and this page shows its table once the "
            "file is committed. Synthetic inputs are in docs/accuracy.md.",
            "",
        ]

    lines += ["## 2. Training: loss curves and final validation loss", ""]
    for group, question in EVIDENCE_GROUPS.items():
        if group.startswith("e2e-"):
            continue
        lines += [f"### {group}: {question}", ""]
        if group not in loaded["matrix"]:
            lines += ["Not measured yet.", ""]
            continue
        path, result = loaded["matrix"][group]
        image = images / f"{path.stem}.png"
        drawn = plot_group(result, image)
        lines += [f"{result['matrix']['title']}.", "", *group_table(result), ""]
        lines += _figure(path, result, image, drawn, doc, f"loss curves, {group}")

    lines += ["## 3. The controller's record", ""]
    any_record = False
    for group in EVIDENCE_GROUPS:
        if group in loaded["matrix"]:
            path, result = loaded["matrix"][group]
            record = controller_record(result)
            if record:
                any_record = True
                lines += [f"### {group}", "", *record, _source(path, result, doc), ""]
    if not any_record:
        lines += ["Not measured yet.", ""]

    # Speed groups by their flag: the group is named after its sequence length (e2e-seq4096 for small.yaml).
    speed_groups = [group for group, (_, result) in loaded["matrix"].items() if result["matrix"].get("speed")]
    lines += ["## 4. Speed at sequence 4096 (issue #4)", ""]
    if not speed_groups:
        lines += ["Not measured yet.", ""]
    for group in speed_groups:
        path, result = loaded["matrix"][group]
        lines += [f"{result['matrix']['title']}.", "", *speed_table(result), "", _source(path, result, doc), ""]

    lines += ["## 5. Findings against the study's", "", *findings(loaded)]

    lines += [
        "## Earlier runs (before the matrix)",
        "",
        "Single-seed comparisons of `small.yaml` on one GPU; each file's command gives its tokens per step and its "
        "line its device and commit (files before 2026-11-23 ran older kernels). Differences are computed within one "
        "file only (runs of one command); with no seed spread, differences under about 0.01 are not evidence. The "
        "`parity` runs are `benchmarks.kernels.gpu_verify`'s, beside its other checks on the same GPU: their tokens/s "
        "are "
        "not speeds.",
        "",
    ]
    if not loaded["earlier"]:
        lines += ["None committed.", ""]
    for path, result in loaded["earlier"]:
        image = images / f"{path.stem}.png"
        drawn = plot_group(result, image)
        lines += [f"### {path.stem}", "", *earlier_table(result), ""]
        records = [(name, r) for name in summaries_by_run(result) for r in decision_records(result, name)]
        if records:
            lines += ["| run | step | layer | from | to | reason |", "|---|---:|---|---|---|---|"]
            lines += [
                f"| {n} | {r['step']} | {r['layer']} | {r['old']} | {r['new']} | {r['reason']} |" for n, r in records
            ]
            lines.append("")
        lines += _figure(path, result, image, drawn, doc, f"loss curves, {path.stem}")
    text = "\n".join(lines).rstrip() + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return text


def main(argv: list[str] | None = None) -> str:
    """Write the page from the command line; returns its text."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSON")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "results.md", help="the page to write")
    parser.add_argument("--images", type=Path, default=REPO / "docs" / "images" / "results", help="figure folder")
    parser.add_argument(
        "--tracked-only",
        action="store_true",
        help="read only the result files git tracks (not others' files in flight)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.results.is_dir():
        parser.error(f"--results must be a folder of result JSON files; received {str(args.results)!r}.")
    text = write_doc(args.results, args.doc, args.images, args.tracked_only)
    print(f"wrote {args.doc} ({len(text.splitlines())} lines), figures in {args.images}")
    return text


if __name__ == "__main__":
    main()
