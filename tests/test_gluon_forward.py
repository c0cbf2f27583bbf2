"""The warp-specialised Gluon forward with FP8 P.V (``kernels/hopper/gluon_forward.py``): the plan's rule that picks it
(opt-in, ``SAGE_LIGHTNING_GLUON_FWD``), its refusal of what it does not serve, and on a Hopper GPU its O and logsumexp
against the ``tl`` Hopper forward's and the reference's.

The CPU interpreter cannot run Gluon (``TRITON_INTERPRET=1`` interprets ``triton.jit`` kernels only), so the kernel's
own tests run only on an sm_90 GPU; the plan's rule and the refusal are tested everywhere.
"""

from __future__ import annotations

import pytest
import torch
from gluon_support import TRITON, needs_hopper, pretend_verified_hopper
from sage_lightning.kernels import AttentionPrecision, plan
from sage_lightning.kernels.hopper import forward as hopper_forward_module
from sage_lightning.kernels.hopper import gluon_backward
from sage_lightning.kernels.hopper import gluon_forward as gf
from sage_lightning.kernels.hopper.forward import hopper_forward
from sage_lightning.kernels.ops import sage_attention_triton
from sage_lightning.kernels.quant import finite_mean, quantize_channels_fp8, quantize_rows
from sage_lightning.kernels.reference import sage_attention_reference

FP8_PV = {"pv": "fp8"}


def _forward(causal: bool = False, **overrides: object) -> plan.KernelPlan:
    """The plan of SageBwd's call on meta tensors (B=1, 8 heads, N=Nk=4096, D=128, bf16, 128 x 64 tiles) with FP8 P.V,
    unless ``overrides`` names ``seq_q``, ``seq_k``, ``head_dim``, ``dtype``, ``block_m``, ``block_n``, a product's
    format or ``smooth_q``."""
    n, nk, d = (overrides.get(name, 4096 if name != "head_dim" else 128) for name in ("seq_q", "seq_k", "head_dim"))
    dtype = overrides.get("dtype", torch.bfloat16)
    q = torch.zeros(1, 8, n, d, dtype=dtype, device="meta")
    k = torch.zeros(1, 8, nk, d, dtype=dtype, device="meta")
    formats = {**FP8_PV, **{name: overrides[name] for name in ("qk", "pv", "smooth_q") if name in overrides}}
    tiles = {name: overrides.get(name, default) for name, default in (("block_m", 128), ("block_n", 64))}
    return plan.plan_attention(q, k, AttentionPrecision(**formats), is_causal=causal, **tiles, backend="triton")


@pytest.fixture
def gluon_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine is a verified Hopper with the Gluon API the kernel is written for."""
    pretend_verified_hopper(monkeypatch)


def test_off_is_the_default_until_a_gpu_run_has_compared_it(gluon_here):
    assert plan.settings().gluon_fwd == "off"
    chosen = _forward()
    assert chosen.forward == plan.HOPPER_FORWARD and "gluon" not in chosen.forward_reason


def test_auto_takes_fp8_pv_on_a_verified_hopper(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_FWD_ENV, "auto")
    for overrides in ({}, {"qk": "fp8"}, {"head_dim": 64}, {"dtype": torch.float16}, {"seq_q": 200, "seq_k": 176}):
        chosen = _forward(True, **overrides)
        assert chosen.forward == plan.GLUON_FORWARD and chosen.backend == plan.HOPPER, overrides
        assert "warp-specialised" in chosen.forward_reason
    kernel_switch(plan.HOPPER_ENV, "off")
    assert _forward().forward == plan.TRITON_FORWARD
    kernel_switch(plan.HOPPER_ENV, "auto")
    monkeypatch.setattr(plan, "verified_here", lambda device: False)
    assert _forward().forward == plan.TRITON_FORWARD  # not a verified Hopper
    kernel_switch(plan.GLUON_FWD_ENV, "force")
    assert _forward().forward == plan.GLUON_FORWARD  # force: whatever the device


def test_other_tritons_keep_the_tl_forward(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_FWD_ENV, "force")
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", ("0.0",))
    assert "Gluon API" in _forward().forward_reason and _forward().forward == plan.HOPPER_FORWARD
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", (TRITON,))
    monkeypatch.setattr(gluon_backward, "HAVE_GLUON", False)
    assert _forward().forward == plan.HOPPER_FORWARD


@pytest.mark.parametrize(
    "overrides, need",
    [
        ({"pv": "int8"}, "FP8 pv"),
        ({"pv": "bf16"}, "FP8 pv"),
        ({"qk": "bf16"}, "INT8 or FP8 qk"),
        ({"smooth_q": True}, "no Q-smoothing"),
        ({"dtype": torch.float32}, "bf16 or fp16"),
        ({"head_dim": 96}, "head dim"),
        ({"seq_k": 4000 + 8}, "a key count that is a multiple of 16"),
        ({"block_m": 64}, "block_m"),
        ({"block_n": 128}, "block_n 64"),
    ],
)
def test_what_it_does_not_serve_keeps_the_tl_rule_with_the_reason(kernel_switch, gluon_here, overrides, need):
    kernel_switch(plan.GLUON_FWD_ENV, "force")
    chosen = _forward(**overrides)
    assert chosen.forward != plan.GLUON_FORWARD and f"gluon_forward needs {need}" in chosen.forward_reason


def test_a_bad_setting_is_refused(kernel_switch):
    kernel_switch(plan.GLUON_FWD_ENV, "on")
    with pytest.raises(ValueError, match="SAGE_LIGHTNING_GLUON_FWD must be one of off, auto, force; received 'on'"):
        plan.settings()


def test_the_kernel_refuses_a_call_it_does_not_serve_before_launching():
    """A typed refusal (:class:`~sage_lightning.kernels.plan.UnsupportedAttention`) naming the need, on any device."""
    codes = torch.zeros(1, 2, 128, 128, dtype=torch.int8)
    scales = torch.ones(1, 2, 2)
    args = (codes, scales, None, codes, scales, codes.transpose(-1, -2), scales)
    kw = dict(out_dtype=torch.bfloat16, is_causal=False, scale=0.1, block_m=128, block_n=64)
    with pytest.raises(plan.UnsupportedAttention, match="gluon_forward: .*need FP8 pv"):
        gf.gluon_forward(*args, **kw, qk="int8", pv="int8")
    with pytest.raises(plan.UnsupportedAttention, match="need Q'\\^ and K'\\^ as fp8 codes"):
        gf.gluon_forward(*args, **kw, qk="fp8", pv="fp8")
    with pytest.raises(plan.UnsupportedAttention, match="need a ring of at least 2 stages"):
        gf.gluon_forward(*args, **kw, qk="int8", pv="fp8", stages=1)
    with pytest.raises(plan.UnsupportedAttention, match=r"need consumers in \(2, 3\) \(received 4\)"):
        gf.gluon_forward(*args, **kw, qk="int8", pv="fp8", consumers=4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "given"])
def test_both_hopper_launchers_prepare_their_launch_alike(monkeypatch, causal, given):
    """``hopper_forward`` and ``gluon_forward`` take O, the logsumexp, the poison arguments (``lse`` standing in),
    ``CONFINED``, the base-2 scale and the grid's order from one helper (``forward.forward_launch``): their launches,
    recorded on the CPU with the kernels replaced, agree (128-row programs: the ``tl`` kernel's ``BLOCK_M=128``,
    two Gluon consumer warpgroups)."""
    launches = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object) -> object:
            return lambda *args, **kw: launches.__setitem__(self.name, (grid, args, kw))

    monkeypatch.setattr(hopper_forward_module, "_hopper_forward_kernel", Recorder("tl"))
    monkeypatch.setattr(gf, "_gluon_forward_kernel", Recorder("gluon"))
    q, k = torch.zeros(2, 4, 256, 64, dtype=torch.int8), torch.zeros(2, 2, 320, 64, dtype=torch.int8)
    v, v_scale = torch.zeros(2, 2, 64, 320, dtype=torch.float8_e4m3fn), torch.ones(2, 2, 64)
    operands = (q, torch.ones(2, 4, 2), None, k, torch.ones(2, 2, 5), v, v_scale)
    poison = (torch.zeros(2, 4, 256), torch.zeros(4, dtype=torch.int32)) if given else (None, None)
    kw = dict(out_dtype=torch.bfloat16, is_causal=causal, scale=0.1, block_m=128, block_n=64, qk="int8", pv="fp8")
    results = {}
    for name, launch in (("tl", hopper_forward), ("gluon", lambda *a, **k: gf.gluon_forward(*a, **k, consumers=2))):
        out = torch.empty(2, 256, 4, 64, dtype=torch.bfloat16).transpose(1, 2) if given else None
        results[name] = (out, *launch(*operands, **kw, out=out, row_poison=poison[0], first_bad=poison[1]))
    (tl_grid, tl_args, tl_kw), (grid, args, gluon_kw) = launches["tl"], launches["gluon"]
    assert tl_grid({"BLOCK_M": 128}) == grid == ((8, 2) if causal else (2, 8))
    for (given_out, out, lse), lse_arg, poison_args in (
        (results["tl"], tl_args[8], tl_args[9:11]),
        (results["gluon"], args[6], args[8:10]),
    ):
        assert out.shape == (2, 4, 256, 64) and out.dtype == torch.bfloat16 and (out is given_out or not given)
        assert lse.shape == (2, 4, 256) and lse.dtype == torch.float32 and lse_arg is lse
        assert all(arg is (mine if given else lse) for arg, mine in zip(poison_args, poison, strict=True))
    assert tl_args[-1] == args[-1] == pytest.approx(0.1 * 1.4426950408889634)
    assert tl_kw["CONFINED"] is gluon_kw["CONFINED"] is given


def _operands(hq: int, hkv: int, n: int, nk: int, d: int, qk: str) -> tuple:
    """Q'^, K'^ (``qk``) and V^ (e4m3, per channel) quantized as ``ops._sagebwd_forward`` does, on the GPU."""
    gen = torch.Generator().manual_seed(n + nk + d + hq)
    q = torch.randn(2, hq, n, d, generator=gen).cuda().bfloat16()
    k = (torch.randn(2, hkv, nk, d, generator=gen) + 0.5).cuda().bfloat16()
    v = torch.randn(2, hkv, nk, d, generator=gen).cuda().bfloat16()
    q_op, q_scale, _ = quantize_rows(q, 128, fmt=qk, confine=True)
    k_op, k_scale, _ = quantize_rows(k, 64, fmt=qk, mean=finite_mean(k), confine=True)
    v_op, v_scale = quantize_channels_fp8(v, confine=True)
    return q_op, q_scale, None, k_op, k_scale, v_op, v_scale


#: (hq, hkv, n, nk, d): GQA 2:1, ragged counts (a partial key tile, a 64-row half of padding), one key tile.
CASES = [(4, 2, 512, 512, 128), (2, 1, 192, 176, 128), (4, 4, 1024, 1024, 64), (3, 3, 160, 64, 64)]
VARIANTS = {
    "default": {}, "2wg-pp": {"consumers": 2, "pingpong": True}, "2wg-free": {"consumers": 2, "pingpong": False},
    "2wg-regs": {"consumers": 2, "pingpong": True, "p_in_regs": True}, "st2": {"stages": 2},
    "3wg-pp": {"consumers": 3, "pingpong": True}, "3wg-free": {"consumers": 3, "pingpong": False},
}  # fmt: skip


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@needs_hopper
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("qk", ["int8", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hkv, n, nk, d", CASES)
def test_gluon_forward_equals_the_tl_forward(hq, hkv, n, nk, d, causal, qk, variant):
    """O and the logsumexp of ``_hopper_forward_kernel`` (``PV_FMT="fp8"``) on the same operands: bit for bit where
    both visit the same key tiles (non-causal: the same expressions, instruction shapes and order of additions).
    Causal, a 64-row ``tl`` candidate skips the last (fully masked) key tile for the first 64 rows of a 128-row
    program (two tiles for the first 64 of three consumer warpgroups' 192 rows), which adds an all-zero P.V product
    into those rows here: within a bf16 last bit if the tensor core does not return C unchanged."""
    operands = _operands(hq, hkv, n, nk, d, qk)
    kw = dict(out_dtype=torch.bfloat16, is_causal=causal, scale=d**-0.5, block_m=128, block_n=64, qk=qk, pv="fp8")
    poison = (torch.zeros(2, hq, n, device="cuda"), torch.full((2 * hkv,), 2**31 - 1, device="cuda", dtype=torch.int32))
    ref_out, ref_lse = hopper_forward(*operands, **kw, row_poison=poison[0], first_bad=poison[1])
    out, lse = gf.gluon_forward(*operands, **kw, row_poison=poison[0], first_bad=poison[1], **VARIANTS[variant])
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    if not causal:
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), (rel_l2(out, ref_out), rel_l2(lse, ref_lse))
    else:
        assert rel_l2(out, ref_out) < 1e-3
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)


@needs_hopper
@pytest.mark.parametrize("qk", ["int8", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_plan_runs_it_and_it_agrees_with_the_reference(monkeypatch, kernel_switch, causal, qk):
    """Through ``sage_attention_triton`` with ``SAGE_LIGHTNING_GLUON_FWD=force``: the forward is the Gluon kernel's,
    O in the caller's layout, and within the FP8 products' agreement bound of the reference (``gpu_verify``'s)."""
    kernel_switch(plan.GLUON_FWD_ENV, "force")
    calls = []
    original = gf.gluon_forward
    monkeypatch.setattr(gf, "gluon_forward", lambda *a, **kw: calls.append("gluon_forward") or original(*a, **kw))
    precision = AttentionPrecision(qk=qk, pv="fp8")
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 300, 4, 128, device="cuda", generator=gen).bfloat16().transpose(1, 2)  # [B, N, H, D] memory
    k, v = (torch.randn(2, 2, 320, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    out, lse = sage_attention_triton(q, k, v, is_causal=causal, precision=precision, with_lse=True)
    ref_out, ref_lse = sage_attention_reference(q, k, v, is_causal=causal, precision=precision)
    assert calls == ["gluon_forward"] and out.stride() == q.stride()
    assert rel_l2(out, ref_out) < 1e-2 and rel_l2(lse, ref_lse) < 2e-4
