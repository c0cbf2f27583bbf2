"""A tiny causal language model with SageBwd attention, for the callback's tests (CPU, seconds per run), and a
reader of what a run wrote to TensorBoard's HParams.

Not a test module: the tests import it (and the DDP test's spawned workers unpickle from it).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from google.protobuf import json_format
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sage_lightning import AttentionPrecision, SageAttentionMixin

VOCAB = 64


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention that calls SDPA (what the mixin swaps)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(SageAttentionMixin, L.LightningModule):
    """Embedding, ``layers`` pre-norm blocks, a linear head; next-token cross-entropy; SGD with momentum.

    Args:
        precision: the starting precision of every attention layer (the mixin's ``sage_precision``).
        nan_loss_at_step: make the loss of the first micro-batch of this optimizer step NaN (a real NaN in
            training: it flows into the gradients), on rank ``nan_loss_rank`` only.
        fused: the fused optimizer implementation (it can skip a step on the device).
        optimizer: ``"sgd"`` (SGD with momentum 0.9) or ``"adamw"``.
    """

    def __init__(
        self,
        layers: int = 2,
        d_model: int = 32,
        heads: int = 2,
        lr: float = 0.05,
        precision: AttentionPrecision | None = None,
        nan_loss_at_step: int | None = None,
        nan_loss_rank: int = 0,
        fused: bool = False,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        self.lr = lr
        self.sage_precision = precision
        self.nan_loss_at_step = nan_loss_at_step
        self.nan_loss_rank = nan_loss_rank
        self.fused = fused
        self.optimizer = optimizer
        self.embed = nn.Embedding(VOCAB, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.head = nn.Linear(d_model, VOCAB)
        #: Every micro-batch loss training_step returned, in order (before Lightning divides it).
        self.step_losses: list[float] = []
        self._nan_done = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = lm_loss(self, ids)
        if (
            self.trainer.global_step == self.nan_loss_at_step
            and self.global_rank == self.nan_loss_rank
            and not self._nan_done
        ):
            self._nan_done = True
            loss = loss * float("nan")
        self.step_losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr * 0.1, fused=self.fused or None)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, fused=self.fused or None)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on token ids ``[batch, seq + 1]``."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call, for tests that read what the callback logged without TensorBoard."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: object, *args: object, **kwargs: object) -> None:
        pass

    def series(self, tag: str) -> dict[int, float]:
        """``{step: value}`` of one tag."""
        return {step: metrics[tag] for step, metrics in self.logged if tag in metrics}


def hparams_session(accumulator: EventAccumulator) -> tuple[dict[str, object], list[str]]:
    """The first HParams session of a run (the one TensorBoard shows): its hyperparameters and metric columns."""
    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    values = {name: json_format.MessageToDict(value) for name, value in start.hparams.items()}
    return values, [metric.name.tag for metric in experiment.metric_infos]


def token_loader(
    batches: int, batch_size: int = 2, seq: int = 32, seed: int = 0, same_batch: bool = False
) -> DataLoader:
    """``batches`` micro-batches of random token ids ``[batch_size, seq + 1]``, in a fixed order.

    ``same_batch``: every micro-batch holds the same ids, so which batch a step sees cannot matter (Lightning
    replays the first batch of an epoch when it resumes from a checkpoint saved at that epoch's end).
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, ((1 if same_batch else batches) * batch_size, seq + 1), generator=generator)
    ids = ids.repeat(batches, 1) if same_batch else ids
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def trainer_kwargs(tmp_path, **overrides) -> dict:
    """Quiet CPU Trainer settings for tests."""
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


class PressCtrlC(Callback):
    """Presses Ctrl-C (raises ``KeyboardInterrupt``) once optimizer step ``step`` is done; LightningCLI finds it as
    ``tiny_lightning.PressCtrlC``.

    Args:
        step: the ``trainer.global_step`` after which to interrupt.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt
