"""What a run prints: one line on what SageBwd did, and none of the console noise a user cannot act on.

* :func:`attention_summary`: layers served, calls sent to SDPA and why, decisions, low-bit share.
  ``AdaptivePrecision`` prints it when training ends (``SageAttentionMixin`` does, when there is no controller), so
  a run that succeeded says that SageBwd ran; in a notebook, call it.
* :func:`resume_instructions`: after Ctrl-C, where and how to resume (``AdaptivePrecision`` prints it);
  :func:`newest_checkpoint`, the file it names.
* :func:`quiet_lightning_noise`: drops two lines Lightning prints on every run, narrowly (``AdaptivePrecision``
  calls it when it is made).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from sage_lightning.layer import attention_layers

if TYPE_CHECKING:
    from sage_lightning.callback import AdaptivePrecision

# How many fallback reasons the line names (the most frequent); the rest are counted in attention_layers(model).
_REASONS_SHOWN = 2


def attention_summary(model: nn.Module, controller: AdaptivePrecision | None = None) -> str:
    """One line: how many swapped attention layers ran SageBwd, their calls, the calls sent to PyTorch's SDPA and
    why, and with a controller its decisions, its low-bit share and the tokens it saw.

    The counts are the layers' own (:attr:`~sage_lightning.AttentionLayerState.calls`,
    :attr:`~sage_lightning.AttentionLayerState.fallback_reasons`): every call since the swap, validation included,
    and a resumed run's from its checkpoint on. A layer "ran SageBwd" when at least one of its calls was served.

    Args:
        model: the model, or the LightningModule, after the swap (``SageAttentionMixin`` or
            ``convert_to_sage_attention``).
        controller: the ``AdaptivePrecision`` callback of the run, if any.

    Returns:
        The line, e.g. ``"AdaptivePrecision: 2 of 2 attention layers ran SageBwd (16 calls, none sent to SDPA),
        0 decisions, low-bit share 1.000, 528 tokens seen"``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``controller`` not an ``AdaptivePrecision``.

    Example::

        from sage_lightning import AdaptivePrecision, attention_summary

        controller = AdaptivePrecision()
        trainer = L.Trainer(max_steps=100, callbacks=[controller])
        trainer.fit(model)
        print(attention_summary(model, controller))
    """
    from sage_lightning.callback import AdaptivePrecision

    if not isinstance(model, nn.Module):
        raise TypeError(
            "attention_summary: model must be the torch.nn.Module whose attention was swapped (the LightningModule); "
            f"received {type(model).__name__}."
        )
    if controller is not None and not isinstance(controller, AdaptivePrecision):
        raise TypeError(
            "attention_summary: controller must be the run's sage_lightning.AdaptivePrecision callback or None; "
            f"received {type(controller).__name__}."
        )
    layers = attention_layers(model)
    served_layers = sum(layer.calls > layer.fallback_calls for layer in layers.values())
    calls = sum(layer.calls for layer in layers.values())
    reasons: dict[str, int] = {}
    for layer in layers.values():
        for reason, count in layer.fallback_reasons.items():
            short = reason.split(" (")[0]  # the reason without its explanation, which the warning gave
            reasons[short] = reasons.get(short, 0) + count
    fallbacks = sum(reasons.values())
    if not layers:
        where = "no attention layer was swapped to SageBwd (SageAttentionMixin, convert_to_sage_attention)"
    else:
        if fallbacks:
            common = sorted(reasons.items(), key=lambda item: -item[1])
            named = ", ".join(f"{count:,} {reason}" for reason, count in common[:_REASONS_SHOWN])
            more = f", {len(common) - _REASONS_SHOWN} more reasons" if len(common) > _REASONS_SHOWN else ""
            sent = f"{fallbacks:,} sent to SDPA: {named}{more}"
        else:
            sent = "none sent to SDPA"
        noun = "attention layer" if len(layers) == 1 else "attention layers"
        where = f"{served_layers} of {len(layers)} {noun} ran SageBwd ({calls:,} calls, {sent})"
    if controller is None:
        return f"sage_lightning: {where}; no AdaptivePrecision controller"
    decisions = len(controller.history)
    return (
        f"AdaptivePrecision: {where}, {decisions} decision{'' if decisions == 1 else 's'}, "
        f"low-bit share {controller.int8_fraction:.3f}, {controller.tokens_seen:,} tokens seen"
    )


class _DropLitLoggerTip(logging.Filter):
    """Drops Lightning's advertisement for its cloud logger (printed by every Trainer that does not use it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_lightning_noise() -> None:
    """Silence two console lines of every Lightning run that carry nothing for its user; every other warning and
    message stays. Idempotent.

    * the "Tip: ... litlogger" line, which Lightning prints whenever its cloud logger is not in use (a filter on
      Lightning's ``rank_zero`` loggers that drops that one message);
    * ``isinstance(treespec, LeafSpec)` is deprecated``, raised by torch >= 2.10 inside Lightning's own
      ``lightning/pytorch/utilities/_pytree.py`` (its ``CombinedLoader`` flattens the dataloaders on every fit);
      ignored only when it comes from that module.

    Example::

        from sage_lightning.console import quiet_lightning_noise

        quiet_lightning_noise()   # before building the Trainer: the tip is printed by Trainer(...)
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLitLoggerTip) for f in logger.filters):
            logger.addFilter(_DropLitLoggerTip())
    warnings.filterwarnings(
        "ignore",
        message=r".*isinstance\(treespec, LeafSpec\)` is deprecated",
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def newest_checkpoint(trainer: pl.Trainer) -> tuple[str, int | None] | None:
    """The newest checkpoint file the Trainer's ``ModelCheckpoint`` callbacks saved, and its step when known.

    Args:
        trainer: the Trainer, during or after a fit.

    Returns:
        ``(path, step)``, ``step`` ``None`` when Lightning did not record it; ``None`` when no file was saved.

    Example::

        found = newest_checkpoint(trainer)
        if found is not None:
            trainer.fit(model, ckpt_path=found[0])
    """
    saved: list[tuple[float, str, int | None]] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        step = getattr(callback, "_last_global_step_saved", None) or None  # Lightning's record of its last save
        for path in {callback.last_model_path, callback.best_model_path, *callback.best_k_models}:
            if path and os.path.isfile(path):
                saved.append((os.path.getmtime(path), path, step))
    if not saved:
        return None
    _, path, step = max(saved)
    return path, step


def resume_instructions(trainer: pl.Trainer) -> str:
    """Where an interrupted fit can resume from and how: the newest checkpoint (:func:`newest_checkpoint`) and the
    ``ckpt_path`` to give ``fit``; where a ``ModelCheckpoint(save_on_exception=True)`` is about to save the
    interrupted step, that; without a checkpoint, how to keep one next time.

    Args:
        trainer: the interrupted Trainer (``AdaptivePrecision`` calls this from ``on_exception``, before the
            checkpoint callbacks' own ``on_exception``).

    Returns:
        One paragraph, e.g. ``"AdaptivePrecision: training interrupted at step 7. Resume from ckpt/step=4.ckpt (step 4):
        trainer.fit(model, ..., ckpt_path='ckpt/step=4.ckpt') ..."``.

    Example::

        print(resume_instructions(trainer))
    """
    text = f"AdaptivePrecision: training interrupted at step {trainer.global_step}."
    on_exception = [
        callback.dirpath
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint) and getattr(callback, "save_on_exception", False) and callback.dirpath
    ]
    if on_exception:
        return (
            f"{text} ModelCheckpoint(save_on_exception=True) saves this step in {on_exception[0]} now: resume from "
            "that checkpoint with trainer.fit(model, ..., ckpt_path=<it>) (LightningCLI: --ckpt_path <it>); "
            "TensorBoard keeps each step once."
        )
    found = newest_checkpoint(trainer)
    if found is None:
        return (
            f"{text} No checkpoint was saved, so it cannot resume: give the Trainer a "
            "ModelCheckpoint(every_n_train_steps=..., save_last=True) or ModelCheckpoint(save_on_exception=True) "
            "to keep one next time."
        )
    path, step = found
    at = f" (step {step})" if step is not None else ""
    return (
        f"{text} Resume from {path}{at}: trainer.fit(model, ..., ckpt_path={path!r}) (LightningCLI: --ckpt_path "
        f"{path}); the steps after it run again, and TensorBoard keeps each step once."
    )
