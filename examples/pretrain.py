"""Pretrain a LLaMA-style model with SageBwd attention, steered by ``AdaptivePrecision``, logged to TensorBoard.

Run it from the repository root (after ``make demo`` or ``make test`` has set up ``.venv``)::

    .venv/bin/python -m examples.pretrain fit --config examples/configs/tiny.yaml    # CPU, a few minutes
    .venv/bin/tensorboard --logdir runs                                              # the sage/ charts

The same run with full-precision attention, everything else equal::

    .venv/bin/python -m examples.pretrain fit --config examples/configs/tiny.yaml --model.attention full

Without the controller (SageBwd all the way, nothing adapts)::

    .venv/bin/python -m examples.pretrain fit --config examples/configs/tiny.yaml --adaptive_precision null

Where things go: ``--trainer.default_root_dir DIR`` (``runs`` in the configs) holds the TensorBoard logs and the
checkpoints of each run, ``DIR/<name>/version_N``. ``--ckpt_path DIR/<name>/version_N/checkpoints/last.ckpt``
resumes that run into the same ``version_N`` and continues exactly where it stopped (the data order included).

Any argument of the model (``--model.config.n_layers 8``), the data (``--data.paths my_text/``), the
Trainer (``--trainer.max_steps 500``) or the callback
(``--adaptive_precision.init_args.config.ds_rel_err_high 0.15``) can be changed on the command line;
``.venv/bin/python -m examples.pretrain fit --help`` lists them and ``--print_config`` shows the resolved configuration.
A misspelt option or config key is reported first, with the name meant where one is close (:class:`PretrainParser`).
LightningCLI needs ``jsonargparse[signatures]`` (``pip install "sage-lightning[examples]"``; ``make demo``
installs it).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.logger import _flatten_dict
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.tensorboard.summary import hparams as hparams_summary

from examples.corpus import TextDataModule
from examples.llama import Llama, LlamaConfig
from sage_lightning import (
    AdaptivePrecision,
    AttentionPrecision,
    Rung,
    SageAttentionMixin,
    attention_layers,
    attention_summary,
)
from sage_lightning.callback import count_tokens
from sage_lightning.console import newest_checkpoint, quiet_lightning_noise
from sage_lightning.layer_checkpoint import checkpoint_file_problem

#: ``attention`` -> the starting precision of every attention layer.
ATTENTION_MODES: dict[str, AttentionPrecision] = {
    "sage": AttentionPrecision(),
    # SageBwd with some products in FP8 (e4m3, a scale max|X| / 448 per block) instead of INT8, everything else as
    # "sage" (dp bf16, K-smoothing); "sage_fp8" runs all five in FP8, dp included.
    "sage_fp8_pv": AttentionPrecision(pv="fp8"),
    "sage_fp8_ds": AttentionPrecision(ds="fp8"),
    "sage_fp8_pv_ds": AttentionPrecision(pv="fp8", ds="fp8"),
    "sage_fp8": AttentionPrecision.all_fp8(),
    # dS in bf16: the controller's rung for dS (ds_bf16), fixed from the start.
    "sage_bf16_ds": AttentionPrecision(ds="bf16"),
    "attn_qat": AttentionPrecision(mode="attn_qat"),
    # Attn-QAT's "drop-in" variant: the FP4 forward with a plain backward (no matching recomputation), which the
    # Attn-QAT paper reports as unstable; here for the comparison.
    "attn_qat_dropin": AttentionPrecision(mode="attn_qat", qat_backward="dropin"),
    "full": AttentionPrecision(mode="full"),
}


class LlamaPretraining(SageAttentionMixin, L.LightningModule):
    """Next-token pretraining of :class:`llama.Llama`, its attention swapped by ``SageAttentionMixin``.

    ``attention`` picks the layers' starting precision; everything else (the model, the data order, the
    optimizer, the callbacks, the swap itself) stays the same, so two runs that differ only in it compare the
    attention numerics alone. ``"full"`` keeps the swapped layers, in ``mode="full"`` (PyTorch's own SDPA, the
    last rung of the controller's ladder), rather than skipping the swap, so both runs pay the same interception
    and controller bookkeeping and their tokens per second compare fairly.

    AdamW (fused on CUDA, so ``AdaptivePrecision`` skips a bad step on the device without a host sync), weight
    decay on matrices only, a linear warmup then a cosine decay to ``min_lr_ratio * lr`` at the Trainer's last
    step.

    Args:
        config: the model's shape (:class:`llama.LlamaConfig`). The command line links
            ``vocab_size`` to the data's tokenizer and ``max_seq_len`` to the data's ``seq_len``.
        attention: ``"sage"`` (SageBwd, INT8), ``"sage_fp8_pv"``, ``"sage_fp8_ds"``, ``"sage_fp8_pv_ds"``
            (SageBwd with ``O = P V``, the score gradient's products, or both in FP8 e4m3), ``"sage_fp8"`` (every
            product in FP8, ``AttentionPrecision.all_fp8()``), ``"sage_bf16_ds"`` (dS in bf16), ``"attn_qat"``
            (simulated NVFP4),
            ``"attn_qat_dropin"`` (its FP4 forward with a plain backward) or ``"full"`` (full precision);
            :data:`ATTENTION_MODES` maps each to its precision.
        lr: peak learning rate.
        min_lr_ratio: the learning rate at the last step, as a share of ``lr``.
        warmup_steps: optimizer steps of linear warmup from zero.
        weight_decay: AdamW's decoupled weight decay, on weight matrices and embeddings.
        betas: AdamW's betas.

    Raises:
        ValueError: an unknown ``attention`` or an argument out of range; the message says what works.

    Example::

        model = LlamaPretraining(LlamaConfig.from_name("tiny"), attention="full", lr=1e-3)
        trainer = L.Trainer(max_steps=100, callbacks=[AdaptivePrecision()])
        trainer.fit(model, datamodule=TextDataModule(seq_len=128))
    """

    def __init__(
        self,
        config: LlamaConfig = LlamaConfig(),  # noqa: B008  (frozen, so a shared default is safe)
        attention: str = "sage",
        lr: float = 1e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        if attention not in ATTENTION_MODES:
            raise ValueError(
                f"LlamaPretraining: attention must be one of {', '.join(map(repr, ATTENTION_MODES))}; "
                f"received {attention!r}."
            )
        if not lr > 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0 or weight_decay < 0:
            raise ValueError(
                "LlamaPretraining: needs lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0 and weight_decay >= 0; "
                f"received lr={lr}, min_lr_ratio={min_lr_ratio}, warmup_steps={warmup_steps}, "
                f"weight_decay={weight_decay}."
            )
        if isinstance(config, dict):  # as a checkpoint's hyperparameters hold it (load_from_checkpoint)
            config = LlamaConfig(**config)
        self.config = config
        self.attention = attention
        self.sage_precision = ATTENTION_MODES[attention]
        self.lr, self.min_lr_ratio, self.warmup_steps = lr, min_lr_ratio, warmup_steps
        self.weight_decay, self.betas = weight_decay, tuple(betas)
        # Given as one dict of plain values, so hparams.yaml, TensorBoard's HParams and load_from_checkpoint all see
        # the model's config (a dataclass is skipped by the YAML writer) and not LightningCLI's `_instantiator`.
        self.save_hyperparameters(
            {
                "config": dict(self.config.__dict__),
                "attention": attention,
                "lr": lr,
                "min_lr_ratio": min_lr_ratio,
                "warmup_steps": warmup_steps,
                "weight_decay": weight_decay,
                "betas": list(self.betas),
            }
        )
        self.model = Llama(self.config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of a batch of ``input_ids`` and ``labels``."""
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        """Clip by norm on the device, also for the fused AdamW.

        Lightning's mixed-precision plugin refuses to clip for an optimizer that unscales gradients itself (the
        fused ones), because under fp16 a GradScaler's gradients are still scaled then. Under bf16 nothing is
        scaled, so the norm is clipped here directly; with a GradScaler, Lightning's own rules apply.
        """
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if not gradient_clip_val or scaler is not None or gradient_clip_algorithm not in (None, "norm"):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        # Named groups and a scheduler named train/lr: LearningRateMonitor logs train/lr/decay and
        # train/lr/no_decay, beside train/loss, where TensorBoard would otherwise start with an lr-AdamW group.
        groups = [
            {"params": decay, "weight_decay": self.weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
        optimizer = torch.optim.AdamW(
            groups,
            lr=self.lr,
            betas=self.betas,
            fused=self.device.type == "cuda" or None,
        )
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(self.warmup_steps, total, self.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step", "name": "train/lr"}}


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Any:
    """The learning-rate factor of each step: linear warmup to 1, then a cosine to ``min_ratio`` at ``total_steps``.

    Example::

        factor = warmup_cosine(100, 1000, 0.1)
        factor(0), factor(99), factor(1000)     # 0.01, 1.0, 0.1
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class TokensPerSecond(Callback):
    """Log the training throughput, ``throughput/tokens_per_s``, and ``throughput/tokens_seen``.

    Measured over each window of ``log_every_n_steps`` optimizer steps (the Trainer's when ``None``), the
    device synchronised at its ends only (one sync per window), validation time left out. Tokens are counted
    as ``AdaptivePrecision`` counts them (the elements of ``batch["input_ids"]``), on every rank. The windows are
    also kept in :attr:`windows`, for scripts that compare runs.

    Args:
        log_every_n_steps: optimizer steps per window; the Trainer's ``log_every_n_steps`` when ``None``.

    Example::

        trainer = L.Trainer(callbacks=[TokensPerSecond()], log_every_n_steps=10)
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        super().__init__()
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(
                "TokensPerSecond: log_every_n_steps must be a positive integer or None (the Trainer's); "
                f"received {log_every_n_steps!r}."
            )
        self.log_every_n_steps = log_every_n_steps
        #: ``{"step", "tokens_seen", "tokens_per_s", "seconds"}`` per window, oldest first.
        self.windows: list[dict[str, float]] = []
        self.tokens_seen = 0
        self._window_tokens = 0
        self._window_start = 0.0
        self._paused = 0.0
        self._pause_start: float | None = None
        self._step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        self._window_start = self._now(pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens = int(count_tokens(batch)) * trainer.world_size
        self._window_tokens += tokens
        self.tokens_seen += tokens

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step:
            return  # still accumulating
        self._step = trainer.global_step
        every = self.log_every_n_steps or max(1, trainer.log_every_n_steps)
        if self._step % every:
            return
        now = self._now(pl_module)
        seconds = now - self._window_start - self._paused
        window = {
            "step": self._step,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": self._window_tokens / seconds if seconds > 0 else float("nan"),
            "seconds": seconds,
        }
        self.windows.append(window)
        metrics = {"throughput/tokens_per_s": window["tokens_per_s"], "throughput/tokens_seen": self.tokens_seen}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self._step)
        self._window_start, self._window_tokens, self._paused = now, 0, 0.0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation inside fit (not the sanity check before it) stops the clock.
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._pause_start = self._now(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += self._now(pl_module) - self._pause_start
            self._pause_start = None

    @staticmethod
    def _now(pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()


class PretrainLogger(TensorBoardLogger):
    """Lightning's ``TensorBoardLogger``, arranged so that TensorBoard opens on the run's ``sage/`` charts and its
    HParams tab shows real metrics.

    * No ``epoch`` scalar: Lightning adds one beside every ``self.log`` metric, a flat line in these step-limited
      runs, and the first chart TensorBoard showed (its groups sort by name, ``epoch`` before ``sage``).
    * HParams: the first ``log_hyperparams`` call of a run (``AdaptivePrecision``'s, with the module's and the
      controller's settings; Lightning's when there is no controller) writes TensorBoard's HParams session with
      ``hparams_metrics`` as its columns, read from those scalars as they are logged. Lightning's own way
      (``default_hp_metric=True``) logs a placeholder ``hp_metric`` of -1, a chart of its own, as the metric.

    ``hparams.yaml`` holds every hyperparameter logged, as with Lightning's logger.

    Args:
        save_dir: the folder of the runs (the command line links it to ``--trainer.default_root_dir``).
        name: the experiment's folder under ``save_dir``.
        version: the run's folder under it; the next ``version_N`` when ``None``.
        hparams_metrics: the scalar tags the HParams tab shows beside the hyperparameters; none: no session is
            written by this logger.
        default_hp_metric: Lightning's placeholder ``hp_metric`` and its session instead of ``hparams_metrics``.
        **kwargs: the rest of ``TensorBoardLogger``'s arguments.

    Raises:
        ValueError: ``hparams_metrics`` is not a list of tags.

    Example::

        trainer = L.Trainer(logger=PretrainLogger("runs", name="tiny"), callbacks=[AdaptivePrecision()])
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        hparams_metrics: Sequence[str] = ("val/loss", "train/loss"),
        default_hp_metric: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(hparams_metrics, str) or not all(isinstance(tag, str) for tag in hparams_metrics):
            raise ValueError(
                "PretrainLogger: hparams_metrics must be a list of scalar tags, e.g. ['val/loss']; "
                f"received {hparams_metrics!r}."
            )
        super().__init__(save_dir, name=name, version=version, default_hp_metric=default_hp_metric, **kwargs)
        # With the placeholder, Lightning writes the session (with hp_metric) itself.
        self.hparams_metrics = () if default_hp_metric else tuple(hparams_metrics)
        self._session_written = False

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({tag: value for tag, value in metrics.items() if tag != "epoch"}, step)

    @rank_zero_only
    def log_hyperparams(self, params: Any, metrics: dict[str, Any] | None = None, step: int | None = None) -> None:
        super().log_hyperparams(params, metrics, step)  # stores them (hparams.yaml); a session only with metrics
        if metrics is not None or self._session_written or not self.hparams_metrics:
            return
        # TensorBoard shows a run's first session: the first call's hyperparameters (all of them, when
        # AdaptivePrecision is on: it logs the module's with its own, before Lightning does). Flattened and
        # sanitized as Lightning's own log_hyperparams does; the metrics are columns, no values are logged.
        flat = self._sanitize_params(_flatten_dict(dict(self.hparams)))
        for summary in hparams_summary(flat, dict.fromkeys(self.hparams_metrics, 0.0)):
            self.experiment._get_file_writer().add_summary(summary, step)
        self._session_written = True


#: Progress-bar metrics that count something, shown as whole numbers (Lightning hands every metric over as a float).
WHOLE_NUMBER_METRICS: tuple[str, ...] = ("tokens_per_step",)


class _ReadableMetrics:
    """Progress-bar metrics a person reads: no ``v_num`` (the run's folder says it), counts as integers."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        metrics.pop("v_num", None)
        readable = {}
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if name in WHOLE_NUMBER_METRICS and isinstance(value, float) and value.is_integer():
                value = str(int(value))  # a string: the rich bar formats every number with three decimals
            readable[name] = value
        return readable


class StepProgressBar(_ReadableMetrics, RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar):  # type: ignore[misc]
    """Lightning's progress bar (rich when installed) without its noise in a step-limited run, readable in an
    80-column terminal.

    A run limited by ``max_steps`` has ``max_epochs=-1``, which the rich bar prints as ``Epoch 0/-2``: here the
    epoch goes alone (``Epoch 0``) unless ``max_epochs`` is a real limit. ``v_num`` is left out and counts
    (``tokens_per_step``) print without decimals. The rich bar writes the metrics on a line of their own under
    the bars, where they have the terminal's whole width: beside the bar, in 80 columns, they had 18 characters
    and every one of them broke over two lines::

        Epoch 0    ━━━━━━━━╸━━━━━━━━━━━━━━━━━━━━━━━━━ 100/400 0:00:23 • 0:01:11 4.26it/s
        train/loss: 2.226 int8_share: 0.308 tokens_per_step: 2048 val/loss: 2.596

    Example::

        trainer = L.Trainer(callbacks=[StepProgressBar()])
    """

    def _init_progress(self, trainer: L.Trainer) -> None:  # RichProgressBar's: builds the rich display
        super()._init_progress(trainer)
        progress, metrics = self.progress, getattr(self, "_metric_component", None)
        if progress is None or metrics is None or metrics not in progress.columns:
            return  # the TQDM bar, a display already arranged, or a Lightning whose rich bar is built otherwise
        progress.columns = tuple(column for column in progress.columns if column is not metrics)

        def renderables() -> Iterator[Any]:  # rich's Progress.get_renderables: the bars, then the metrics line
            yield progress.make_tasks_table(progress.tasks)
            if self.train_progress_bar_id is not None:
                line = metrics(self.train_progress_bar)
                if line.plain:
                    yield line

        progress.get_renderables = renderables  # type: ignore[method-assign]

    @property
    def total_train_batches(self) -> int | float:
        """The batches this epoch will run: Lightning's count, right also for a run resumed mid-epoch.

        Lightning caps the epoch's batches at the steps left (``max_steps - global_step``) but counts the bar from
        the epoch's first batch, so a resumed run read ``251/149``; the cap here counts the batches already done.
        """
        trainer = self.trainer
        if trainer.max_epochs != -1 or trainer.max_steps is None or trainer.max_steps < 0:
            return super().total_train_batches
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        return min(trainer.num_training_batches, done + left)

    def _get_train_description(self, current_epoch: int) -> str:  # RichProgressBar's hook for the bar's label
        description = f"Epoch {current_epoch}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            description += f"/{self.trainer.max_epochs - 1}"
        return f"{description:{len(getattr(self, 'validation_description', ''))}}"


class ParameterSummary(ModelSummary):
    """Lightning's model summary without the FLOPs it cannot count here.

    Lightning counts FLOPs only when the module has an ``example_input_array``, and the Triton kernels are invisible
    to its counter in any case, so for this model it would print ``Total FLOPs: 0``; this summary leaves the
    FLOPs column and total out when they are zero, and keeps everything else (parameters, size, modes).

    Example::

        trainer = L.Trainer(callbacks=[ParameterSummary()])
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs" or total_flops]
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *columns
        )
        if not total_flops:
            table = "\n".join(line for line in table.splitlines() if not line.rstrip().endswith("Total Flops"))
        print(table)


def tensorboard_command() -> str:
    """``tensorboard`` beside this Python (``.venv/bin/tensorboard`` from the repository), so it runs as printed.

    Example::

        tensorboard_command()      # ".venv/bin/tensorboard" when run as .venv/bin/python from the repository
    """
    beside = Path(sys.executable).parent / "tensorboard"
    if not beside.is_file():
        return "tensorboard"
    relative = os.path.relpath(beside)
    return relative if not relative.startswith("..") else str(beside)


def logger_save_dir(default_root_dir: str | None) -> str:
    """The logger's ``save_dir``: the Trainer's ``default_root_dir`` (the current folder when unset, as in Lightning).

    Example::

        logger_save_dir("out")      # "out"
    """
    return os.getcwd() if default_root_dir is None else str(default_root_dir)


def run_version(ckpt_path: str | os.PathLike, root_dir: str | os.PathLike) -> int | str | None:
    """The logger version a checkpoint belongs to, when it lies in ``root_dir/<version>/checkpoints/``.

    Args:
        ckpt_path: the checkpoint file.
        root_dir: the logger's ``save_dir/name``.

    Example::

        run_version("runs/tiny/version_3/checkpoints/last.ckpt", "runs/tiny")   # 3
    """
    path = Path(ckpt_path).expanduser().resolve()
    if path.parent.name != "checkpoints" or path.parent.parent.parent != Path(root_dir).expanduser().resolve():
        return None
    version = path.parent.parent.name
    match = re.fullmatch(r"version_(\d+)", version)
    return int(match.group(1)) if match else version


#: Lines of a jsonargparse message that only say where the error sits in a union of types, not what it is.
_UNION_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes: |Errors:|- Expected a |Given value type: "
    r"|Given value: )"
)


def _close(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to a misspelt ``name`` (difflib's ratio of at least 0.6), or ``None``."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def _class_arguments(class_path: str) -> list[str]:
    """The argument names of the class at ``class_path`` (its dataclass fields, or its ``__init__``'s); ``[]`` when it
    cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        klass = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    if dataclasses.is_dataclass(klass):
        return [field.name for field in dataclasses.fields(klass)]
    parameters = inspect.signature(klass.__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def explain_parse_error(message: str, options: Sequence[str]) -> list[str]:
    """The lines that matter in a jsonargparse error, first: what is wrong and, for a misspelt name, the close one.

    Args:
        message: jsonargparse's message (one line, or a nested report of a union of types).
        options: the parser's option strings (``--trainer.max_steps`` ...), for a misspelt command-line key.

    Returns:
        One or two lines: the error, then ``did you mean ...?`` where a known name is close.

    Example::

        explain_parse_error("unrecognized arguments: --trainer.max_stesp 5", ["--trainer.max_steps"])
        # ["unrecognized arguments: --trainer.max_stesp 5", "did you mean --trainer.max_steps?"]
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return [message]
    unrecognized = re.match(r"unrecognized arguments: (.*)", lines[0], flags=re.I)
    if unrecognized:
        keys = [word.split("=", 1)[0] for word in unrecognized.group(1).split() if word.startswith("--")]
        hints = [close for key in keys if (close := _close(key, options)) is not None]
        return [lines[0]] + ([f"did you mean {' '.join(hints)}?"] if hints else [])
    # A nested report: the keys and classes it descends through, then the innermost line that says what is wrong.
    keys = []
    class_path = None
    for line in lines:
        key = re.match(r'Parser key "([^"]+)":', line)
        problem = re.match(r"- Problem with given class_path '([^']+)':", line)
        if key:
            keys += (["init_args"] if class_path else []) + [key.group(1)]
        elif problem:
            class_path = problem.group(1)
        elif not _UNION_NOISE.match(line):
            where = ".".join(keys)
            not_accepted = re.match(r"(?:Option|Key) '([^']+)' is not (?:accepted|expected)", line)
            if not_accepted and class_path:
                name, owner = not_accepted.group(1), class_path.rpartition(".")[2]
                arguments = _class_arguments(class_path)
                close = _close(name.rpartition(".")[2], arguments)
                hint = f"did you mean {close!r} ({where}.{close})?" if close else f"it takes {', '.join(arguments)}"
                return [f"{owner} ({where}) has no argument {name!r}", hint]
            return [f"{where}: {line}" if where else line]
    return [lines[0]]


class PretrainParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors start with what is wrong (and the close name, for a misspelt one) instead of
    the whole usage; ``--help`` prints the usage. Abbreviated options are refused (``--trainer.max_step`` would
    otherwise be read as ``--trainer.max_steps``, so a typo could run).

    Example::

        PretrainCLI(LlamaPretraining, TextDataModule, parser_class=PretrainParser)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        options = [option for action in parser._actions for option in action.option_strings]
        explained = explain_parse_error(message, options)
        sys.stderr.write(f"{prog}: error: {explained[0]}\n")
        for line in explained[1:]:
            sys.stderr.write(f"  {line}\n")
        sys.stderr.write(f"  (every option: {prog} --help)\n")
        self.exit(2)


def resume_command(args: Sequence[str], ckpt_path: str) -> str:
    """The command that resumes a run of this script from ``ckpt_path``: the same arguments, ``--ckpt_path`` replaced.

    Args:
        args: the arguments the run was given (``sys.argv[1:]``).
        ckpt_path: the checkpoint to resume from.

    Example::

        resume_command(["fit", "--config", "tiny.yaml"], "runs/tiny/version_0/checkpoints/last.ckpt")
        # ".venv/bin/python examples/pretrain.py fit --config tiny.yaml --ckpt_path runs/tiny/.../last.ckpt"
    """
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    python = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    script = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    return shlex.join([python, script, *kept, "--ckpt_path", ckpt_path])


class UsageError(SystemExit):
    """A run refused before training: the message is the whole report (no traceback), exit status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class PretrainCLI(LightningCLI):
    """LightningCLI for :class:`LlamaPretraining` and :class:`corpus.TextDataModule`, with the controller.

    Adds to LightningCLI's arguments:

    * ``adaptive_precision``: the :class:`sage_lightning.AdaptivePrecision` callback (``class_path`` and
      ``init_args``, its ``config`` a :class:`sage_lightning.PolicyConfig`); on by default, ``null`` turns it off;
    * links: the data's ``vocab_size`` and ``seq_len`` set the model's ``config.vocab_size`` and
      ``config.max_seq_len``; the Trainer's ``default_root_dir`` sets the logger's ``save_dir``, so it moves the
      logs and the checkpoints together, as in Lightning without a configured logger;
    * a :class:`TokensPerSecond` callback on every run, :class:`StepProgressBar` and :class:`ParameterSummary`
      in place of Lightning's own; the TensorBoard logger unless the config names another.

    A run given ``--ckpt_path`` from one of its logger's ``version_N/checkpoints`` folders logs into that same
    ``version_N``. An argument a class refuses, or data that cannot be read, ends the command with that one
    message (exit status 2) before anything is written; a run that fails before its first optimizer step
    removes the log folder it created. After ``fit`` it prints where the logs and checkpoints are and how to
    open TensorBoard on them; after Ctrl-C, the command that resumes the run (its own, with ``--ckpt_path``). A
    misspelt option or config key is reported by :class:`PretrainParser`: the error first, the name meant.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The command as given, for the resume command printed after Ctrl-C.
        given = kwargs.get("args")
        self.command_args = [str(a) for a in (sys.argv[1:] if given is None else given)]
        register_rung_type()
        quiet_lightning_noise()
        try:
            super().__init__(*args, **kwargs)
        except UsageError as error:
            print(f"{Path(sys.argv[0]).name}: error: {error.message}", file=sys.stderr)
            raise

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_subclass_arguments(AdaptivePrecision, "adaptive_precision", required=False, fail_untyped=False)
        parser.set_defaults({"adaptive_precision": {"class_path": "sage_lightning.AdaptivePrecision"}})
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.config.max_seq_len")
        parser.link_arguments("trainer.default_root_dir", "trainer.logger.init_args.save_dir", logger_save_dir)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        # LightningCLI reads the checkpoint's hyperparameters right after parsing: an empty or truncated file is
        # named here, before any folder is made, instead of the unpickler's EOFError.
        problem = checkpoint_file_problem(self.config[subcommand].get("ckpt_path")) if subcommand else None
        if problem:
            raise UsageError(problem)

    def before_instantiate_classes(self) -> None:
        if not self.subcommand:
            return
        config = self.config[self.subcommand]
        logger, ckpt_path = config.trainer.get("logger"), config.get("ckpt_path")
        init_args = getattr(logger, "init_args", None)
        if ckpt_path and init_args is not None and init_args.get("version") is None and "name" in init_args:
            root = Path(init_args.save_dir) / (init_args.name or "")
            version = run_version(ckpt_path, root)
            if version is not None:  # resume into the run's own folder: TensorBoard shows one run, not two
                init_args.version = version

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, ImportError) as error:
            # The classes validate their arguments: the message names the argument, the value and what works.
            raise UsageError(str(error)) from None

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_config = config["trainer"]
        callbacks = list(trainer_config.get("callbacks") or [])
        callbacks.append(TokensPerSecond())
        if trainer_config.get("enable_progress_bar") is not False:
            callbacks.append(StepProgressBar())
        if trainer_config.get("enable_model_summary") is not False:
            callbacks.append(ParameterSummary())
            # Lightning would otherwise announce that it is not adding its own summary; ours runs all the same.
            kwargs["enable_model_summary"] = False
        if config["adaptive_precision"] is not None:
            callbacks.append(config["adaptive_precision"])
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)

    def fit(self, model: L.LightningModule, **kwargs: Any) -> None:
        """``trainer.fit``, with the data read before any folder is made and a failed start cleaned up."""
        datamodule = kwargs.get("datamodule")
        if isinstance(datamodule, TextDataModule):
            try:  # the corpus's errors (empty, too short) before the logger and the checkpoints make folders
                datamodule.prepare_data()
                datamodule.setup("fit")
            except (ValueError, FileNotFoundError, ImportError) as error:
                raise UsageError(str(error)) from None
        trainer = self.trainer
        new_folders = [
            Path(logger.log_dir)
            for logger in trainer.loggers
            if logger.log_dir is not None and not Path(logger.log_dir).exists()
        ]
        try:
            trainer.fit(model, **kwargs)
        except BaseException as error:
            if trainer.global_step == 0 and trainer.is_global_zero:
                for folder in new_folders:  # nothing trained, nothing to keep: no empty version_N left behind
                    shutil.rmtree(folder, ignore_errors=True)
            elif isinstance(error, SystemExit) and trainer.interrupted and trainer.is_global_zero:
                # Ctrl-C (Lightning exits after its on_exception hooks, the checkpoint callbacks' saves included).
                found = newest_checkpoint(trainer)
                if found is not None:
                    print(f"resume it: {resume_command(self.command_args, found[0])}")
            raise

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        controllers = [cb for cb in trainer.callbacks if isinstance(cb, AdaptivePrecision)]
        lines = [f"attention layers: {len(attention_layers(self.model))}, starting as {self.model.attention}"]
        for controller in controllers:  # lines that fit an 80-column terminal, where the paths allow
            if not controller.verbose:  # a verbose controller printed them, and its summary line, already
                lines.append(attention_summary(self.model, controller))
                lines.extend(f"  {decision}" for decision in controller.history[-10:])
            lines.append("decisions, each with its reason: TensorBoard's Text tab, sage/decisions")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                lines.append(f"TensorBoard logs: {logger.log_dir}")
                lines.append(f"  open them: {tensorboard_command()} --logdir {logger.root_dir}")
        for checkpoint in trainer.checkpoint_callbacks:
            if isinstance(checkpoint, ModelCheckpoint) and checkpoint.last_model_path:
                lines.append(f"last checkpoint: {checkpoint.last_model_path}")
                lines.append(f"  resume from it: add --ckpt_path {checkpoint.last_model_path}")
        print("\n".join(lines))


def register_rung_type() -> None:
    """Teach jsonargparse to read and write a :class:`sage_lightning.Rung` as a mapping.

    ``PolicyConfig.ladder`` is a tuple of rungs; without this, the configuration LightningCLI saves beside the
    logs (``config.yaml``) holds "Unable to serialize" strings in their place and cannot be run again. With it,
    a rung reads and writes as ``{name: ds_bf16, changes: {ds: bf16}, scope: backward}``.
    """
    from jsonargparse.typing import register_type

    def serialize(rung: Rung) -> dict[str, Any]:
        return {"name": rung.name, "changes": rung.fields, "scope": rung.scope}

    def deserialize(value: Any) -> Rung:
        return value if isinstance(value, Rung) else Rung(**value)

    register_type(Rung, serializer=serialize, deserializer=deserialize)


def main(args: list[str] | None = None) -> PretrainCLI:
    """Run the command line (``args`` instead of ``sys.argv[1:]`` when given).

    Example::

        main(["fit", "--config", "examples/configs/tiny.yaml", "--trainer.max_steps", "5"])
    """
    return PretrainCLI(
        LlamaPretraining,
        TextDataModule,
        args=args,
        parser_class=PretrainParser,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "default_root_dir": "runs",
            # save_dir comes from default_root_dir (linked in PretrainCLI.add_arguments_to_parser).
            "logger": {"class_path": "examples.pretrain.PretrainLogger"},
        },
    )


if __name__ == "__main__":
    # Run as ``python -m examples.pretrain``: the configs name ``examples.pretrain.PretrainLogger``, so the command
    # line runs from that module too, not from a second copy of its classes in ``__main__``.
    from examples.pretrain import main as run

    run()
