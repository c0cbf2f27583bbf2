"""The Gluon dK/dV kernels for Hopper (``kernels/hopper/gluon_backward.py``, and at D=64 ``gluon_dkdv_wg.py``): the
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
from sage_lightning.kernels.hopper import gluon_dkdv_wg as wg


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
        {"ds": "fp8"},
        {"dv": "bf16"},
        {"ds": "bf16"},
        {"qk": "bf16"},
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
        wg.gluon_dkdv_wg(x, x, x, x, x, x, x, x, x, x, x, None, is_causal=False, scale=0.1)


def _count_gluon_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Both Gluon dK/dV kernels as ``ops`` runs them (:func:`gluon_support.count_calls`), ``wg`` at auto."""
    monkeypatch.delenv(plan.GLUON_DKDV_WG_ENV, raising=False)
    plan.refresh_settings()
    return count_calls(monkeypatch, ("gluon_dkdv", "gluon_dkdv_wg"))


def _grads(monkeypatch, setting: str, *shape) -> tuple[torch.Tensor, ...]:
    return hopper_grads(monkeypatch, plan.GLUON_DKDV_ENV, setting, shape, with_stats=True)


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
    expected = "gluon_dkdv_wg" if wg.gluon_dkdv_wg_serves(d, nk) else "gluon_dkdv"
    assert calls == [expected], f"the backward took {calls}, not {expected}"
    calls.clear()
    want = _grads(monkeypatch, "off", *shape)
    assert not calls
    for name, a, b in zip(("dQ", "dK", "dV"), got, want, strict=False):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max |diff|"
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)  # the dS statistics (summed atomically)


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
