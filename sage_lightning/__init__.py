"""sage-lightning: trainable INT8 attention (SageBwd) for PyTorch Lightning.

Public API (more lands with the Lightning integration):

* :func:`sage_attention`: SDPA-compatible attention with SageBwd numerics.
* :class:`AttentionPrecision`: how one attention layer runs.
"""

from sage_lightning.kernels import AttentionPrecision, sage_attention

__version__ = "0.1.0"

__all__ = ["AttentionPrecision", "__version__", "sage_attention"]
