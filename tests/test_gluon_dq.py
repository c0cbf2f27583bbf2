"""The Gluon dQ kernel for Hopper (``kernels/hopper/gluon_dq.py``): the rule that picks it, and on a Hopper GPU its
dQ against ``_dq_kernel``'s, bit for bit.

The CPU interpreter cannot run Gluon, so the kernel's own tests run only on an sm_90 GPU; the dispatch rule is
tested everywhere.
"""

from __future__ import annotations

import pytest
import torch
from gluon_support import TRITON, count_calls, hopper_grads, meta_plan, needs_hopper, pretend_verified_hopper
from sage_lightning.kernels import plan
from sage_lightning.kernels.hopper import gluon_backward
from sage_lightning.kernels.hopper import gluon_dq as gq


def _applies(causal: bool = False, **overrides: object) -> bool:
    """Whether the plan of SageBwd's default call on meta tensors (B=1, 8 heads, N=Nk=4096, D=128) takes a Gluon
    dQ kernel, with ``overrides`` of the shapes (``batch``, ``heads``, ``seq_q``, ``seq_k``, ``head_dim``), dtype,
    formats, Q-smoothing and tiles (:func:`gluon_support.meta_plan`)."""
    return meta_plan(causal, overrides).dq in ("gluon_dq", "gluon_dq_wg")


@pytest.fixture
def gluon_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine is a verified Hopper with the Gluon API the kernel is written for."""
    pretend_verified_hopper(monkeypatch)


def test_auto_is_the_default_once_a_gpu_run_has_checked_it(gluon_here):
    assert plan.settings().gluon_dq == "auto"
    assert _applies(batch=4, heads=16)  # 2^30 scores: measured 1.09x on the whole backward
    assert not _applies()  # 2^27 scores: below the measured crossover


def test_auto_takes_it_on_a_verified_hopper_above_the_size_threshold(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_DQ_ENV, "auto")
    assert _applies(batch=2)  # 2 x 8 heads x 4096 x 4096 scores = 2^28
    assert not _applies(heads=1, seq_q=1024, seq_k=1024)
    edge = gq.AUTO_MIN_SCORES[128] // (4096 * 4096)
    assert _applies(heads=edge) and not _applies(causal=True, heads=edge)
    for head_dim in (64, 128):
        edge = gq.AUTO_MIN_SCORES.get(head_dim)
        assert _applies(batch=4, heads=16, head_dim=head_dim) is (edge is not None), head_dim
    kernel_switch(plan.HOPPER_ENV, "off")
    assert not _applies()
    monkeypatch.setattr(plan, "verified_here", lambda device: False)
    kernel_switch(plan.HOPPER_ENV, "auto")
    assert not _applies()  # not a verified Hopper
    kernel_switch(plan.GLUON_DQ_ENV, "force")
    assert _applies(heads=1, seq_q=128, seq_k=64)  # force: whatever the device and the size


def test_off_and_other_tritons_keep_the_portable_kernel(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_DQ_ENV, "off")
    assert not _applies()
    kernel_switch(plan.GLUON_DQ_ENV, "force")
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", ("0.0",))
    assert not _applies()
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", (TRITON,))
    monkeypatch.setattr(gluon_backward, "HAVE_GLUON", False)
    assert not _applies()


@pytest.mark.parametrize(
    "overrides",
    [
        {"dp": "int8"},
        {"dp": "fp8"},
        {"qk": "bf16"},
        {"qk": "fp8", "ds": "fp8"},
        {"smooth_q": True},
        {"dtype": torch.float16},
        {"head_dim": 96},
        {"block_m": 64},
        {"block_n": 128},
        {"seq_q": 4000},  # a TMA tile would cross into the next head
        {"seq_k": 4032 + 16},
    ],
)
def test_it_leaves_what_it_does_not_serve_to_the_portable_kernel(kernel_switch, gluon_here, monkeypatch, overrides):
    kernel_switch(plan.GLUON_DQ_ENV, "force")
    assert _applies()
    assert not _applies(**overrides)


@pytest.mark.parametrize("ds", ["fp8", "bf16"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_an_fp8_or_bf16_ds_keeps_the_gluon_dq_kernels(kernel_switch, gluon_here, ds, head_dim):
    """Issue 42: ``ds="fp8"`` or ``"bf16"`` (the other products INT8) keeps the Gluon dQ kernels, their dQ product in
    bf16: at D=64 the one-warpgroup twin, at D=128 the two-warpgroup kernel, as for INT8."""
    kernel_switch(plan.GLUON_DQ_ENV, "force")
    expected = "gluon_dq_wg" if head_dim == 64 else "gluon_dq"
    assert meta_plan(False, dict(ds=ds, head_dim=head_dim)).dq == expected
    assert meta_plan(True, dict(ds=ds, head_dim=head_dim)).dq == expected
    kernel_switch(plan.GLUON_DQ_ENV, "auto")
    assert meta_plan(False, dict(ds=ds, batch=4, heads=16, head_dim=head_dim)).dq == expected
    kernel_switch(plan.GLUON_DQ_ENV, "force")
    kernel_switch(plan.GLUON_DQ_WG_ENV, "off")
    assert meta_plan(False, dict(ds=ds, head_dim=head_dim)).dq == "gluon_dq"
    kernel_switch(plan.GLUON_DQ_ENV, "off")
    assert meta_plan(False, dict(ds=ds, head_dim=head_dim)).dq == "triton_dq"


def test_the_launchers_refuse_a_ds_format_they_do_not_take():
    q = torch.zeros(1, 1, 128, 128, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"gluon_dq: ds_fmt must be 'int8', 'fp8' or 'bf16'; received 'int4'"):
        gq.gluon_dq(q, q, q, q, q, q, q, q, is_causal=False, scale=0.1, ds_fmt="int4")
    q = torch.zeros(1, 1, 256, 64, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"gluon_dq_wg: ds_fmt must be 'int8', 'fp8' or 'bf16'; received 'int4'"):
        gq.gluon_dq(q, q, q, q, q, q, q, q, is_causal=False, scale=0.1, ds_fmt="int4", wg=True)


def test_an_unknown_setting_is_refused(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_DQ_ENV, "fast")
    with pytest.raises(ValueError, match=r"SAGE_LIGHTNING_GLUON_DQ must be one of auto, off, force; received 'fast'"):
        _applies()


@pytest.mark.parametrize(
    ("variant", "needs"), [({"defer": True}, "defer"), ({}, r"the producer warpgroup \(warp_specialize=True\)")]
)
def test_defer_and_the_producer_refuse_a_one_stage_ring(variant, needs):
    """``defer`` hands a stage back one tile late, and the producer warpgroup refills a tile's stage after it has
    transposed the next tile: with one stage the loads would wait for it forever. One 8-warp partition serves it."""
    q = torch.zeros(1, 1, 128, 64, dtype=torch.int8, device="meta")
    f32 = torch.zeros(1, 1, 128, dtype=torch.float32, device="meta")
    bf16 = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16, device="meta")
    args = (bf16, f32, q, f32, q, f32, bf16, f32)
    with pytest.raises(ValueError, match=f"stages=1 would deadlock with {needs}; use stages >= 2"):
        gq.gluon_dq(*args, is_causal=False, scale=0.125, stages=1, **variant)


@pytest.mark.parametrize(("head_dim", "takes"), [(64, True), (128, False), (96, False)])
def test_the_one_warpgroup_per_block_kernel_takes_d64(kernel_switch, gluon_here, head_dim, takes):
    kernel_switch(plan.GLUON_DQ_ENV, "force")
    assert (meta_plan(False, dict(head_dim=head_dim)).dq == "gluon_dq_wg") is takes
    kernel_switch(plan.GLUON_DQ_WG_ENV, "off")
    assert meta_plan(False, dict(head_dim=head_dim)).dq != "gluon_dq_wg"


def test_the_one_warpgroup_per_block_switch_and_launcher_refuse_what_they_do_not_serve(kernel_switch):
    kernel_switch(plan.GLUON_DQ_WG_ENV, "force")
    with pytest.raises(ValueError, match=r"SAGE_LIGHTNING_GLUON_DQ_WG must be one of auto, off; received 'force'"):
        meta_plan(False, {"head_dim": 64})
    q = torch.zeros(1, 1, 256, 128, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"gluon_dq_wg: serves head_dim in \(64,\); received head_dim=128"):
        gq.gluon_dq(q, q, q, q, q, q, q, q, is_causal=False, scale=0.1, wg=True)
    q = torch.zeros(1, 1, 256, 64, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"gluon_dq_wg: stages must be at least 2 .*; received stages=1"):
        gq.gluon_dq(q, q, q, q, q, q, q, q, is_causal=False, scale=0.1, stages=1, wg=True)


def _grads(monkeypatch, setting: str, *shape, precision=None) -> tuple[torch.Tensor, ...]:
    return hopper_grads(monkeypatch, plan.GLUON_DQ_ENV, setting, shape, precision=precision)


def _count_gluon_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Both Gluon dQ kernels as ``ops`` runs them (:func:`gluon_support.count_calls`), ``wg`` at auto."""
    monkeypatch.delenv(plan.GLUON_DQ_WG_ENV, raising=False)
    plan.refresh_settings()
    return count_calls(monkeypatch, ("gluon_dq", "gluon_dq_wg"))


@needs_hopper
@pytest.mark.parametrize(
    "batch, hq, hkv, n, nk, d, causal",
    [
        pytest.param(1, 2, 2, 256, 256, 64, False, id="mha-d64"),
        pytest.param(2, 4, 2, 512, 512, 128, True, id="gqa-causal-d128"),
        pytest.param(1, 4, 2, 256, 512, 64, True, id="causal-more-keys"),
        pytest.param(1, 2, 2, 1024, 320, 128, True, id="causal-fewer-keys"),  # query tiles past the last key
        pytest.param(1, 8, 8, 2048, 2048, 128, True, id="large-causal"),
        # D=64, one warpgroup per 128-query block: an odd number of blocks (the last program's upper warpgroup has
        # none), GQA causal with more keys, more queries than keys, a large causal call.
        pytest.param(1, 2, 2, 384, 384, 64, True, id="wg-odd-blocks-causal"),
        pytest.param(2, 4, 2, 640, 768, 64, True, id="wg-gqa-causal-more-keys"),
        pytest.param(1, 2, 2, 1024, 320, 64, True, id="wg-causal-fewer-keys"),
        pytest.param(1, 2, 2, 384, 256, 64, False, id="wg-odd-blocks"),
        pytest.param(1, 8, 8, 2048, 2048, 64, True, id="wg-large-causal"),
    ],
)
def test_gluon_dq_equals_the_portable_kernel_bit_for_bit(monkeypatch, batch, hq, hkv, n, nk, d, causal):
    calls = _count_gluon_calls(monkeypatch)
    shape = (batch, hq, hkv, n, nk, d, causal)
    got = _grads(monkeypatch, "force", *shape)
    expected = "gluon_dq_wg" if gq.gluon_dq_wg_serves(d) else "gluon_dq"
    assert calls == [expected], f"the backward took {calls}, not {expected}"
    calls.clear()
    want = _grads(monkeypatch, "off", *shape)
    assert not calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"


@needs_hopper
@pytest.mark.parametrize("ds", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "batch, hq, hkv, n, nk, d, causal",
    [
        pytest.param(1, 2, 2, 256, 256, 64, False, id="mha-d64"),
        pytest.param(2, 4, 2, 512, 512, 128, True, id="gqa-causal-d128"),
        pytest.param(1, 4, 2, 256, 512, 64, True, id="causal-more-keys"),
        pytest.param(1, 2, 2, 1024, 320, 128, True, id="causal-fewer-keys"),
        pytest.param(1, 8, 8, 2048, 2048, 128, True, id="large-causal"),
        # D=64 (the one-warpgroup twin): odd blocks causal, GQA causal with more keys, a large causal call.
        pytest.param(1, 2, 2, 384, 384, 64, True, id="wg-odd-blocks-causal"),
        pytest.param(2, 4, 2, 640, 768, 64, True, id="wg-gqa-causal-more-keys"),
        pytest.param(1, 8, 8, 2048, 2048, 64, True, id="wg-large-causal"),
    ],
)
def test_an_fp8_or_bf16_ds_gives_the_portable_kernels_dq(monkeypatch, ds, batch, hq, hkv, n, nk, d, causal):
    """Issue 42: with ``ds="fp8"`` or ``"bf16"`` the Gluon kernels' dQ product runs in bf16 (dS's e4m3 codes or bf16
    values from registers against K'^'s INT8 codes widened to bf16, fp32 accumulation), as ``_dq_kernel``'s does:
    the portable kernel's dQ to its last bits, the bf16 sums' order aside (D=64: the one-warpgroup twin)."""
    from sage_lightning.kernels import AttentionPrecision

    precision = AttentionPrecision(ds=ds)
    calls = _count_gluon_calls(monkeypatch)
    shape = (batch, hq, hkv, n, nk, d, causal)
    got = _grads(monkeypatch, "force", *shape, precision=precision)
    expected = "gluon_dq_wg" if gq.gluon_dq_wg_serves(d) else "gluon_dq"
    assert calls == [expected], f"the backward took {calls}, not {expected}"
    calls.clear()
    want = _grads(monkeypatch, "off", *shape, precision=precision)
    assert not calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        if name == "dQ":  # bf16 products: a wgmma may sum in another order than the dot (FP8 P V did, device run 19)
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-3, f"dQ: rel_l2 {rel} against the portable kernel's (equal: {torch.equal(a, b)})"
        else:  # the dK/dV kernel is the same in both calls
            assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    assert not torch.equal(got[0], _grads(monkeypatch, "force", *shape)[0])  # dS in INT8: a different dQ


@needs_hopper
@pytest.mark.parametrize("ds", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("variant", [dict(warp_specialize=False), dict(codes_in_registers=False), dict(defer=True)])
def test_every_variant_gives_the_same_dq(variant, ds):
    """The variants change where the loads are issued and where the codes live, not a value (whatever dS's
    format)."""
    from sage_lightning.kernels.quant import backward_preprocess

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, 512, 128, device="cuda", generator=gen).bfloat16() for _ in range(4))
    out, lse, q_op, q_scale, _q_mean, k_op, k_scale = portable_forward(q, k, v)
    delta, *_ = backward_preprocess(do, out, 128, codes=False, codes_t=False)
    args = (do, delta, q_op, q_scale, k_op, k_scale, v.contiguous(), lse)
    want = gq.gluon_dq(*args, is_causal=True, scale=128**-0.5, ds_fmt=ds)
    got = gq.gluon_dq(*args, is_causal=True, scale=128**-0.5, ds_fmt=ds, **variant)
    assert torch.equal(got, want)


def portable_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> tuple:
    """SageBwd's forward at its default precision (causal unless told), returning what the backward saves."""
    from sage_lightning.kernels import AttentionPrecision
    from sage_lightning.kernels.ops import sagebwd_forward

    prec = AttentionPrecision()
    return sagebwd_forward(
        q, k, v, None, causal, q.shape[-1] ** -0.5, "int8", "int8", "int8", "bf16", "int8", prec.smooth_k, False,
        128, 64, "triton_forward", "triton_dkdv", "triton_dq",
    )  # fmt: skip


@needs_hopper
def test_auto_takes_gluon_dq_on_this_gpu_at_the_threshold(kernel_switch, monkeypatch):
    kernel_switch(plan.HOPPER_ENV, None)
    calls = _count_gluon_calls(monkeypatch)
    seq = 4096
    for head_dim, min_scores in gq.AUTO_MIN_SCORES.items():
        calls.clear()
        heads = max(1, min_scores // (seq * seq))
        _grads(monkeypatch, "auto", 1, heads, heads, seq, seq, head_dim, False)
        assert calls == ["gluon_dq_wg" if gq.gluon_dq_wg_serves(head_dim) else "gluon_dq"], head_dim
        calls.clear()
        _grads(monkeypatch, "auto", 1, heads, heads, seq, seq, head_dim, True)  # causal: half the scores, below it
        assert calls == [], head_dim


def test_three_consumer_warpgroups_only_where_they_serve_and_by_default_where_measured_faster():
    """``consumers=3`` (64-query warpgroups) takes only the ``wg`` variant with a bf16 dS: an INT8 or FP8 dS has one
    scale over 128 queries. Left to the launcher, it takes three where device run 34 measured them faster."""
    x = torch.zeros(1, 2, 256, 64)
    args = (x, x[..., 0], x.to(torch.int8), x[..., :2, 0], x.to(torch.int8), x[..., :4, 0], x, x[..., 0])
    for kwargs in (dict(wg=True, ds_fmt="int8"), dict(wg=True, ds_fmt="fp8"), dict(ds_fmt="bf16"), dict(wg=True)):
        with pytest.raises(ValueError, match="consumers must be 2, or 3 with wg=True and ds_fmt='bf16'"):
            gq.gluon_dq(*args, is_causal=True, scale=0.125, consumers=3, **kwargs)
    with pytest.raises(ValueError, match="received consumers=4"):
        gq.gluon_dq(*args, is_causal=True, scale=0.125, wg=True, ds_fmt="bf16", consumers=4)
    assert gq.wg_consumers("bf16", True) == 3
    assert gq.wg_consumers("bf16", False) == gq.wg_consumers("int8", True) == gq.wg_consumers("fp8", True) == 2


@needs_hopper
@pytest.mark.parametrize(
    "batch, hq, hkv, n, causal",
    [
        pytest.param(2, 4, 2, 512, False, id="gqa"),
        pytest.param(2, 4, 2, 512, True, id="gqa-causal"),
        pytest.param(1, 2, 1, 640, True, id="causal-last-program-short"),  # 10 blocks of 64: a program of one
        pytest.param(2, 10, 5, 2048, True, id="training-heads"),
    ],
)
def test_three_consumer_warpgroups_give_two_warpgroups_dq_bit_for_bit(batch, hq, hkv, n, causal):
    """bf16 dS: three 64-query warpgroups a program against two of 128 queries, dO and V in a model's layout. Each
    row's products and their order of addition are the same, so dQ is (device run 34: 6 of 6 cases)."""
    from sage_lightning.kernels.quant import backward_preprocess

    gen = torch.Generator(device="cuda").manual_seed(n + hq)
    q = torch.randn(batch, hq, n, 64, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(batch, hkv, n, 64, device="cuda", generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(batch, n, hq, 64, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    out, lse, q_op, q_scale, _q_mean, k_op, k_scale = portable_forward(q, k, v, causal)
    delta, *_ = backward_preprocess(do, out, 128, codes=False, codes_t=False)
    args = (do, delta, q_op, q_scale, k_op, k_scale, v, lse)
    two = gq.gluon_dq(*args, is_causal=causal, scale=0.125, ds_fmt="bf16", wg=True, consumers=2)
    three = gq.gluon_dq(*args, is_causal=causal, scale=0.125, ds_fmt="bf16", wg=True, consumers=3)
    assert torch.isfinite(three).all()
    assert torch.equal(three, two), f"max |diff| {(three.float() - two.float()).abs().max().item()}"
