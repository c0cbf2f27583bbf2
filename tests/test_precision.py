"""AttentionPrecision: SageBwd defaults, the attn_qat mode, validation, labels."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sage_lightning.kernels import FORMATS, MODES, PRODUCTS, QAT_BACKWARDS, AttentionPrecision
from sage_lightning.kernels.precision import KERNEL_FORMATS


def test_defaults_are_sagebwd() -> None:
    p = AttentionPrecision()
    assert p.mode == "sagebwd" and p.smooth_k and not p.smooth_q
    assert p.int8_products == ("qk", "pv", "dv", "ds")  # six of seven products: dQ and dK both use ds
    assert p.dp == "bf16"
    assert p.short_name == "sagebwd:int8=qk,pv,dv,ds;smooth_k"


def test_frozen_and_hashable() -> None:
    p = AttentionPrecision()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.ds = "bf16"  # type: ignore[misc]
    assert len({p, AttentionPrecision(), p.replace(ds="bf16")}) == 2


def test_helpers() -> None:
    assert AttentionPrecision.all_int8().int8_products == PRODUCTS
    assert AttentionPrecision.all_bf16().int8_products == ()
    assert AttentionPrecision.all_bf16(ds="int8").int8_products == ("ds",)
    assert AttentionPrecision.all_bf16().short_name == "sagebwd:int8=none;smooth_k"
    assert AttentionPrecision(mode="full").int8_products == () and AttentionPrecision(mode="full").short_name == "full"
    assert AttentionPrecision().replace(smooth_q=True).short_name.endswith("smooth_k;smooth_q")
    assert FORMATS == ("int8", "fp8", "bf16") and MODES == ("sagebwd", "attn_qat", "full")
    assert QAT_BACKWARDS == ("matched", "dropin")


def test_fp8_products_and_labels() -> None:
    fp8_pv = AttentionPrecision(pv="fp8")
    assert fp8_pv.fp8_products == ("pv",) and fp8_pv.int8_products == ("qk", "dv", "ds")
    assert fp8_pv.short_name == "sagebwd:int8=qk,dv,ds;fp8=pv;smooth_k"
    assert AttentionPrecision.all_fp8().fp8_products == PRODUCTS
    assert AttentionPrecision.all_fp8().short_name == "sagebwd:int8=none;fp8=qk,pv,dv,dp,ds;smooth_k"
    # Labels without an FP8 product are unchanged (checkpoints and result files carry them).
    assert AttentionPrecision(ds="bf16").short_name == "sagebwd:int8=qk,pv,dv;smooth_k"
    assert AttentionPrecision(mode="attn_qat", pv="fp8").fp8_products == ()
    assert len({p.short_name for p in (fp8_pv, AttentionPrecision(ds="fp8"), AttentionPrecision())}) == 3


def test_attn_qat_preset() -> None:
    assert AttentionPrecision.attn_qat() == AttentionPrecision(mode="attn_qat")
    assert AttentionPrecision.attn_qat(backward="dropin") == AttentionPrecision(mode="attn_qat", qat_backward="dropin")
    with pytest.raises(ValueError, match="qat_backward"):
        AttentionPrecision.attn_qat(backward="drop-in")


def test_formats_are_what_the_kernels_run() -> None:
    """``formats`` is the one view the kernels and the reference read: the fields in SageBwd mode, Attn-QAT's NVFP4
    set in attn_qat mode whatever SageBwd's fields hold, bf16 for full precision."""
    fp8_pv = AttentionPrecision(pv="fp8", ds="bf16")
    assert fp8_pv.formats == {"qk": "int8", "pv": "fp8", "dv": "int8", "dp": "bf16", "ds": "bf16"}
    matched = AttentionPrecision.attn_qat().replace(qk="fp8", ds="int8")  # SageBwd's fields do not run in attn_qat
    assert matched.formats == {"qk": "nvfp4", "pv": "nvfp4", "dv": "nvfp4", "dp": "nvfp4", "ds": "bf16"}
    assert matched.high_precision_out and not matched.backward_from_inputs
    dropin = AttentionPrecision.attn_qat(backward="dropin")
    assert dropin.formats == {"qk": "nvfp4", "pv": "nvfp4", "dv": "bf16", "dp": "bf16", "ds": "bf16"}
    assert dropin.backward_from_inputs and not dropin.high_precision_out
    assert AttentionPrecision(mode="full").formats == dict.fromkeys(PRODUCTS, "bf16")
    # The drop-in flag belongs to attn_qat mode only.
    assert not AttentionPrecision(qat_backward="dropin").backward_from_inputs
    assert set(KERNEL_FORMATS) == {*FORMATS, "nvfp4"}
    for precision in (fp8_pv, matched, dropin, AttentionPrecision.all_fp8()):
        assert set(precision.formats.values()) <= set(KERNEL_FORMATS) and list(precision.formats) == list(PRODUCTS)


def test_attn_qat_mode_labels_and_ignored_fields() -> None:
    qat = AttentionPrecision(mode="attn_qat")
    assert qat.qat_backward == "matched" and qat.int8_products == () and qat.short_name == "attn_qat"
    assert qat.replace(qat_backward="dropin").short_name == "attn_qat:dropin"
    # SageBwd's fields are kept but do not run in attn_qat mode: the label, which names what runs, ignores them.
    assert qat.replace(ds="bf16", smooth_q=True).short_name == "attn_qat"
    # ... and qat_backward is ignored outside attn_qat mode; switching modes keeps every field.
    dropin_sage = AttentionPrecision(qat_backward="dropin")
    assert dropin_sage.short_name == AttentionPrecision().short_name
    assert dropin_sage.replace(mode="attn_qat").replace(mode="sagebwd") == dropin_sage
    assert qat.replace(mode="full").short_name == "full"


@pytest.mark.parametrize(
    "kwargs, pieces",
    [
        ({"mode": "fp8"}, ["mode", "'fp8'", "sagebwd"]),
        ({"mode": "attn-qat"}, ["mode", "'attn-qat'", "attn_qat"]),
        ({"mode": "attn_qat", "qat_backward": "drop-in"}, ["qat_backward", "'drop-in'", "'matched', 'dropin'"]),
        ({"ds": "fp16"}, ["ds", "'fp16'", "'int8', 'fp8', 'bf16'"]),
        ({"pv": "nvfp4"}, ["pv", "'nvfp4'", "mode='attn_qat'"]),
        ({"dp": "e5m2"}, ["dp", "'e5m2'", "'fp8'"]),
        ({"qk": "INT8"}, ["qk", "'INT8'"]),
        ({"smooth_k": 1}, ["smooth_k", "1", "True or False"]),
    ],
)
def test_bad_fields_are_refused_with_a_clear_message(kwargs: dict, pieces: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        AttentionPrecision(**kwargs)
    for piece in pieces:
        assert piece in str(info.value)
    with pytest.raises(ValueError):
        AttentionPrecision().replace(**kwargs)


@pytest.mark.parametrize("field", ["mode", "qk", "ds", "qat_backward"])
def test_a_field_that_is_not_a_str_is_refused_where_it_is_set(field: str) -> None:
    # An array passes ``in`` and ``==`` elementwise and would fail later, at hash (issue #17).
    value = np.array(["int8"]) if field != "mode" else np.array(["sagebwd"])
    for bad in (value, None):
        with pytest.raises(TypeError) as info:
            AttentionPrecision(**{field: bad})
        assert field in str(info.value) and "must be a str" in str(info.value) and type(bad).__name__ in str(info.value)


def test_the_hopper_preset_is_the_default_with_bf16_ds() -> None:
    assert AttentionPrecision.hopper() == AttentionPrecision(ds="bf16")
    assert AttentionPrecision.hopper().short_name == "sagebwd:int8=qk,pv,dv;smooth_k"
    assert AttentionPrecision.hopper(smooth_q=True) == AttentionPrecision(ds="bf16", smooth_q=True)
    assert AttentionPrecision() != AttentionPrecision.hopper()  # the INT8 default stays the default
    with pytest.raises(ValueError, match="ds"):
        AttentionPrecision.hopper(ds="int4")
