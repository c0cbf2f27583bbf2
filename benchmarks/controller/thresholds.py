"""The measurements behind ``PolicyConfig``'s default thresholds (``docs/controller.md`` cites them): the signals
per rung of the default ladder on each input kind of the accuracy harness (``accuracy-<device>-<date>-controller``),
and a calm run of ``overhead``'s transformer with ``AdaptivePrecision`` (``training-<device>-<date>-calm``: loss,
gradient norm, the spike detectors' z-scores and ``ds_rel_err`` per step), whose noise the thresholds must clear.

Example::

    python -m benchmarks.controller.thresholds           # CPU, about a minute; writes benchmarks/results/
    python -m benchmarks.controller.thresholds --seq 256 --steps 40 --out-dir /tmp/thresholds
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import statistics
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from sage_lightning.kernels import sage_attention, use_backend
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import result_file
from benchmarks.controller import overhead
from benchmarks.kernels import accuracy
from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig
from sage_lightning.layer import compare_with_full_precision

PROBED = ("O", "dQ", "dK", "dV")


def rungs() -> list[tuple[str, AttentionPrecision]]:
    """The default ladder's settings, cumulative from the SageBwd base (smooth_q shown on its own, as the
    forward's rung; ds_bf16 as reached by a backward signal, without it).
    """
    base = AttentionPrecision()
    return [
        ("base", base),
        ("smooth_q", base.replace(smooth_q=True)),
        ("ds_bf16", base.replace(ds="bf16")),
        ("full", base.replace(mode="full")),
    ]


def signal_rows(args: argparse.Namespace) -> list[dict]:
    """Part 1: ``ds_rel_err`` and the probe for every input kind and rung."""
    harness = accuracy.parse_args(["--seq", str(args.seq), "--head-dim", str(args.head_dim), "--seed", str(args.seed)])
    rows = []
    for kind in accuracy.input_kinds():
        x = accuracy.make_inputs(kind, harness)
        for label, precision in rungs():
            common = {
                "path": "reference",
                "setting": precision.short_name,
                "label": label,
                "inputs": kind,
                "seq": args.seq,
                "head_dim": args.head_dim,
                "causal": False,
            }
            q, k, v = (x[name].detach().requires_grad_(True) for name in ("q", "k", "v"))
            stats = torch.zeros(2)
            sage_attention(q, k, v, precision=precision, stats=stats).backward(x["do"])
            err2, norm2 = stats.tolist()
            ds_rel_err = math.sqrt(err2 / norm2) if norm2 > 0 else None  # "full" leaves the buffer alone
            rows.append({**common, "tensor": "ds_rel_err", "cos": None, "rel_l2": ds_rel_err})
            probe = compare_with_full_precision(x["q"], x["k"], x["v"], x["do"], precision=precision)
            rows += [{**common, "tensor": t, "cos": probe[t]["cos"], "rel_l2": probe[t]["rel_l2"]} for t in PROBED]
    return rows


class _Collect(Logger):
    """Keeps what the callback logs, step by step."""

    def __init__(self) -> None:
        super().__init__()
        self.by_step: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "collect"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.by_step.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params: object, *args: object, **kwargs: object) -> None:
        pass


def calm_rows(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Part 2: one row per optimizer step of a calm run, and the decisions it took (expected: none)."""
    torch.manual_seed(args.seed)
    model = overhead.TransformerLM(layers=args.layers, d_model=args.d_model, heads=args.heads, lr=args.lr)
    controller = AdaptivePrecision(PolicyConfig(ds_stats_every_n_steps=5), log_every_n_steps=1, verbose=False)
    collect = _Collect()
    data = overhead.markov_tokens(args.steps * args.batch, args.train_seq, seed=args.seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        callbacks=[controller],
        logger=collect,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=args.batch, shuffle=False))
    rows = []
    for step in sorted(s for s in collect.by_step if s is not None):
        logged = collect.by_step[step]
        if "sage/loss" not in logged:
            continue
        ds_errs = [v for tag, v in logged.items() if tag.startswith("sage/ds_rel_err/")]
        rows.append(
            {
                "run": "calm-markov",
                "attention": "sage",
                "tokens_per_step": int(logged["sage/tokens_per_step"]),
                "qk_norm": False,
                "seed": args.seed,
                "step": step,
                "tokens_seen": int(logged["sage/tokens_seen"]),
                "train_loss": logged["sage/loss"],
                "grad_norm": logged.get("sage/grad_norm"),
                "loss_z": logged.get("sage/spike/loss_z"),
                "grad_norm_z": logged.get("sage/spike/grad_norm_z"),
                "ds_rel_err_max": max(ds_errs) if ds_errs else None,
            }
        )
    return rows, [str(d) for d in controller.history]


def signal_table(rows: list[dict]) -> str:
    """Markdown: per input kind and rung, ds_rel_err and the probe's cosines."""
    lines = ["| inputs | rung | ds_rel_err | O cos | dQ cos | dK cos | dV cos |", "|---|---|---:|---:|---:|---:|---:|"]
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        table.setdefault((row["inputs"], row["label"]), {})[row["tensor"]] = row
    for (kind, label), by_tensor in table.items():
        err = by_tensor["ds_rel_err"]["rel_l2"]
        cells = ["-" if err is None else f"{err:.4f}"] + [f"{by_tensor[t]['cos']:.5f}" for t in PROBED]
        lines.append(f"| {kind} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calm_summary(rows: list[dict], decisions: list[str]) -> str:
    """Markdown: how far the calm run's z-scores and dS error went."""
    loss_z = [r["loss_z"] for r in rows if r["loss_z"] is not None]
    grad_z = [r["grad_norm_z"] for r in rows if r["grad_norm_z"] is not None]
    ds = [r["ds_rel_err_max"] for r in rows if r["ds_rel_err_max"] is not None]
    steps_between = [b / a for a, b in zip(ds, ds[1:], strict=False) if a > 0]
    lines = [
        f"- steps: {len(rows)}; loss {rows[0]['train_loss']:.3f} -> {rows[-1]['train_loss']:.3f}",
        f"- loss robust z (after the detector's warm-up, {len(loss_z)} steps): max {max(loss_z):.2f}, "
        f"median {statistics.median(loss_z):.2f}",
        f"- gradient-norm robust z ({len(grad_z)} steps): max {max(grad_z):.2f}, "
        f"median {statistics.median(grad_z):.2f}",
        f"- ds_rel_err (worst layer, {len(ds)} measurements): {min(ds):.4f} to {max(ds):.4f}; ratio of consecutive "
        f"measurements {min(steps_between):.3f} to {max(steps_between):.3f}",
        f"- decisions taken: {len(decisions)}" + (": " + "; ".join(decisions) if decisions else ""),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024, help="part 1: sequence length (the harness's default)")
    parser.add_argument("--head-dim", type=int, default=64, help="part 1: head dim (the harness's default)")
    parser.add_argument("--steps", type=int, default=300, help="part 2: optimizer steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--train-seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=result_file.RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, dict]:
    """Run both parts on CPU, print the tables, write the two JSON files and their markdown."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    today = datetime.date.today()
    header = result_file.header("accuracy", "cpu", "benchmarks.controller.thresholds", argv)
    with use_backend("reference"):
        signals = {**header, "rows": signal_rows(args)}
        calm_list, decisions = calm_rows(args)
    calm = {**header, "kind": "training", "rows": calm_list}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    outputs = []
    for result, stem, text in (
        (signals, f"accuracy-cpu-{today:%Y%m%d}-controller", signal_table(signals["rows"])),
        (calm, f"training-cpu-{today:%Y%m%d}-calm", calm_summary(calm["rows"], decisions)),
    ):
        path = result_file.write(result, args.out_dir / f"{stem}.json")
        heading = f"# {stem}\n\ncpu, {header['date']}, commit {header['commit']}\n\n`{header['command']}`\n\n"
        path.with_suffix(".md").write_text(heading + text + "\n")
        print(text)
        outputs.append(path)
    print("wrote " + ", ".join(str(p) for p in outputs))
    return signals, calm


if __name__ == "__main__":
    main()
