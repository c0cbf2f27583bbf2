"""``benchmarks/fp8_pv_probe.py`` computes the numerics it says it measures (its figures are input for issue 15).

The probe's kernel is checked against a plain-PyTorch walk over the same key tiles: INT8 ``Q'^ K'^T`` from the
operands SageBwd makes, an online softmax in base 2, P coded as e4m3 of ``448 * exp2(S - m)`` against the running
max, V in e4m3 with one scale per channel. The kernel's test runs on a Hopper GPU only: Triton's interpreter rounds
an fp32 tensor cast to e4m3 inside a kernel and fed to ``tl.dot`` otherwise than the GPU and torch do (a lone
32 x 32 x 32 product of such a cast against torch's e4m3 codes: 2.2% relative error in the interpreter of Triton 3.9,
against 2e-9 for e4m3 operands loaded from memory), so the emulation could not tell a wrong kernel from the
interpreter's rounding there. The e4m3 V codes are checked everywhere.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fp8_pv_probe as probe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not ON_HOPPER, reason="the probe's FP8 product is checked on a Hopper GPU (the interpreter rounds its cast apart)"
)


def emulated(x: dict, causal: bool, scale: float) -> torch.Tensor:
    """O of the probe's numerics in float64 with the e4m3 roundings done by torch (no GQA: the test's heads match)."""
    q_op, k_op, v8 = x["q_op"].double(), x["k_op"].double(), x["v8"].double()
    batch, heads, seq, _ = q_op.shape
    block_m, block_n = x["block_m"], x["block_n"]
    q_scale = x["q_scale"].double().repeat_interleave(block_m, dim=-1)[..., :seq, None]
    k_scale = x["k_scale"].double().repeat_interleave(block_n, dim=-1)[..., None, :]
    s = (q_op @ k_op.transpose(-1, -2)) * q_scale * k_scale * (scale * math.log2(math.e))
    if causal:
        s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    m = torch.full((batch, heads, seq, 1), -math.inf, dtype=torch.float64, device=s.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros(batch, heads, seq, v8.shape[2], dtype=torch.float64, device=s.device)
    for start in range(0, seq, block_n):
        tile = s[..., start : start + block_n]
        m_new = torch.maximum(m, tile.amax(dim=-1, keepdim=True))
        p = torch.exp2(tile - m_new)
        alpha = torch.exp2(m - m_new)
        l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
        codes = (p * probe.E4M3_MAX.value).float().to(torch.float8_e4m3fn).double()
        acc = acc * alpha + codes @ v8[..., start : start + block_n].transpose(-1, -2)
        m = m_new
    return acc * (x["v8_scale"].double()[..., None, :] / probe.E4M3_MAX.value) / l_sum


def test_v_codes_take_one_scale_per_channel():
    v = torch.randn(2, 3, 64, 16) * torch.linspace(0.1, 10, 16)
    v[..., 5] = 0.0
    codes, scale = probe.quantize_v_fp8(v)
    assert codes.shape == (2, 3, 16, 64) and codes.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 16)
    decoded = codes.float() * scale[..., None]
    # Each channel's largest value is coded exactly as e4m3's maximum; the rest within e4m3's spacing (2^-3 relative
    # for normal values, an absolute 2^-9 times the scale below them).
    assert torch.equal(codes.float().abs().amax(dim=-1)[..., [0, 1, 15]], torch.full((2, 3, 3), 448.0))
    err = (decoded - v.transpose(-1, -2)).abs()
    assert (err <= v.transpose(-1, -2).abs() * 2**-4 + scale[..., None] * 2**-10).all()
    assert torch.equal(scale[..., 5], torch.ones(2, 3)) and not codes.float()[..., 5, :].any()


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_probe_kernel_computes_its_numerics(causal, head_dim):
    gen = torch.Generator().manual_seed(head_dim + causal)
    q, k, v = (torch.randn(1, 2, 192, head_dim, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3))
    v[..., :2] *= 20  # outlier channels: a per-tensor or per-block V scale would show
    scale = head_dim**-0.5
    x = probe.operands(q, k, v)
    out = probe.fp8_pv_forward(x, is_causal=causal, scale=scale, out_dtype=q.dtype)
    want = emulated(x, causal, scale)
    err = ((out.double() - want).norm() / want.norm()).item()
    # bf16 output (2^-9 relative) and the odd P code flipped by fp32 against float64 rounding: far under e4m3's
    # own error of 2-4% against exact attention.
    assert err < 4e-3, err
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.1
