"""How one attention layer runs: the per-product formats of SageBwd, or full precision."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: The products whose format can be chosen, in the order they run. ``qk`` is ``S = Q K^T`` (forward, and
#: its recomputation in the backward), ``pv`` is ``O = P V``, ``dv`` is ``dV = P^T dO``, ``dp`` is
#: ``dP = dO V^T`` and ``ds`` covers the two products that consume the score gradient,
#: ``dQ = dS K`` and ``dK = dS^T Q``.
PRODUCTS: tuple[str, ...] = ("qk", "pv", "dv", "dp", "ds")
#: Formats a product can run in. ``"bf16"`` means "the input's 16-bit float type with fp32
#: accumulation" (fp16 inputs run it in fp16, fp32 inputs in fp32).
FORMATS: tuple[str, ...] = ("int8", "bf16")
#: Modes of an attention layer. ``"full"`` is plain full-precision attention (the last rung of the
#: controller's ladder).
MODES: tuple[str, ...] = ("sagebwd", "full")
#: Modes the design names that this version does not implement yet.
PLANNED_MODES: tuple[str, ...] = ("attn_qat",)


@dataclass(frozen=True)
class AttentionPrecision:
    """The numerics of one attention layer.

    The default is SageBwd as published: six of the seven matrix products in INT8 (``dp`` stays in
    bf16), K-smoothing on, Q-smoothing off.

    Args:
        mode: ``"sagebwd"`` (quantized attention, formats below) or ``"full"`` (plain
            full-precision attention through ``torch.nn.functional.scaled_dot_product_attention``).
        qk: format of ``S = Q K^T``.
        pv: format of ``O = P V``.
        dv: format of ``dV = P^T dO``.
        dp: format of ``dP = dO V^T``.
        ds: format of ``dQ = dS K`` and ``dK = dS^T Q`` (the score gradient's products).
        smooth_k: subtract the per-head token mean of K before quantizing it (softmax is invariant
            to it; it removes the channel bias that would otherwise dominate K's INT8 scale).
        smooth_q: subtract the per-block mean of Q before quantizing it and add the dropped term
            back to S in fp32.

    Raises:
        ValueError: an unknown mode or format, or a non-bool smoothing flag.

    Example::

        from sage_lightning.kernels import AttentionPrecision

        fast = AttentionPrecision()                      # SageBwd defaults
        safer = fast.replace(ds="bf16")                   # the score gradient in bf16
        print(safer.short_name)                           # "sagebwd:int8=qk,pv,dv;smooth_k"
    """

    mode: str = "sagebwd"
    qk: str = "int8"
    pv: str = "int8"
    dv: str = "int8"
    dp: str = "bf16"
    ds: str = "int8"
    smooth_k: bool = True
    smooth_q: bool = False

    def __post_init__(self) -> None:
        if self.mode in PLANNED_MODES:
            raise ValueError(
                f"AttentionPrecision: mode={self.mode!r} (simulated NVFP4 attention) is planned but not "
                f"available in this version; use one of {MODES}."
            )
        if self.mode not in MODES:
            raise ValueError(f"AttentionPrecision: mode must be one of {MODES}; received {self.mode!r}.")
        for name in PRODUCTS:
            value = getattr(self, name)
            if value not in FORMATS:
                raise ValueError(f"AttentionPrecision: {name} must be one of {FORMATS}; received {value!r}.")
        for name in ("smooth_k", "smooth_q"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"AttentionPrecision: {name} must be True or False; received {value!r}.")

    @property
    def int8_products(self) -> tuple[str, ...]:
        """The products that run in INT8 (empty in ``"full"`` mode)."""
        if self.mode != "sagebwd":
            return ()
        return tuple(name for name in PRODUCTS if getattr(self, name) == "int8")

    @property
    def short_name(self) -> str:
        """A compact, stable label, e.g. ``"sagebwd:int8=qk,pv,dv,ds;smooth_k"`` or ``"full"``."""
        if self.mode != "sagebwd":
            return self.mode
        parts = [f"int8={','.join(self.int8_products) or 'none'}"]
        parts += [name for name in ("smooth_k", "smooth_q") if getattr(self, name)]
        return "sagebwd:" + ";".join(parts)

    def replace(self, **changes: object) -> AttentionPrecision:
        """A copy with some fields changed (validated like the constructor).

        Example::

            AttentionPrecision().replace(ds="bf16", smooth_q=True)
        """
        return dataclasses.replace(self, **changes)

    @classmethod
    def all_int8(cls, **changes: object) -> AttentionPrecision:
        """Every product in INT8, ``dp`` included (the seven-of-seven setting of the accuracy study)."""
        base = dict.fromkeys(PRODUCTS, "int8")
        base.update(changes)
        return cls(**base)

    @classmethod
    def all_bf16(cls, **changes: object) -> AttentionPrecision:
        """SageBwd's tiling with every product in high precision (isolates one product at a time)."""
        base = dict.fromkeys(PRODUCTS, "bf16")
        base.update(changes)
        return cls(**base)
