"""sage_attention as a user calls it: SDPA's layout, and a clear error for what it cannot serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sage_lightning.kernels import AttentionPrecision, sage_attention

import sage_lightning


def qkv(b=1, hq=2, hkv=2, n=16, nk=16, d=16, dtype=torch.bfloat16):  # noqa: ANN001, ANN201
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, hq, n, d, generator=g).to(dtype),
        torch.randn(b, hkv, nk, d, generator=g).to(dtype),
        torch.randn(b, hkv, nk, d, generator=g).to(dtype),
    )


def test_public_names() -> None:
    assert sage_lightning.sage_attention is sage_attention
    assert sage_lightning.AttentionPrecision is AttentionPrecision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_has_the_input_dtype_and_shape_and_tracks_sdpa(dtype: torch.dtype) -> None:
    q, k, v = qkv(b=2, hq=4, hkv=1, n=37, nk=53, d=32, dtype=dtype)
    q.requires_grad_()
    out = sage_attention(q, k, v, is_causal=True, scale=0.2)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.2, enable_gqa=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.999
    out.sum().backward()
    assert q.grad is not None and q.grad.dtype == dtype


def test_non_contiguous_views_from_a_seq_first_layout() -> None:
    """Models often hold [B, N, H, D] and pass q.transpose(1, 2): same result as contiguous inputs."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 50, h, 16, generator=g).bfloat16().transpose(1, 2) for h in (4, 2, 2))
    assert not q.is_contiguous()
    out = sage_attention(q, k, v, is_causal=True)
    assert torch.equal(out, sage_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True))


def test_float32_is_computed_as_is_not_cast() -> None:
    """fp32 inputs: the high-precision products run in fp32, so all-bf16 settings are fp32-accurate."""
    q, k, v = qkv(dtype=torch.float32, n=40, nk=40)
    out = sage_attention(q, k, v, precision=AttentionPrecision.all_bf16())
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max() < 1e-5


def test_empty_query_sequence_gives_an_empty_output() -> None:
    q, k, v = qkv(n=0)
    assert sage_attention(q, k, v).shape == (1, 2, 0, 16)


def test_stats_left_alone_in_full_mode_and_filled_otherwise() -> None:
    q, k, v = qkv(n=40, nk=40)
    q.requires_grad_()
    stats = torch.zeros(2)
    sage_attention(q, k, v, precision=AttentionPrecision(mode="full"), stats=stats).sum().backward()
    assert not stats.any()
    sage_attention(q, k, v, stats=stats).float().square().sum().backward()
    assert (stats > 0).all()


BAD_CALLS = [
    # (what to change, expected exception, pieces the message must contain)
    (lambda q, k, v: dict(q=q[0]), ValueError, ["q", "shape (2, 16, 16)", "4-D"]),
    (lambda q, k, v: dict(q=q.double(), k=k.double(), v=v.double()), ValueError, ["q", "torch.float64", "bfloat16"]),
    (lambda q, k, v: dict(k=k.half(), v=v.half()), ValueError, ["q, k, v", "dtypes", "one dtype"]),
    (lambda q, k, v: dict(k=k.to("meta")), ValueError, ["q, k, v", "meta", "one device"]),
    (lambda q, k, v: dict(v=v[:, :, :8]), ValueError, ["k, v", "(1, 2, 8, 16)", "same sequence length"]),
    (lambda q, k, v: dict(v=v[..., :8]), ValueError, ["k, v", "(1, 2, 16, 8)", "same head_dim", "value head dim"]),
    (lambda q, k, v: dict(v=v[:, :1]), ValueError, ["k, v", "(1, 1, 16, 16)", "same shape"]),
    (lambda q, k, v: dict(k=k[:, :, :, :8], v=v[:, :, :, :8]), ValueError, ["k", "head_dim 8", "q's head_dim"]),
    (lambda q, k, v: dict(k=torch.cat([k, k]), v=torch.cat([v, v])), ValueError, ["k", "batch 2", "batch size of q"]),
    (
        lambda q, k, v: dict(q=torch.cat([q, q[:, :1]], 1)),
        ValueError,
        ["q, k", "3 query heads and 2 kv heads", "divisible"],
    ),
    (lambda q, k, v: dict(k=k[:, :, :0], v=v[:, :, :0]), ValueError, ["k", "seq_k=0", "at least one key"]),
    (lambda q, k, v: dict(is_causal=1), ValueError, ["is_causal", "1", "True or False"]),
    (lambda q, k, v: dict(scale=-1.0), ValueError, ["scale", "-1.0", "positive finite float"]),
    (lambda q, k, v: dict(scale="0.1"), ValueError, ["scale", "'0.1'", "positive finite float"]),
    (lambda q, k, v: dict(scale=float("inf")), ValueError, ["scale", "inf", "positive finite float"]),
    (lambda q, k, v: dict(scale=float("nan")), ValueError, ["scale", "nan", "positive finite float"]),
    (lambda q, k, v: dict(q=q.to_sparse()), ValueError, ["q", "sparse_coo", "dense (strided)", ".to_dense()"]),
    (lambda q, k, v: dict(precision="int8"), TypeError, ["precision", "str", "AttentionPrecision"]),
    (lambda q, k, v: dict(stats=torch.zeros(3)), ValueError, ["stats", "shape (3,)", "float32 tensor of shape (2,)"]),
    (lambda q, k, v: dict(stats=torch.zeros(2, dtype=torch.float64)), ValueError, ["stats", "float64", "float32"]),
    (lambda q, k, v: dict(stats=[0.0, 0.0]), TypeError, ["stats", "list"]),
    (lambda q, k, v: dict(v="v"), TypeError, ["v", "str", "torch.Tensor"]),
]


@pytest.mark.parametrize("change, error, pieces", BAD_CALLS)
def test_a_bad_argument_gets_an_error_naming_it(change, error, pieces) -> None:  # noqa: ANN001
    q, k, v = qkv()
    kwargs = {"q": q, "k": k, "v": v}
    kwargs.update(change(q, k, v))
    with pytest.raises(error) as info:
        sage_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)
    message = str(info.value)
    assert message.startswith("sage_attention:")
    for piece in pieces:
        assert piece in message, (piece, message)


def test_head_dim_over_the_exact_bound_is_refused() -> None:
    q, k, v = qkv(n=2, nk=2, d=1041)
    with pytest.raises(ValueError, match="head_dim from 1 to 1040.*Triton kernels take up to 128.*head_dim=1041"):
        sage_attention(q, k, v)
    q, k, v = qkv(n=2, nk=2, d=1040)
    assert torch.isfinite(sage_attention(q, k, v)).all()


def test_query_with_no_tokens_cannot_ask_for_gradients() -> None:
    q, k, v = qkv(n=0)
    with pytest.raises(ValueError, match="seq=0 with requires_grad"):
        sage_attention(q.requires_grad_(), k, v)


def test_fp8_products_on_a_gpu_without_fp8_tensor_cores_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (8.0) has no FP8 tensor cores: an FP8 product is refused by name, with what works; 8.9 and 9.0 pass,
    and INT8 or bf16 precisions are not checked at all."""
    from types import SimpleNamespace

    from sage_lightning.kernels import UnsupportedAttention, plan

    q = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    capability = {"value": (8, 0)}
    monkeypatch.setattr(plan, "_capability", lambda index: capability["value"])
    with pytest.raises(UnsupportedAttention) as info:
        plan.check_fp8_device(q, AttentionPrecision(pv="fp8", ds="fp8"))
    for piece in ("pv='fp8', ds='fp8'", "8.9", "8.0", "'int8' or 'bf16'"):
        assert piece in str(info.value)
    plan.check_fp8_device(q, AttentionPrecision())  # no FP8 product: nothing to check
    for capability["value"] in ((8, 9), (9, 0)):
        plan.check_fp8_device(q, AttentionPrecision.all_fp8())
