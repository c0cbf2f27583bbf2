"""Pretraining with SageBwd against full-precision attention: the same config run once per attention setting.

Reads an example config (``examples/configs/small.yaml`` by default) and trains it once per ``--attention``
value, everything else equal: the same seed (so the same initial weights and data order), the same callbacks
(``AdaptivePrecision`` as the config gives it, and the throughput log), the same step budget. Only the layers'
starting precision differs (``LlamaPretraining``'s ``attention``). It records each run's training loss per
optimizer step, its validation loss, its tokens per second and the controller's decisions, and writes

* ``training-<device>-<date>-<tag>.json`` in the format of the project's result files (kind ``training``, one row
  per logged window of steps, see below),
* ``training-<device>-<date>-<tag>.md``: a summary table (steady-state tokens/s, losses at the last common
  step, the ratio of speeds),
* ``training-<device>-<date>-<tag>.png``: loss and throughput curves, where matplotlib is installed (else
  ``--plot-only`` draws them later from the JSON),
* the runs' TensorBoard logs under ``tensorboard/``,

into ``--out-dir`` (default ``$OUT`` when set, else ``benchmarks/results``).

The model, data and callbacks are built here in Python from the config, without LightningCLI, so the script needs
only what the package itself needs (torch, lightning, tensorboard, numpy; PyYAML comes with lightning), not
jsonargparse. ``--set section.key=value`` changes one config entry (the value read as YAML) for every run.

Rows (one per ``trainer.log_every_n_steps`` optimizer steps and run): ``run``, ``attention``, ``tokens_per_step``,
``qk_norm``, ``seed``, ``step`` (optimizer steps done), ``tokens_seen``, ``train_loss`` (mean of the per-step
training losses in the window), ``tokens_per_s`` (the window's, validation excluded), ``val_loss`` at the steps
that ran validation, and ``seconds`` (the window's training wall time).

Example::

    # on one GPU, both runs in one call, each stopped after 2000 steps or 3.3 minutes:
    python benchmarks/pretrain_compare.py --max-steps 2000 --max-minutes 3.3
    # on a CPU, tiny:
    python benchmarks/pretrain_compare.py --config examples/configs/tiny.yaml --max-steps 20 --tag tiny \\
        --out-dir /tmp/compare
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from sage_lightning import AdaptivePrecision, PolicyConfig, Rung

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "examples"))
import accuracy  # noqa: E402  (benchmarks/ and examples/ are folders of scripts: their helpers are imported so)
from corpus import TextDataModule  # noqa: E402
from llama import LlamaConfig  # noqa: E402
from pretrain import LlamaPretraining, TokensPerSecond  # noqa: E402

#: Trainer entries of a config that this script sets itself.
_TRAINER_OWN = ("callbacks", "logger", "default_root_dir", "enable_checkpointing", "enable_progress_bar")


class LossCurve(Callback):
    """Each optimizer step's training loss (kept on the device, read once at the end) and each validation loss.

    Lightning hands ``on_train_batch_end`` the micro-batch loss divided by ``accumulate_grad_batches``; their sum
    over one optimizer step is the step's mean loss.
    """

    def __init__(self) -> None:
        super().__init__()
        self._losses: list[torch.Tensor] = []
        self._current: torch.Tensor | None = None
        self._step = 0
        #: ``{step: validation loss}``.
        self.val_losses: dict[int, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach().float()
        self._current = loss if self._current is None else self._current + loss
        if trainer.global_step != self._step:  # this micro-batch closed an optimizer step
            self._losses.append(self._current)
            self._current, self._step = None, trainer.global_step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val_losses[trainer.global_step] = float(trainer.callback_metrics["val/loss"])

    def losses(self) -> list[float]:
        """The training loss of every optimizer step, in order (one host sync)."""
        return torch.stack(self._losses).tolist() if self._losses else []


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "small.yaml")
    parser.add_argument("--attention", nargs="+", default=["sage", "full"], help="one run per value, in this order")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (the config's if unset)")
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-clock cap per run (Trainer.max_time)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one config entry for every run, e.g. data.seq_len=1024 or model.config.n_layers=4",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="untimed steps per attention setting first, on a throwaway model (compilation, autotuning); 0: none",
    )
    parser.add_argument("--tag", default=None, help="file-name tag (default: the config's name)")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: $OUT when set, else benchmarks/results")
    parser.add_argument("--plot-only", type=Path, default=None, help="draw the PNG of an existing result JSON")
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be a positive integer; received {args.max_steps}.")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be 0 or more; received {args.warmup_steps}.")
    if args.max_minutes is not None and not args.max_minutes > 0:
        parser.error(f"--max-minutes must be positive; received {args.max_minutes}.")
    return args


def load_config(path: Path, changes: list[str]) -> dict[str, Any]:
    """The YAML config at ``path`` with ``SECTION.KEY=VALUE`` changes applied (values parsed as YAML).

    Example::

        load_config(Path("examples/configs/tiny.yaml"), ["trainer.max_steps=10"])["trainer"]["max_steps"]   # 10
    """
    config = yaml.safe_load(path.read_text())
    for change in changes:
        key, sep, value = change.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes SECTION.KEY=VALUE, e.g. data.seq_len=1024; received {change!r}.")
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
            if node is None:
                raise ValueError(f"--set {change!r}: {part!r} is not a section of {path}.")
        node[last] = yaml.safe_load(value)
    return config


def build_controller(spec: dict[str, Any] | None) -> AdaptivePrecision | None:
    """``AdaptivePrecision`` from the config's ``adaptive_precision`` entry (``class_path`` and ``init_args``).

    Example::

        build_controller({"class_path": "sage_lightning.AdaptivePrecision", "init_args": {"config": {}}})
    """
    if spec is None:
        return None
    if spec.get("class_path", "sage_lightning.AdaptivePrecision") not in (
        "sage_lightning.AdaptivePrecision",
        "sage_lightning.callback.AdaptivePrecision",
    ):
        raise ValueError(f"adaptive_precision: this script builds sage_lightning.AdaptivePrecision; received {spec}.")
    kwargs = dict(spec.get("init_args") or {})
    policy = dict(kwargs.pop("config", None) or {})
    if "ladder" in policy:
        policy["ladder"] = tuple(Rung(**rung) for rung in policy["ladder"])
    kwargs.setdefault("progress_bar", False)
    return AdaptivePrecision(PolicyConfig(**policy), **kwargs)


def warm_up(config: dict[str, Any], attention: str, steps: int, data: TextDataModule) -> None:
    """Train ``steps`` steps with ``attention`` and throw the model away: the Triton kernels compile and autotune
    (once per process; minutes on a fresh machine) and CUDA initialises before any run is timed, so no run's
    time budget pays for them."""
    model_args = dict(config.get("model") or {})
    model_args["config"] = LlamaConfig(
        **{**(model_args.get("config") or {}), "vocab_size": data.vocab_size, "max_seq_len": data.seq_len}
    )
    model = LlamaPretraining(**{**model_args, "attention": attention})
    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k not in _TRAINER_OWN}
    trainer_args.update(max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, enable_model_summary=False)
    controller = build_controller(config.get("adaptive_precision"))
    if controller is not None:
        controller.verbose = False
    trainer = L.Trainer(
        **trainer_args,
        callbacks=[controller] if controller is not None else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=data)


def run_one(
    config: dict[str, Any], attention: str, args: argparse.Namespace, data: TextDataModule, log_dir: Path, run: str
) -> dict[str, Any]:
    """Train the config once with ``attention``; return its rows, summary and decisions."""
    seed = int(config.get("seed_everything", 0) or 0)
    L.seed_everything(seed, workers=True)
    model_args = dict(config.get("model") or {})
    model_args["config"] = LlamaConfig(
        **{**(model_args.get("config") or {}), "vocab_size": data.vocab_size, "max_seq_len": data.seq_len}
    )
    model_args["attention"] = attention
    model = LlamaPretraining(**model_args)

    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k not in _TRAINER_OWN}
    if args.max_steps is not None:
        trainer_args["max_steps"] = args.max_steps
    if args.max_minutes is not None:
        trainer_args["max_time"] = datetime.timedelta(minutes=args.max_minutes)
    throughput, curve = TokensPerSecond(), LossCurve()
    controller = build_controller(config.get("adaptive_precision"))
    callbacks: list[Callback] = [throughput, curve] + ([controller] if controller is not None else [])
    trainer = L.Trainer(
        **trainer_args,
        callbacks=callbacks,
        logger=TensorBoardLogger(str(log_dir), name=f"{run}-{attention}", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(log_dir),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start

    losses = curve.losses()
    tokens_per_step = data.batch_size * data.seq_len * trainer.accumulate_grad_batches * trainer.world_size
    common = {
        "run": run,
        "attention": attention,
        "tokens_per_step": tokens_per_step,
        "qk_norm": model.config.qk_norm,
        "seed": seed,
    }
    rows = []
    previous = 0
    for window in throughput.windows:
        step = int(window["step"])
        window_losses = losses[previous:step]
        row = {
            **common,
            "step": step,
            "tokens_seen": int(window["tokens_seen"]),
            "train_loss": statistics.fmean(window_losses) if window_losses else None,
            "tokens_per_s": window["tokens_per_s"],
            "seconds": window["seconds"],
        }
        if step in curve.val_losses:
            row["val_loss"] = curve.val_losses[step]
        rows.append(row)
        previous = step
    logged = {row["step"] for row in rows}
    for step, value in sorted(curve.val_losses.items()):
        if step not in logged:
            rows.append({**common, "step": step, "tokens_seen": step * tokens_per_step, "val_loss": value})
    rows.sort(key=lambda row: row["step"])
    decisions = [] if controller is None else [str(decision) for decision in controller.history]
    summary = {
        "attention": attention,
        "steps": trainer.global_step,
        "wall_s": wall,
        "tokens_per_s": steady_tokens_per_s(throughput.windows),
        "int8_fraction": None if controller is None else controller.int8_fraction,
        "decisions": len(decisions),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"rows": rows, "summary": summary, "decisions": decisions}


def steady_tokens_per_s(windows: list[dict[str, float]]) -> float | None:
    """Median tokens/s over the windows after the first tenth of the run (and never the first window, which holds
    the kernels' compilation and autotuning).

    Example::

        steady_tokens_per_s([{"step": s, "tokens_per_s": 100.0} for s in range(10, 110, 10)])   # 100.0
    """
    if not windows:
        return None
    last = windows[-1]["step"]
    steady = [w["tokens_per_s"] for w in windows[1:] if w["step"] > 0.1 * last and math.isfinite(w["tokens_per_s"])]
    return statistics.median(steady) if steady else windows[-1]["tokens_per_s"]


def compare(result: dict[str, Any]) -> list[str]:
    """The markdown summary: one line per run, then the losses at the last step every run reached."""
    summaries = result["summary"]
    lines = [
        "| attention | steps | wall s | tokens/s (steady) | int8 share | decisions | peak GPU memory GB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        memory = "" if s["peak_memory_gb"] is None else f"{s['peak_memory_gb']:.1f}"
        # Measured against each layer's starting precision: a full-precision run has no INT8 to keep.
        int8 = "" if s["int8_fraction"] is None or s["attention"] == "full" else f"{s['int8_fraction']:.3f}"
        lines.append(
            f"| {s['attention']} | {s['steps']} | {s['wall_s']:.0f} | {s['tokens_per_s']:,.0f} | {int8} | "
            f"{s['decisions']} | {memory} |"
        )
    by_run: dict[str, list[dict]] = {}
    for row in result["rows"]:
        by_run.setdefault(row["attention"], []).append(row)
    if len(by_run) > 1:
        common_step = min(max(r["step"] for r in rows if r.get("train_loss") is not None) for rows in by_run.values())
        val_steps = set.intersection(*({r["step"] for r in rows if "val_loss" in r} for rows in by_run.values()))
        lines += ["", f"At step {common_step} (the last every run reached):", ""]
        header = "| attention | train loss (window mean) |"
        rule = "|---|---:|"
        if val_steps:
            last_val = max(val_steps)
            header += f" val loss at step {last_val} |"
            rule += "---:|"
        lines += [header, rule]
        for attention, rows in by_run.items():
            train = next(r["train_loss"] for r in rows if r["step"] == common_step)
            line = f"| {attention} | {train:.4f} |"
            if val_steps:
                line += f" {next(r['val_loss'] for r in rows if r['step'] == last_val):.4f} |"
            lines.append(line)
        speeds = {s["attention"]: s["tokens_per_s"] for s in summaries}
        if "sage" in speeds and "full" in speeds and speeds["full"]:
            lines += ["", f"Speed, sage / full: {speeds['sage'] / speeds['full']:.3f}x (steady-state tokens/s)."]
    return lines


def plot(result: dict[str, Any], path: Path) -> bool:
    """Loss against step and tokens/s against step, one line per run; ``False`` where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_run: dict[str, list[dict]] = {}
    for row in result["rows"]:
        by_run.setdefault(row["attention"], []).append(row)
    figure, (loss_axis, speed_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for attention, rows in by_run.items():
        train = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        speed = [(r["step"], r["tokens_per_s"]) for r in rows if r.get("tokens_per_s") is not None]
        (line,) = loss_axis.plot(*zip(*train, strict=True), label=f"{attention} train", linewidth=1)
        if val:
            loss_axis.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{attention} val")
        if speed:
            speed_axis.plot(*zip(*speed, strict=True), color=line.get_color(), label=attention, linewidth=1)
    loss_axis.set(xlabel="optimizer step", ylabel="loss (nats per token)", title="loss")
    speed_axis.set(xlabel="optimizer step", ylabel="tokens / s", title="throughput (validation excluded)")
    for axis in (loss_axis, speed_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(textwrap.fill(f"{result['device']}, {result['date']}: {result['command']}", 160), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison and write its files; returns the result dict.

    Example::

        main(["--config", "examples/configs/tiny.yaml", "--max-steps", "4", "--out-dir", "/tmp/compare"])
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.plot_only is not None:
        result = json.loads(args.plot_only.read_text())
        png, markdown = args.plot_only.with_suffix(".png"), args.plot_only.with_suffix(".md")
        if not plot(result, png):
            print("matplotlib is not installed: no plot")
            return result
        link = f"\n![loss and throughput]({png.name})\n"
        if markdown.is_file() and link not in markdown.read_text():
            markdown.write_text(markdown.read_text() + link)  # the summary written where matplotlib was missing
        print(f"wrote {png}")
        return result
    config = load_config(args.config, args.set)
    tag = args.tag or args.config.stem
    out_dir = args.out_dir or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)

    data = TextDataModule(**(config.get("data") or {}))
    data.prepare_data()
    accelerator = (config.get("trainer") or {}).get("accelerator", "auto")
    device = (
        "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu"
    )
    name, today = accuracy.device_name(device), datetime.date.today()
    result: dict[str, Any] = {
        "kind": "training",
        "device": name,
        "date": today.isoformat(),
        "commit": accuracy._commit(),
        "command": shlex.join(["python", "benchmarks/pretrain_compare.py", *argv]),
        "versions": accuracy._versions(),
        "config": str(args.config.resolve().relative_to(REPO)) if args.config.resolve().is_relative_to(REPO) else "",
        "corpus": {key: data.meta.get(key) for key in ("tokens", "documents", "text_bytes", "tokenizer")},
        "warmup_s": {},
        "summary": [],
        "decisions": {},
        "rows": [],
    }
    if args.warmup_steps:
        for attention in dict.fromkeys(args.attention):
            print(f"--- {tag}: warm-up, attention={attention}, {args.warmup_steps} steps", flush=True)
            start = time.perf_counter()
            warm_up(config, attention, args.warmup_steps, data)
            result["warmup_s"][attention] = round(time.perf_counter() - start, 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    for attention in args.attention:
        print(f"--- {tag}: attention={attention}", flush=True)
        outcome = run_one(config, attention, args, data, out_dir / "tensorboard", tag)
        result["rows"] += outcome["rows"]
        result["summary"].append(outcome["summary"])
        result["decisions"][attention] = outcome["decisions"]

    out = out_dir / f"training-{accuracy.device_slug(name)}-{today:%Y%m%d}-{tag}.json"
    out.write_text(accuracy.to_json(result))
    lines = compare(result)
    decisions = [f"- {attention}: {d}" for attention, items in result["decisions"].items() for d in items]
    heading = (
        f"# Pretraining: SageBwd against full-precision attention ({tag})\n\n{name}, {result['date']}, commit "
        f"{result['commit']}\n\n`{result['command']}`\n\nConfig `{result['config']}`; corpus "
        f"{result['corpus']['tokens']:,} tokens ({result['corpus']['tokenizer']}). Same seed, data order and callbacks "
        "in every run; only the attention layers' starting precision differs. Untimed warm-up first (kernel "
        f"compilation and autotuning), seconds: {result['warmup_s'] or 'none'}.\n\n"
    )
    text = "\n".join(lines) + "\n\nDecisions of AdaptivePrecision:\n\n" + ("\n".join(decisions) or "none") + "\n"
    drawn = plot(result, out.with_suffix(".png"))
    if drawn:
        text += f"\n![loss and throughput]({out.with_suffix('.png').name})\n"
    out.with_suffix(".md").write_text(heading + text)
    print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {out.with_suffix('.png')}" if drawn else " (no matplotlib)"))
    return result


if __name__ == "__main__":
    main()
