"""Pretrain a LLaMA-style model with SageBwd attention, steered by ``AdaptivePrecision``, logged to TensorBoard.

Run it from the repository root::

    python examples/pretrain.py fit --config examples/configs/tiny.yaml      # CPU, about 75 s
    tensorboard --logdir runs                                                # the sage/ charts

The same run with full-precision attention, everything else equal::

    python examples/pretrain.py fit --config examples/configs/tiny.yaml --model.attention full

Without the controller (SageBwd all the way, nothing adapts)::

    python examples/pretrain.py fit --config examples/configs/tiny.yaml --adaptive_precision null

Any argument of the model (``--model.config.n_layers 8``), the data (``--data.paths '[my_text/]'``), the
Trainer (``--trainer.max_steps 500``) or the callback
(``--adaptive_precision.init_args.config.ds_rel_err_high 0.15``) can be changed on the command line;
``python examples/pretrain.py fit --help`` lists them and ``--print_config`` shows the resolved configuration.
LightningCLI needs ``jsonargparse[signatures]`` (``pip install "sage-lightning[examples]"``; ``make demo``
installs it).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn

from sage_lightning import AdaptivePrecision, AttentionPrecision, Rung, SageAttentionMixin, attention_layers
from sage_lightning.callback import count_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import TextDataModule  # noqa: E402  (examples/ is a folder of scripts, not a package)
from llama import Llama, LlamaConfig  # noqa: E402

#: ``attention`` -> the starting precision of every attention layer.
ATTENTION_MODES: dict[str, AttentionPrecision] = {
    "sage": AttentionPrecision(),
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
        attention: ``"sage"`` (SageBwd, INT8), ``"attn_qat"`` (simulated NVFP4), ``"attn_qat_dropin"`` (its FP4
            forward with a plain backward) or ``"full"`` (full precision).
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
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = self.config.__dict__.copy()  # plain values: hparams.yaml and TensorBoard read them
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
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=self.betas,
            fused=self.device.type == "cuda" or None,
        )
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(self.warmup_steps, total, self.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


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


class PretrainCLI(LightningCLI):
    """LightningCLI for :class:`LlamaPretraining` and :class:`corpus.TextDataModule`, with the controller.

    Adds to LightningCLI's arguments:

    * ``adaptive_precision``: the :class:`sage_lightning.AdaptivePrecision` callback (``class_path`` and
      ``init_args``, its ``config`` a :class:`sage_lightning.PolicyConfig`); on by default, ``null`` turns it off;
    * links: the data's ``vocab_size`` and ``seq_len`` set the model's ``config.vocab_size`` and
      ``config.max_seq_len``;
    * a :class:`TokensPerSecond` callback on every run; the TensorBoard logger unless the config names another.

    After ``fit`` it prints where the logs and checkpoints are and how to open TensorBoard on them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        register_rung_type()
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_subclass_arguments(AdaptivePrecision, "adaptive_precision", required=False, fail_untyped=False)
        parser.set_defaults({"adaptive_precision": {"class_path": "sage_lightning.AdaptivePrecision"}})
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.config.max_seq_len")

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        callbacks = list(config["trainer"].get("callbacks") or [])
        callbacks.append(TokensPerSecond())
        if config["adaptive_precision"] is not None:
            callbacks.append(config["adaptive_precision"])
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        controllers = [cb for cb in trainer.callbacks if isinstance(cb, AdaptivePrecision)]
        lines = [f"attention layers: {len(attention_layers(self.model))}, starting as {self.model.attention}"]
        for controller in controllers:
            lines.append(
                f"AdaptivePrecision: {len(controller.history)} decision(s) (TensorBoard's Text tab, sage/decisions), "
                f"int8 share {controller.int8_fraction:.3f}, tokens seen {controller.tokens_seen}"
            )
            if not controller.verbose:  # a verbose controller printed each one as it happened
                lines.extend(f"  {decision}" for decision in controller.history[-10:])
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                lines.append(f"TensorBoard logs: {logger.log_dir}")
                lines.append(f"  open them: tensorboard --logdir {logger.root_dir}")
        for checkpoint in trainer.checkpoint_callbacks:
            if isinstance(checkpoint, ModelCheckpoint) and checkpoint.last_model_path:
                lines.append(f"last checkpoint: {checkpoint.last_model_path}")
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
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "runs"}}
        },
    )


if __name__ == "__main__":
    main()
