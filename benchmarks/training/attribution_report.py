"""The attribution on real activations, measured and reported: the accuracy harness's rows per captured layer,
the input statistics that explain them, the verdict "does dS dominate?" per layer, and the markdown tables."""

from __future__ import annotations

import math
from typing import Any

import torch

from benchmarks.kernels import accuracy

GRADIENTS: tuple[str, ...] = ("dQ", "dK", "dV")
#: Tensors captured per attention call, as the accuracy harness names its inputs.
CAPTURED: tuple[str, ...] = ("q", "k", "v", "do")


def input_statistics(inputs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Statistics of one layer's inputs that explain its errors (see the module docstring), in float64."""
    q, k, v, do = (inputs[name].double() for name in CAPTURED)
    stats: dict[str, float] = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        stats[f"{name}_max_abs"] = float(x.abs().max())
    for name, x in (("q", q), ("k", k)):
        stats[f"{name}_rms"] = float(x.square().mean().sqrt())
        bias = x.mean(dim=2).abs() / x.std(dim=2).clamp_min(torch.finfo(torch.float64).tiny)  # [B, H, D]
        stats[f"{name}_channel_bias_mean"] = float(bias.mean())
        stats[f"{name}_channel_bias_max"] = float(bias.max())
    centered = k - k.mean(dim=2, keepdim=True)
    stats["k_range_over_centered"] = float((k.abs().amax(dim=(2, 3)) / centered.abs().amax(dim=(2, 3))).mean())
    rms = do.square().mean().sqrt()
    stats["do_rms"], stats["do_max_abs"] = float(rms), float(do.abs().max())
    stats["do_max_over_rms"] = float(do.abs().max() / rms) if rms > 0 else math.nan
    row_max = ref["P"].amax(dim=-1)  # max_j S_ij = lse_i + log max_j P_ij
    stats["score_max"] = float((ref["lse"] + row_max.log()).max())
    stats["p_row_max_mean"] = float(row_max.mean())
    return stats


def layer_rows(
    inputs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], causal: bool, path: str, common: dict[str, Any]
) -> list[dict]:
    """accuracy.py's rows for one layer: every setting, K-smoothing on and off, every tensor."""
    rows = []
    for smooth_k in accuracy.SMOOTH_K["sagebwd"]:
        for label, precision in accuracy.settings(smooth_k):
            for tensor, (cos, rel) in accuracy.measure(inputs, ref, precision, causal, path).items():
                row = {**common, "setting": precision.short_name, "label": label, "smooth_k": smooth_k}
                rows.append({**row, "tensor": tensor, "cos": accuracy.finite(cos), "rel_l2": accuracy.finite(rel)})
    return rows


def measure_layers(
    captured: list[dict[str, Any]], layers: list[int], source: str, path: str
) -> tuple[list[dict], list[dict[str, Any]]]:
    """accuracy.py's rows and the input statistics of each chosen layer of a capture."""
    rows, activations = [], []
    for index in layers:
        layer = captured[index]
        inputs = {name: layer[name].to(torch.bfloat16) for name in CAPTURED}
        batch, heads, length, head_dim = inputs["q"].shape
        kind = f"activations layer={index} {source}"
        common = {
            "path": path,
            "inputs": kind,
            "layer": index,
            "layer_name": layer["name"],
            "batch": batch,
            "heads": heads,
            "kv_heads": inputs["k"].shape[1],
            "seq": length,
            "head_dim": head_dim,
            "causal": layer["is_causal"],
        }
        print(f"--- {kind} ({layer['name']}): q {list(inputs['q'].shape)}, k {list(inputs['k'].shape)}", flush=True)
        ref = accuracy.exact(inputs, layer["is_causal"])
        rows += layer_rows(inputs, ref, layer["is_causal"], path, common)
        stats = input_statistics(inputs, ref)
        activations.append({"layer": index, "layer_name": layer["name"], "inputs": kind, "stats": stats})
    return rows, activations


def verdicts(rows: list[dict]) -> list[dict[str, Any]]:
    """The attribution of each layer and K-smoothing setting, from the rows."""
    found = []
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        layer = next(row["layer"] for row in rows if row["inputs"] == kind)
        for smooth_k in accuracy.SMOOTH_K["sagebwd"]:
            table = accuracy.lookup(rows, kind, smooth_k)
            finite = all(table["sagebwd"][t]["rel_l2"] is not None for t in GRADIENTS)
            costliest = {}
            for tensor in GRADIENTS:
                label = accuracy.largest_product(table, tensor)
                share = accuracy.error_share(table, label, tensor)
                costliest[tensor] = {
                    "product": label.split()[1],
                    "rel_l2": table[label][tensor]["rel_l2"],
                    "share": share if math.isfinite(share) else None,
                }
            shares = {t: accuracy.error_share(table, "only ds", t) for t in ("dQ", "dK")}
            found.append(
                {
                    "layer": layer,
                    "smooth_k": smooth_k,
                    "ds_dominates": accuracy.ds_dominates(table) if finite else None,
                    "ds_share": {t: share if math.isfinite(share) else None for t, share in shares.items()},
                    "costliest": costliest,
                }
            )
    return found


# ---------------------------------------------------------------------------------------------------- reports


def _cell(row: dict) -> str:
    """``cos / rel_l2`` of one row."""
    return f"{accuracy.fmt(row['cos'], 4)} / {accuracy.fmt(row['rel_l2'], 4)}"


def _share_text(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def attribution_table(rows: list[dict], found: list[dict[str, Any]]) -> list[str]:
    """Markdown: per layer and K-smoothing, the default's gradient errors and the costliest INT8 product of each."""
    lines = [
        "| layer | smooth_k | sagebwd dQ cos / rel_l2 | dK | dV | costliest INT8 product for dQ | for dK | for dV "
        "| ds share of dQ, dK | dS dominates |",
        "|---|---|---:|---:|---:|---|---|---|---:|---|",
    ]
    kinds = {row["layer"]: row["inputs"] for row in rows}
    for verdict in found:
        table = accuracy.lookup(rows, kinds[verdict["layer"]], verdict["smooth_k"])
        sage = [_cell(table["sagebwd"][t]) for t in GRADIENTS]
        costliest = [
            f"{c['product']} ({accuracy.fmt(c['rel_l2'], 4)}, {_share_text(c['share'])})"
            for c in (verdict["costliest"][t] for t in GRADIENTS)
        ]
        shares = ", ".join(_share_text(verdict["ds_share"][t]) for t in ("dQ", "dK"))
        dominates = {True: "yes", False: "no", None: "not ranked"}[verdict["ds_dominates"]]
        lines.append(
            f"| {verdict['layer']} | {verdict['smooth_k']} | " + " | ".join(sage + costliest) + f" | {shares} | "
            f"{dominates} |"
        )
    return lines


def _layers_text(layers: list[int], of: int) -> str:
    """``"every layer measured (4)"``, ``"none of the 4 layers"`` or ``"3 of 4 layers (0, 2, 3)"``."""
    if of and len(layers) == of:
        return f"every layer measured ({of})"
    if not layers:
        return f"none of the {of} layers"
    return f"{len(layers)} of {of} layers ({', '.join(map(str, layers))})"


def summary_lines(found: list[dict[str, Any]]) -> list[str]:
    """The answer to "does dS dominate?", overall and per layer, for K-smoothing on and off, from the verdicts.

    Overall, per K-smoothing setting: "yes" when dS dominates (:func:`accuracy.ds_dominates`) in every layer whose
    gradients are finite, "no" in none, "partly" in between; beside it, in how many layers ds is the costliest
    single INT8 product of both dQ and dK.
    """
    lines = []
    for smooth_k in accuracy.SMOOTH_K["sagebwd"]:
        chosen = [v for v in found if v["smooth_k"] == smooth_k]
        ranked = [v for v in chosen if v["ds_dominates"] is not None]
        dominated = [v["layer"] for v in ranked if v["ds_dominates"]]
        costliest = [v["layer"] for v in ranked if {v["costliest"][t]["product"] for t in ("dQ", "dK")} == {"ds"}]
        if not ranked:
            answer = "not ranked (non-finite gradients)"
        else:
            answer = "yes" if len(dominated) == len(ranked) else "no" if not dominated else "partly"
            answer += (
                f": over half of the dQ and dK error in {_layers_text(dominated, len(ranked))}; the costliest single "
                f"INT8 product of both dQ and dK in {_layers_text(costliest, len(ranked))}"
            )
        lines.append(f"- smooth_k={smooth_k}: does dS dominate the dQ/dK error? {answer}.")
        for verdict in chosen:
            top = verdict["costliest"]
            lines.append(
                f"  - layer {verdict['layer']}: "
                f"{ {True: 'yes', False: 'no', None: 'not ranked'}[verdict['ds_dominates']] }; ds alone gives "
                f"{_share_text(verdict['ds_share']['dQ'])} of dQ's and {_share_text(verdict['ds_share']['dK'])} of "
                f"dK's squared rel_l2; costliest product: dQ {top['dQ']['product']}, dK {top['dK']['product']}, dV "
                f"{top['dV']['product']}."
            )
    return lines


STAT_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("q_max_abs", "max abs q", 2),
    ("k_max_abs", "max abs k", 2),
    ("v_max_abs", "max abs v", 2),
    ("k_channel_bias_mean", "K bias/std mean", 3),
    ("k_channel_bias_max", "K bias/std max", 2),
    ("k_range_over_centered", "K range / centered", 3),
    ("q_channel_bias_mean", "Q bias/std mean", 3),
    ("do_rms", "dO rms", 3),
    ("do_max_over_rms", "dO max/rms", 1),
    ("score_max", "score max", 2),
    ("p_row_max_mean", "mean row max P", 3),
)


def statistics_table(activations: list[dict[str, Any]]) -> list[str]:
    """Markdown: the input statistics of every layer (:data:`STAT_COLUMNS`)."""
    lines = ["| layer | " + " | ".join(title for _, title, _ in STAT_COLUMNS) + " |"]
    lines.append("|---|" + "---:|" * len(STAT_COLUMNS))
    for layer in activations:
        stats = layer["stats"]
        cells = [
            f"{stats[key]:.{digits}e}" if key == "do_rms" else f"{stats[key]:.{digits}f}"
            for key, _, digits in STAT_COLUMNS
        ]
        lines.append(f"| {layer['layer']} | " + " | ".join(cells) + " |")
    return lines


def report(rows: list[dict], found: list[dict[str, Any]], activations: list[dict[str, Any]]) -> str:
    """The markdown body: the answer, the attribution table, the input statistics, accuracy.py's summary and tables."""
    return "\n".join(
        [
            "## Does dS dominate?",
            "",
            f'"dS dominates": INT8 dS alone reproduces more than {accuracy.DOMINANT_SHARE:.0%} of the SageBwd '
            "default's squared rel_l2 of dQ and of dK (accuracy.py's rule).",
            "",
            *summary_lines(found),
            "",
            "## Attribution per layer",
            "",
            "The SageBwd default's gradient errors against float64 attention (cos / rel_l2), and for each gradient "
            "the single INT8 product of the default whose `only` setting costs the most (its rel_l2, and its share of "
            "the default's squared rel_l2).",
            "",
            *attribution_table(rows, found),
            "",
            "## Inputs",
            "",
            "Per layer, over every captured token (definitions in benchmarks.training.attribution's docstring).",
            "",
            *statistics_table(activations),
            "",
            *accuracy.summarize(rows),
            "",
            "## Full tables",
            "",
            accuracy.format_tables(rows),
        ]
    )
