"""docs/results.md from the committed result files: issue #7's evidence, every figure traced to its JSON and command.

Reads ``--results``: the training files of ``pretrain_compare`` (the newest file of each group of ``--matrix
evidence``, or a combined file of ``benchmarks/noise_evidence.sh`` keyed by group, and earlier comparisons run on a
GPU) and the accuracy harness's files; draws figures into ``--images`` where matplotlib is installed. No torch.

Example::

    python -m benchmarks.training.results_doc
    python -m benchmarks.training.results_doc --tracked-only   # only what git tracks: what a commit links to
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.result_file import REPO, RESULTS
from benchmarks.training import evidence as ev
from benchmarks.training.summary import plot_group
from sage_lightning.noise import calibrate_threshold, percentile_95
from sage_lightning.precision_image import save_decisions_picture

#: The command that regenerates this page, and the one that makes the matrix on a GPU.
REGENERATE = "python -m benchmarks.training.results_doc"
GPU_COMMAND = "GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_evidence.sh"


def prose(section: str) -> str:
    """A section of the page's fixed prose (``results_page.md`` beside this file), its commands filled in."""
    text = (Path(__file__).parent / "results_page.md").read_text()
    found = dict(re.findall(r"<!-- ([\w-]+) -->\n(.*?)\n*(?=<!-- |\Z)", text, re.S))
    return found[section].format(regenerate=REGENERATE, gpu_command=GPU_COMMAND)


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


def _figure(path: Path, result: dict[str, Any], image: Path, drawn: bool, doc: Path, alt: str) -> list[str]:
    shown = f"![{alt}]({os.path.relpath(image, doc.parent)})"
    shown = shown if drawn else f"*(Figure not drawn: matplotlib is not installed where `{REGENERATE}` ran.)*"
    return [shown, "", f"{_source(path, result, doc)} Figure drawn by `{REGENERATE}`.", ""]


def group_table(result: dict[str, Any]) -> list[str]:
    """Final validation loss of each run against full precision, with the noise floor, and each run's speed."""
    found, summaries = ev.roles(result), ev.summaries_by_run(result)
    role_of = {name: role for role, name in found.items()}
    floor, full = ev.noise_floor(result), found.get("full")
    lines = [
        "| run | what | steps | tokens | final val loss | vs full precision | vs noise floor | tokens/s | "
        "peak GPU GB | INT8 share of layer-steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spec in result.get("runs", []):
        name, s = spec["name"], summaries.get(spec["name"], {})
        what = ev.ROLES.get(role_of.get(name, ""), spec.get("attention", ""))
        if s.get("error"):
            lines.append(f"| {name} | {what} | failed: {s['error'][:160]} | | | | | | | |")
            continue
        point = ev.final_val(result, name)
        delta = ev.difference(result, name, full) if full and name != full else None
        ratio = ""
        if delta is not None and floor is not None and floor[1] > 0:
            ratio = f"{abs(delta[1]) / floor[1]:.1f}x"
        share = s.get("int8_fraction")
        int8 = "" if s.get("attention") == "full" else "1 (no controller)" if share is None else f"{share:.3f}"
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
    summaries, found = ev.summaries_by_run(result), ev.roles(result)
    lines: list[str] = []
    for s in result.get("summary", []):
        name = s.get("run", s.get("attention"))
        if not s.get("controller") or s.get("error") or s.get("attention") == "full" or name.endswith("-observe"):
            continue
        records = ev.decision_records(result, name)
        share = s.get("int8_fraction")
        fixed = summaries.get(found.get("sage_fixed", ""), {})
        cost = ""
        if fixed.get("tokens_per_s") and s.get("tokens_per_s") and not result.get("matrix", {}).get("combined"):
            cost = f"; tokens/s {s['tokens_per_s'] / fixed['tokens_per_s']:.3f}x SageBwd fixed's"
        lines.append(
            f"**{name}**: {len(records)} decision(s); low-bit (INT8 or FP8) share of layer-steps {_f(share, 3)}, "
            f"with QK, PV and dV low-bit {_f(ev.qk_pv_dv_share(result, name), 3)}; "
            f"skipped steps {s.get('skipped_steps', 0)}, rollbacks {s.get('rollbacks', 0)}, accumulate_grad_batches at "
            f"the end {s.get('accumulate_grad_batches', '')}{cost}."
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
    """Whether the controlled run ended without a gap where SageBwd fixed of the same seed had one (the margin)."""
    bound, point = ev.margin(result), ev.final_val(result, run)
    fixed = ev.by_seed(result).get("sage-fixed", {}).get(ev.summaries_by_run(result).get(run, {}).get("seed") or 0)
    if bound is None or point is None or fixed is None:
        return []
    top = sum(bound)
    where = [
        f"{v:.4f}, " + ("without a gap" if v <= top else f"{v - top:+.4f} beyond the margin")
        for v in (point[1], fixed[1])
    ]
    text = f"Final val loss {where[0]} (at most {top:.4f}); SageBwd fixed of the same seed ({fixed[0]}) {where[1]}. "
    if fixed[1] <= top:
        return [text + "SageBwd fixed left no gap in this seed: there was none to close."]
    closed = (
        "closed the gap" if point[1] <= top else f"did not close the gap ({point[1] - fixed[1]:+.4f} against fixed)"
    )
    return [text + f"The controller {closed} in this seed."]


def seed_table(result: dict[str, Any]) -> list[str]:
    """A combined group's runs, seeds side by side: final validation loss and whether it ends without a gap."""
    bound, runs, summaries = ev.margin(result), ev.by_seed(result), ev.summaries_by_run(result)
    seeds = sorted({seed for by in runs.values() for seed in by})
    lines = [
        f"| run | what | {' | '.join(f'val loss, seed {seed}' for seed in seeds)} | no gap |",
        "|---|---|" + "---:|" * len(seeds) + ":---:|",
    ]
    for base in sorted(runs, key=lambda name: (name != "full", name)):
        by, first = runs[base], summaries[next(iter(runs[base].values()))[0]]
        what = "full precision" if first.get("attention") == "full" else f"`{first.get('precision')}`"
        what = "cuDNN's FP8 attention" if first.get("sdpa_backend") == "cudnn_fp8" else what
        acting = first.get("controller") and not first["run"].endswith("-observe")
        rule = first.get("controller_config") or {"noise_ratio_high": first.get("threshold")}  # pretrain_compare's
        ruled = ", controller at " + ", ".join(f"{k} {v}" for k, v in rule.items()) if any(rule.values()) else ""
        what += ruled or (", with the controller" if acting else "")
        what += "".join(
            f"; seed {seed}: the controller observing only" for seed, (n, _) in by.items() if "observe" in n
        )
        inside = " / ".join("yes" if v <= sum(bound) else "no" for _, v in by.values()) if bound else ""
        lines.append(
            f"| {base} | {what} | " + " | ".join(_f(by[s][1]) if s in by else "" for s in seeds) + f" | {inside} |"
        )
    if bound:
        spread = [
            f"{max(v for _, v in r.values()) - min(v for _, v in r.values()):.4f} ({b})"
            for b, r in runs.items()
            if len(r) > 1 and b != "full"
        ]
        lines += [
            "",
            f"Margin: full precision's mean {bound[0]:.4f}, margin {bound[1]:.4f} (the seeds' spread or "
            f"{ev.MIN_MARGIN}, whichever is larger): no gap at most {sum(bound):.4f}."
            + (f" Low-bit runs' spread between seeds: {', '.join(spread)}." if spread else ""),
        ]
    return lines


def precision_figures(group: str, path: Path, result: dict[str, Any], images: Path, doc: Path) -> list[str]:
    """The precision image of each run that moved a layer (``sage_lightning.precision_image``), with its colours."""
    lines, drawn = [], importlib.util.find_spec("matplotlib") is not None  # Pillow comes with matplotlib
    for s in result.get("summary", []):
        records = [r for r in ev.decision_records(result, s["run"]) if r["lever"] == "precision"]
        if records and s.get("final_precisions"):
            image = images / f"{path.stem}{'' if group in path.stem else '-' + group}-{s['run']}-precision.png"
            key = save_decisions_picture(image, list(s["final_precisions"]), records, s["steps"]) if drawn else []
            what = f"**{s['run']}**, each layer's precision by step" + "".join(f"; {c}: `{n}`" for n, c in key)
            lines += [what + ".", "", *_figure(path, result, image, drawn, doc, f"precision of {s['run']}")]
    return lines


def noise_record(result: dict[str, Any]) -> list[str]:
    """The noise ratio (base precision, after step 0) of each observing run; its gradient noise scale where recorded."""
    lines = []
    for run, readings in ev.observed(result).items():
        late: dict[str, list[float]] = {}
        for step, layer, base, *_ in readings:
            if step > 0.2 * readings[-1][0]:
                late.setdefault(layer.removeprefix("model.blocks.").removesuffix(".attn"), []).append(base)
        values = [r[2] for r in readings]
        scales = [r[4] for r in readings if r[4:] and r[4] is not None and r[0] > 0.2 * readings[-1][0]]  # 12beba4 on
        scale = f"{statistics.median(scales):.1f} sequences" if scales else None
        lines += [
            f"Noise ratio of **{run}** (the controller measuring, not acting): {len(values)} readings, median "
            f"{statistics.median(values):.3f}, 95th percentile {percentile_95(values):.3f}, max {max(values):.3f}; per "
            f"layer, median over the last 80%: {', '.join(f'{k}: {statistics.median(v):.3f}' for k, v in late.items())}"
            "." + (f" Gradient noise scale, median over the last 80%: {scale}." if scale else ""),
            "",
        ]
    return lines


def data_says(loaded: dict[str, Any], doc: Path) -> list[str]:
    """What the combined files say: per group, which low-bit runs end without a gap; the controller's count; the
    noise ratio's calibration (``sage_lightning.noise.calibrate_threshold``'s rule on the observing runs)."""
    lines: list[str] = []
    for path in sorted({p for p, r in loaded["matrix"].values() if r["matrix"].get("combined")}):
        ordered = [(g, loaded["matrix"].get(g)) for g in ev.group_questions(loaded["matrix"])]
        groups = [(g, found[1]) for g, found in ordered if found and found[0] == path]
        first, human = groups[0][1], path.with_suffix(".md")
        lines += [
            f"The matrix as run: {_link(path, doc)} ({first['device']}, {first['date']}: `{first['command']}`). "
            + first.get("note", "")
            + (f" Its tables written by hand: {_link(human, doc)}." if human.is_file() else ""),
            "",
        ]
        quiet: list[float] = []
        loud: list[list[float]] = []
        for group, result in groups:
            bound, runs, summaries = ev.margin(result), ev.by_seed(result), ev.summaries_by_run(result)
            if bound is None:
                continue
            top, ran = sum(bound), [(n, v) for b, by in runs.items() if b != "full" for n, v in by.values()]
            pairs = [(runs["sage-fixed"].get(seed), c) for seed, c in runs.get("sage-controller", {}).items()]
            gapped = [c for f, c in pairs if f and f[1] > top]
            calm = [bool(summaries[c[0]].get("decisions")) for f, c in pairs if f and f[1] <= top]
            closed = f" The controller ended without a gap in {sum(c[1] <= top for c in gapped)} of {len(gapped)} "
            closed = closed + "seed(s) where SageBwd fixed of the same seed had one." if gapped else ""
            closed += f" Controller decisions in {sum(calm)} of {len(calm)} seed(s) with no gap." if calm else ""
            lines.append(
                f"- **{group}** ({result['matrix']['title']}): without a gap (at most {top:.4f}): "
                f"{', '.join(n for n, v in ran if v <= top) or 'none'}; beyond the margin: "
                f"{', '.join(n for n, v in ran if v > top) or 'none'}." + closed
            )
            readings = [r[2] for v in ev.observed(result).values() for r in v]
            if ev.ends(result, "sage-fixed")[1]:
                quiet += readings
            elif readings:
                loud.append(readings)
        used = ", ".join(
            map(str, sorted({s["threshold"] for _, g in groups for s in g["summary"] if s.get("threshold")}))
        )
        if quiet and loud:
            threshold, why = calibrate_threshold(quiet, loud)
            if threshold is not None:
                verdict = f"a threshold of {threshold:.3f} separates them ({why})."
            else:
                verdict = f"no threshold separates them ({why}), so the rule is off by default (docs/controller.md, "
                verdict += "Noise ratio)" + (
                    f"; the controller runs here acted at noise_ratio_high {used}, set by hand." if used else "."
                )
            lines += [
                "",
                "Noise ratio, calibrated by `sage_lightning.noise.calibrate_threshold` on the observing runs (loud: "
                f"the groups where SageBwd fixed ends beyond the margin; quiet: those without a gap): {verdict}",
            ]
        lines.append("")
    return lines


def speed_table(result: dict[str, Any]) -> list[str]:
    """Tokens/s and peak memory of each run of a speed group, against the cuDNN run of the same file."""
    found, summaries = ev.roles(result), ev.summaries_by_run(result)
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
    runs, summaries = ev.rows_by_run(result), ev.summaries_by_run(result)
    full = "full" if "full" in runs else None
    lines = [
        "| run | steps | final val loss | best val loss (step) | vs full precision, final | tokens/s | INT8 share | "
        "decisions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in runs.items():
        s = summaries.get(name, {})
        points = ev.val_points(rows)
        point = ev.final_val(result, name)
        best = min(points.items(), key=lambda item: item[1]) if points else None
        delta = ev.difference(result, name, full) if full and name != full else None
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
        shares = ev.dq_error_shares(result, lambda kind, inputs=values["inputs"]: kind == inputs)
        share = ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda item: -item[1]))
        lines.append(f"| {layer} | " + " | ".join(_f(values.get(t), 5) for t in tensors) + f" | {share} |")
    return lines


def write_doc(results: Path, doc: Path, images: Path, tracked_only: bool = False) -> str:
    """Draw the figures and write the page; returns its text."""
    loaded = ev.load(results, ev.tracked_files(results) if tracked_only else None)
    lines = [prose("intro"), ""]
    planned = [result for _, result in loaded["matrix"].values() if "plan" in result["matrix"]]
    lines += data_says(loaded, doc)
    if planned:
        first, first_result = planned[0]["matrix"], planned[0]
        corpus = first_result.get("corpus", {})
        per_run = first["plan"].get("tokens_per_run", 0)
        passes = per_run / corpus["tokens"] if corpus.get("tokens") else None
        reads = f"; a training run reads {passes:.0%} of it." if passes and passes < 1 else "."
        reads = f"; a training run reads it {passes:.1f} times." if passes and passes >= 1 else reads
        lines += [
            f"This run's plan: {_tokens(per_run)} tokens per training run; steps per group "
            f"{json.dumps(first['plan'].get('steps', {}))}; budget {first['plan'].get('budget_minutes')} minutes. "
            f"Corpus: {_tokens(corpus.get('tokens') or 0)} tokens"
            + (f" ({corpus['note']})" if corpus.get("note") else "")
            + reads,
            "",
        ]
    elif not loaded["matrix"]:
        lines += [prose("pending"), ""]

    lines += ["## 1. Error attribution with real activations", ""]
    if loaded["activations"]:
        for path, result in loaded["activations"]:
            markdown = path.with_suffix(".md")
            every = f" Every setting and tensor: {_link(markdown, doc)}." if markdown.is_file() else ""
            what = f"Model {ev.model_source(result)}; SageBwd defaults (INT8 QK^T, PV, dV, dS; K-smoothing) against "
            what += f"float64 on the captured q, k, v and dO of each attention layer.{every}"
            lines += [what, "", *attribution_table(result), "", _source(path, result, doc), ""]
    else:
        lines += [prose("no-activations"), ""]

    lines += ["## 2. Training: loss curves and final validation loss", ""]
    for group, question in ev.group_questions(loaded["matrix"]).items():
        if group.startswith("e2e-") or (group not in ev.EVIDENCE_GROUPS and group not in loaded["matrix"]):
            continue
        lines += [f"### {group}: {question}", ""]
        if group not in loaded["matrix"]:
            lines += ["Not measured yet.", ""]
            continue
        path, result = loaded["matrix"][group]
        image = images / f"{path.stem}{'' if group in path.stem else '-' + group}.png"
        drawn = plot_group(result, image)
        table = seed_table(result) if result["matrix"].get("combined") else group_table(result)
        lines += [f"{result['matrix']['title']}.", "", *table, ""]
        lines += _figure(path, result, image, drawn, doc, f"loss curves, {group}")

    lines += ["## 3. The controller's record", ""]
    any_record = False
    for group in ev.group_questions(loaded["matrix"]):
        if group in loaded["matrix"]:
            path, result = loaded["matrix"][group]
            record = controller_record(result) + noise_record(result)
            record += precision_figures(group, path, result, images, doc)
            if record:
                any_record = True
                lines += [f"### {group}", "", *record, _source(path, result, doc), ""]
    if not any_record:
        lines += ["Not measured yet.", ""]
    # Speed groups by their flag: the group is named after its sequence length (e2e-seq4096 for small.yaml).
    speed_groups = [group for group, (_, result) in loaded["matrix"].items() if result["matrix"].get("speed")]
    lines += ["## 4. Speed at sequence 4096 (issue #4)", ""]
    if not speed_groups:  # the kernels' speed has its own page, from its own result files
        lines += [f"The matrix's speed group has not run; see {_link(REPO / 'docs/performance.md', doc)}.", ""]
    for group in speed_groups:
        path, result = loaded["matrix"][group]
        lines += [f"{result['matrix']['title']}.", "", *speed_table(result), "", _source(path, result, doc), ""]

    lines += [prose("cost"), "", "## 5. Findings against the study's", "", *ev.findings(loaded), "", prose("issue-41")]

    lines += [prose("earlier"), ""]
    if not loaded["earlier"]:
        lines += ["None committed.", ""]
    for path, result in loaded["earlier"]:
        image = images / f"{path.stem}.png"
        drawn = plot_group(result, image)
        lines += [f"### {path.stem}", "", *earlier_table(result), ""]
        records = [(name, r) for name in ev.summaries_by_run(result) for r in ev.decision_records(result, name)]
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
    parser.add_argument("--tracked-only", action="store_true", help="only the result files git tracks")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.results.is_dir():
        parser.error(f"--results must be a folder of result JSON files; received {str(args.results)!r}.")
    text = write_doc(args.results, args.doc, args.images, args.tracked_only)
    print(f"wrote {args.doc} ({len(text.splitlines())} lines), figures in {args.images}")
    return text


if __name__ == "__main__":
    main()
