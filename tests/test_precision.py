"""AttentionPrecision: SageBwd defaults, validation, labels."""

from __future__ import annotations

import dataclasses

import pytest
from sage_lightning.kernels import FORMATS, MODES, PRODUCTS, AttentionPrecision


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
    assert FORMATS == ("int8", "bf16") and MODES == ("sagebwd", "full")


@pytest.mark.parametrize(
    "kwargs, pieces",
    [
        ({"mode": "fp8"}, ["mode", "'fp8'", "sagebwd"]),
        ({"mode": "attn_qat"}, ["attn_qat", "not available"]),
        ({"ds": "fp16"}, ["ds", "'fp16'", "'int8', 'bf16'"]),
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
