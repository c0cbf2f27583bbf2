"""What the Gluon kernels' test files share (``test_gluon_backward.py``, ``test_gluon_dq.py``).

* :func:`meta_backward`: the operands a dispatch rule (``gluon_*_applies``) reads, as meta tensors of SageBwd's
  default backward, with a test's overrides of the shapes, dtype and Q-mean;
* :func:`pretend_verified_hopper`: this machine as a verified Hopper with the Gluon API a kernel module is written for;
* :func:`hopper_grads`: dQ, dK and dV of SageBwd's Triton path on the GPU with one kernel switch set;
* :func:`count_calls`: which of the backward's Gluon kernels a call took, by name.
"""

from __future__ import annotations

import pytest
import torch
import triton
from sage_lightning.kernels.hopper import dispatch
from sage_lightning.kernels.ops import sage_attention_triton

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TRITON = ".".join(triton.__version__.split(".")[:2])
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon runs only on a Hopper GPU (not in the interpreter)")


def meta_backward(overrides: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(grad_out, q_op, q_mean, k_op)`` on the meta device: B=1, 8 heads, N=Nk=4096, D=128, bf16, no Q-mean,
    unless ``overrides`` names ``batch``, ``heads``, ``seq_q``, ``seq_k``, ``head_dim``, ``dtype`` or ``q_mean``;
    those keys are popped, so what stays in ``overrides`` is for the rule itself (formats, tiles).

    Example::

        grad_out, q_op, q_mean, k_op = meta_backward({"head_dim": 64})
    """
    shape = {"batch": 1, "heads": 8, "seq_q": 4096, "seq_k": 4096, "head_dim": 128}
    shape.update({name: overrides.pop(name) for name in list(overrides) if name in shape})
    dtype = overrides.pop("dtype", torch.bfloat16)
    q_mean = overrides.pop("q_mean", None)
    b, h, n, nk, d = shape.values()
    q_op = torch.zeros(b, h, n, d, dtype=torch.int8, device="meta")
    k_op = torch.zeros(b, h, nk, d, dtype=torch.int8, device="meta")
    grad_out = torch.zeros(b, h, n, d, dtype=dtype, device="meta")
    return grad_out, q_op, q_mean, k_op


def pretend_verified_hopper(monkeypatch: pytest.MonkeyPatch, module: object) -> None:
    """Make ``module`` (a Gluon kernel module with ``HAVE_GLUON``, ``GLUON_TRITON`` and ``ENV``) see a verified
    Hopper with its Gluon API, both switches unset."""
    monkeypatch.setattr(module, "HAVE_GLUON", True)
    monkeypatch.setattr(module, "GLUON_TRITON", (TRITON,))
    monkeypatch.setattr(dispatch, "verified_here", lambda device: True)
    monkeypatch.delenv(module.ENV, raising=False)
    monkeypatch.delenv(dispatch.ENV, raising=False)


def count_calls(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[str]:
    """Wrap each kernel of ``names`` as ``kernels.backward`` calls it; the returned list names each call's kernel.

    Example::

        calls = count_calls(monkeypatch, ("gluon_dq", "gluon_dq_wg"))
    """
    from sage_lightning.kernels import backward

    calls: list[str] = []
    for name in names:
        original = getattr(backward, name)
        monkeypatch.setattr(
            backward, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw)
        )  # fmt: skip
    return calls


def hopper_grads(
    monkeypatch: pytest.MonkeyPatch, env: str, setting: str, shape: tuple, with_stats: bool = False
) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV (and the dS statistics when ``with_stats``) of ``sage_attention_triton`` on CUDA with the
    environment variable ``env`` at ``setting``; ``shape`` is ``(batch, hq, hkv, n, nk, d, causal)`` and seeds the
    inputs, so two settings see the same tensors."""
    batch, hq, hkv, n, nk, d, causal = shape
    monkeypatch.setenv(env, setting)
    gen = torch.Generator(device="cuda").manual_seed(n + nk + d + hq)
    q = torch.randn(batch, hq, n, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    k = torch.randn(batch, hkv, nk, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    v = torch.randn(batch, hkv, nk, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    do = torch.randn(batch, hq, n, d, device="cuda", generator=gen).bfloat16()
    stats = torch.zeros(2, device="cuda") if with_stats else None
    out, _ = sage_attention_triton(q, k, v, is_causal=causal, stats=stats)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return (*grads, stats) if with_stats else grads
