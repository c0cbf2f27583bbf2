"""The training result file of the pretraining comparison: its header, its runs, its summary table and figure."""

from __future__ import annotations

import argparse
import dataclasses
import math
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.result_file import REPO, device_name, header, write
from benchmarks.training.evidence import roles, rows_by_run, runs_tokens, val_points
from benchmarks.training.specs import RunSpec
from examples.corpus import TextDataModule


def compare(result: dict[str, Any]) -> list[str]:
    """The markdown summary: one line per run, then the losses at the last step every run reached."""
    summaries = result["summary"]
    lines = [
        "| run | steps | wall s | tokens/s (steady) | int8 share | decisions | peak GPU memory GB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        name = s.get("run", s["attention"])
        if s.get("error"):
            lines.append(f"| {name} | failed: {s['error'][:120]} | | | | | |")
            continue
        memory = "" if s.get("peak_memory_gb") is None else f"{s['peak_memory_gb']:.1f}"
        # Measured against each layer's starting precision: a full-precision run has no INT8 to keep.
        int8 = "" if s["int8_fraction"] is None or s["attention"] == "full" else f"{s['int8_fraction']:.3f}"
        speed = "" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
        lines.append(f"| {name} | {s['steps']} | {s['wall_s']:.0f} | {speed} | {int8} | {s['decisions']} | {memory} |")
    by_run = {
        name: rows for name, rows in rows_by_run(result).items() if any(r.get("train_loss") is not None for r in rows)
    }
    if len(by_run) > 1:
        common_step = min(max(r["step"] for r in rows if r.get("train_loss") is not None) for rows in by_run.values())
        val_steps = set.intersection(*({r["step"] for r in rows if "val_loss" in r} for rows in by_run.values()))
        lines += ["", f"At step {common_step} (the last every run reached):", ""]
        header = "| run | train loss (window mean) |"
        rule = "|---|---:|"
        if val_steps:
            last_val = max(val_steps)
            header += f" val loss at step {last_val} |"
            rule += "---:|"
        lines += [header, rule]
        for name, rows in by_run.items():
            train = next((r["train_loss"] for r in rows if r["step"] == common_step), None)
            line = f"| {name} | {'' if train is None else f'{train:.4f}'} |"
            if val_steps:
                line += f" {next(r['val_loss'] for r in rows if r['step'] == last_val):.4f} |"
            lines.append(line)
        speeds = {s.get("run", s["attention"]): s["tokens_per_s"] for s in summaries if not s.get("error")}
        ratios = [
            f"Speed, {name} / full: {speed / speeds['full']:.3f}x (steady-state tokens/s)."
            for name, speed in speeds.items()
            if name != "full" and speed and speeds.get("full")
        ]
        lines += ["", *ratios] if ratios else []
    return lines


def plot(result: dict[str, Any], path: Path) -> bool:
    """Loss against step and tokens/s against step, one line per run; ``False`` where matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    figure, (loss_axis, speed_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in rows_by_run(result).items():
        train = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        speed = [(r["step"], r["tokens_per_s"]) for r in rows if r.get("tokens_per_s") is not None]
        if not train:
            continue
        (line,) = loss_axis.plot(*zip(*train, strict=True), label=f"{name} train", linewidth=1)
        if val:
            loss_axis.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{name} val")
        if speed:
            speed_axis.plot(*zip(*speed, strict=True), color=line.get_color(), label=name, linewidth=1)
    loss_axis.set(xlabel="optimizer step", ylabel="loss (nats per token)", title="loss")
    speed_axis.set(xlabel="optimizer step", ylabel="tokens / s", title="throughput (validation excluded)")
    for axis in (loss_axis, speed_axis):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.suptitle(textwrap.fill(f"{result['device']}, {result['date']}: {result['command']}", 160), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def new_result(args: argparse.Namespace, argv: list[str], data: TextDataModule, device: str) -> dict[str, Any]:
    """The header of a training result file (``rows`` empty)."""
    config = args.config.resolve()
    return {
        **header("training", device_name(device), "benchmarks.training.pretrain_compare", argv),
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else "",
        "corpus": {
            **{key: data.meta.get(key) for key in ("tokens", "documents", "text_bytes", "tokenizer", "files")},
            **({"note": args.corpus_note} if args.corpus_note else {}),
        },
        "warmup_s": {},
        "runs": [],
        "summary": [],
        "decisions": {},
        "decision_log": {},
        "rows": [],
    }


def add_outcome(result: dict[str, Any], spec: RunSpec, outcome: dict[str, Any]) -> None:
    """Put one run's rows, summary and decisions into ``result``."""
    result["runs"].append(dataclasses.asdict(spec))
    result["rows"] += outcome["rows"]
    result["summary"].append(outcome["summary"])
    result["decisions"][spec.name] = outcome["decisions"]
    result["decision_log"][spec.name] = outcome["decision_log"]


def write_result(result: dict[str, Any], out: Path, tag: str, quiet: bool = False, draw: bool = True) -> None:
    """Write ``out`` (the JSON), its markdown summary and, where matplotlib is installed and ``draw``, its plot."""
    write(result, out)
    lines = compare(result)
    decisions = [f"- {name}: {d}" for name, items in result["decisions"].items() for d in items]
    matrix = result.get("matrix")
    intro = f"Group `{matrix['group']}`: {matrix['title']}. " if matrix else ""
    heading = (
        f"# Pretraining: SageBwd against full-precision attention ({tag})\n\n{result['device']}, {result['date']}, "
        f"commit {result['commit']}\n\n`{result['command']}`\n\n{intro}Config `{result['config']}`; corpus "
        f"{result['corpus']['tokens']:,} tokens ({result['corpus']['tokenizer']}). Same seed, data order and callbacks "
        "in every run unless the run's name says otherwise. Untimed warm-up first (kernel compilation and "
        f"autotuning), seconds: {result['warmup_s'] or 'none'}.\n\n"
    )
    text = "\n".join(lines) + "\n\nDecisions of AdaptivePrecision:\n\n" + ("\n".join(decisions) or "none") + "\n"
    drawn = draw and plot(result, out.with_suffix(".png"))
    if drawn:
        text += f"\n![loss and throughput]({out.with_suffix('.png').name})\n"
    out.with_suffix(".md").write_text(heading + text)
    if not quiet:
        print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {out.with_suffix('.png')}" if drawn else " (no matplotlib)"))


def date_stamp(result: dict[str, Any]) -> str:
    """``YYYYMMDD`` of the result's date."""
    return result["date"].replace("-", "")


_COLORS = {
    "full": "black",
    "full_seed_b": "0.55",
    "sage_fixed": "tab:blue",
    "sage_controller": "tab:orange",
    "sage_no_smooth_k": "tab:red",
}


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
    band = sorted((runs_tokens(runs, full, s), abs(seed_b[s] - reference[s])) for s in seed_b if s in reference)
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
