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
    scale over 128 queries. Left to the launcher, it takes three where device runs 34 and 46c measured them faster."""
    x = torch.zeros(1, 2, 256, 64)
    args = (x, x[..., 0], x.to(torch.int8), x[..., :2, 0], x.to(torch.int8), x[..., :4, 0], x, x[..., 0])
    for kwargs in (dict(wg=True, ds_fmt="fp8"), dict(ds_fmt="bf16"), dict(ds_fmt="int8")):
        with pytest.raises(ValueError, match="consumers must be 2, or 3 with wg=True and ds_fmt='bf16' or 'int8'"):
            gq.gluon_dq(*args, is_causal=True, scale=0.125, consumers=3, **kwargs)
    # An INT8 dS takes three only with the dK/dV kernel's tile scales (test_an_int8_ds_takes_three_...).
    for kwargs in (dict(wg=True, ds_fmt="int8"), dict(wg=True)):
        with pytest.raises(ValueError, match=r"consumers=3 with ds_fmt='int8' reads .*; received ds_scale=None"):
            gq.gluon_dq(*args, is_causal=True, scale=0.125, consumers=3, **kwargs)
    with pytest.raises(ValueError, match="received consumers=4"):
        gq.gluon_dq(*args, is_causal=True, scale=0.125, wg=True, ds_fmt="bf16", consumers=4)
    assert gq.wg_consumers("bf16", True) == gq.wg_consumers("bf16", False) == 3
    assert gq.wg_consumers("int8", True) == gq.wg_consumers("fp8", True) == gq.wg_consumers("fp8", False) == 2


def test_an_int8_ds_takes_three_consumer_warpgroups_only_with_the_dkdv_kernels_tile_scales():
    """Three warpgroups of 64 queries cannot reduce an INT8 dS's scale over a tile's 128 queries: they read the
    ``wg`` dK/dV kernel's (``ds_scale``, one fp32 per query head, 128-query block and 64-key block). The launcher
    refuses the scales where no such kernel reads them, or of another shape, dtype or layout; :func:`wg_consumers`
    takes three for them where it takes three for a bf16 dS (causal), and keeps its answer for callers without."""
    from sage_lightning.kernels.hopper.gluon_common import ds_scales_shape

    x = torch.zeros(2, 4, 384, 64)
    k = torch.zeros(2, 2, 512, 64)
    args = (x, x[..., 0], x.to(torch.int8), x[..., :3, 0], k.to(torch.int8), k[..., :8, 0], k, x[..., 0])
    assert ds_scales_shape(tuple(x.shape), tuple(k.shape)) == (2, 4, 3, 8)
    good = torch.zeros(2, 4, 3, 8)
    for kwargs, received in (
        (dict(wg=False), "wg=False, ds_fmt='int8'"),
        (dict(wg=True, ds_fmt="bf16"), "wg=True, ds_fmt='bf16'"),
        (dict(wg=True, ds_fmt="fp8"), "wg=True, ds_fmt='fp8'"),
    ):
        with pytest.raises(ValueError, match=f"ds_scale is read by the wg variant with an INT8 dS only .*{received}"):
            gq.gluon_dq(*args, is_causal=True, scale=0.125, ds_scale=good, **kwargs)
    refused = r"gluon_dq_wg: ds_scale must be fp32 \(2, 4, 3, 8\) \(query heads, 128-query blocks, 64-key blocks\)"
    for bad, received in (
        (torch.zeros(2, 4, 3, 4), r"torch.float32 \(2, 4, 3, 4\), contiguous=True"),
        (torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16), r"torch.bfloat16 \(2, 4, 3, 8\)"),
        (torch.zeros(2, 4, 8, 3).transpose(2, 3), r"torch.float32 \(2, 4, 3, 8\), contiguous=False"),
    ):
        with pytest.raises(ValueError, match=refused + ".*; received " + received):
            gq.gluon_dq(*args, is_causal=True, scale=0.125, wg=True, ds_scale=bad)
    assert gq.wg_consumers("int8", True, ds_scale=True) == 3
    assert gq.wg_consumers("int8", False, ds_scale=True) == gq.wg_consumers("fp8", True, ds_scale=True) == 2
    assert gq.wg_consumers("bf16", True, ds_scale=False) == 3


@pytest.mark.parametrize(
    ("dkdv_kernel", "dq_kernel", "ds", "causal", "shared"),
    [
        ("gluon_dkdv_wg", "gluon_dq_wg", "int8", True, True),
        ("gluon_dkdv_wg", "gluon_dq_wg", "int8", False, False),  # two warpgroups: their own scale
        ("gluon_dkdv_wg", "gluon_dq_wg", "bf16", True, False),  # no scale over the tile
        ("gluon_dkdv", "gluon_dq_wg", "int8", True, False),  # the 64-key kernel stores none
        ("gluon_dkdv_wg", "gluon_dq", "int8", True, False),  # the two-warpgroup dQ kernel reduces its own
    ],
)
def test_the_backward_hands_the_dkdv_kernels_ds_scales_to_the_dq_kernel_where_it_takes_three_warpgroups(
    monkeypatch, dkdv_kernel, dq_kernel, ds, causal, shared
):
    """The backward allocates the dS tile scales (:func:`.gluon_common.ds_scales_shape`) only for the ``wg`` dK/dV and
    dQ kernels with an INT8 dS where the dQ kernel then takes three warpgroups (causal), and hands the one tensor to
    both: ``ds_scale_out`` to the one, ``ds_scale`` to the other. :func:`gluon_dq.wg_consumers` patched to its old rule
    (no INT8) turns it off. (The Gluon kernels are stood in for: the interpreter cannot run them.)"""
    from sage_lightning.kernels import ops

    seen: dict[str, dict] = {}

    def dkdv(grad_out, delta, do_codes_t, do_scale, q_op, q_op_t, q_scale, k_op, *rest, **kwargs):
        seen["dkdv"] = kwargs
        grad_k = torch.zeros(k_op.shape, dtype=grad_out.dtype, device=grad_out.device)
        return grad_k, grad_k.clone()

    def dq(grad_out, delta, q_op, *rest, **kwargs):
        seen["dq"] = kwargs
        return torch.zeros(q_op.shape, dtype=grad_out.dtype, device=grad_out.device)

    for name in ("gluon_dkdv", "gluon_dkdv_wg"):
        monkeypatch.setattr(ops, name, dkdv)
    for name in ("gluon_dq", "gluon_dq_wg"):
        monkeypatch.setattr(ops, name, dq)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the preprocess launch: interpreted on a CPU
    gen = torch.Generator().manual_seed(7)
    shape = (1, 4, 128, 64)
    kv_shape = (1, 2, 256, 64)
    q_op = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
    k_op = torch.randint(-127, 128, kv_shape, generator=gen, dtype=torch.int8).to(device)
    grad_out, out = (torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    v = torch.randn(kv_shape, generator=gen).to(device, torch.bfloat16)
    q_scale, k_scale = torch.full((1, 4, 1), 1e-3, device=device), torch.full((1, 2, 4), 1e-3, device=device)
    lse = torch.zeros(1, 4, 128, device=device)

    def run() -> None:
        seen.clear()
        ops._sagebwd_backward(
            grad_out, out, lse, q_op, q_scale, torch.empty(0, device=device), k_op, k_scale, v, None, causal, 0.125,
            "int8", "int8", "bf16", ds, 128, 64, dkdv_kernel, dq_kernel,
        )  # fmt: skip

    run()
    if shared:
        scales = seen["dkdv"]["ds_scale_out"]
        assert seen["dq"]["ds_scale"] is scales
        assert scales.dtype == torch.float32 and scales.shape == (1, 4, 1, 4) and scales.is_contiguous()
        # Forced off: the dQ kernel's rule without INT8 (what the device check compares against).
        monkeypatch.setattr(gq, "wg_consumers", lambda ds_fmt, is_causal, ds_scale=False: 3 if ds_fmt == "bf16" else 2)
        run()
    assert "ds_scale_out" not in seen["dkdv"]
    assert "ds_scale" not in seen.get("dq", {})


def test_the_backward_refuses_to_share_ds_scales_without_both_planned_kernels():
    from sage_lightning.kernels.backward import backward

    x = torch.zeros(1, 1, 128, 64)
    with pytest.raises(ValueError, match=r"backward: share_ds_scales hands .*; received dkdv_kernel=None"):
        backward(
            x, x, x, x, None, x, x, x, x, None, is_causal=True, scale=0.125, block_m=128, block_n=64, qk="int8",
            dv="int8", dp="bf16", ds="int8", dq_kernel=lambda *a, **k: None, share_ds_scales=True,
        )  # fmt: skip


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


def _wg_int8_backward(batch: int, hq: int, hkv: int, n: int, causal: bool) -> dict:
    """SageBwd's forward (the portable kernel) and the backward's preprocess on the GPU at D=64, dO and V in a model's
    ``[B, N, H, D]`` layout: every argument of the ``wg`` dK/dV and dQ launchers, and ``qk_scale``."""
    from sage_lightning.kernels.quant import backward_preprocess

    gen = torch.Generator(device="cuda").manual_seed(n + hq + causal)
    q = torch.randn(batch, hq, n, 64, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, hkv, n, 64, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, n, hkv, 64, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    do = torch.randn(batch, n, hq, 64, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    out, lse, q_op, q_scale, _q_mean, k_op, k_scale = portable_forward(q, k, v.contiguous(), causal)
    delta, _, do_codes_t, do_scale, q_op_t, _ = backward_preprocess(
        do, out, 128, codes=False, codes_t=True, transpose=q_op
    )  # fmt: skip
    return dict(
        do=do, delta=delta, do_codes_t=do_codes_t, do_scale=do_scale, q_op=q_op, q_op_t=q_op_t, q_scale=q_scale,
        k_op=k_op, k_scale=k_scale, v=v, lse=lse, causal=causal,
    )  # fmt: skip


def _wg_dkdv(x: dict, ds_scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return gluon_backward.gluon_dkdv(
        x["do"], x["delta"], x["do_codes_t"], x["do_scale"], x["q_op"], x["q_op_t"], x["q_scale"], x["k_op"],
        x["k_scale"], x["v"], x["lse"], None, is_causal=x["causal"], scale=0.125, wg=True, ds_scale_out=ds_scale_out,
    )  # fmt: skip


def _wg_dq(x: dict, consumers: int, ds_scale: torch.Tensor | None = None) -> torch.Tensor:
    return gq.gluon_dq(
        x["do"], x["delta"], x["q_op"], x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"],
        is_causal=x["causal"], scale=0.125, wg=True, consumers=consumers, ds_scale=ds_scale,
    )  # fmt: skip


def _tile_ds_scales(x: dict) -> torch.Tensor:
    """Each 128-query x 64-key tile's INT8 dS scale (``max|dS| / 127``, 1 where 0) recomputed in PyTorch from the
    saved operands as both kernels compute dS: ``S`` from the exact int32 product (here fp64) times ``s_Q s_K tau
    log2(e)``, ``P = exp2(S - lse)`` (zero where a key comes after its query when causal), ``dP = dO V^T`` in fp32,
    ``dS = P (dP - delta)``. The same to a few fp32 roundings (exp2 and dP's order of sums differ)."""
    from sage_lightning.kernels.tiles import LOG2E

    q_op, k_op = x["q_op"], x["k_op"]
    batch, hq, n, _ = q_op.shape
    group = hq // k_op.shape[1]
    k_rep = k_op.repeat_interleave(group, dim=1)
    v_rep = x["v"].repeat_interleave(group, dim=1).float()
    s_int = q_op.double() @ k_rep.double().transpose(-1, -2)
    scale = (x["q_scale"].repeat_interleave(128, dim=-1)[..., :, None] * x["k_scale"].repeat_interleave(64, dim=-1)
             .repeat_interleave(group, dim=1)[..., None, :]) * (0.125 * LOG2E)  # fmt: skip
    p = torch.exp2((s_int * scale.double()).float() - x["lse"][..., None])
    if x["causal"]:
        p = p.masked_fill(torch.ones(n, n, dtype=torch.bool, device=p.device).triu(1), 0.0)
    ds = p * (x["do"].float() @ v_rep.transpose(-1, -2) - x["delta"][..., None])
    amax = ds.abs().view(batch, hq, n // 128, 128, n // 64, 64).amax(dim=(3, 5))
    scales = amax / 127.0
    return torch.where(scales == 0, torch.ones_like(scales), scales)


@needs_hopper
@pytest.mark.parametrize(
    "batch, hq, hkv, n, causal",
    [
        pytest.param(2, 4, 2, 512, False, id="gqa"),
        pytest.param(2, 4, 2, 512, True, id="gqa-causal"),
        pytest.param(1, 2, 1, 640, True, id="causal-n-not-a-multiple-of-192"),
    ],
)
def test_the_dkdv_kernel_stores_each_tiles_ds_scale(batch, hq, hkv, n, causal):
    """The ``wg`` dK/dV kernel with ``ds_scale_out``: every tile's INT8 dS scale at its query head (GQA: each query
    head of the kv group), query block and key block, equal to ``max|dS| / 127`` recomputed in PyTorch to fp32
    roundings; the tiles a causal call visits in neither kernel (every key after every query) left as they were; dK
    and dV as without the store, bit for bit."""
    from sage_lightning.kernels.hopper.gluon_common import ds_scales_shape

    x = _wg_int8_backward(batch, hq, hkv, n, causal)
    scales = torch.full(ds_scales_shape(tuple(x["q_op"].shape), tuple(x["k_op"].shape)), float("nan"), device="cuda")
    dk, dv = _wg_dkdv(x, scales)
    dk_without, dv_without = _wg_dkdv(x)
    assert torch.equal(dk, dk_without) and torch.equal(dv, dv_without)
    m_block = torch.arange(n // 128, device="cuda")[:, None]
    k_block = torch.arange(n // 64, device="cuda")[None, :]
    visited = (k_block * 64 < (m_block + 1) * 128) if causal else torch.ones_like(m_block * k_block, dtype=torch.bool)
    visited = visited.expand_as(scales)
    assert torch.isfinite(scales[visited]).all(), "a visited tile's scale was not stored"
    assert torch.isnan(scales[~visited]).all(), "a scale was stored where no kernel visits the tile"
    want = _tile_ds_scales(x)
    torch.testing.assert_close(scales[visited], want[visited], rtol=1e-4, atol=0)


@needs_hopper
@pytest.mark.parametrize(
    "batch, hq, hkv, n, causal",
    [
        pytest.param(2, 4, 2, 512, False, id="gqa"),
        pytest.param(2, 4, 2, 512, True, id="gqa-causal"),
        pytest.param(1, 2, 2, 384, True, id="causal-n-a-multiple-of-128-and-192"),
        pytest.param(1, 2, 1, 640, True, id="causal-last-program-short"),  # 10 blocks of 64: a program of one
        pytest.param(1, 2, 1, 256, False, id="n-not-a-multiple-of-192"),
        pytest.param(2, 10, 5, 2048, True, id="training-heads"),
    ],
)
def test_three_consumer_warpgroups_with_the_dkdv_kernels_scales_give_two_warpgroups_int8_dq(batch, hq, hkv, n, causal):
    """INT8 dS: three 64-query warpgroups reading the ``wg`` dK/dV kernel's tile scales against two of 128 queries
    reducing their own, dO and V in a model's layout: bit for bit, as the two kernels compute the same dS (the same
    int32 products, scales, exp2, dP wgmma and delta; dK and dV equal the portable kernel's, which shares its dS code
    with the portable dQ kernel, and so does the dQ kernel's dQ). Should a device show a last-bit difference in dS
    between the kernels (a scale one ulp apart, a code one apart: the three-warpgroup kernel clamps its codes to
    +-127, so none wraps), compare with a tight tolerance instead (rel_l2 below 1e-3, as an FP8 dS's dQ against the
    portable kernel's) and record the figures: the dQ kernel's numerics are then the dK/dV kernel's scale's."""
    from sage_lightning.kernels.hopper.gluon_common import ds_scales_shape

    x = _wg_int8_backward(batch, hq, hkv, n, causal)
    scales = torch.full(ds_scales_shape(tuple(x["q_op"].shape), tuple(x["k_op"].shape)), float("nan"), device="cuda")
    _wg_dkdv(x, scales)
    two = _wg_dq(x, 2)
    three = _wg_dq(x, 3, scales)
    assert torch.isfinite(three).all()
    assert torch.equal(three, two), f"max |diff| {(three.float() - two.float()).abs().max().item()}"
    assert torch.equal(_wg_dq(x, 2, scales), two)  # two warpgroups reduce their own: the scales are not read
