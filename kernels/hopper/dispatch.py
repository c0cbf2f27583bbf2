"""Whether a call takes the Hopper path: the GPU, the Triton version it was verified on, the shapes it serves.

``SAGE_LIGHTNING_HOPPER`` overrides the choice: ``off`` keeps every call on the portable kernels (to compare the
two, or to step around a fault); ``force`` takes the Hopper path for every call whose shapes it serves, whatever
the device and the Triton version (the interpreter tests, ``benchmarks/sm90_compile.py``'s offline compiles);
the default, ``auto``, takes it only on a compute capability 9.0 GPU under a verified Triton.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .forward import HEAD_DIMS

#: Triton versions (major.minor) on which the Hopper path ran on the GPU and passed the verification record
#: (``benchmarks/gpu_verify.py``); elsewhere ``auto`` keeps the portable kernels.
VERIFIED_TRITON = ("3.6",)
#: The environment variable, and the values it takes.
ENV = "SAGE_LIGHTNING_HOPPER"
CHOICES = ("auto", "off", "force")


def env_choice(name: str, choices: tuple[str, ...], default: str = "auto") -> str:
    """The value of the environment variable ``name`` (``default`` when unset or blank), lower-cased; a value not in
    ``choices`` raises ``ValueError`` naming the variable, what works and what was received. Every kernel switch
    (``SAGE_LIGHTNING_HOPPER`` and the Gluon kernels') reads itself through this.

    Example::

        env_choice("SAGE_LIGHTNING_GLUON_DQ_WG", ("auto", "off"))   # "auto" when unset
    """
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; received {value!r}")
    return value


def choice() -> str:
    """The value of :data:`ENV` (``auto`` when unset); an unknown value raises ``ValueError`` naming it."""
    return env_choice(ENV, CHOICES)


#: The installed Triton's major.minor version.
TRITON_VERSION = ".".join(triton.__version__.split(".")[:2])


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # Read once per GPU: the query costs the host tens of microseconds, and each attention call asks up to three times.
    return torch.cuda.get_device_capability(index)


def verified_here(device: torch.device) -> bool:
    """Whether ``device`` is a compute capability 9.0 GPU and the installed Triton is one of :data:`VERIFIED_TRITON`."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0) and TRITON_VERSION in VERIFIED_TRITON


def hopper_forward_applies(
    q_op: torch.Tensor,
    k_op: torch.Tensor,
    *,
    qk: str,
    pv: str,
    scale: float,
    block_m: int,
    block_n: int,
) -> bool:
    """Whether :func:`.forward.hopper_forward` serves this forward.

    It serves INT8 ``QK`` with INT8 or FP8 ``PV`` (with or without Q-smoothing), head dims 64 and
    128, key counts that are multiples of 16 (the transposed V^'s rows must be 16-byte aligned for the copy
    engine), a positive scale, Q blocks of a multiple of 128 rows and key tiles of 64 or 128, on a compute
    capability 9.0 GPU under a verified Triton (:data:`VERIFIED_TRITON`), unless :data:`ENV` says otherwise.

    Args:
        q_op, k_op: the quantized Q'^ ``[B, Hq, N, D]`` and K'^ ``[B, Hkv, Nk, D]``.
        qk, pv, scale, block_m, block_n: the products' formats and the rest as :func:`..forward.forward`.

    Example::

        if hopper_forward_applies(q_op, k_op, qk="int8", pv="int8", scale=0.125, block_m=128, block_n=64):
            out, lse2 = hopper_forward(...)
    """
    setting = choice()
    if setting == "off" or (setting == "auto" and not verified_here(q_op.device)):
        return False
    return (
        qk == "int8"
        and pv in ("int8", "fp8")
        and q_op.shape[-1] in HEAD_DIMS
        and k_op.shape[2] % 16 == 0
        and scale > 0
        and block_m % 128 == 0
        and block_n in (64, 128)
    )
