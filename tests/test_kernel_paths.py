"""Which kernels serve a call (``sage_lightning.kernels.kernel_path``), the log line a CUDA call's first use writes,
and no silent slow path: a kernel module missing from an install is an error at import (issue 38)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sage_lightning.kernels import AttentionPrecision, KernelPath, kernel_path, paths, plan, use_backend

REPO = Path(__file__).resolve().parent.parent


def _qk(seq: int = 256, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(1, 2, seq, head_dim, dtype=dtype)


def test_cpu_calls_take_the_reference_and_say_why():
    q = _qk()
    path = kernel_path(q, q)
    assert (path.backend, path.forward, path.dkdv, path.dq) == ("reference",) * 4
    assert path.slow and "cpu tensors" in path.reason
    assert path.describe().startswith("reference: every pass reference (")


def test_full_mode_is_sdpa_and_attn_qat_the_portable_kernels():
    q = _qk()
    assert kernel_path(q, q, precision=AttentionPrecision(mode="full")).backend == "sdpa"
    with use_backend("triton"):
        path = kernel_path(q, q, precision=AttentionPrecision.attn_qat())
    assert (path.backend, path.forward, path.dkdv, path.dq) == ("triton", "triton_forward", "triton_dkdv", "triton_dq")
    assert "NVFP4" in path.reason


def test_the_portable_kernels_off_a_gpu_name_the_hopper_requirement():
    q = _qk()
    with use_backend("triton"):
        path = kernel_path(q, q, is_causal=True)
    assert path.backend == "triton" and not path.slow
    assert "compute capability 9.0" in path.reason


def test_the_path_follows_the_hopper_switch(kernel_switch):
    # ``force`` takes the Hopper forward for every call whose shapes it serves, whatever the device: the report must
    # say so, because the call would run it (both run plan.plan_attention's answer).
    q = _qk(seq=256, head_dim=128)
    kernel_switch(plan.HOPPER_ENV, "force")
    with use_backend("triton"):
        forced = kernel_path(q, q)
        odd_head = kernel_path(_qk(head_dim=96), _qk(head_dim=96))
    assert forced.forward == "hopper_forward" and forced.backend == "hopper"
    assert odd_head.forward == "triton_forward"  # head dims 64 and 128 only
    kernel_switch(plan.HOPPER_ENV, "off")
    with use_backend("triton"):
        assert kernel_path(q, q).forward == "triton_forward"
    kernel_switch(plan.HOPPER_ENV, "sometimes")
    with use_backend("triton"), pytest.raises(ValueError, match="SAGE_LIGHTNING_HOPPER must be one of"):
        kernel_path(q, q)


def test_large_heads_on_a_gpu_would_take_the_reference_and_say_so(monkeypatch):
    q = _qk(head_dim=256)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    path = kernel_path(q, q)
    assert path.slow and "head dim 256 is over the Triton kernels' 128" in path.reason


def test_announce_logs_each_path_once(caplog, monkeypatch):
    monkeypatch.setattr(paths, "_ANNOUNCED", set())
    q = _qk()
    with caplog.at_level(logging.INFO, logger="sage_lightning.kernels"):
        first = paths.announce(q, q, is_causal=False, precision=AttentionPrecision())
        paths.announce(q, q, is_causal=True, precision=AttentionPrecision())  # the same path: not said again
        with use_backend("triton"):
            paths.announce(q, q, is_causal=False, precision=AttentionPrecision())
    assert isinstance(first, KernelPath)
    records = [r for r in caplog.records if r.name == "sage_lightning.kernels"]
    assert len(records) == 2
    # The reference is the slow path: a warning; the Triton kernels are information.
    assert records[0].levelno == logging.WARNING and "reference: every pass reference" in records[0].getMessage()
    assert records[1].levelno == logging.INFO and "triton: forward triton_forward" in records[1].getMessage()


def _import_with_blocked(module: str) -> subprocess.CompletedProcess:
    # A module set to None in sys.modules cannot be imported: what a wheel that lost it does.
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "import torch, sage_lightning.kernels as k\n"
        "from sage_lightning.kernels import interface\n"
        "q = torch.randn(1, 1, 8, 16)\n"
        "print(k.sage_attention(q, q, q).shape[-1], repr(interface.TRITON_MISSING))\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO.parent, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["sage_lightning.kernels.hopper.gluon_dq", "sage_lightning.kernels.ops"])
def test_a_kernel_module_missing_from_the_install_is_an_error_naming_it(module):
    done = _import_with_blocked(module)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: sage_lightning.kernels: the Triton kernels failed to import"), last
    assert f"(module {module})" in last and "python -m sage_lightning" in last


def test_without_triton_every_call_takes_the_reference_deliberately():
    done = _import_with_blocked("triton")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "16" and "triton package is not installed" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_call_logs_its_path_once(caplog, monkeypatch):
    from sage_lightning.kernels import interface, sage_attention

    monkeypatch.setattr(paths, "_ANNOUNCED", set())
    interface._announce_once.cache_clear()
    q = torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="sage_lightning.kernels"):
        for _ in range(3):
            sage_attention(q, q, q, is_causal=True)
    records = [r for r in caplog.records if r.name == "sage_lightning.kernels"]
    assert len(records) == 1
    expected = kernel_path(q, q, is_causal=True)
    assert expected.describe() in records[0].getMessage()
    if torch.cuda.get_device_capability() == (9, 0) and plan.TRITON_VERSION in plan.VERIFIED_TRITON:
        assert expected.forward == "hopper_forward"
