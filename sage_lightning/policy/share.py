"""The low-bit share: how many layer-steps ran on their base precision's fast path (INT8 or FP8 products).

Counted here, beside the decisions that move layers off the fast path, so that the number the progress bar, the
TensorBoard tag ``sage/int8_fraction`` and the run's last line show is defined in one place.
"""

from __future__ import annotations

from sage_lightning.policy._precision import LOW_BIT_FORMATS, AttentionPrecision


def runs_low_bit(base: AttentionPrecision, now: AttentionPrecision) -> bool:
    """Whether a layer whose base precision is ``base`` runs low-bit at ``now``: the base has low-bit work
    (attn_qat, or SageBwd with an INT8 or FP8 product) and ``now`` is still on a fast path, i.e. runs the base's
    mode with every low-bit product of the base still low-bit, INT8 or FP8 (an attn_qat layer has no low-bit
    products: it is on its fast path while still in attn_qat mode). INT8 dS moved to FP8 (the tokens-per-step rule)
    stays low-bit.

    Example::

        runs_low_bit(AttentionPrecision(), AttentionPrecision(ds="bf16"))   # False: dS left the low-bit formats
        runs_low_bit(AttentionPrecision(), AttentionPrecision(ds="fp8"))    # True
    """
    has_low_bit = base.mode == "attn_qat" or bool(base.int8_products or base.fp8_products)
    if not has_low_bit:
        return False
    low_bit = (*base.int8_products, *base.fp8_products)
    return now.mode == base.mode and all(getattr(now, product) in LOW_BIT_FORMATS for product in low_bit)


class LowBitShare:
    """The share of layer-steps that ran low-bit (:func:`runs_low_bit`), counted step by step.

    Example::

        share = LowBitShare()
        share.count(layers=4, low_bit=3)
        share.fraction   # 0.75
    """

    def __init__(self) -> None:
        self.layer_steps = 0
        self.low_bit_layer_steps = 0

    @property
    def fraction(self) -> float:
        """Low-bit layer-steps over all layer-steps; 1 before the first step."""
        return self.low_bit_layer_steps / self.layer_steps if self.layer_steps else 1.0

    def count(self, layers: int, low_bit: int) -> None:
        """Count one optimizer step of ``layers`` layers, ``low_bit`` of which ran low-bit."""
        self.layer_steps += layers
        self.low_bit_layer_steps += low_bit
