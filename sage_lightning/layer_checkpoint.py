"""Every attention layer's precision in the module's checkpoint, so it survives a resume without the callback.

``SageAttentionMixin``'s checkpoint hooks call :func:`save_layers` and :func:`load_layers`; the entry lives under
:data:`CHECKPOINT_KEY` beside Lightning's ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import attention_layers

#: The checkpoint entry holding the attention layers' precisions.
CHECKPOINT_KEY = "sage_attention"


def checkpoint_file_problem(path: str | os.PathLike | None) -> str | None:
    """Why a local checkpoint file cannot hold a checkpoint, naming it, or ``None`` when it may.

    A run stopped while writing leaves a zero-length ``last.ckpt`` (or a zip archive without its end), and resuming
    from it gets PyTorch's unpickler's ``EOFError: Ran out of input`` (or the zip reader's error) with no file named.
    Remote paths (``s3://...``), missing files (Lightning names those itself) and files that look whole give ``None``.

    Args:
        path: the checkpoint a run resumes from, or ``None``.

    Example::

        problem = checkpoint_file_problem("runs/version_0/checkpoints/last.ckpt")
        if problem:
            raise ValueError(problem)
    """
    if path is None or not os.path.isfile(path):
        return None
    size = os.path.getsize(path)
    advice = (
        "most likely by a run stopped while writing it. Resume from an earlier checkpoint (its folder may hold "
        "others), or fit without ckpt_path to start over."
    )
    if size == 0:
        return f"The checkpoint {os.fspath(path)!r} is empty (0 bytes): it was cut short, {advice}"
    with open(path, "rb") as file:
        zipped = file.read(4) == b"PK\x03\x04"  # torch.save's format: a zip archive, whose directory is at its end
    if zipped and not zipfile.is_zipfile(path):
        return (
            f"The checkpoint {os.fspath(path)!r} is truncated ({size} bytes, a zip archive without its end), {advice}"
        )
    return None


def save_layers(module: nn.Module, configured: AttentionPrecision | None) -> dict[str, Any]:
    """The entry :func:`load_layers` reads: the configured starting precision and every layer's state.

    Args:
        module: the model, after the swap.
        configured: the starting precision the layers were swapped with (the mixin's ``sage_precision``).

    Example::

        checkpoint["sage_attention"] = save_layers(model, model.sage_precision)
    """
    return {
        "configured": None if configured is None else dataclasses.asdict(configured),
        "layers": {name: layer.state_dict() for name, layer in attention_layers(module).items()},
    }


def load_layers(module: nn.Module, saved: object, configured: AttentionPrecision | None, *, owner: str) -> None:
    """Put every layer back at the precision the checkpoint holds for it.

    Args:
        module: the model, after the swap.
        saved: the checkpoint's entry (from :func:`save_layers`).
        configured: the starting precision configured now; a warning when it differs from the checkpoint's.
        owner: who is loading, for the messages.

    Raises:
        ValueError: a malformed entry, or a checkpoint whose attention layers are not the model's.

    Example::

        load_layers(model, checkpoint["sage_attention"], model.sage_precision, owner="MyModel")
    """
    if not isinstance(saved, Mapping) or not isinstance(saved.get("layers"), Mapping) or "configured" not in saved:
        raise ValueError(
            f"{owner}: the checkpoint's {CHECKPOINT_KEY!r} entry must be a dict with 'configured' and 'layers' "
            f"(written by the mixin's on_save_checkpoint); received {saved!r:.200}."
        )
    layers = attention_layers(module)
    names, known = list(saved["layers"]), list(layers)
    if set(names) != set(known):
        raise ValueError(
            f"{owner}: the checkpoint holds attention layers {names}, this model has {known} (only in the "
            f"checkpoint: {sorted(set(names) - set(known))}; only in the model: {sorted(set(known) - set(names))}). "
            "Load it into the model it was saved from (same layers, same sage_attention_filter)."
        )
    for name, layer in layers.items():
        layer.load_state_dict(dict(saved["layers"][name]))
    before = None if saved["configured"] is None else AttentionPrecision(**saved["configured"])
    if (before or AttentionPrecision()) != (configured or AttentionPrecision()):
        rank_zero_warn(
            f"{owner}: sage_precision is {(configured or AttentionPrecision()).short_name}, the checkpoint was "
            f"trained from {(before or AttentionPrecision()).short_name}; its layers keep the checkpoint's precisions "
            f"(with the controller's escalations): {sorted({layer.precision.short_name for layer in layers.values()})}"
            ". To start from sage_precision instead, load the weights alone (model.load_state_dict(checkpoint["
            "'state_dict'])) and fit without ckpt_path."
        )
