"""What the Gluon kernels' test files share (``test_gluon_backward.py``, ``test_gluon_dq.py``).

* :func:`meta_plan`: the plan (:func:`sage_lightning.kernels.plan.plan_attention`) of SageBwd's default call on meta
  tensors, with a test's overrides of the shapes, dtype, formats and tiles;
* :func:`pretend_verified_hopper`: this machine as a verified Hopper with the Gluon API a kernel module is written for;
* :func:`hopper_grads`: dQ, dK and dV of SageBwd's Triton path on the GPU with one kernel switch set;
* :func:`count_calls`: which of the backward's Gluon kernels a call took, by name.
"""

from __future__ import annotations

import pytest
import torch
import triton
from sage_lightning.kernels import AttentionPrecision, plan
from sage_lightning.kernels.hopper import gluon_backward
from sage_lightning.kernels.ops import sage_attention_triton

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TRITON = ".".join(triton.__version__.split(".")[:2])
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon runs only on a Hopper GPU (not in the interpreter)")


def meta_plan(causal: bool, overrides: dict) -> plan.KernelPlan:
    """The plan of SageBwd's default call on the meta device (B=1, 8 heads, N=Nk=4096, D=128, bf16, 128 x 64 tiles),
    unless ``overrides`` names ``batch``, ``heads``, ``seq_q``, ``seq_k``, ``head_dim``, ``dtype``, ``block_m``,
    ``block_n``, a product's format (``qk``, ``dv``, ``dp``, ``ds``) or ``smooth_q``.

    Example::

        meta_plan(False, {"head_dim": 64}).dkdv   # "gluon_dkdv_wg" where the Gluon kernels are taken
    """
    shape = {"batch": 1, "heads": 8, "seq_q": 4096, "seq_k": 4096, "head_dim": 128}
    shape.update({name: overrides[name] for name in overrides if name in shape})
    b, h, n, nk, d = shape.values()
    dtype = overrides.get("dtype", torch.bfloat16)
    q = torch.zeros(b, h, n, d, dtype=dtype, device="meta")
    k = torch.zeros(b, h, nk, d, dtype=dtype, device="meta")
    formats = {name: overrides[name] for name in ("qk", "dv", "dp", "ds", "smooth_q") if name in overrides}
    tiles = {name: overrides.get(name, default) for name, default in (("block_m", 128), ("block_n", 64))}
    return plan.plan_attention(q, k, AttentionPrecision(**formats), is_causal=causal, **tiles, backend="triton")


def pretend_verified_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the plan see a verified Hopper with the Gluon API the kernels are written for, every switch unset."""
    monkeypatch.setattr(gluon_backward, "HAVE_GLUON", True)
    monkeypatch.setattr(gluon_backward, "GLUON_TRITON", (TRITON,))
    monkeypatch.setattr(plan, "verified_here", lambda device: True)
    for name in plan.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plan.refresh_settings()


def count_calls(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[str]:
    """Wrap each kernel of ``names`` as ``kernels.ops`` runs it; the returned list names each call's kernel.

    Example::

        calls = count_calls(monkeypatch, ("gluon_dq", "gluon_dq_wg"))
    """
    from sage_lightning.kernels import ops

    calls: list[str] = []
    for name in names:
        original = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw)
        )  # fmt: skip
    return calls


def hopper_grads(
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    setting: str,
    shape: tuple,
    with_stats: bool = False,
    precision: AttentionPrecision | None = None,
    attention: object = sage_attention_triton,
) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV (and the dS statistics when ``with_stats``) of ``sage_attention_triton`` on CUDA with the
    environment variable ``env`` at ``setting``; ``shape`` is ``(batch, hq, hkv, n, nk, d, causal)`` and seeds the
    inputs, so two settings see the same tensors. ``precision``: SageBwd's default unless given; ``attention``:
    the function run (``sage_attention_reference`` for the reference's gradients of the same inputs)."""
    batch, hq, hkv, n, nk, d, causal = shape
    monkeypatch.setenv(env, setting)
    plan.refresh_settings()
    gen = torch.Generator(device="cuda").manual_seed(n + nk + d + hq)
    q = torch.randn(batch, hq, n, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    k = torch.randn(batch, hkv, nk, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    v = torch.randn(batch, hkv, nk, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    do = torch.randn(batch, hq, n, d, device="cuda", generator=gen).bfloat16()
    stats = torch.zeros(2, device="cuda") if with_stats else None
    out, _ = attention(q, k, v, is_causal=causal, stats=stats, precision=precision)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return (*grads, stats) if with_stats else grads
