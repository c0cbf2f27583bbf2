"""docs/results.md from the committed result files: issue #7's evidence, every figure traced to its JSON and command.

Reads ``--results`` (``benchmarks/results``): the ``training-*.json`` of ``pretrain_compare`` (the groups of
``--matrix evidence``, the newest file of each, and the earlier comparisons run on a GPU), ``accuracy-*-activations``
``.json`` (the per-tensor error on real activations) and the accuracy harness's files. Draws the figures into
``--images`` where matplotlib is installed and writes ``--doc``: loss curves per group, final validation losses
against full precision with two seeds' spread as the noise floor, the controller's record, tokens/s, and the findings
set against the SageBwd study's. What has not been measured says so. No torch: it runs wherever the repository is.

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
import sys
from pathlib import Path
from typing import Any

from benchmarks.result_file import REPO, RESULTS
from benchmarks.training.evidence import (
    EVIDENCE_GROUPS,
    ROLES,
    decision_records,
    difference,
    dq_error_shares,
    final_val,
    findings,
    load,
    model_source,
    noise_floor,
    roles,
    rows_by_run,
    summaries_by_run,
    tracked_files,
    val_points,
    verdict,
)
from benchmarks.training.summary import plot_group

#: The command that regenerates this page, and the one that makes the matrix on a GPU.
REGENERATE = "python -m benchmarks.training.results_doc"
GPU_COMMAND = "GIT_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_evidence.sh"


# ------------------------------------------------------------------------------------------------------ plotting


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
        "standard library and site-packages, up to 256 MB of byte tokens, so that no run repeats data. The matrix "
        "keeps the final model of large-qknorm's first full-precision run with the config it trained with "
        "(`--save-checkpoint large-qknorm/full`), the input of section 1's measurement on real activations.",
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
            "Not measured yet: the attribution on real activations (`benchmarks/attribution.py`, retired after its CPU "
            "run: `benchmarks/results/retired.md`) writes `accuracy-<device>-<date>-activations.json` from a trained "
            "checkpoint such as the one the matrix keeps; this page shows its table once the file is committed. "
            "Synthetic inputs are in docs/accuracy.md.",
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
