"""Build and train one run of the pretraining comparison (model, data, controller, SDPA backend), and its warm-up."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import math
import statistics
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from benchmarks.controller.overhead_profile import ProfilerWindow
from benchmarks.training.cudnn_fp8 import CudnnFp8Attention, check_serves
from benchmarks.training.specs import CUDNN_FP8, SDPA_BACKENDS, TRAINER_OWN, RunSpec
from examples.corpus import TextDataModule
from examples.llama import LlamaConfig
from examples.pretrain import LlamaPretraining, PretrainLogger, TokensPerSecond
from sage_lightning import AdaptivePrecision, PolicyConfig, Rung, attention_layers


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


def build_controller(spec: dict[str, Any] | None) -> AdaptivePrecision | None:
    """``AdaptivePrecision`` from the config's ``adaptive_precision`` entry (``class_path`` and ``init_args``)."""
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


def run_controller(config: dict[str, Any], spec: RunSpec) -> AdaptivePrecision | None:
    """The run's controller: the config's, unless the run turns it off; the defaults where the config has none."""
    entry = config.get("adaptive_precision")
    if spec.controller is False:
        return None
    if spec.controller is True and entry is None:
        entry = {"class_path": "sage_lightning.AdaptivePrecision"}
    return build_controller(entry)


def model_config(config: dict[str, Any], data: TextDataModule) -> LlamaConfig:
    """The model's shape from the config's ``model.config``, its vocabulary and length from the data."""
    return LlamaConfig(
        **{
            **((config.get("model") or {}).get("config") or {}),
            "vocab_size": data.vocab_size,
            "max_seq_len": data.seq_len,
        }
    )


def build_model(config: dict[str, Any], spec: RunSpec, data: TextDataModule) -> LlamaPretraining:
    """``LlamaPretraining`` from the config's ``model`` entry, with the run's attention and smoothing."""
    model_args = {**(config.get("model") or {}), "config": model_config(config, data), "attention": spec.attention}
    model = LlamaPretraining(**model_args)
    changes = {k: v for k, v in (("smooth_k", spec.smooth_k), ("smooth_q", spec.smooth_q)) if v is not None}
    if changes:
        # SageAttentionMixin reads the layers' starting precision in configure_model, when the Trainer starts.
        model.sage_precision = model.sage_precision.replace(**changes)
    return model


@contextlib.contextmanager
def sdpa_backend(name: str | None) -> Iterator[None]:
    """Force PyTorch's SDPA onto one backend (a key of :data:`SDPA_BACKENDS`) while the block runs."""
    member = SDPA_BACKENDS[name or "default"]
    if member is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, member)]):
        yield


def sdpa_callbacks(name: str | None) -> list[Callback]:
    """What an ``sdpa=`` setting adds to the Trainer: ``cudnn_fp8``'s routing of SDPA calls to cuDNN FP8."""
    return [CudnnFp8Attention()] if name == CUDNN_FP8 else []


def check_sdpa_backend(name: str | None, cfg: LlamaConfig, seq_len: int, device: str, dtype: torch.dtype) -> None:
    """Refuse a forced SDPA backend that cannot run this model's attention call (one forward and backward of SDPA
    with the model's shapes, causal, ``enable_gqa`` as the model calls it), before any training (``check_serves``)."""
    if name == CUDNN_FP8:
        return check_serves(cfg.d_model // cfg.n_heads, device, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads)
    if SDPA_BACKENDS[name or "default"] is None:
        return
    head_dim = cfg.d_model // cfg.n_heads
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    # Its own generator: the global one, seeded for the run, also shuffles the data.
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, cfg.n_heads, seq_len, head_dim, device=device, dtype=dtype, generator=generator)
    kv = torch.randn(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype, generator=generator)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    try:
        with sdpa_backend(name):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=kv_heads != cfg.n_heads
            )
            out.sum().backward()
    except RuntimeError as error:
        raise ValueError(
            f"sdpa={name}: PyTorch's SDPA has no {name} kernel for this model's attention ({cfg.n_heads} query and "
            f"{kv_heads} key/value heads of {head_dim}, sequence {seq_len}, {dtype}, causal, on {device}): "
            f"{str(error).splitlines()[0]} Use one of {', '.join(SDPA_BACKENDS)} that runs here (default lets "
            "PyTorch choose)."
        ) from None


def run_device(config: dict[str, Any]) -> str:
    accelerator = (config.get("trainer") or {}).get("accelerator", "auto")
    return "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu"


def run_dtype(config: dict[str, Any]) -> torch.dtype:
    precision = str((config.get("trainer") or {}).get("precision", "32-true"))
    return torch.bfloat16 if "bf16" in precision else torch.float16 if precision.startswith("16") else torch.float32


def trainer_for(config: dict[str, Any], callbacks: list[Callback], **entries: Any) -> L.Trainer:
    """A Trainer of the config's ``trainer`` entries but :data:`TRAINER_OWN`, ``entries`` over them, with
    ``callbacks``, no checkpointing and no progress bar."""
    own = {k: v for k, v in (config.get("trainer") or {}).items() if k not in TRAINER_OWN}
    return L.Trainer(**{**own, **entries}, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False)


def warm_up(
    config: dict[str, Any],
    spec: RunSpec | str,
    steps: int,
    data: TextDataModule,
    timed_steps: int = 0,
    sdpa: str | None = None,
) -> float | None:
    """Train ``steps`` untimed steps, then ``timed_steps`` timed ones, with the run's settings, and throw the model
    away: the kernels compile and autotune (minutes on a fresh machine; with a controller measuring dS every step,
    the statistics variant too) and CUDA initialises before any run is timed, so no run's budget pays for them."""
    spec = RunSpec(name=spec, attention=spec) if isinstance(spec, str) else spec
    model = build_model(config, spec, data)
    entry = copy.deepcopy(config.get("adaptive_precision"))
    if entry is not None:
        entry.setdefault("init_args", {}).setdefault("config", {})["ds_stats_every_n_steps"] = 1
    controller = run_controller({**config, "adaptive_precision": entry}, spec)
    if controller is not None:
        controller.verbose = False
    clock = TokensPerSecond(log_every_n_steps=1)
    callbacks = [clock] + ([controller] if controller is not None else []) + sdpa_callbacks(spec.sdpa_backend or sdpa)
    steps_only = {"max_steps": steps + timed_steps, "max_time": None, "limit_val_batches": 0}
    trainer = trainer_for(
        config, callbacks, **steps_only, num_sanity_val_steps=0, enable_model_summary=False, logger=False
    )
    with sdpa_backend(spec.sdpa_backend or sdpa):
        trainer.fit(model, datamodule=data)
    timed = [w["tokens_per_s"] for w in clock.windows[steps:] if math.isfinite(w["tokens_per_s"])]
    return statistics.median(timed) if timed_steps and timed else None


def run_one(
    config: dict[str, Any],
    spec: RunSpec | str,
    args: argparse.Namespace,
    data: TextDataModule,
    log_dir: Path,
    run: str,
    *,
    max_steps: int | None = None,
    max_minutes: float | None = None,
    save_to: Path | None = None,
    changes: Sequence[str] = (),
) -> dict[str, Any]:
    """Train the config once as ``spec`` says; return its rows, summary and decisions."""
    spec = RunSpec(name=spec, attention=spec) if isinstance(spec, str) else spec
    backend = spec.sdpa_backend or args.sdpa_backend
    seed = spec.seed if spec.seed is not None else int(config.get("seed_everything", 0) or 0)
    max_steps = args.max_steps if max_steps is None else max_steps
    max_minutes = args.max_minutes if max_minutes is None else max_minutes
    L.seed_everything(seed, workers=True)
    model = build_model(config, spec, data)
    check_sdpa_backend(backend, model.config, data.seq_len, run_device(config), run_dtype(config))

    limits = {} if max_steps is None else {"max_steps": max_steps}
    if max_minutes is not None:
        limits["max_time"] = datetime.timedelta(minutes=max_minutes)
    throughput, curve = TokensPerSecond(), LossCurve()
    controller = run_controller(config, spec)
    callbacks: list[Callback] = [throughput, curve] + ([controller] if controller is not None else [])
    profiled = ProfilerWindow(10, args.profile_steps, True, args.profile_copies) if args.profile_steps else None
    callbacks += sdpa_callbacks(backend) + ([profiled] if profiled else [])  # GPU time per kernel, per step
    logger = PretrainLogger(str(log_dir), name=f"{run}-{spec.name}", version=0)
    trainer = trainer_for(config, callbacks, **limits, logger=logger, default_root_dir=str(log_dir))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with sdpa_backend(backend):
        trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start
    saved = None
    if save_to is not None:
        try:
            saved, config_path = save_final_model(
                trainer, config, spec, seed, save_to, f"{args.config} with {', '.join(changes) or 'no changes'}"
            )
            print(
                f"--- {run}-{spec.name}: final model (step {trainer.global_step}) in {saved}, config {config_path}",
                flush=True,
            )
        except Exception as error:  # noqa: BLE001  (the run's results matter more than its checkpoint)
            print(f"--- {run}-{spec.name}: checkpoint failed, not saved: {type(error).__name__}: {error}", flush=True)

    losses = curve.losses()
    tokens_per_step = data.batch_size * data.seq_len * trainer.accumulate_grad_batches * trainer.world_size
    common = {
        "run": spec.name,
        "attention": spec.attention,
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
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    if peak is not None:
        for row in rows:  # the run's peak on each of its rows, as speed rows carry it (benchmarks.training.readme_perf)
            row["peak_mem_mb"] = peak
    history = [] if controller is None else list(controller.history)
    layers = attention_layers(model)
    summary = {
        "run": spec.name,
        "attention": spec.attention,
        "controller": controller is not None,
        "seed": seed,
        "precision": model.sage_precision.short_name if model.sage_precision is not None else None,
        "sdpa_backend": backend,
        "qk_norm": model.config.qk_norm,
        "tokens_per_step": tokens_per_step,
        "max_steps": trainer.max_steps,
        "steps": trainer.global_step,
        "wall_s": wall,
        "tokens_per_s": steady_tokens_per_s(throughput.windows),
        "tokens_seen": throughput.tokens_seen,
        "int8_fraction": None if controller is None else controller.int8_fraction,
        "decisions": len(history),
        "skipped_steps": None if controller is None else controller.skipped_steps,
        "rollbacks": None if controller is None else controller.rollbacks,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "nonfinite_losses": sum(not math.isfinite(loss) for loss in losses),
        "fallback_calls": sum(layer.fallback_calls for layer in layers.values()),
        "final_precisions": {name: layer.precision.short_name for name, layer in layers.items()},
        "noise_readings": [] if controller is None else [list(r) for r in controller.policy.noise_readings],
        "peak_memory_gb": None if peak is None else peak / 2**10,
        "profile": profiled and {**profiled.per_step(), "wall_ms_per_step": 1000 * profiled.wall_s / profiled.steps},
    }
    if saved is not None:
        summary["checkpoint"] = str(saved)
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "rows": rows,
        "summary": summary,
        "decisions": [str(decision) for decision in history],
        "decision_log": [dataclasses.asdict(decision) for decision in history],
    }


def save_final_model(
    trainer: L.Trainer, config: dict[str, Any], spec: RunSpec, seed: int, path: Path, source: str
) -> tuple[Path, Path]:
    """Save a run's final model (``Trainer.save_checkpoint`` with ``weights_only``: no optimizer state; what
    ``LlamaPretraining.load_from_checkpoint`` rebuilds) and, beside it as ``.yaml``, the config as the run used it,
    with its seed, attention and steps (the retired attribution.py of 49163cf takes it as ``--config``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path, weights_only=True)
    effective = copy.deepcopy(config)
    effective["seed_everything"] = seed
    effective["model"] = {**(effective.get("model") or {}), "attention": spec.attention}
    effective["trainer"] = {**(effective.get("trainer") or {}), "max_steps": trainer.max_steps}
    smoothing = {k: v for k, v in (("smooth_k", spec.smooth_k), ("smooth_q", spec.smooth_q)) if v is not None}
    config_path = path.with_suffix(".yaml")
    text = (
        f"The config of run {spec.name} as it trained (pretrain_compare --save-checkpoint): {source}; "
        f"the run's seed, attention and steps. Its final model, step {trainer.global_step}, is {path.name} beside it."
        + (f" The run's SageBwd smoothing, which is no config entry: {smoothing}." if smoothing else "")
    )
    command = f"  python benchmarks/attribution.py --config {config_path} --checkpoint {path}   # at 49163cf"
    header = [*textwrap.wrap(text, 116), command]
    config_path.write_text("".join(f"# {line}\n" for line in header) + yaml.safe_dump(effective, sort_keys=False))
    return path, config_path


def steady_tokens_per_s(windows: list[dict[str, float]]) -> float | None:
    """Median tokens/s over the windows after the first tenth of the run (never the first window: compilation)."""
    if not windows:
        return None
    last = windows[-1]["step"]
    steady = [w["tokens_per_s"] for w in windows[1:] if w["step"] > 0.1 * last and math.isfinite(w["tokens_per_s"])]
    return statistics.median(steady) if steady else windows[-1]["tokens_per_s"]
