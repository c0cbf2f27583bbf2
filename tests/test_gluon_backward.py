"""The Gluon dK/dV kernel for Hopper (``kernels/hopper/gluon_backward.py``, and at D=64 its ``wg`` variant): the
rules that pick them, and on a Hopper GPU their gradients against ``_dkdv_kernel``'s, bit for bit.

The CPU interpreter cannot run Gluon, so the kernel's own tests run only on an sm_90 GPU (in
``benchmarks.kernels.gpu_verify``'s kernel tests, whose record CI checks); the dispatch rule is tested everywhere.
"""

from __future__ import annotations

import pytest
import torch
from gluon_support import TRITON, count_calls, hopper_grads, meta_plan, needs_hopper, pretend_verified_hopper
from sage_lightning.kernels import plan
from sage_lightning.kernels.hopper import gluon_backward
from sage_lightning.kernels.hopper import gluon_backward as gb


def _applies(causal: bool = False, **overrides: object) -> bool:
    """Whether the plan of SageBwd's default call on meta tensors (B=1, 8 heads, N=Nk=4096, D=128) takes a Gluon
    dK/dV kernel, with ``overrides`` of the shapes (``batch``, ``heads``, ``seq_q``, ``seq_k``, ``head_dim``), dtype,
    formats, Q-smoothing and tiles (:func:`gluon_support.meta_plan`)."""
    return meta_plan(causal, overrides).dkdv in ("gluon_dkdv", "gluon_dkdv_wg")


@pytest.fixture
def gluon_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine is a verified Hopper with the Gluon API the kernel is written for."""
    pretend_verified_hopper(monkeypatch)


def test_auto_takes_it_on_a_verified_hopper_above_the_size_threshold(gluon_here):
    assert _applies()  # 8 heads x 4096 x 4096 scores = 2^27
    assert _applies(batch=4, heads=16)
    assert not _applies(heads=1, seq_q=1024, seq_k=1024)  # 2^20 scores: the launch's fixed cost dominates
    # Causal calls compute half the scores: the same shape falls below the threshold.
    edge = gb.AUTO_MIN_SCORES[128] // (4096 * 4096)
    assert _applies(heads=edge) and not _applies(causal=True, heads=edge)
    # D=64: from 2^28 scores (the one-warpgroup-per-64-keys kernel: 1.19x the whole backward there, 2^28 causal).
    assert not _applies(batch=1, heads=8, head_dim=64)
    assert _applies(batch=2, heads=8, head_dim=64) and _applies(batch=4, heads=8, causal=True, head_dim=64)
    assert not _applies(batch=2, heads=8, causal=True, head_dim=64)


def test_auto_defers_to_the_hopper_switch_and_to_the_device(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.HOPPER_ENV, "off")
    assert not _applies()
    monkeypatch.setattr(plan, "verified_here", lambda device: False)
    kernel_switch(plan.HOPPER_ENV, "auto")
    assert not _applies()  # not a verified Hopper
    kernel_switch(plan.GLUON_DKDV_ENV, "force")
    assert _applies(heads=1, seq_q=128, seq_k=64)  # force: whatever the device and the size


def test_off_and_other_tritons_keep_the_portable_kernel(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_DKDV_ENV, "off")
    assert not _applies()
    kernel_switch(plan.GLUON_DKDV_ENV, "force")
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", ("0.0",))
    assert not _applies()  # its Gluon API is Triton 3.6's
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", (TRITON,))
    monkeypatch.setattr(gluon_backward, "HAVE_GLUON", False)
    assert not _applies()


@pytest.mark.parametrize(
    "overrides",
    [
        {"dp": "int8"},
        {"dp": "fp8"},
        {"dv": "bf16"},
        {"dv": "fp8", "ds": "fp8"},
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
    kernel_switch(plan.GLUON_DKDV_ENV, "force")
    assert _applies()
    assert not _applies(**overrides)


@pytest.mark.parametrize("ds", ["fp8", "bf16"])
@pytest.mark.parametrize(("head_dim", "seq_k"), [(128, 4096), (64, 4096), (64, 4032)])
def test_an_fp8_or_bf16_ds_keeps_the_kernel_an_int8_ds_takes(kernel_switch, gluon_here, ds, head_dim, seq_k):
    """Issue 42: a layer the controller escalates to ``ds="fp8"`` or ``"bf16"`` keeps the Gluon dK/dV kernel its INT8
    dS had (its dK product in bf16): at D=64 the one-warpgroup twin where it serves the key count."""
    kernel_switch(plan.GLUON_DKDV_ENV, "force")
    want = "gluon_dkdv_wg" if gb.gluon_dkdv_wg_serves(head_dim, seq_k) else "gluon_dkdv"
    for causal in (False, True):
        assert meta_plan(causal, dict(ds=ds, head_dim=head_dim, seq_k=seq_k)).dkdv == want
        assert meta_plan(causal, dict(head_dim=head_dim, seq_k=seq_k)).dkdv == want
    kernel_switch(plan.GLUON_DKDV_ENV, "auto")
    assert meta_plan(False, dict(ds=ds, batch=4, heads=16, head_dim=head_dim, seq_k=seq_k)).dkdv == want
    kernel_switch(plan.GLUON_DKDV_ENV, "off")
    assert meta_plan(False, dict(ds=ds, head_dim=head_dim, seq_k=seq_k)).dkdv == "triton_dkdv"


def test_the_launcher_refuses_a_ds_format_it_does_not_take():
    x = torch.zeros(1, 1, 128, 128, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"gluon_dkdv: ds_fmt must be 'int8', 'fp8' or 'bf16'; received 'nvfp4'"):
        gb.gluon_dkdv(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1, ds_fmt="nvfp4")


def test_an_unknown_setting_is_refused(kernel_switch, gluon_here, monkeypatch):
    kernel_switch(plan.GLUON_DKDV_ENV, "fast")
    with pytest.raises(ValueError, match=r"SAGE_LIGHTNING_GLUON_DKDV must be one of auto, off, force; received 'fast'"):
        _applies()


@pytest.mark.parametrize(
    ("head_dim", "seq_k", "takes"),
    [(64, 4096, True), (64, 128, True), (64, 4032, False), (128, 4096, False), (96, 4096, False)],
)
def test_the_one_warpgroup_per_half_kernel_takes_d64_with_whole_128_key_programs(
    kernel_switch, gluon_here, head_dim, seq_k, takes
):
    kernel_switch(plan.GLUON_DKDV_ENV, "force")
    assert (meta_plan(False, dict(head_dim=head_dim, seq_k=seq_k)).dkdv == "gluon_dkdv_wg") is takes
    kernel_switch(plan.GLUON_DKDV_WG_ENV, "off")
    assert meta_plan(False, dict(head_dim=head_dim, seq_k=seq_k)).dkdv != "gluon_dkdv_wg"


def test_the_one_warpgroup_per_half_switch_refuses_an_unknown_setting(kernel_switch):
    kernel_switch(plan.GLUON_DKDV_WG_ENV, "force")
    with pytest.raises(ValueError, match=r"SAGE_LIGHTNING_GLUON_DKDV_WG must be one of auto, off; received 'force'"):
        meta_plan(False, {"head_dim": 64})
    with pytest.raises(ValueError, match=r"gluon_dkdv_wg: serves head_dim in \(64,\) .* received head_dim=128"):
        x = torch.zeros(1, 1, 4096, 128, dtype=torch.int8, device="meta")
        gb.gluon_dkdv(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1, wg=True)
    x = torch.zeros(1, 1, 4096, 64, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"gluon_dkdv_wg: ds_fmt must be 'int8', 'fp8' or 'bf16'; received 'e5m2'"):
        gb.gluon_dkdv(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1, ds_fmt="e5m2", wg=True)
    # The wg variant is warp-specialised and does not defer.
    for variant in ({"warp_specialize": False}, {"defer": True}):
        with pytest.raises(ValueError, match=r"gluon_dkdv_wg: is warp-specialised without defer; received "):
            gb.gluon_dkdv(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1, wg=True, **variant)
    # Q'^ in bf16 from the preprocess: for an FP8 or bf16 dS only, of Q'^'s shape, contiguous; the same checks of the
    # copy in both variants that read it (without wg: the warp-specialised one without defer, one buffer beside the
    # ring).
    wide = torch.zeros(1, 1, 4096, 64, dtype=torch.bfloat16, device="meta")
    refused_copies = {
        "gluon_dkdv_wg": [
            ("int8", wide, r"torch.bfloat16 \(1, 1, 4096, 64\), contiguous=True, ds_fmt='int8'"),
            ("fp8", x, r"torch.int8 \(1, 1, 4096, 64\)"),
            ("fp8", wide[:, :, :2048], r"torch.bfloat16 \(1, 1, 2048, 64\)"),
            (
                "bf16",
                wide.new_zeros(1, 1, 64, 4096).transpose(2, 3),
                r"torch.bfloat16 \(1, 1, 4096, 64\), contiguous=False",
            ),
        ],
        "gluon_dkdv": [
            ("int8", wide, r"torch.bfloat16 \(1, 1, 4096, 64\), contiguous=True, ds_fmt='int8'"),
            ("bf16", x, r"torch.int8 \(1, 1, 4096, 64\)"),
        ],
    }
    for name, cases in refused_copies.items():
        refused = rf"{name}: q_wide must be Q'\^ in bf16 \(1, 1, 4096, 64\), contiguous, .*; received "
        for ds_fmt, q_wide, received in cases:
            with pytest.raises(ValueError, match=refused + received):
                gb.gluon_dkdv(
                    x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1, ds_fmt=ds_fmt, q_wide=q_wide,
                    wg=name == "gluon_dkdv_wg",
                )  # fmt: skip
    # The variants that widen the codes themselves refuse it.
    for variant, received in (
        ({"warp_specialize": False}, "warp_specialize=False, defer=False"),
        ({"defer": True}, "warp_specialize=True, defer=True"),
    ):
        refused_variant = (
            r"gluon_dkdv: q_wide is read by the warp-specialised variants without defer \(warp_specialize=True, "
            rf"defer=False\); received {received}"
        )
        with pytest.raises(ValueError, match=refused_variant):
            gb.gluon_dkdv(
                x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1, ds_fmt="fp8", q_wide=wide, **variant
            )
    # The dS tile scales for the dQ kernel's three warpgroups: stored by the wg variant with an INT8 dS only, into
    # fp32 [B, Hq, N / 128, Nk / 64], contiguous.
    good = torch.zeros(1, 1, 32, 64, device="meta")
    for kwargs, received in (
        (dict(), "wg=False, ds_fmt='int8'"),
        (dict(wg=True, ds_fmt="bf16"), "wg=True, ds_fmt='bf16'"),
    ):
        with pytest.raises(
            ValueError, match=f"ds_scale_out is written by the wg variant with an INT8 dS only .*{received}"
        ):
            gb.gluon_dkdv(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=True, scale=0.1, ds_scale_out=good, **kwargs)
    refused = r"gluon_dkdv_wg: ds_scale_out must be fp32 \(1, 1, 32, 64\) .*; received "
    for bad, received in ((good[..., :32], r"torch.float32 \(1, 1, 32, 32\)"), (good.half(), r"torch.float16")):
        with pytest.raises(ValueError, match=refused + received):
            gb.gluon_dkdv(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=True, scale=0.1, ds_scale_out=bad, wg=True)


@pytest.mark.parametrize(
    ("dkdv_kernel", "ds", "widened"),
    [("gluon_dkdv_wg", "fp8", True), ("gluon_dkdv_wg", "bf16", True), ("gluon_dkdv_wg", "int8", False),
     ("gluon_dkdv", "fp8", True), ("gluon_dkdv", "bf16", True), ("gluon_dkdv", "int8", False)],
)  # fmt: skip
def test_the_preprocess_widens_q_for_the_gluon_dkdv_kernels_with_an_fp8_or_bf16_ds_only(
    monkeypatch, dkdv_kernel, ds, widened
):
    """Issue 42: the backward's preprocess launch writes Q'^ in bf16 (N x D x 2 bytes per query head) only when the
    plan runs a Gluon dK/dV kernel (``gluon_dkdv_wg``, or ``gluon_dkdv`` as ``ops`` runs it: warp-specialised without
    defer) with an FP8 or bf16 dS, and hands it to that kernel as ``q_wide``: the values are the INT8 codes, exactly.
    (The Gluon kernel is stood in for: the interpreter cannot run it; the portable dQ runs.)"""
    from sage_lightning.kernels import ops

    seen: dict[str, object] = {}

    def stand_in(grad_out, delta, do_codes_t, do_scale, q_op, q_op_t, q_scale, k_op, *rest, **kwargs):
        seen.update(kwargs, q_op=q_op)
        grad_k = torch.zeros(k_op.shape, dtype=grad_out.dtype, device=grad_out.device)
        return grad_k, grad_k.clone()

    monkeypatch.setattr(ops, dkdv_kernel, stand_in)
    # The preprocess and the portable dQ kernel run: on the GPU where there is one (conftest: the interpreter
    # otherwise, on CPU tensors).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and ds == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("an FP8 dS needs FP8 tensor cores (compute capability 8.9 or newer)")
    gen = torch.Generator().manual_seed(42)
    batch, heads, seq, head_dim = 1, 2, 128, 64
    shape = (batch, heads, seq, head_dim)
    q_op = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
    k_op = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
    grad_out, out, v = (torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    scales = (
        torch.full((batch, heads, seq // 128), 1e-3, device=device),
        torch.full((batch, heads, seq // 64), 1e-3, device=device),
    )
    lse = torch.zeros(batch, heads, seq, device=device)
    ops._sagebwd_backward(
        grad_out, out, lse, q_op, scales[0], torch.empty(0, device=device), k_op, scales[1], v, None, False, 0.125,
        "int8", "int8", "bf16", ds, 128, 64, dkdv_kernel, "triton_dq",
    )  # fmt: skip
    assert seen["q_op"] is q_op and seen.get("ds_fmt", "int8") == ds
    if widened:
        q_wide = seen["q_wide"]
        assert q_wide.dtype == torch.bfloat16 and q_wide.is_contiguous()
        assert torch.equal(q_wide, q_op.to(torch.bfloat16))
    else:
        assert "q_wide" not in seen


def _count_gluon_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Both Gluon dK/dV kernels as ``ops`` runs them (:func:`gluon_support.count_calls`), ``wg`` at auto."""
    monkeypatch.delenv(plan.GLUON_DKDV_WG_ENV, raising=False)
    plan.refresh_settings()
    return count_calls(monkeypatch, ("gluon_dkdv", "gluon_dkdv_wg"))


def _grads(monkeypatch, setting: str, *shape, precision=None) -> tuple[torch.Tensor, ...]:
    return hopper_grads(monkeypatch, plan.GLUON_DKDV_ENV, setting, shape, with_stats=True, precision=precision)


@needs_hopper
@pytest.mark.parametrize(
    "batch, hq, hkv, n, nk, d, causal",
    [
        pytest.param(1, 2, 2, 256, 256, 64, False, id="mha-d64"),
        pytest.param(2, 4, 2, 512, 512, 128, True, id="gqa-causal-d128"),
        pytest.param(1, 4, 2, 256, 512, 64, True, id="causal-more-keys"),  # key blocks past the last query
        pytest.param(1, 2, 2, 1024, 320, 128, False, id="fewer-keys"),
        pytest.param(1, 8, 8, 2048, 2048, 128, True, id="large-causal"),
        # D=64, one warpgroup per 64 keys: GQA and causal with more queries than keys, and a key count that is not
        # a multiple of 128 (the 64-key kernel serves it).
        pytest.param(2, 4, 2, 512, 384, 64, True, id="wg-gqa-causal-fewer-keys"),
        pytest.param(1, 2, 2, 1024, 1024, 64, True, id="wg-large-causal"),
        pytest.param(1, 2, 2, 256, 320, 64, False, id="d64-keys-not-128"),
    ],
)
def test_gluon_gradients_equal_the_portable_kernels_bit_for_bit(monkeypatch, batch, hq, hkv, n, nk, d, causal):
    calls = _count_gluon_calls(monkeypatch)
    shape = (batch, hq, hkv, n, nk, d, causal)
    got = _grads(monkeypatch, "force", *shape)
    expected = "gluon_dkdv_wg" if gb.gluon_dkdv_wg_serves(d, nk) else "gluon_dkdv"
    assert calls == [expected], f"the backward took {calls}, not {expected}"
    calls.clear()
    want = _grads(monkeypatch, "off", *shape)
    assert not calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=False):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)  # the dS statistics (summed atomically)


@needs_hopper
@pytest.mark.parametrize("ds", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "batch, hq, hkv, n, nk, d, causal",
    [
        pytest.param(1, 2, 2, 256, 256, 64, False, id="mha-d64"),
        pytest.param(2, 4, 2, 512, 512, 128, True, id="gqa-causal-d128"),
        pytest.param(1, 4, 2, 256, 512, 64, True, id="causal-more-keys"),
        pytest.param(1, 2, 2, 1024, 320, 128, False, id="fewer-keys"),
        pytest.param(1, 8, 8, 2048, 2048, 128, True, id="large-causal"),
        # D=64 with whole 128-key programs: the one-warpgroup kernel (also in mha-d64 and causal-more-keys above).
        pytest.param(2, 4, 2, 512, 384, 64, True, id="wg-gqa-causal-fewer-keys"),
        pytest.param(1, 2, 2, 1024, 1024, 64, True, id="wg-large-causal"),
        pytest.param(1, 2, 2, 256, 320, 64, False, id="d64-keys-not-128"),
    ],
)
def test_an_fp8_or_bf16_ds_gives_the_portable_kernels_gradients(monkeypatch, ds, batch, hq, hkv, n, nk, d, causal):
    """Issue 42: with ``ds="fp8"`` or ``"bf16"`` the Gluon kernel's dK product runs in bf16 (dS's e4m3 codes or
    bf16 values against Q'^'s INT8 codes widened to bf16, fp32 accumulation), as ``_dkdv_kernel``'s does: dV
    and the dS statistics as the portable kernel's, dK to its last bits (the bf16 sums' order), and as near the
    reference (``test_triton_kernels``'s bound on the GPU)."""
    from sage_lightning.kernels import AttentionPrecision
    from sage_lightning.kernels.reference import sage_attention_reference

    precision = AttentionPrecision(ds=ds)
    calls = _count_gluon_calls(monkeypatch)
    shape = (batch, hq, hkv, n, nk, d, causal)
    got = _grads(monkeypatch, "force", *shape, precision=precision)
    expected = "gluon_dkdv_wg" if gb.gluon_dkdv_wg_serves(d, nk) else "gluon_dkdv"
    assert calls == [expected], f"the backward took {calls}, not {expected}"
    calls.clear()
    want = _grads(monkeypatch, "off", *shape, precision=precision)
    assert not calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=False):
        assert torch.isfinite(a).all(), name
        if name == "dK":  # bf16 products: a wgmma may sum in another order than the dot (FP8 P V did, device run 19)
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-3, f"dK: rel_l2 {rel} against the portable kernel's (equal: {torch.equal(a, b)})"
        else:  # dV's INT8 product and the dQ kernel are the same in both calls
            assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)  # the dS statistics (summed atomically)
    int8 = _grads(monkeypatch, "force", *shape)  # the same inputs, dS in INT8: a different dK
    assert not torch.equal(got[1], int8[1])
    if n * nk <= 512 * 512:
        ref = hopper_grads(
            monkeypatch, plan.GLUON_DKDV_ENV, "force", shape, True, precision, attention=sage_attention_reference
        )
        for name, a, b in zip(("dQ", "dK", "dV"), got, ref, strict=False):
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 2e-2, f"{name}: rel_l2 {rel} against the reference"


def test_dp_beside_s_where_device_run_47_measured_it_faster():
    """The one-warpgroup kernel's dP^T beside S^T: with a bf16 dS always, with an INT8 dS on non-causal calls only
    (causal, the training shape, it spills and lost 3.4%); never an FP8 dS (not measured)."""
    assert gb.wg_dp_beside_s("bf16", True) and gb.wg_dp_beside_s("bf16", False) and gb.wg_dp_beside_s("int8", False)
    assert not gb.wg_dp_beside_s("int8", True)
    assert not gb.wg_dp_beside_s("fp8", True) and not gb.wg_dp_beside_s("fp8", False)


@needs_hopper
@pytest.mark.parametrize("ds", ["fp8", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_an_fp8_or_bf16_ds_gives_the_one_warpgroup_kernel_the_64_key_kernels_gradients(monkeypatch, ds, causal):
    """Issue 42: at D=64 the one-warpgroup dK/dV kernel with an FP8 or bf16 dS against the 64-key kernel with the
    same dS (``SAGE_LIGHTNING_GLUON_DKDV_WG=off``): dV, dQ and the dS statistics as there, dK's bf16 product near its
    last bits (one warpgroup sums each element over the tile's 128 queries as the two of the 64-key kernel do)."""
    from sage_lightning.kernels import AttentionPrecision

    precision = AttentionPrecision(ds=ds)
    calls = _count_gluon_calls(monkeypatch)
    shape = (2, 4, 2, 1024, 1024, 64, causal)
    got = _grads(monkeypatch, "force", *shape, precision=precision)
    assert calls == ["gluon_dkdv_wg"], calls
    calls.clear()
    monkeypatch.setenv(plan.GLUON_DKDV_WG_ENV, "off")
    plan.refresh_settings()
    want = _grads(monkeypatch, "force", *shape, precision=precision)
    assert calls == ["gluon_dkdv"], calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=False):
        assert torch.isfinite(a).all(), name
        if name == "dK":
            # A bf16 dS's product adds into dK inside the tensor core in the wg kernel (as in the portable one, which
            # it equals bit for bit) and after it in the 64-key kernel: 5.7e-5 apart non-causal, 1.4e-4 causal, both
            # 0.0153-0.0156 from float64 (device run 47b). An FP8 dS's products are scaled after them in both.
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            bound = 1e-3 if ds == "bf16" else 1e-4
            assert rel < bound, f"dK: rel_l2 {rel} against the 64-key kernel's (equal: {torch.equal(a, b)})"
        else:
            assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)


@needs_hopper
@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("ds", ["int8", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_dp_issued_beside_s_gives_the_one_warpgroup_kernel_the_same_gradients_bit_for_bit(
    monkeypatch, ds, causal, with_stats
):
    """Issue 42 (device run 47): the one-warpgroup dK/dV kernel can issue each tile's dP^T product beside S^T's
    (:func:`gluon_backward.wg_dp_beside_s` says where it does). The same products in the same order: dQ, dK, dV and the
    dS statistics equal those of the kernel that issues dP^T after P's codes, bit for bit (the statistics to their
    atomic sums' order), with both dS formats it may serve, causal or not."""
    from sage_lightning.kernels import AttentionPrecision

    precision = AttentionPrecision(ds=ds)
    calls = _count_gluon_calls(monkeypatch)
    shape = (2, 4, 2, 1024, 1024, 64, causal)
    monkeypatch.setattr(gb, "wg_dp_beside_s", lambda ds_fmt, is_causal, q_wide=True: True)
    got = hopper_grads(monkeypatch, plan.GLUON_DKDV_ENV, "force", shape, with_stats, precision)
    monkeypatch.setattr(gb, "wg_dp_beside_s", lambda ds_fmt, is_causal, q_wide=True: False)
    want = hopper_grads(monkeypatch, plan.GLUON_DKDV_ENV, "force", shape, with_stats, precision)
    assert calls == ["gluon_dkdv_wg", "gluon_dkdv_wg"], calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=False):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    if with_stats:
        torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)  # the dS statistics (summed atomically)


@needs_hopper
@pytest.mark.parametrize("ds", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "kernel, batch, hq, hkv, n, nk, head_dim, causal",
    [
        pytest.param("gluon_dkdv_wg", 2, 4, 2, 1024, 1024, 64, False, id="wg-gqa"),
        pytest.param("gluon_dkdv_wg", 2, 4, 2, 1024, 1024, 64, True, id="wg-gqa-causal"),
        pytest.param("gluon_dkdv_wg", 2, 4, 2, 512, 384, 64, True, id="wg-causal-fewer-keys"),
        pytest.param("gluon_dkdv_wg", 1, 4, 2, 256, 512, 64, True, id="wg-causal-more-keys"),
        pytest.param("gluon_dkdv", 2, 4, 2, 1024, 1024, 128, False, id="d128-gqa"),
        pytest.param("gluon_dkdv", 2, 4, 2, 1024, 1024, 128, True, id="d128-gqa-causal"),
        pytest.param("gluon_dkdv", 2, 4, 2, 512, 384, 128, True, id="d128-causal-fewer-keys"),
        pytest.param("gluon_dkdv", 1, 4, 2, 256, 512, 128, True, id="d128-causal-more-keys"),
        pytest.param("gluon_dkdv", 2, 4, 2, 1024, 960, 64, False, id="d64-keys-not-of-128"),
    ],
)  # fmt: skip
def test_q_widened_by_the_preprocess_gives_the_gluon_dkdv_kernels_the_gradients_of_q_widened_per_tile(
    monkeypatch, ds, kernel, batch, hq, hkv, n, nk, head_dim, causal
):
    """Issue 42: with an FP8 or bf16 dS, each Gluon dK/dV kernel reading Q'^ in bf16 from the preprocess's copy (what
    the backward runs: ``gluon_dkdv_wg`` at D=64 through the TMA ring; ``gluon_dkdv``, two consumer warpgroups per 64
    keys at D=128 and at D=64 where the key count is no multiple of 128, in one buffer beside the ring) against the
    same kernel widening each tile's codes itself (``q_wide`` dropped): the same bf16 operand in the same
    shared-memory layout and the same wgmma, so dQ, dK, dV and the dS statistics are equal, dK bit for bit."""
    from sage_lightning.kernels import AttentionPrecision, ops

    precision = AttentionPrecision(ds=ds)
    widened: list[bool] = []
    original = getattr(ops, kernel)
    shape = (batch, hq, hkv, n, nk, head_dim, causal)
    monkeypatch.setattr(
        ops, kernel, lambda *a, **kw: widened.append(kw.get("q_wide") is not None) or original(*a, **kw)
    )
    got = _grads(monkeypatch, "force", *shape, precision=precision)
    assert widened == [True], widened

    def per_tile(*args, q_wide=None, **kwargs):
        widened.append(False)
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, kernel, per_tile)
    want = _grads(monkeypatch, "force", *shape, precision=precision)
    assert widened == [True, False], widened
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=False):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)


@needs_hopper
def test_auto_takes_gluon_on_this_gpu_at_the_threshold(kernel_switch, monkeypatch):
    kernel_switch(plan.HOPPER_ENV, None)
    calls = _count_gluon_calls(monkeypatch)
    seq = 4096
    for head_dim, min_scores in gb.AUTO_MIN_SCORES.items():
        calls.clear()
        heads = max(1, min_scores // (seq * seq))
        _grads(monkeypatch, "auto", 1, heads, heads, seq, seq, head_dim, False)
        assert calls == ["gluon_dkdv_wg" if head_dim == 64 else "gluon_dkdv"], head_dim


@pytest.mark.parametrize("layout", ["contiguous", "model", "other"])
def test_rows_view_places_every_heads_rows_where_the_kernels_look(layout):
    """``rows_view`` (the Gluon backward's dO and V): the 2-D view its descriptor reads and, per head, the row and
    column ``_head_origin`` computes from its three numbers (``b * rows_b + h * rows_h``, ``h * cols_h``): every head's
    ``N x D`` block is there. A model's ``[B, N, H, D]`` memory is read where it lies (no copy); another layout is
    copied contiguous."""
    from sage_lightning.kernels.hopper.gluon_common import rows_view

    batch, heads, seq, dim = 2, 3, 8, 4
    base = torch.arange(batch * heads * seq * dim, dtype=torch.float32)
    x = {
        "contiguous": base.view(batch, heads, seq, dim),
        "model": base.view(batch, seq, heads, dim).transpose(1, 2),
        "other": base.view(seq, batch, heads, dim).permute(1, 2, 0, 3),  # [N, B, H, D] memory: copied
    }[layout]
    view, (rows_b, rows_h, cols_h) = rows_view(x)
    assert view.dim() == 2 and view.is_contiguous()
    assert (view.data_ptr() == x.data_ptr()) == (layout != "other")
    for b in range(batch):
        for h in range(heads):
            row, col = b * rows_b + h * rows_h, h * cols_h
            assert torch.equal(view[row : row + seq, col : col + dim], x[b, h]), (layout, b, h)


@needs_hopper
@pytest.mark.parametrize(
    "batch, hq, hkv, n, nk, d, causal",
    [
        pytest.param(2, 4, 2, 512, 512, 128, True, id="gqa-causal-d128"),
        pytest.param(2, 4, 2, 512, 384, 64, True, id="wg-gqa-causal-fewer-keys"),
        pytest.param(1, 2, 2, 1024, 1024, 64, False, id="wg-mha"),
    ],
)
@pytest.mark.parametrize("ds", ["int8", "bf16"])
def test_do_and_v_in_a_models_layout_give_the_contiguous_gradients_bit_for_bit(
    monkeypatch, batch, hq, hkv, n, nk, d, causal, ds
):
    """Q, K, V and dO as a model hands them (``[B, N, H, D]`` memory, viewed ``[B, H, N, D]``): the Gluon dK/dV and
    dQ kernels read dO and V where they lie, and the gradients equal those of the same values made contiguous."""
    from sage_lightning.kernels import AttentionPrecision
    from sage_lightning.kernels.ops import sage_attention_triton

    for env in (plan.GLUON_DKDV_ENV, plan.GLUON_DQ_ENV):
        monkeypatch.setenv(env, "force")
    plan.refresh_settings()
    calls = count_calls(monkeypatch, ("gluon_dkdv", "gluon_dkdv_wg", "gluon_dq", "gluon_dq_wg"))
    gen = torch.Generator(device="cuda").manual_seed(n + nk + d)
    model = [
        torch.randn(batch, length, heads, d, device="cuda", generator=gen).bfloat16().transpose(1, 2)
        for length, heads in ((n, hq), (nk, hkv), (nk, hkv), (n, hq))
    ]
    precision = AttentionPrecision(ds=ds)
    grads = []
    for tensors in (model, [t.contiguous() for t in model]):
        q, k, v = (t.detach().clone().requires_grad_() if t.is_contiguous() else t.detach().requires_grad_()
                   for t in tensors[:3])  # fmt: skip
        out, _ = sage_attention_triton(q, k, v, is_causal=causal, precision=precision)
        grads.append(torch.autograd.grad(out, (q, k, v), tensors[3]))
    assert len(calls) == 4 and all(c.startswith("gluon_") for c in calls), calls
    assert not model[3].is_contiguous() and not model[2].is_contiguous()
    for name, a, b in zip(("dQ", "dK", "dV"), *grads, strict=True):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"


@pytest.mark.parametrize("layout", ["model", "other"])
def test_the_backward_hands_both_planned_kernels_one_readable_do_and_v(layout):
    """``backward`` with both passes planned (stand-ins recording what they receive): dO and V reach the dK/dV and
    the dQ kernel as the same tensors, in a layout ``rows_view`` reads without a copy. A model's ``[B, N, H, D]``
    memory is handed as it lies; another layout is copied once, here, not once per kernel."""
    from sage_lightning.kernels.backward import backward
    from sage_lightning.kernels.hopper.gluon_common import rows_view

    batch, heads, seq, dim, block = 2, 2, 64, 16, 32
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the preprocess launch: the interpreter on a CPU
    torch.manual_seed(0)

    def laid(x: torch.Tensor) -> torch.Tensor:
        if layout == "model":
            return x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, N, H, D] memory
        return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # [N, B, H, D] memory

    shape = (batch, heads, seq, dim)
    grad_out, v = laid(torch.randn(shape, device=device)), laid(torch.randn(shape, device=device))
    q_op = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    k_op = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    scales = torch.full((batch, heads, seq // block), 0.01, device=device)
    received: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def dkdv(grad_out, delta, codes_t, do_scale, q_op, q_op_t, q_scale, k_op, k_scale, v, lse, stats, **kw):
        received["dkdv"] = (grad_out, v)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def dq(grad_out, delta, q_op, q_scale, k_op, k_scale, v, lse, **kw):
        received["dq"] = (grad_out, v)
        return torch.zeros(shape, device=device)

    backward(
        grad_out, torch.randn(shape, device=device), q_op, scales, None, k_op, scales, v,
        torch.zeros(batch, heads, seq, device=device), None,
        is_causal=False, scale=0.25, block_m=block, block_n=block, qk="int8", dv="int8", dp="bf16", ds="int8",
        dkdv_kernel=dkdv, dq_kernel=dq,
    )  # fmt: skip
    for i, original in enumerate((grad_out, v)):
        handed, again = received["dkdv"][i], received["dq"][i]
        assert handed is again  # one tensor for both kernels: at most one copy
        assert torch.equal(handed, original)
        assert (handed.data_ptr() == original.data_ptr()) == (layout == "model")
        assert rows_view(handed)[0].data_ptr() == handed.data_ptr()  # each kernel's view copies nothing


@pytest.mark.skipif(not gluon_backward.HAVE_GLUON, reason="the helper is a Gluon constexpr function")
def test_warp_split_splits_the_kernels_own_wgmma_layouts_as_their_docstrings_say():
    """``gluon_common._warp_split`` on the layouts the kernels reduce: the two-warpgroup dK/dV tile [64 keys, 128
    queries] over warps [4, 2], whole and by columns; the D=64 dQ warpgroup's [128, 64] over 4 warps, whose rows 64-127
    are a second register repeat (a warp bit between two that are not)."""
    from sage_lightning.kernels.hopper.gluon_common import _warp_split

    assert _warp_split((64, 128), [[16, 0], [32, 0], [0, 64]], (0, 1)) == ((4, 16, 2, 64), (3, 1))
    assert _warp_split((64, 128), [[16, 0], [32, 0], [0, 64]], (1,)) == ((64, 2, 64), (2,))
    assert _warp_split((128, 64), [[16, 0], [32, 0]], (0, 1)) == ((2, 4, 16, 64), (3, 2, 0))


@pytest.mark.skipif(not gluon_backward.HAVE_GLUON, reason="the helper is a Gluon constexpr function")
@pytest.mark.parametrize("seed", range(12))
def test_warp_split_reduces_only_within_a_warp_and_keeps_every_warp_apart(seed):
    """``gluon_common._warp_split``, which ``_tile_amax`` and ``_row_max`` reshape a tile by: reducing the axes it
    returns merges only elements of one warp, and what is left holds each warp's (or, for the rows' variant, each
    row's and warp's) elements apart, for random tiles and warp bases."""
    import numpy as np
    from sage_lightning.kernels.hopper.gluon_common import _warp_split

    rng = np.random.default_rng(seed)
    bits = (int(rng.integers(3, 8)), int(rng.integers(3, 8)))
    shape = (2 ** bits[0], 2 ** bits[1])
    places = [(dim, bit) for dim in (0, 1) for bit in range(bits[dim])]
    chosen = [places[i] for i in rng.choice(len(places), size=int(rng.integers(1, 4)), replace=False)]
    bases = [[2**bit if d == dim else 0 for d in (0, 1)] for dim, bit in chosen] + [[0, 0]]  # one warp bit unused
    rows, cols = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    warp = sum(((rows if dim == 0 else cols) >> bit & 1) << i for i, (dim, bit) in enumerate(chosen))
    for dims in ((0, 1), (1,)):
        split, axes = _warp_split(shape, bases, dims)
        assert list(axes) == sorted(axes, reverse=True)
        key = warp if dims == (0, 1) else warp * shape[0] + rows  # the rows' variant keeps each row apart too
        grouped = np.moveaxis(key.reshape(split), list(axes), list(range(len(axes))))
        groups = grouped.reshape(int(np.prod([split[a] for a in axes])), -1)
        assert (groups == groups[:1]).all()  # one warp (and row) in each reduced group
        assert len(set(groups[0].tolist())) == groups.shape[1]  # and every kept index a different one
    with pytest.raises(ValueError, match="warp_bases"):
        _warp_split(shape, [[3, 0]], (0, 1))
