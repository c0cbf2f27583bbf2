"""sage-lightning: trainable INT8 attention (SageBwd) for PyTorch Lightning.

Public API:

* :func:`sage_attention`: SDPA-compatible attention with SageBwd numerics.
* :class:`AttentionPrecision`: how one attention layer runs.
* :class:`SageAttentionMixin`: a LightningModule mixin that swaps the model's attention to SageBwd.
* :func:`convert_to_sage_attention`: the same swap for a plain PyTorch model.
* :class:`AttentionLayerState` and :func:`attention_layers`: each swapped layer's precision and signals.
* :class:`AdaptivePrecision`: the Lightning callback that adapts each layer's precision to training's signals;
  :class:`TrainingDiverged`, what it raises when a persistent fault spends its rollback budget.
* :class:`PolicyConfig` and :class:`Rung`: its thresholds, cadences and precision ladder.
* :func:`attention_summary`: the line a run prints at its end (layers served, calls sent to SDPA and why,
  decisions, low-bit share), for notebooks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sage_lightning.callback import AdaptivePrecision, TrainingDiverged
    from sage_lightning.console import attention_summary
    from sage_lightning.kernels import AttentionPrecision, sage_attention
    from sage_lightning.layer import AttentionLayerState, attention_layers
    from sage_lightning.mixin import SageAttentionMixin
    from sage_lightning.policy import PolicyConfig, Rung
    from sage_lightning.swap import convert_to_sage_attention

# Imported on first use, so that the pure parts (``sage_lightning.policy``, ``sage_lightning.detectors``) load
# without torch or Lightning.
_EXPORTS = {
    "AdaptivePrecision": "sage_lightning.callback",
    "AttentionLayerState": "sage_lightning.layer",
    "AttentionPrecision": "sage_lightning.kernels",
    "PolicyConfig": "sage_lightning.policy",
    "Rung": "sage_lightning.policy",
    "SageAttentionMixin": "sage_lightning.mixin",
    "TrainingDiverged": "sage_lightning.callback",
    "attention_layers": "sage_lightning.layer",
    "attention_summary": "sage_lightning.console",
    "convert_to_sage_attention": "sage_lightning.swap",
    "sage_attention": "sage_lightning.kernels",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sage_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "AdaptivePrecision",
    "AttentionLayerState",
    "AttentionPrecision",
    "PolicyConfig",
    "Rung",
    "SageAttentionMixin",
    "TrainingDiverged",
    "__version__",
    "attention_layers",
    "attention_summary",
    "convert_to_sage_attention",
    "sage_attention",
]
