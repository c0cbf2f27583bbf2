"""SageBwd and Attn-QAT attention kernels and their pure-PyTorch references (imported as ``sage_lightning.kernels``).

Nothing in here knows about Lightning.
"""

from .interface import SUPPORTED_DTYPES, check_inputs, sage_attention, use_backend
from .precision import FORMATS, MODES, PRODUCTS, QAT_BACKWARDS, AttentionPrecision

__all__ = [
    "FORMATS",
    "MODES",
    "PRODUCTS",
    "QAT_BACKWARDS",
    "SUPPORTED_DTYPES",
    "AttentionPrecision",
    "check_inputs",
    "sage_attention",
    "use_backend",
]
