"""Which kernels serve a call, and why: the answer :func:`kernel_path` gives, and the one log line a GPU's first call
writes (:func:`announce`).

Nothing is decided here. The choices stay where they are made and run (``interface._uses_triton``,
:func:`.ops.forward_kernel`, :func:`.backward.backward_kernels`); this module asks them about a call, with stand-in
tensors of the call's shapes, dtype and device, and puts the answer in words. A user reads it in
``python -m sage_lightning`` and once per path in the log, so that no call runs a slower path than they expect
without a word (issue 38: an install that lost a module used to fall back to the reference silently).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import interface
from .precision import AttentionPrecision
from .reference import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N

#: The logger of the path lines (``logging.getLogger("sage_lightning.kernels")``).
logger = logging.getLogger("sage_lightning.kernels")

#: The kernel names of the paths that are not Triton kernels.
REFERENCE, SDPA = "reference", "sdpa"


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


def _standin(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The choices read shapes, dtypes and the device only: one element, expanded, costs no memory.
    return torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(shape)


def _reference_reason(q: torch.Tensor) -> str:
    if interface.sage_attention_triton is None:
        return interface.TRITON_MISSING or "the Triton kernels are not installed"
    if interface._BACKEND == "reference":
        return "use_backend('reference') is in force"
    if not q.is_cuda:
        return f"{q.device.type} tensors run the reference: the Triton kernels are for CUDA tensors"
    return (
        f"head dim {q.shape[-1]} is over the Triton kernels' {interface.MAX_TRITON_HEAD_DIM}; the reference serves it, "
        "many times slower (route such layers to scaled_dot_product_attention)"
    )


def _hopper_reason(q: torch.Tensor, names: tuple[str, str, str]) -> str:
    """Why the Hopper kernels do or do not serve a CUDA call (the machine's and the environment's part)."""
    from .hopper import dispatch

    capability = None
    if q.is_cuda:
        capability = dispatch._capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    setting = dispatch.choice()
    if any(not name.startswith("triton_") for name in names):
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else q.device.type
        return f"{where}, Triton {dispatch.TRITON_VERSION} (verified: {', '.join(dispatch.VERIFIED_TRITON)})"
    if capability is None:
        return f"{q.device.type} tensors: the Hopper kernels run on compute capability 9.0 GPUs only"
    if setting == "off":
        return f"{dispatch.ENV}=off"
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]}: the Hopper kernels are for 9.0 (H100, H200)"
    if dispatch.TRITON_VERSION not in dispatch.VERIFIED_TRITON:
        return (
            f"the Hopper kernels are off under Triton {dispatch.TRITON_VERSION}: they were verified on the GPU under "
            f"Triton {', '.join(dispatch.VERIFIED_TRITON)} only ({dispatch.ENV}=force takes them anyway)"
        )
    return "this call's formats or shapes are not among the Hopper kernels' (or it is below their size threshold)"


def kernel_path(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    precision: AttentionPrecision | None = None,
) -> KernelPath:
    """The kernels :func:`~sage_lightning.kernels.sage_attention` runs for a call with these arguments, and why.

    It asks the same functions the call does, so the answer is the call's; nothing runs on the GPU.

    Args:
        q: queries ``[B, Hq, N, D]`` (or a tensor of that shape, dtype and device).
        k: keys ``[B, Hkv, Nk, D]``.
        is_causal: as the call.
        precision: as the call; ``None`` is ``AttentionPrecision()``.

    Returns:
        A :class:`KernelPath`.

    Raises:
        ValueError: what the call would refuse too: FP8 products on a GPU without FP8 tensor cores, an unknown
            value of a kernel switch (``SAGE_LIGHTNING_HOPPER``, ...).

    Example::

        import torch
        from sage_lightning.kernels import kernel_path

        q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16, device="cuda")
        print(kernel_path(q, q, is_causal=True).describe())
    """
    precision = AttentionPrecision() if precision is None else precision
    if precision.mode == "full":
        return KernelPath(SDPA, SDPA, SDPA, SDPA, "mode='full': torch.nn.functional.scaled_dot_product_attention")
    if not interface._uses_triton(q):
        return KernelPath(REFERENCE, REFERENCE, REFERENCE, REFERENCE, _reference_reason(q))
    interface._check_fp8_device(q, precision)  # FP8 before Ada is refused, as the call refuses it
    from .backward import backward_kernels
    from .ops import forward_kernel
    from .quant import CODE_DTYPES

    if precision.mode == "attn_qat":
        names = ("triton_forward", "triton_dkdv", "triton_dq")
        return KernelPath("triton", *names, "Attn-QAT (simulated NVFP4) runs the portable Triton kernels")
    formats = precision.formats
    op_dtype = CODE_DTYPES.get(formats["qk"], q.dtype)
    q_op, k_op = _standin(q.shape, op_dtype, q.device), _standin(k.shape, op_dtype, q.device)
    scale = q.shape[-1] ** -0.5
    tiles = {"block_m": DEFAULT_BLOCK_M, "block_n": DEFAULT_BLOCK_N}
    forward = forward_kernel(q_op, k_op, qk=formats["qk"], pv=formats["pv"], scale=scale, **tiles)
    q_mean = _standin((1,), torch.float32, q.device) if precision.smooth_q else None
    grad_out = _standin(q.shape, q.dtype, q.device)
    dkdv, dq = backward_kernels(
        grad_out, q_op, q_mean, k_op, is_causal=is_causal, qk=formats["qk"], dv=formats["dv"], dp=formats["dp"],
        ds=formats["ds"], **tiles,
    )  # fmt: skip
    names = (forward, dkdv, dq)
    backend = "triton" if all(name.startswith("triton_") for name in names) else "hopper"
    return KernelPath(backend, *names, _hopper_reason(q, names))


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
