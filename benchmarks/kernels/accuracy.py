"""Per-tensor error of SageBwd's PyTorch reference against float64 attention: which product costs what.

For every input kind (:func:`input_kinds`), precision setting and K-smoothing on and off, the reference's
intermediates (``O, lse, delta, P, dP, dS, dQ, dK, dV``) against ``exact_attention`` (float64) on the same bf16
inputs: cosine and relative L2 in float64 (non-finite: JSON ``null``). ``--mode`` picks the settings (:data:`MODES`:
INT8 products alone, FP8 formats, simulated NVFP4); ``--path triton`` measures the kernels' outputs instead.

Example::

    python -m benchmarks.kernels.accuracy                      # default size on CPU, writes benchmarks/results/
    python -m benchmarks.kernels.accuracy --seq 512 --causal --out /tmp/acc.json
    python -m benchmarks.kernels.accuracy --mode formats --seq 512 --causal
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from sage_lightning.kernels import PRODUCTS, AttentionPrecision
from sage_lightning.kernels.reference import exact_attention, sage_attention_intermediates

from benchmarks.result_file import default_path, device_name, header, write

TENSORS: tuple[str, ...] = ("O", "lse", "delta", "P", "dP", "dS", "dQ", "dK", "dV")
#: What the Triton path returns (its intermediates live in registers): the outputs and the gradients.
OUTPUT_TENSORS: tuple[str, ...] = ("O", "lse", "dQ", "dK", "dV")
#: The bar of issue #3 on N(0,1) inputs with the default setting: (O, dV) and (dQ, dK) cosines.
BAR_COS = {"O": 0.999, "dV": 0.999, "dQ": 0.997, "dK": 0.997}
SIGMAS: tuple[float, ...] = (1.0, 3.0, 4.0, 10.0)
OUTLIER_CHANNELS = 4
OUTLIER_OFFSET = 10.0
OUTLIER_SCALE = 3.0
#: What the harness measures: SageBwd's products one at a time (INT8; ``formats``: INT8 and FP8), or simulated
#: NVFP4 (Attn-QAT).
MODES: tuple[str, ...] = ("sagebwd", "attn_qat", "formats")
#: K-smoothing settings measured per mode (attn_qat mode has no smoothing; its baselines keep SageBwd's default).
SMOOTH_K: dict[str, tuple[bool, ...]] = {"sagebwd": (True, False), "attn_qat": (True,), "formats": (True, False)}
#: The result file's name tag and the markdown heading's subject, per mode.
MODE_TAGS: dict[str, str] = {"sagebwd": "", "attn_qat": "-attn_qat", "formats": "-formats"}
MODE_TITLES: dict[str, str] = {
    "sagebwd": "SageBwd",
    "attn_qat": "Attn-QAT (simulated NVFP4)",
    "formats": "SageBwd, INT8 and FP8 products",
}
#: The tensors compared with the FP4 forward's own float64 gradient in attn_qat mode.
FP4_GRADIENT_TENSORS: tuple[str, ...] = ("O", "dQ", "dK", "dV")


def settings(smooth_k: bool, mode: str = "sagebwd") -> list[tuple[str, AttentionPrecision]]:
    """The precision settings compared, as ``(label, precision)`` pairs."""
    if mode not in MODES:
        raise ValueError(f"settings: mode must be one of {MODES}; received {mode!r}")
    bf16 = AttentionPrecision.all_bf16(smooth_k=smooth_k)
    if mode == "attn_qat":
        qat = AttentionPrecision(mode="attn_qat")
        return [
            ("bf16", bf16),
            ("sagebwd", AttentionPrecision(smooth_k=smooth_k)),
            ("attn_qat", qat),
            ("attn_qat dropin", qat.replace(qat_backward="dropin")),
        ]
    pairs = [
        ("bf16", bf16),
        ("sagebwd", AttentionPrecision(smooth_k=smooth_k)),
        ("all7", AttentionPrecision.all_int8(smooth_k=smooth_k)),
    ]
    pairs += [(f"only {p}", bf16.replace(**{p: "int8"})) for p in PRODUCTS]
    return pairs + (fp8_settings(smooth_k) if mode == "formats" else [])


def fp8_settings(smooth_k: bool) -> list[tuple[str, AttentionPrecision]]:
    """The FP8 settings of ``--mode formats``, as ``(label, precision)`` pairs: each product alone in FP8 (the
    rest bf16), then the mixes worth running (the INT8 default with pv, ds or both in FP8, or ds in bf16; the
    forward in FP8 with the default's backward; every product in FP8).
    """
    bf16 = AttentionPrecision.all_bf16(smooth_k=smooth_k)
    default = AttentionPrecision(smooth_k=smooth_k)
    pairs = [(f"only {p} fp8", bf16.replace(**{p: "fp8"})) for p in PRODUCTS]
    return pairs + [
        ("default, pv fp8", default.replace(pv="fp8")),
        ("default, ds fp8", default.replace(ds="fp8")),
        ("default, ds bf16", default.replace(ds="bf16")),
        ("default, pv+ds fp8", default.replace(pv="fp8", ds="fp8")),
        ("fp8 fwd, int8 bwd", default.replace(qk="fp8", pv="fp8")),
        ("all fp8", AttentionPrecision.all_fp8(smooth_k=smooth_k)),
    ]


def input_kinds() -> list[str]:
    """The names of the input kinds, as written to the ``inputs`` field."""
    names = [f"normal sigma={s:g}" for s in SIGMAS]
    return names + [f"outliers ch={OUTLIER_CHANNELS} offset={OUTLIER_OFFSET:g} scale={OUTLIER_SCALE:g}"]


def _add_outliers(x: torch.Tensor, channels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` with ``channels`` replaced by ``offset * sign + scale * z`` (sign per batch, head, channel)."""
    b, h, _, _ = x.shape
    sign = torch.randint(0, 2, (b, h, 1, len(channels)), generator=gen).float() * 2 - 1
    z = torch.randn(x.shape[:3] + (len(channels),), generator=gen)
    x = x.clone()
    x[..., channels] = OUTLIER_OFFSET * sign + OUTLIER_SCALE * z
    return x


def make_inputs(kind: str, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """q, k, v, dO in bf16 on ``args.device`` for one input kind (see the module docstring)."""
    gen = torch.Generator().manual_seed(args.seed)
    q_shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q, k = torch.randn(q_shape, generator=gen), torch.randn(kv_shape, generator=gen)
    v, do = torch.randn(kv_shape, generator=gen), torch.randn(q_shape, generator=gen)
    if kind.startswith("normal"):
        sigma = float(kind.split("=")[1])
        q, k = q * sigma, k * sigma
    else:
        channels = torch.randperm(args.head_dim, generator=gen)[: min(OUTLIER_CHANNELS, args.head_dim)]
        q, k = _add_outliers(q, channels, gen), _add_outliers(k, channels, gen)
    return {name: t.to(torch.bfloat16).to(args.device) for name, t in (("q", q), ("k", k), ("v", v), ("do", do))}


def compare(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Cosine similarity and relative L2 error of ``x`` against ``ref``, in float64, flattened.

    A cosine above 1 by at most 1e-12 (float64 round-off) is reported as 1.
    """
    a, r = x.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten()
    r_norm = r.norm()
    cos = float((a @ r) / (a.norm() * r_norm))
    if 1.0 < cos <= 1.0 + 1e-12:  # float64 round-off on identical directions
        cos = 1.0
    return cos, float((a - r).norm() / r_norm)


def exact(inputs: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """``exact_attention`` (float64) on ``inputs``."""
    return exact_attention(inputs["q"], inputs["k"], inputs["v"], inputs["do"], is_causal=causal)


def measure(
    inputs: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    precision: AttentionPrecision,
    causal: bool,
    path: str = "reference",
) -> dict[str, tuple[float, float]]:
    """``(cos, rel_l2)`` of every tensor of one SageBwd run against ``ref``."""
    if path == "triton":
        from sage_lightning.kernels.ops import sage_attention_triton

        q, k, v = (inputs[name].detach().requires_grad_() for name in ("q", "k", "v"))
        out, lse = sage_attention_triton(q, k, v, is_causal=causal, precision=precision)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs["do"])
        got = {"O": out, "lse": lse, "dQ": dq, "dK": dk, "dV": dv}
        return {name: compare(got[name], ref[name]) for name in OUTPUT_TENSORS if name in ref}
    got = sage_attention_intermediates(
        inputs["q"], inputs["k"], inputs["v"], inputs["do"], is_causal=causal, precision=precision
    )
    return {name: compare(got[name], ref[name]) for name in TENSORS if name in ref}


def fp4_gradient(inputs: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """The FP4 forward's own straight-through gradient in float64: the Attn-QAT reference on the inputs upcast.

    ``tests/test_attn_qat.py`` holds it to a dense float64 formula (agreement to 1e-10).
    """
    f64 = {name: t.to(torch.float64) for name, t in inputs.items()}
    got = sage_attention_intermediates(
        f64["q"], f64["k"], f64["v"], f64["do"], is_causal=causal, precision=AttentionPrecision.attn_qat()
    )
    return {name: got[name] for name in FP4_GRADIENT_TENSORS}


def finite(x: float) -> float | None:
    """``x``, or ``None`` (JSON null) when it is NaN or infinite."""
    return x if math.isfinite(x) else None


def collect_rows(args: argparse.Namespace) -> list[dict]:
    """Every result row: input kinds x smooth_k x settings x tensors."""
    rows = []
    for kind in args.inputs or input_kinds():
        inputs = make_inputs(kind, args)
        references = [("float64", exact(inputs, args.causal))]
        if args.mode == "attn_qat":
            references.append(("fp4_float64", fp4_gradient(inputs, args.causal)))
        for smooth_k in SMOOTH_K[args.mode]:
            for label, precision in settings(smooth_k, args.mode):
                for against, ref in references:
                    if against == "fp4_float64" and precision.mode != "attn_qat":
                        continue
                    for tensor, (cos, rel) in measure(inputs, ref, precision, args.causal, args.path).items():
                        row = {
                            "path": args.path,
                            "setting": precision.short_name,
                            "label": label,
                            "inputs": kind,
                            "batch": args.batch,
                            "heads": args.heads,
                            "kv_heads": args.kv_heads,
                            "seq": args.seq,
                            "head_dim": args.head_dim,
                            "causal": args.causal,
                            "smooth_k": smooth_k,
                            "tensor": tensor,
                            "cos": finite(cos),
                            "rel_l2": finite(rel),
                        }
                        if args.mode == "attn_qat":
                            row["against"] = against
                        rows.append(row)
    return rows


def lookup(rows: list[dict], kind: str, smooth_k: bool, against: str = "float64") -> dict[str, dict[str, dict]]:
    """Rows of one input kind and smooth_k, against one reference, as ``{label: {tensor: row}}``."""
    table: dict[str, dict[str, dict]] = {}
    for row in rows:
        if row["inputs"] == kind and row["smooth_k"] == smooth_k and row.get("against", "float64") == against:
            table.setdefault(row["label"], {})[row["tensor"]] = row
    return table


def fmt(x: float | None, digits: int) -> str:
    return "nan" if x is None else f"{x:.{digits}f}"


def format_tables(rows: list[dict]) -> str:
    """Markdown tables: for each input kind and smooth_k, cos then rel_l2, rows = settings."""
    lines = []
    kinds = list(dict.fromkeys(row["inputs"] for row in rows))
    for kind in kinds:
        for against in dict.fromkeys(row.get("against", "float64") for row in rows):
            for smooth_k in dict.fromkeys(row["smooth_k"] for row in rows):
                table = lookup(rows, kind, smooth_k, against)
                present = {t for by_tensor in table.values() for t in by_tensor}
                tensors = [t for t in TENSORS if t in present]
                title = f"{kind}, smooth_k={smooth_k}" if against == "float64" else f"{kind}, against {against}"
                for metric, digits in (("cos", 6), ("rel_l2", 5)):
                    lines += [f"### {metric}: {title}", ""]
                    lines.append("| setting | " + " | ".join(tensors) + " |")
                    lines.append("|---|" + "---:|" * len(tensors))
                    for label, by_tensor in table.items():
                        cells = [fmt(by_tensor[t][metric], digits) for t in tensors]
                        lines.append(f"| {label} | " + " | ".join(cells) + " |")
                    lines.append("")
    return "\n".join(lines)


#: The single-product settings whose product is INT8 in the default SageBwd (dp is not).
PRODUCT_LABELS: tuple[str, ...] = tuple(f"only {p}" for p in AttentionPrecision().int8_products)


def _worst(by_tensor: dict[str, dict], names: tuple[str, ...], count: int) -> list[str]:
    """The ``count`` tensors among ``names`` with the lowest cos (all finite: callers check)."""
    return sorted(names, key=lambda t: by_tensor[t]["cos"])[:count]


def error_share(table: dict[str, dict[str, dict]], label: str, tensor: str) -> float:
    """Share of sagebwd's squared rel_l2 of ``tensor`` that setting ``label`` alone reproduces."""
    alone, full = table[label][tensor]["rel_l2"], table["sagebwd"][tensor]["rel_l2"]
    return math.nan if alone is None or not full else (alone / full) ** 2


def _kind_summary(table: dict[str, dict[str, dict]], kind: str) -> tuple[list[str], bool | None, bool | None]:
    """Summary lines for one input kind, whether the ordering agrees with the study, whether ds dominates.

    Both flags are ``None`` when the sagebwd run has a non-finite metric (nothing to rank).
    """
    sage = table["sagebwd"]
    names = ("P", "dP", "dS", "O", "dQ", "dK", "dV")
    cos = ", ".join(f"{t} {fmt(sage[t]['cos'], 4)}" for t in names)
    lines = [f"- {kind}: cos {cos}."]
    bad = [t for t in TENSORS if sage[t]["cos"] is None]
    if bad:
        lines.append(f"  non-finite in the reference's output ({', '.join(bad)}): not ranked.")
        return lines, None, None
    low = _worst(sage, ("P", "dP", "dS"), 1)[0]
    worst = _worst(sage, ("O", "dQ", "dK", "dV"), 2)
    ordering = low == "dS" and set(worst) == {"dQ", "dK"}
    ds = {t: error_share(table, "only ds", t) for t in ("dQ", "dK")}
    top = {t: largest_product(table, t) for t in ("dQ", "dK")}
    lines += [
        f"  lowest of P/dP/dS: {low} (study: dS); worst of O/dQ/dK/dV: {', '.join(worst)} (study: dQ, dK) "
        f"-> {'agrees' if ordering else 'DIFFERS'}.",
        f"  ds alone in INT8 gives {ds['dQ']:.0%} of dQ's and {ds['dK']:.0%} of dK's squared rel_l2; "
        f"largest single INT8 product of sagebwd: dQ {top['dQ'].split()[1]} "
        f"({error_share(table, top['dQ'], 'dQ'):.0%}), "
        f"dK {top['dK'].split()[1]} ({error_share(table, top['dK'], 'dK'):.0%}).",
    ]
    return lines, ordering, ds_dominates(table)


def largest_product(table: dict[str, dict[str, dict]], tensor: str) -> str:
    """The label of :data:`PRODUCT_LABELS` that alone reproduces the largest share of sagebwd's error in ``tensor``."""

    def rank(label: str) -> float:
        share = error_share(table, label, tensor)
        return -math.inf if math.isnan(share) else share

    return max(PRODUCT_LABELS, key=rank)


#: INT8 dS "dominates" when it alone reproduces more than this share of sagebwd's squared rel_l2 of dQ and of dK.
DOMINANT_SHARE = 0.5


def ds_dominates(table: dict[str, dict[str, dict]]) -> bool:
    """Whether ``only ds`` reproduces more than :data:`DOMINANT_SHARE` of sagebwd's squared dQ and dK error.

    Squared rel_l2, because errors of independent sources add in squares.
    """
    return min(error_share(table, "only ds", t) for t in ("dQ", "dK")) > DOMINANT_SHARE


def summarize(rows: list[dict]) -> list[str]:
    """Summary lines on the default ``sagebwd`` setting with K-smoothing, per input kind, against the SageBwd study
    (dS the lowest-cos intermediate, dQ and dK the worst outputs): the lowest cos of P, dP, dS, the two worst of O, dQ,
    dK, dV, and the share of the dQ/dK error (squared rel_l2) that ``ds`` alone in INT8 reproduces, beside the most."""
    if any("against" in row for row in rows):
        return summarize_attn_qat(rows)
    formats = summarize_formats(rows) if any(row["label"] in FP8_LABELS for row in rows) else []
    if {row["path"] for row in rows} == {"triton"}:
        return summarize_outputs(rows) + formats
    lines = ["## Summary (setting sagebwd, smooth_k=True)", ""]
    ordering, dominant = {}, {}
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        kind_lines, ordering[kind], dominant[kind] = _kind_summary(lookup(rows, kind, True), kind)
        lines += kind_lines

    def which(flags: dict[str, bool | None], value: bool | None) -> str:
        return ", ".join(k for k, v in flags.items() if v is value) or "none"

    lines += [
        "",
        f"Ordering (dS lowest intermediate, dQ/dK worst outputs) agrees with the study for: "
        f"{which(ordering, True)}; differs for: {which(ordering, False)}; not ranked (non-finite): "
        f"{which(ordering, None)}.",
        f"ds alone accounts for most (>50%) of the dQ and dK error for: {which(dominant, True)}; "
        f"not for: {which(dominant, False)}.",
    ]
    return lines + formats


#: The labels of :func:`fp8_settings` (the same for either smooth_k).
FP8_LABELS: tuple[str, ...] = tuple(label for label, _ in fp8_settings(True))
#: The tensor a product's error shows in first, in order of preference (the first one measured is used): the
#: product's own result where it is an intermediate, else the first output it feeds.
PRODUCT_TENSORS: dict[str, tuple[str, ...]] = {
    "qk": ("P", "O"),
    "pv": ("O",),
    "dv": ("dV",),
    "dp": ("dP", "dQ"),
    "ds": ("dS", "dQ"),
}


def fp8_over_int8(table: dict[str, dict[str, dict]]) -> dict[str, tuple[str, float]]:
    """Per product, ``(tensor, rel_l2 of "only <p> fp8" / rel_l2 of "only <p>")`` on the tensor of
    :data:`PRODUCT_TENSORS` (NaN where either is missing or not finite, or INT8's is zero).
    """
    ratios = {}
    for product, candidates in PRODUCT_TENSORS.items():
        int8, fp8 = table.get(f"only {product}", {}), table.get(f"only {product} fp8", {})
        tensor = next((t for t in candidates if t in int8 and t in fp8), None)
        if tensor is None:
            continue
        a, b = fp8[tensor]["rel_l2"], int8[tensor]["rel_l2"]
        ratios[product] = (tensor, a / b if a is not None and b else math.nan)
    return ratios


def summarize_formats(rows: list[dict]) -> list[str]:
    """Summary of a ``formats`` run (smooth_k=True): per input kind, rel_l2 of O, dS and the gradients under every
    setting but ``all7`` and the INT8-alone rows' FP8 twins side by side, and FP8's rel_l2 over INT8's for each
    product alone (on the tensor of :data:`PRODUCT_TENSORS`; below 1: FP8 is the more accurate).
    """
    lines = ["", "## FP8 (e4m3) against INT8, rel_l2 against float64 (smooth_k=True)", ""]
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        table = lookup(rows, kind, True)
        present = {t for by_tensor in table.values() for t in by_tensor}
        tensors = [t for t in ("O", "dS", "dQ", "dK", "dV") if t in present]
        order = ["bf16", "sagebwd"]
        for product in PRODUCTS:
            order += [f"only {product}", f"only {product} fp8"]
        order += [label for label in FP8_LABELS if not label.startswith("only ")]
        lines += [f"### {kind}", "", "| setting | " + " | ".join(tensors) + " |", "|---|" + "---:|" * len(tensors)]
        for label in (label for label in order if label in table):
            lines.append(f"| {label} | " + " | ".join(fmt(table[label][t]["rel_l2"], 5) for t in tensors) + " |")
        ratios = fp8_over_int8(table)
        text = ", ".join(f"{p} ({t}) {fmt(r if math.isfinite(r) else None, 2)}" for p, (t, r) in ratios.items())
        lines += ["", f"FP8 / INT8 rel_l2, each product alone: {text}.", ""]
    return lines


def summarize_outputs(rows: list[dict]) -> list[str]:
    """Summary of a run without intermediates (the Triton path): the default setting's output cosines per
    input kind, and whether N(0,1) inputs meet :data:`BAR_COS`.
    """
    lines = ["## Summary (setting sagebwd, smooth_k=True)", ""]
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        sage = lookup(rows, kind, True)["sagebwd"]
        lines.append(f"- {kind}: cos " + ", ".join(f"{t} {fmt(sage[t]['cos'], 5)}" for t in BAR_COS))
        if kind == "normal sigma=1":
            misses = [t for t, bar in BAR_COS.items() if sage[t]["cos"] is None or sage[t]["cos"] < bar]
            verdict = "meets" if not misses else f"MISSES ({', '.join(misses)})"
            lines.append(f"  bar (O, dV >= 0.999; dQ, dK >= 0.997 with int8 dS): {verdict}.")
    return lines


def summarize_attn_qat(rows: list[dict]) -> list[str]:
    """Summary of an attn_qat run: per input kind, the output cosines of each setting against float64, and of the
    two QAT backwards against the FP4 forward's own gradient.
    """
    lines = ["## Summary (simulated NVFP4)", ""]
    names = FP4_GRADIENT_TENSORS
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        exact_table = lookup(rows, kind, True)
        own_table = lookup(rows, kind, True, "fp4_float64")
        lines.append(f"- {kind}, cos against float64 attention:")
        for label, by_tensor in exact_table.items():
            lines.append(f"  {label}: " + ", ".join(f"{t} {fmt(by_tensor[t]['cos'], 5)}" for t in names))
        lines.append("  against the FP4 forward's own float64 gradient (what QAT should follow):")
        for label, by_tensor in own_table.items():
            lines.append(f"  {label}: " + ", ".join(f"{t} {fmt(by_tensor[t]['cos'], 5)}" for t in names))
    lines += [
        "",
        "The matched backward is the straight-through gradient of the FP4 forward (up to bf16 rounding); the "
        "drop-in backward is FlashAttention's gradient at the unquantized inputs, fed the FP4 output and "
        "logsumexp, which follows neither function where FP4 moves the scores.",
    ]
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--inputs", action="append", choices=input_kinds(), help="an input kind (repeatable; default: all)"
    )
    parser.add_argument("--path", choices=("reference", "triton"), default="reference",
                        help="reference: every intermediate; triton: the kernels' outputs and gradients")  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="sagebwd",
                        help="sagebwd: each INT8 product alone; formats: and FP8 products alone and in mixes; "
                        "attn_qat: simulated NVFP4 beside bf16 and the SageBwd default")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON path; the .md table is written beside it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the harness, print the tables and summary, write the JSON and markdown; returns the JSON dict."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    rows = collect_rows(args)
    result = {**header("accuracy", device_name(args.device), __spec__.name, argv), "rows": rows}
    out = args.out or default_path("accuracy", result["device"], MODE_TAGS[args.mode])
    text = format_tables(rows) + "\n" + "\n".join(summarize(rows)) + "\n"
    print(text)
    write(result, out)
    what = MODE_TITLES[args.mode]
    heading = (
        f"# Accuracy: {what} ({args.path}) vs float64\n\n{result['device']}, {result['date']}, commit "
        f"{result['commit']}\n\n`{result['command']}`\n\n"
    )
    out.with_suffix(".md").write_text(heading + text)
    print(f"wrote {out} and {out.with_suffix('.md')} ({time.perf_counter() - start:.1f} s)")
    return result


if __name__ == "__main__":
    main()
