"""sage-lightning: trainable INT8 attention (SageBwd) for PyTorch Lightning.

Public API:

* :func:`sage_attention`: SDPA-compatible attention with SageBwd numerics.
* :class:`AttentionPrecision`: how one attention layer runs.
* :class:`SageAttentionMixin`: a LightningModule mixin that swaps the model's attention to SageBwd.
* :func:`convert_to_sage_attention`: the same swap for a plain PyTorch model.
* :class:`AttentionLayerState` and :func:`attention_layers`: each swapped layer's precision and signals.
* :class:`AdaptivePrecision`: the Lightning callback that adapts each layer's precision to training's signals.
* :class:`PolicyConfig` and :class:`Rung`: its thresholds, cadences and precision ladder.
"""

from sage_lightning.callback import AdaptivePrecision
from sage_lightning.kernels import AttentionPrecision, sage_attention
from sage_lightning.layer import AttentionLayerState, attention_layers
from sage_lightning.mixin import SageAttentionMixin
from sage_lightning.policy import PolicyConfig, Rung
from sage_lightning.swap import convert_to_sage_attention

__version__ = "0.1.0"

__all__ = [
    "AdaptivePrecision",
    "AttentionLayerState",
    "AttentionPrecision",
    "PolicyConfig",
    "Rung",
    "SageAttentionMixin",
    "__version__",
    "attention_layers",
    "convert_to_sage_attention",
    "sage_attention",
]
