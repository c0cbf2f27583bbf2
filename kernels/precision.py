"""How one attention layer runs: the per-product formats of SageBwd, simulated NVFP4 (Attn-QAT), or full precision."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: The products whose format can be chosen, in the order they run. ``qk`` is ``S = Q K^T`` (forward, and
#: its recomputation in the backward), ``pv`` is ``O = P V``, ``dv`` is ``dV = P^T dO``, ``dp`` is
#: ``dP = dO V^T`` and ``ds`` covers the two products that consume the score gradient,
#: ``dQ = dS K`` and ``dK = dS^T Q``.
PRODUCTS: tuple[str, ...] = ("qk", "pv", "dv", "dp", "ds")
#: Formats a product can run in. ``"int8"``: symmetric INT8 codes, ``s = max|X| / 127`` per block, int32
#: accumulation. ``"fp8"``: e4m3 codes, ``s = max|X| / 448`` per block (round to nearest even), fp32 accumulation
#: (``docs/how-it-works.md`` lists each product's blocks). ``"bf16"`` means "the input's 16-bit float type with fp32
#: accumulation" (fp16 inputs run it in fp16, fp32 inputs in fp32).
FORMATS: tuple[str, ...] = ("int8", "fp8", "bf16")
#: The 8-bit formats, whose operands are quantized codes with scales.
LOW_BIT_FORMATS: tuple[str, ...] = ("int8", "fp8")
#: Every format the kernels and the reference compute: :data:`FORMATS` and ``"nvfp4"``, simulated NVFP4 (E2M1 values
#: in blocks of 16 with E4M3 block scales and an FP32 scale per (batch, head), or per row of a key tile for P; the
#: values are exact in the input's 16-bit type, so the products run in it with fp32 accumulation). A layer runs NVFP4
#: through the Attn-QAT preset (:meth:`AttentionPrecision.attn_qat`), whose formats :attr:`AttentionPrecision.formats`
#: lists.
KERNEL_FORMATS: tuple[str, ...] = (*FORMATS, "nvfp4")
#: Modes of an attention layer. ``"sagebwd"`` is INT8 attention (the product formats below), ``"attn_qat"``
#: simulated NVFP4 attention for quantization-aware training (``docs/how-it-works.md``), ``"full"`` plain
#: full-precision attention (the last rung of the controller's ladder).
MODES: tuple[str, ...] = ("sagebwd", "attn_qat", "full")
#: Backward passes of ``mode="attn_qat"``. ``"matched"`` is Attn-QAT's: S and P recomputed from the same
#: fake-quantized Q and K as the forward, dV from P re-quantized as in the forward, and
#: ``delta = rowsum(dO * O_hp)`` with the output of the unquantized P. ``"dropin"`` is the "drop-in" QAT the
#: paper reports as unstable: FlashAttention's backward from the unquantized q, k, v, fed the FP4 forward's
#: output and logsumexp.
QAT_BACKWARDS: tuple[str, ...] = ("matched", "dropin")


@dataclass(frozen=True)
class AttentionPrecision:
    """The numerics of one attention layer.

    The default is SageBwd as published: six of the seven matrix products in INT8 (``dp`` stays in
    bf16), K-smoothing on, Q-smoothing off.

    Each field belongs to one mode and is ignored (kept as it is) in the others, so switching a layer's mode
    back and forth keeps its settings: the product formats and smoothing flags are SageBwd's, ``qat_backward``
    is Attn-QAT's, and ``"full"`` reads none. :attr:`short_name` names only what runs.

    Args:
        mode: ``"sagebwd"`` (INT8 attention, formats below), ``"attn_qat"`` (simulated NVFP4 attention for
            quantization-aware training: Q, K, V and P fake-quantized to NVFP4, products in the input's
            16-bit type) or ``"full"`` (plain full-precision attention through
            ``torch.nn.functional.scaled_dot_product_attention``).
        qk: format of ``S = Q K^T`` (``"int8"``, ``"fp8"`` or ``"bf16"``; so are the four below).
        pv: format of ``O = P V``.
        dv: format of ``dV = P^T dO``.
        dp: format of ``dP = dO V^T``.
        ds: format of ``dQ = dS K`` and ``dK = dS^T Q`` (the score gradient's products).
        smooth_k: subtract the per-head token mean of K before quantizing it (softmax is invariant
            to it; it removes the channel bias that would otherwise dominate K's INT8 scale).
        smooth_q: subtract the per-block mean of Q before quantizing it and add the dropped term
            back to S in fp32.
        qat_backward: the backward of ``mode="attn_qat"``: ``"matched"`` (Attn-QAT: matching low-precision
            recomputation, the default) or ``"dropin"`` (an FP4 forward with FlashAttention's backward from
            the unquantized inputs, the unstable baseline of the Attn-QAT paper; for comparisons).

    Raises:
        ValueError: an unknown mode, format or ``qat_backward``, or a non-bool smoothing flag.

    Example::

        from sage_lightning.kernels import AttentionPrecision

        fast = AttentionPrecision()                      # SageBwd defaults
        safer = fast.replace(ds="bf16")                   # the score gradient in bf16
        print(safer.short_name)                           # "sagebwd:int8=qk,pv,dv;smooth_k"
        fp8_pv = fast.replace(pv="fp8")                   # O = P V with e4m3 operands
        print(fp8_pv.short_name)                          # "sagebwd:int8=qk,dv,ds;fp8=pv;smooth_k"
        qat = AttentionPrecision(mode="attn_qat")         # simulated NVFP4, Attn-QAT's backward
        print(qat.replace(qat_backward="dropin").short_name)  # "attn_qat:dropin"
    """

    mode: str = "sagebwd"
    qk: str = "int8"
    pv: str = "int8"
    dv: str = "int8"
    dp: str = "bf16"
    ds: str = "int8"
    smooth_k: bool = True
    smooth_q: bool = False
    qat_backward: str = "matched"

    def __post_init__(self) -> None:
        # A str first: an array or tensor would pass ``in`` (elementwise ==) and fail later, at hash.
        for name in ("mode", *PRODUCTS, "qat_backward"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(
                    f"AttentionPrecision: {name} must be a str; received {value!r} of type {type(value).__name__}."
                )
        if self.mode not in MODES:
            raise ValueError(f"AttentionPrecision: mode must be one of {MODES}; received {self.mode!r}.")
        for name in PRODUCTS:
            value = getattr(self, name)
            if value not in FORMATS:
                raise ValueError(
                    f"AttentionPrecision: {name} must be one of {FORMATS}; received {value!r}"
                    + (" (NVFP4 runs as the preset AttentionPrecision(mode='attn_qat'))." if value == "nvfp4" else ".")
                )
        for name in ("smooth_k", "smooth_q"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"AttentionPrecision: {name} must be True or False; received {value!r}.")
        if self.qat_backward not in QAT_BACKWARDS:
            raise ValueError(
                f"AttentionPrecision: qat_backward must be one of {QAT_BACKWARDS} (used by mode='attn_qat'); "
                f"received {self.qat_backward!r}."
            )

    @property
    def int8_products(self) -> tuple[str, ...]:
        """The products that run in INT8 (empty in ``"attn_qat"`` and ``"full"`` modes)."""
        if self.mode != "sagebwd":
            return ()
        return tuple(name for name in PRODUCTS if getattr(self, name) == "int8")

    @property
    def fp8_products(self) -> tuple[str, ...]:
        """The products that run in FP8 (e4m3; empty in ``"attn_qat"`` and ``"full"`` modes)."""
        if self.mode != "sagebwd":
            return ()
        return tuple(name for name in PRODUCTS if getattr(self, name) == "fp8")

    @property
    def formats(self) -> dict[str, str]:
        """The format each product runs in, as the kernels and the reference read it (``{"qk": ..., "ds": ...}``).

        ``"sagebwd"``: the product fields. ``"attn_qat"``: Attn-QAT's NVFP4 set, ``qk``, ``pv`` and ``dp`` in
        ``"nvfp4"`` and ``ds`` in ``"bf16"`` (the score gradient against K's and Q's NVFP4 values); ``dv`` is
        ``"nvfp4"`` (P re-quantized as the forward quantized it) for the matched backward and ``"bf16"`` for the
        drop-in one, whose backward products all run on the unquantized inputs
        (:attr:`backward_from_inputs`). ``"full"``: ``"bf16"`` throughout.

        Example::

            AttentionPrecision.attn_qat().formats
            # {'qk': 'nvfp4', 'pv': 'nvfp4', 'dv': 'nvfp4', 'dp': 'nvfp4', 'ds': 'bf16'}
        """
        if self.mode == "sagebwd":
            return {name: getattr(self, name) for name in PRODUCTS}
        if self.mode == "attn_qat":
            if self.backward_from_inputs:
                return {"qk": "nvfp4", "pv": "nvfp4", "dv": "bf16", "dp": "bf16", "ds": "bf16"}
            return {"qk": "nvfp4", "pv": "nvfp4", "dv": "nvfp4", "dp": "nvfp4", "ds": "bf16"}
        return dict.fromkeys(PRODUCTS, "bf16")

    @property
    def backward_from_inputs(self) -> bool:
        """Whether the backward recomputes S from the unquantized q, k, v in the input dtype rather than from the
        forward's operands: Attn-QAT's drop-in baseline (``qat_backward="dropin"``), FlashAttention's backward fed
        the NVFP4 forward's O and logsumexp."""
        return self.mode == "attn_qat" and self.qat_backward == "dropin"

    @property
    def high_precision_out(self) -> bool:
        """Whether the forward also computes ``O_hp``, the output of the unquantized P, for the backward's
        ``delta = rowsum(dO * O_hp)`` (Attn-QAT's matched backward: ``rowsum(dO * O)`` with the NVFP4 P's O is not
        the softmax gradient's own term)."""
        return self.mode == "attn_qat" and self.qat_backward == "matched"

    @property
    def short_name(self) -> str:
        """A compact, stable label of what runs, e.g. ``"sagebwd:int8=qk,pv,dv,ds;smooth_k"``,
        ``"sagebwd:int8=qk,dv,ds;fp8=pv;smooth_k"``, ``"attn_qat"``, ``"attn_qat:dropin"`` or ``"full"``. Two
        precisions with the same label compute the same numbers (fields the mode ignores are not in it)."""
        if self.mode == "attn_qat":
            return "attn_qat" if self.qat_backward == "matched" else f"attn_qat:{self.qat_backward}"
        if self.mode != "sagebwd":
            return self.mode
        parts = [f"int8={','.join(self.int8_products) or 'none'}"]
        if self.fp8_products:
            parts.append(f"fp8={','.join(self.fp8_products)}")
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
    def all_fp8(cls, **changes: object) -> AttentionPrecision:
        """Every product in FP8 (e4m3), ``dp`` included."""
        base = dict.fromkeys(PRODUCTS, "fp8")
        base.update(changes)
        return cls(**base)

    @classmethod
    def attn_qat(cls, backward: str = "matched") -> AttentionPrecision:
        """Attn-QAT: simulated NVFP4 attention for quantization-aware training (``mode="attn_qat"``), with its
        ``"matched"`` backward or the ``"dropin"`` baseline.

        Example::

            AttentionPrecision.attn_qat()                      # == AttentionPrecision(mode="attn_qat")
            AttentionPrecision.attn_qat(backward="dropin").short_name   # "attn_qat:dropin"
        """
        return cls(mode="attn_qat", qat_backward=backward)

    @classmethod
    def hopper(cls, **changes: object) -> AttentionPrecision:
        """The measured best mix on Hopper for training at large tokens per step: SageBwd's INT8 Q K, P V and dV with
        dS's two products in bf16 (``ds="bf16"``; ``dp`` bf16 as always). On an H200 its forward+backward runs
        1.05-1.13x the INT8 default's from N=2048; on an H100 its backward ran 1.20-1.29x FP8 dS's. Its dQ and dK
        errors against float64 are about a third of the default's at sigma 1, and it closed SageBwd's pretraining gap
        at 131K tokens per step in both seeds. It is not the default: its speed misses issue 42's bars
        (``docs/performance.md``). The INT8 default stays ``AttentionPrecision()``.

        Example::

            AttentionPrecision.hopper().short_name   # "sagebwd:int8=qk,pv,dv;smooth_k"
        """
        base: dict[str, object] = {"ds": "bf16"}
        base.update(changes)
        return cls(**base)

    @classmethod
    def all_bf16(cls, **changes: object) -> AttentionPrecision:
        """SageBwd's tiling with every product in high precision (isolates one product at a time)."""
        base = dict.fromkeys(PRODUCTS, "bf16")
        base.update(changes)
        return cls(**base)
