"""The pretraining example on one GPU, then on two with DDP and with FSDP (NCCL), steered by ``AdaptivePrecision``:
are the decisions identical on both ranks, is a NaN on one rank handled as on the CPU, and what do two GPUs give in
tokens/s against one (issue 16, case 8).

Each run is a child process (Lightning's DDP launcher re-runs the script once per rank); each rank writes what it
did to ``<out>/<run>-rank<r>.json`` (decisions, final precisions, rollbacks, steady tokens/s, whether the weights
are finite); the parent compares them and writes ``multi-gpu-<device>-<date>.{json,md}`` in ``--out-dir``.

Run (on a machine with two GPUs; about 6 minutes with the defaults)::

    python -m benchmarks.controller.multi_gpu --config examples/configs/small.yaml --out-dir "$OUT"

Every run gets a NaN loss on rank ``--nan-rank`` (of the multi-GPU runs; rank 0 on one GPU) at step
``--nan-step``: the controller must roll back on every rank at the same step and escalate the same layers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from benchmarks.result_file import REPO, device_slug, header
from benchmarks.training import runs, specs
from examples.corpus import TextDataModule
from examples.pretrain import TokensPerSecond
from sage_lightning import AdaptivePrecision, attention_layers

#: The runs: name -> (devices, strategy).
RUNS: dict[str, tuple[int, str]] = {"single": (1, "auto"), "ddp": (2, "ddp"), "fsdp": (2, "fsdp")}


class LossFault(Callback):
    """Multiply the loss ``training_step`` returns by ``factor`` (NaN: a real NaN, in the loss and the gradients) on the
    first micro-batch of optimizer step ``step`` (of every step from it with ``every_step``), on global rank ``rank``.
    """

    def __init__(self, step: int, factor: float, rank: int = 0, every_step: bool = False) -> None:
        self.step, self.factor, self.rank, self.every_step = step, factor, rank, every_step
        self.fired: set[int] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        original = pl_module.training_step

        def training_step(batch: Any, batch_idx: int) -> Any:
            loss = original(batch, batch_idx)
            step = trainer.global_step
            due = step == self.step or (self.every_step and step > self.step)
            if due and trainer.global_rank == self.rank and step not in self.fired:
                self.fired.add(step)
                return loss * self.factor
            return loss

        # An instance attribute: Lightning (and DDP's wrapper) call pl_module.training_step.
        pl_module.training_step = training_step


class RankRecord(Callback):
    """Each rank writes what it did at the end of training."""

    def __init__(self, out: Path, run: str, throughput: TokensPerSecond) -> None:
        self.out, self.run, self.throughput = out, run, throughput

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        controller = next(cb for cb in trainer.callbacks if isinstance(cb, AdaptivePrecision))
        record = {
            "run": self.run,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "steps": trainer.global_step,
            "decisions": [str(d) for d in controller.history],
            "precisions": {n: s.precision.short_name for n, s in attention_layers(pl_module).items()},
            "rollbacks": controller.rollbacks,
            "skipped_steps": controller.skipped_steps,
            "int8_fraction": controller.int8_fraction,
            "tokens_seen": controller.tokens_seen,
            "tokens_per_s": runs.steady_tokens_per_s(self.throughput.windows),
            "params_finite": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        }
        (self.out / f"{self.run}-rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def worker(args: argparse.Namespace) -> None:
    """One run (this process is one of its ranks)."""
    devices, strategy_name = RUNS[args.worker]
    config = specs.load_config(args.config, args.set)
    data = TextDataModule(**(config.get("data") or {}))
    data.prepare_data()
    L.seed_everything(int(config.get("seed_everything", 0) or 0), workers=True)
    spec = specs.RunSpec(name="sage", attention="sage")
    model = runs.build_model(config, spec, data)
    controller = runs.run_controller(config, spec) or AdaptivePrecision()
    throughput = TokensPerSecond()
    strategy: Any = strategy_name
    if strategy_name == "ddp":
        strategy = DDPStrategy(process_group_backend=args.backend)
    elif strategy_name == "fsdp":
        strategy = FSDPStrategy(process_group_backend=args.backend, sharding_strategy="FULL_SHARD")
    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k not in specs.TRAINER_OWN}
    trainer_args.update(devices=devices, strategy=strategy, max_steps=args.max_steps, val_check_interval=None)
    trainer_args.update(limit_val_batches=0, check_val_every_n_epoch=None)
    nan_rank = args.nan_rank if devices > 1 else 0
    trainer = L.Trainer(
        **trainer_args,
        callbacks=[
            LossFault(args.nan_step, float("nan"), rank=nan_rank),
            throughput,
            controller,
            RankRecord(args.out_dir, args.worker, throughput),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(args.out_dir / args.worker),
    )
    trainer.fit(model, datamodule=data)


def summarize(out: Path, runs: list[str]) -> dict[str, Any]:
    """Compare the ranks of each run, and each multi-GPU run's tokens/s with the single GPU's."""
    summary: dict[str, Any] = {"runs": {}}
    for run in runs:
        ranks = sorted(out.glob(f"{run}-rank*.json"))
        records = [json.loads(p.read_text()) for p in ranks]
        if not records:
            summary["runs"][run] = {"error": "no rank wrote a record (see the run's log)"}
            continue
        first = records[0]
        summary["runs"][run] = {
            "ranks": len(records),
            "decisions_identical": all(r["decisions"] == first["decisions"] for r in records),
            "precisions_identical": all(r["precisions"] == first["precisions"] for r in records),
            "rollbacks": [r["rollbacks"] for r in records],
            "params_finite": all(r["params_finite"] for r in records),
            "tokens_per_s": first["tokens_per_s"],
            "int8_fraction": first["int8_fraction"],
            "decisions": first["decisions"],
            "peak_memory_gb": [r["peak_memory_gb"] for r in records],
        }
    single = summary["runs"].get("single", {}).get("tokens_per_s")
    for run, entry in summary["runs"].items():
        speed = entry.get("tokens_per_s")
        if single and speed and run != "single":
            entry["speedup_vs_one_gpu"] = speed / single
    return summary


def markdown(summary: dict[str, Any], device: str) -> str:
    lines = [
        f"# Multi-GPU runs of the pretraining example ({device})",
        "",
        "| run | ranks | same decisions | rollbacks per rank | weights finite | tokens/s | vs one GPU | int8 share |",
        "|---|---:|---|---|---|---:|---:|---:|",
    ]
    for run, e in summary["runs"].items():
        if "error" in e:
            lines.append(f"| {run} | | {e['error']} | | | | | |")
            continue
        speed = f"{e['tokens_per_s']:.0f}" if e["tokens_per_s"] and math.isfinite(e["tokens_per_s"]) else "n/a"
        ratio = f"{e['speedup_vs_one_gpu']:.2f}x" if "speedup_vs_one_gpu" in e else ""
        lines.append(
            f"| {run} | {e['ranks']} | {e['decisions_identical'] and e['precisions_identical']} | {e['rollbacks']} | "
            f"{e['params_finite']} | {speed} | {ratio} | {e['int8_fraction']:.3f} |"
        )
    for run, e in summary["runs"].items():
        lines += ["", f"## {run}: decisions (rank 0)", ""] + [f"- {d}" for d in e.get("decisions", [])]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples/configs/small.yaml")
    parser.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE changes to the config")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--nan-step", type=int, default=150)
    parser.add_argument("--nan-rank", type=int, default=1)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out-dir", type=Path, default=Path("multi-gpu-out"))
    parser.add_argument("--backend", default="nccl", help="process group backend (gloo for a CPU try)")
    parser.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return {}
    for run in args.runs:
        command = [sys.executable, "-m", __spec__.name, *(argv if argv is not None else sys.argv[1:]), "--worker", run]
        with open(args.out_dir / f"{run}.log", "w") as log:
            status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
        print(f"{run}: exit {status} (log: {args.out_dir / f'{run}.log'})", flush=True)
    summary = summarize(args.out_dir, args.runs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {**header("multi-gpu", device, "benchmarks.controller.multi_gpu", argv or sys.argv[1:]), **summary}
    stamp = f"{device_slug(device)}-{summary['date'].replace('-', '')}"
    (args.out_dir / f"multi-gpu-{stamp}.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary, device)
    (args.out_dir / f"multi-gpu-{stamp}.md").write_text(text)
    print(text)
    return summary


if __name__ == "__main__":
    main()
