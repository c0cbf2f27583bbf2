"""Which kernels serve a call, and why: the answer :func:`kernel_path` gives, and the one log line a GPU's first call
writes (:func:`announce`).

Nothing is decided here: :func:`.plan.plan_attention` chooses the kernels of a call, and this module reports its plan
in words. A user reads it in
``python -m sage_lightning`` and once per path in the log, so that no call runs a slower path than they expect
without a word (issue 38: an install that lost a module used to fall back to the reference silently).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .plan import REFERENCE, plan_attention
from .precision import AttentionPrecision

#: The logger of the path lines (``logging.getLogger("sage_lightning.kernels")``).
logger = logging.getLogger("sage_lightning.kernels")


@dataclasses.dataclass(frozen=True)
class KernelPath:
    """What serves one attention call: the backend and the kernel of each pass, and why.

    Attributes:
        backend: ``"hopper"`` (some pass runs a Hopper kernel), ``"triton"`` (the portable Triton kernels),
            ``"reference"`` (the PyTorch reference: right everywhere, many times slower on a GPU) or ``"sdpa"``
            (``mode="full"``: PyTorch's own attention).
        forward: the forward's kernel (``"hopper_forward"``, ``"triton_forward"``, ``"reference"``, ``"sdpa"``).
        dkdv: the kernel computing dK and dV (``"gluon_dkdv_wg"``, ``"gluon_dkdv"``, ``"triton_dkdv"``, ...).
        dq: the kernel computing dQ (``"gluon_dq_wg"``, ``"gluon_dq"``, ``"triton_dq"``, ...).
        reason: why this path, in a sentence.

    Example::

        path = kernel_path(q, k, is_causal=True)
        print(path.describe())   # "hopper: forward hopper_forward, dK/dV gluon_dkdv, dQ gluon_dq (...)"
    """

    backend: str
    forward: str
    dkdv: str
    dq: str
    reason: str

    @property
    def slow(self) -> bool:
        """Whether this is the PyTorch reference, the path that is many times slower on a GPU."""
        return self.backend == REFERENCE

    def describe(self) -> str:
        """One line: the backend, each pass's kernel and the reason."""
        if self.forward == self.dkdv == self.dq:
            kernels = f"every pass {self.forward}"
        else:
            kernels = f"forward {self.forward}, dK/dV {self.dkdv}, dQ {self.dq}"
        return f"{self.backend}: {kernels} ({self.reason})"


def kernel_path(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    precision: AttentionPrecision | None = None,
) -> KernelPath:
    """The kernels :func:`~sage_lightning.kernels.sage_attention` runs for a call with these arguments, and why.

    It reports the call's own plan (:func:`.plan.plan_attention`), so the answer is the call's; nothing runs on the
    GPU.

    Args:
        q: queries ``[B, Hq, N, D]`` (or a tensor of that shape, dtype and device).
        k: keys ``[B, Hkv, Nk, D]``.
        is_causal: as the call.
        precision: as the call; ``None`` is ``AttentionPrecision()``.

    Returns:
        A :class:`KernelPath`.

    Raises:
        UnsupportedAttention: what the call would refuse too: FP8 products on a GPU without FP8 tensor cores.
        ValueError: an unknown value of a kernel switch (``SAGE_LIGHTNING_HOPPER``, ...).

    Example::

        import torch
        from sage_lightning.kernels import kernel_path

        q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16, device="cuda")
        print(kernel_path(q, q, is_causal=True).describe())
    """
    plan = plan_attention(q, k, precision, is_causal=is_causal)
    return KernelPath(plan.backend, plan.forward, plan.dkdv, plan.dq, plan.reason)


#: The paths already written to the log, so that each is said once per process.
_ANNOUNCED: set[KernelPath] = set()


def announce(q: torch.Tensor, k: torch.Tensor, *, is_causal: bool, precision: AttentionPrecision) -> KernelPath:
    """Log the path of a CUDA call the first time this process takes it: ``INFO`` for the Triton kernels,
    ``WARNING`` where the slow reference serves a CUDA tensor or a Hopper GPU runs without its kernels.

    Args:
        q, k, is_causal, precision: as :func:`kernel_path`.

    Returns:
        The call's :class:`KernelPath`.

    Example::

        logging.basicConfig(level=logging.INFO)   # to see the INFO lines too
        out = sage_attention(q, k, v)             # logs "sage_attention on cuda:0 (...): hopper: ..."
    """
    path = kernel_path(q, k, is_causal=is_causal, precision=precision)
    if path not in _ANNOUNCED:
        _ANNOUNCED.add(path)
        name = torch.cuda.get_device_name(q.device) if q.is_cuda else q.device.type
        hopper_off = path.backend == "triton" and "Hopper kernels are off" in path.reason
        level = logging.WARNING if path.slow or hopper_off else logging.INFO
        logger.log(level, "sage_attention on %s (%s), %s: %s", q.device, name, precision.short_name, path.describe())
    return path
