"""Which kernels serve an attention call: the one decision, made by :func:`plan_attention` (issue 42).

Everything else runs the plan it returns: :func:`~.interface.sage_attention` takes its backend, the Triton operators
(:mod:`.ops`) launch its forward, dK/dV and dQ kernels, :func:`~.paths.kernel_path` reports it, and the Lightning
layer falls back to SDPA on the :class:`UnsupportedAttention` it raises. The kernel modules describe what they
serve (head dims, tiles, size thresholds measured on the GPU); they choose nothing.

The kernel switches are environment variables, read once into :class:`KernelSettings` (:func:`settings`, cached).
A process that changes them after the first call (a test, a benchmark comparing two paths) calls
:func:`refresh_settings`. ``SAGE_LIGHTNING_HOPPER``: ``auto`` (default) takes the Hopper kernels on a compute
capability 9.0 GPU under a verified Triton only; ``off`` keeps every call on the portable kernels; ``force`` takes
them for every call whose shapes they serve, whatever the device and the Triton (the interpreter tests and the offline
sm_90 compiles). ``SAGE_LIGHTNING_GLUON_DKDV`` and ``SAGE_LIGHTNING_GLUON_DQ`` (``auto``, ``off``, ``force``) do the
same for the Gluon backward kernels, ``auto`` also asking for a call large enough to gain;
``SAGE_LIGHTNING_GLUON_DKDV_WG`` and ``SAGE_LIGHTNING_GLUON_DQ_WG`` (``auto``, ``off``) turn the
one-warpgroup-per-block variants off. ``SAGE_LIGHTNING_GLUON_FWD`` (``off``, the default until a GPU run has
compared it; ``auto``; ``force``) gives the forward of FP8 ``P V`` calls to the warp-specialised Gluon forward
(:mod:`.hopper.gluon_forward`), ``auto`` on a verified Hopper only.

A call being traced (``torch.compile``, or sizes that are symbolic) is planned only as far as the code before the plan
read while tracing: the backend (the device and the head dim against :data:`MAX_TRITON_HEAD_DIM`), the tiles and
the FP8 check. Its passes are named :data:`IN_OPERATOR`, and the SageBwd operators (:mod:`.ops`) plan them here
on their concrete tensors, opaque to the tracer: the size thresholds and divisibility rules add no shape guards (a
model compiled with dynamic shapes compiles once), the plan cache is not traced, and each call runs the kernels an
eager call of its shapes runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping

import torch

from .precision import AttentionPrecision
from .reference import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N

#: Why the Triton kernels are not used on this machine, when that is deliberate: Triton is a Linux dependency, and
#: without it every call takes the reference. Empty where Triton is installed (a Triton that is installed but fails to
#: import is an error, raised by :mod:`.interface`).
TRITON_MISSING = ""
try:
    import triton
except ModuleNotFoundError as error:
    if error.name != "triton":
        raise
    TRITON_MISSING = "the triton package is not installed (it is a Linux dependency): every call runs the reference"
    TRITON_VERSION = ""
else:
    #: The installed Triton's major.minor version ("" without Triton).
    TRITON_VERSION = ".".join(triton.__version__.split(".")[:2])

#: Triton versions (major.minor) on which the Hopper path ran on the GPU and passed the verification record
#: (``benchmarks.kernels.gpu_verify``); elsewhere ``auto`` keeps the portable kernels.
VERIFIED_TRITON = ("3.6",)
#: Largest head dim the Triton kernels take (tiles of ``BLOCK_M x D`` fp32 accumulators must fit in registers);
#: other head dims are padded to the next power of two inside the kernels.
MAX_TRITON_HEAD_DIM = 128
#: Query tile of Attn-QAT's launches. It changes no result (Q's NVFP4 scale is per head, and P's quantization rows
#: are per query within the key tile); 64 rather than SageBwd's 128 because the forward carries two fp32 output
#: accumulators (O and O_hp) and quantizes P in registers.
QAT_BLOCK_M = 64
#: The largest tile: an INT8 product sums over a tile, exact in fp32 up to 256 terms (``quant.MAX_PRODUCT_TERMS``).
MAX_TILE = 256
#: The oldest compute capability with FP8 (e4m3) tensor cores: Ada (8.9) and Hopper (9.0).
FP8_CAPABILITY = (8, 9)

#: Backends, as :class:`KernelPlan` names them.
SDPA, REFERENCE, TRITON, HOPPER = "sdpa", "reference", "triton", "hopper"
#: Kernel names of the passes.
TRITON_FORWARD, HOPPER_FORWARD, GLUON_FORWARD = "triton_forward", "hopper_forward", "gluon_forward"
TRITON_DKDV, GLUON_DKDV, GLUON_DKDV_WG = "triton_dkdv", "gluon_dkdv", "gluon_dkdv_wg"
TRITON_DQ, GLUON_DQ, GLUON_DQ_WG = "triton_dq", "gluon_dq", "gluon_dq_wg"
#: dS formats the Gluon dK/dV and dQ kernels take (every one of them), the other products in INT8.
GLUON_DS_FORMATS = ("int8", "fp8", "bf16")
#: The kernel name of a pass that a traced call leaves to the operator: it plans the pass on its concrete tensors.
IN_OPERATOR = "plan"

#: What :func:`set_backend` may force: ``"auto"`` (the Triton kernels for CUDA tensors whose head dim they take, the
#: reference otherwise), ``"triton"`` (any device Triton runs on, the CPU under ``TRITON_INTERPRET=1``) or
#: ``"reference"``.
BACKENDS = ("auto", "triton", "reference")
_backend = "auto"

#: The kernel switches: environment variable -> (:class:`KernelSettings` field, the values it takes).
SWITCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "SAGE_LIGHTNING_HOPPER": ("hopper", ("auto", "off", "force")),
    "SAGE_LIGHTNING_GLUON_DKDV": ("gluon_dkdv", ("auto", "off", "force")),
    "SAGE_LIGHTNING_GLUON_DKDV_WG": ("gluon_dkdv_wg", ("auto", "off")),
    "SAGE_LIGHTNING_GLUON_DQ": ("gluon_dq", ("auto", "off", "force")),
    "SAGE_LIGHTNING_GLUON_DQ_WG": ("gluon_dq_wg", ("auto", "off")),
    "SAGE_LIGHTNING_GLUON_FWD": ("gluon_fwd", ("off", "auto", "force")),
}
HOPPER_ENV, GLUON_DKDV_ENV, GLUON_DKDV_WG_ENV, GLUON_DQ_ENV, GLUON_DQ_WG_ENV, GLUON_FWD_ENV = SWITCHES
#: The value of a switch when it is unset or blank, where it is not ``"auto"``: the Gluon forward is opt-in until a
#: GPU run has compared it with the ``tl`` Hopper forward.
SWITCH_DEFAULTS = {"SAGE_LIGHTNING_GLUON_FWD": "off"}


class UnsupportedAttention(ValueError):
    """A call the kernels cannot serve: the message names the argument, the value received and what works.

    The Lightning layer routes such a call to ``scaled_dot_product_attention`` (:attr:`reason` is its fallback
    reason); any other error is a bug or a bad setting and propagates.

    Args:
        argument: the argument, as the caller names it (``"q"``, ``"k, v"``, ``"precision"``).
        received: what was received.
        works: what would work, as a predicate of the argument (``"must be 4-D ..."``).
        caller: the function named at the head of the message.

    Example::

        try:
            out = sage_attention(q, k, v)
        except UnsupportedAttention as error:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)   # error.reason says why
    """

    def __init__(self, argument: str, received: str, works: str, *, caller: str = "sage_attention") -> None:
        self.argument, self.received, self.works = argument, received, works
        self.reason = f"{argument} {works}; received {received}."
        super().__init__(f"{caller}: {self.reason}")


class UnsupportedAttentionType(UnsupportedAttention, TypeError):
    """:class:`UnsupportedAttention` for an argument of the wrong type (also a ``TypeError``, as Python's own)."""


def env_choice(
    name: str, choices: tuple[str, ...], environ: Mapping[str, str] | None = None, default: str = "auto"
) -> str:
    """The value of the environment variable ``name`` (``default`` when unset or blank), lower-cased.

    Args:
        name: the variable.
        choices: the values it takes.
        environ: where to read it (``os.environ`` when ``None``).
        default: the value when it is unset or blank.

    Raises:
        ValueError: a value not in ``choices``, naming the variable, what works and what was received.

    Example::

        env_choice("SAGE_LIGHTNING_GLUON_DQ_WG", ("auto", "off"))   # "auto" when unset
    """
    environ = os.environ if environ is None else environ
    value = environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; received {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The kernel switches (:data:`SWITCHES`), as read from the environment.

    Attributes:
        hopper, gluon_dkdv, gluon_dkdv_wg, gluon_dq, gluon_dq_wg, gluon_fwd: the values of
            ``SAGE_LIGHTNING_HOPPER``, ``SAGE_LIGHTNING_GLUON_DKDV``, ``..._DKDV_WG``, ``..._DQ``, ``..._DQ_WG`` and
            ``..._FWD`` (``"auto"`` when unset; :data:`SWITCH_DEFAULTS` for the Gluon forward, ``"off"``).

    Example::

        KernelSettings.from_environment({"SAGE_LIGHTNING_HOPPER": "off"}).hopper   # "off"
    """

    hopper: str = "auto"
    gluon_dkdv: str = "auto"
    gluon_dkdv_wg: str = "auto"
    gluon_dq: str = "auto"
    gluon_dq_wg: str = "auto"
    gluon_fwd: str = "off"

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings ``environ`` (``os.environ`` when ``None``) gives; an unknown value raises ``ValueError``."""
        return cls(**{
            field: env_choice(name, choices, environ, SWITCH_DEFAULTS.get(name, "auto"))
            for name, (field, choices) in SWITCHES.items()
        })  # fmt: skip


_settings: KernelSettings | None = None


def settings() -> KernelSettings:
    """The kernel switches, read from the environment on the first call and kept (:func:`refresh_settings` re-reads).

    Raises:
        ValueError: a switch set to a value it does not take (it is read again on the next call).

    Example::

        settings().hopper   # "auto" unless SAGE_LIGHTNING_HOPPER says otherwise
    """
    global _settings
    if _settings is None:
        _settings = KernelSettings.from_environment()
    return _settings


def refresh_settings() -> KernelSettings | None:
    """Read the kernel switches again, for a process that changed them after its first call (tests, benchmarks).

    Returns:
        The new settings, or ``None`` when a switch holds a value it does not take (the next plan raises).

    Example::

        os.environ["SAGE_LIGHTNING_HOPPER"] = "off"
        refresh_settings()
    """
    global _settings
    _settings = None
    _PLANS.clear()  # they were made under the old settings (and whatever a test patched)
    try:
        return settings()
    except ValueError:
        return None


def set_backend(backend: str) -> str:
    """Make every later plan take ``backend`` (one of :data:`BACKENDS`); returns the previous one.

    :class:`~.interface.use_backend` is the context manager users call.

    Example::

        previous = set_backend("reference")
    """
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"use_backend: backend must be one of {', '.join(BACKENDS)}; received {backend!r}.")
    if backend == TRITON and TRITON_MISSING:
        raise ValueError("use_backend: backend 'triton' needs the triton package, which is not installed.")
    previous, _backend = _backend, backend
    return previous


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # Read once per GPU: the query costs the host tens of microseconds.
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (read once per GPU), ``None`` for other devices.

    Example::

        device_capability(torch.device("cuda"))   # (9, 0) on an H100
    """
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def verified_here(device: torch.device) -> bool:
    """Whether ``device`` is a compute capability 9.0 GPU and the installed Triton is one of :data:`VERIFIED_TRITON`.

    Example::

        verified_here(torch.device("cpu"))   # False
    """
    return device_capability(device) == (9, 0) and TRITON_VERSION in VERIFIED_TRITON


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What runs one attention call: the backend, the kernel of each pass, the tiles, and why.

    Attributes:
        backend: ``"hopper"`` (some pass runs a Hopper kernel), ``"triton"`` (the portable Triton kernels),
            ``"reference"`` (the PyTorch reference) or ``"sdpa"`` (``mode="full"``).
        forward: ``"gluon_forward"``, ``"hopper_forward"``, ``"triton_forward"``, ``"reference"`` or ``"sdpa"``.
        dkdv: ``"gluon_dkdv_wg"``, ``"gluon_dkdv"``, ``"triton_dkdv"``, ``"reference"`` or ``"sdpa"``.
        dq: ``"gluon_dq_wg"``, ``"gluon_dq"``, ``"triton_dq"``, ``"reference"`` or ``"sdpa"``.
            A traced call's SageBwd plan names :data:`IN_OPERATOR` (``"plan"``) for the three passes, with backend
            ``"triton"``: the operators plan them on their concrete tensors (the module docstring).
        block_m, block_n: the query and key tiles of the Triton kernels (also SageBwd's quantization blocks).
        reason: why this backend, in a sentence.
        forward_reason, dkdv_reason, dq_reason: why each pass's kernel.

    Example::

        plan = plan_attention(q, k, is_causal=True)
        print(plan.backend, plan.forward, plan.dkdv, plan.dq, plan.reason)
    """

    backend: str
    forward: str
    dkdv: str
    dq: str
    block_m: int
    block_n: int
    reason: str
    forward_reason: str
    dkdv_reason: str
    dq_reason: str

    @property
    def triton(self) -> bool:
        """Whether the Triton operators run it (the portable kernels, with or without Hopper ones)."""
        return self.backend in (TRITON, HOPPER)


def _first_unmet(conditions: tuple[tuple[bool, str], ...]) -> str | None:
    return next((need for met, need in conditions if not met), None)


def _forward_kernel(q, k, formats, scale, block_m, block_n, switches) -> tuple[str, str]:  # noqa: ANN001
    kernel, reason = _tl_forward_kernel(q, k, formats, scale, block_m, block_n, switches)
    if switches.gluon_fwd == "off":
        return kernel, reason
    takes, why = _gluon_forward_takes(q, k, formats, scale, block_m, block_n, switches)
    return (GLUON_FORWARD, why) if takes else (kernel, f"{reason} ({why})")


def _gluon_forward_takes(q, k, formats, scale, block_m, block_n, switches) -> tuple[bool, str]:  # noqa: ANN001
    """Whether the warp-specialised Gluon forward (:mod:`.hopper.gluon_forward`) takes the call, and why: ``auto`` on
    a verified Hopper, ``force`` whatever the device, for the formats and shapes it serves."""
    from .hopper import gluon_backward, gluon_forward  # where the Gluon API's presence and version are known

    if not gluon_backward.HAVE_GLUON or TRITON_VERSION not in gluon_backward.GLUON_TRITON:
        return False, f"the Gluon forward needs Triton {', '.join(gluon_backward.GLUON_TRITON)}'s Gluon API"
    if switches.gluon_fwd == "auto":
        if switches.hopper == "off":
            return False, f"{HOPPER_ENV}=off"
        if not verified_here(q.device):
            return False, "not a verified Hopper (compute capability 9.0 under a verified Triton)"
    unmet = gluon_forward.gluon_forward_unmet(q.shape, k.shape, q.dtype, formats, scale, block_m, block_n)
    if unmet:
        return False, f"{GLUON_FORWARD} needs {unmet}"
    return True, f"{GLUON_FORWARD} (warp-specialised, FP8 P.V) serves these formats and shapes"


def _tl_forward_kernel(q, k, formats, scale, block_m, block_n, switches) -> tuple[str, str]:  # noqa: ANN001
    from .hopper.forward import HEAD_DIMS

    if switches.hopper == "off":
        return TRITON_FORWARD, f"{HOPPER_ENV}=off"
    if switches.hopper == "auto" and not verified_here(q.device):
        return TRITON_FORWARD, "not a verified Hopper (compute capability 9.0 under a verified Triton)"
    unmet = _first_unmet((
        (formats["qk"] in ("int8", "fp8"), "INT8 or FP8 qk"),
        (formats["pv"] in ("int8", "fp8"), "INT8 or FP8 pv"),
        (q.shape[-1] in HEAD_DIMS, f"head dim in {HEAD_DIMS}"),
        (k.shape[2] % 16 == 0, "a key count that is a multiple of 16"),
        (scale > 0, "a positive scale"),
        (block_m % 128 == 0, "block_m a multiple of 128"),
        (block_n in (64, 128), "block_n 64 or 128"),
    ))  # fmt: skip
    if unmet:
        return TRITON_FORWARD, f"the Hopper forward needs {unmet}"
    return HOPPER_FORWARD, "the Hopper forward serves these formats and shapes"


def _gluon_pass(q, k, formats, is_causal, block_m, block_n, module, name, switches, products, extra=()):  # noqa: ANN001
    """Whether a Gluon backward pass (``module``: :mod:`.hopper.gluon_backward` or :mod:`.hopper.gluon_dq`) takes
    the call, and why (the rule is the same for both; each module's constants say what it serves; ``extra``: more
    ``(met, need)`` conditions of one pass)."""
    from .hopper import gluon_backward  # where the Gluon API's presence and version are known

    choice = getattr(switches, name)
    if not gluon_backward.HAVE_GLUON or TRITON_VERSION not in gluon_backward.GLUON_TRITON:
        return False, f"the Gluon kernels need Triton {', '.join(gluon_backward.GLUON_TRITON)}'s Gluon API"
    if choice == "off":
        return False, f"{name} switched off"
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    if choice == "auto":
        if switches.hopper == "off":
            return False, f"{HOPPER_ENV}=off"
        if not verified_here(q.device):
            return False, "not a verified Hopper (compute capability 9.0 under a verified Triton)"
        scores = batch * heads * seq_q * seq_k // (2 if is_causal else 1)
        if scores < module.AUTO_MIN_SCORES.get(head_dim, math.inf):
            return False, f"{scores} scores, below the size where {name} was measured faster"
    unmet = _first_unmet((
        (all(formats[p] == "int8" for p in products), f"INT8 {', '.join(products)}"),
        (formats["dp"] == "bf16", "bf16 dp"),
        (not formats["smooth_q"], "no Q-smoothing"),
        (q.dtype == torch.bfloat16, "bf16 inputs"),
        (head_dim in module.HEAD_DIMS, f"head dim in {module.HEAD_DIMS}"),
        (block_m == module.BLOCK_M and block_n == module.BLOCK_N, f"{module.BLOCK_M} x {module.BLOCK_N} tiles"),
        (seq_q % module.BLOCK_M == 0 and seq_k % module.BLOCK_N == 0,
         f"query and key counts multiples of {module.BLOCK_M} and {module.BLOCK_N}"),
        *extra,
    ))  # fmt: skip
    if unmet:
        return False, f"{name} needs {unmet}"
    return True, f"{name} serves these formats and shapes"


def _backward_kernels(q, k, formats, is_causal, block_m, block_n, switches) -> tuple[str, str, str, str]:  # noqa: ANN001
    from .hopper import gluon_backward, gluon_dq

    head_dim, seq_q, seq_k = q.shape[3], q.shape[2], k.shape[2]
    # dS in INT8, or in FP8 or bf16 (the product in bf16 against Q'^ and K'^'s codes widened: issue 42): every
    # Gluon kernel takes all three.
    ds_takes = (formats["ds"] in GLUON_DS_FORMATS, f"ds in {', '.join(GLUON_DS_FORMATS)}")
    takes, dkdv_reason = _gluon_pass(
        q, k, formats, is_causal, block_m, block_n, gluon_backward, GLUON_DKDV, switches, ("qk", "dv"), (ds_takes,)
    )
    dkdv = TRITON_DKDV
    if takes:
        dkdv = GLUON_DKDV
        if switches.gluon_dkdv_wg == "auto" and gluon_backward.gluon_dkdv_wg_serves(head_dim, seq_k):
            dkdv, dkdv_reason = GLUON_DKDV_WG, f"{dkdv_reason}; one warpgroup per 64 keys at this head dim"
    nonempty = ((seq_q > 0 and seq_k > 0, "at least one query and one key"), ds_takes)
    takes, dq_reason = _gluon_pass(
        q, k, formats, is_causal, block_m, block_n, gluon_dq, GLUON_DQ, switches, ("qk",), nonempty
    )
    dq = TRITON_DQ
    if takes:
        dq = GLUON_DQ
        if switches.gluon_dq_wg == "auto" and gluon_dq.gluon_dq_wg_serves(head_dim):
            dq, dq_reason = GLUON_DQ_WG, f"{dq_reason}; one warpgroup per 128 queries at this head dim"
    return dkdv, dkdv_reason, dq, dq_reason


def _reference_reason(q: torch.Tensor) -> str:
    if TRITON_MISSING:
        return TRITON_MISSING
    if _backend == REFERENCE:
        return "use_backend('reference') is in force"
    if not q.is_cuda:
        return f"{q.device.type} tensors run the reference: the Triton kernels are for CUDA tensors"
    return (
        f"head dim {q.shape[-1]} is over the Triton kernels' {MAX_TRITON_HEAD_DIM}; the reference serves it, "
        "many times slower (route such layers to scaled_dot_product_attention)"
    )


def _triton_reason(q: torch.Tensor, hopper: bool, switches: KernelSettings) -> str:
    """Why the Hopper kernels do or do not serve a Triton call (the machine's and the environment's part)."""
    capability = device_capability(q.device)
    if hopper:
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else q.device.type
        return f"{where}, Triton {TRITON_VERSION} (verified: {', '.join(VERIFIED_TRITON)})"
    if capability is None:
        return f"{q.device.type} tensors: the Hopper kernels run on compute capability 9.0 GPUs only"
    if switches.hopper == "off":
        return f"{HOPPER_ENV}=off"
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]}: the Hopper kernels are for 9.0 (H100, H200)"
    if TRITON_VERSION not in VERIFIED_TRITON:
        return (
            f"the Hopper kernels are off under Triton {TRITON_VERSION}: they were verified on the GPU under "
            f"Triton {', '.join(VERIFIED_TRITON)} only ({HOPPER_ENV}=force takes them anyway)"
        )
    return "this call's formats or shapes are not among the Hopper kernels' (or it is below their size threshold)"


def _check_tile(name: str, tile: object) -> None:
    if not (isinstance(tile, int) and 16 <= tile <= MAX_TILE and tile & (tile - 1) == 0):
        raise UnsupportedAttention(
            name, repr(tile),
            f"must be a power of two from 16 to {MAX_TILE} (an INT8 product sums over a tile, exact in fp32 up to "
            "that)",
            caller="sage_attention_triton",
        )  # fmt: skip


def check_fp8_device(q: torch.Tensor, precision: AttentionPrecision) -> None:
    """Refuse FP8 products on a GPU without FP8 tensor cores, naming the products and what works.

    Raises:
        UnsupportedAttention: an FP8 product on a CUDA device below compute capability :data:`FP8_CAPABILITY`.

    Example::

        check_fp8_device(q, AttentionPrecision(pv="fp8"))   # raises on an A100
    """
    capability = device_capability(q.device) if precision.fp8_products else None
    if capability is not None and capability < FP8_CAPABILITY:
        fields = ", ".join(f"{name}='fp8'" for name in precision.fp8_products)
        raise UnsupportedAttention(
            "precision",
            f"{fields} on {q.device}, compute capability {capability[0]}.{capability[1]}",
            f"needs FP8 tensor cores for {fields} (compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or "
            "newer: Ada, Hopper); use 'int8' or 'bf16' for those products on this GPU",
        )


def plan_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    precision: AttentionPrecision | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    backend: str | None = None,
) -> KernelPlan:
    """The kernels that serve an attention call with these arguments, and why: the only place they are chosen.

    Only shapes, dtypes, the device and the settings are read (a tensor of one element, expanded, will do); nothing
    runs on the GPU. The arguments are trusted as :func:`~.interface.check_inputs` left them. A call being traced
    (``torch.compile``, symbolic sizes) leaves its SageBwd kernels to the operators (:data:`IN_OPERATOR`).

    Args:
        q: queries ``[B, Hq, N, D]``.
        k: keys ``[B, Hkv, Nk, D]``.
        precision: the call's; ``None`` is ``AttentionPrecision()``.
        is_causal, scale: as :func:`~.interface.sage_attention`'s.
        block_m, block_n: the Triton kernels' tiles; ``None`` is 128 (64 for Attn-QAT) and 64.
        backend: ``"triton"`` to plan the Triton kernels whatever the device (what ``sage_attention_triton`` runs);
            ``None`` follows :func:`set_backend` (``"auto"``: Triton for CUDA tensors whose head dim it takes).

    Returns:
        A :class:`KernelPlan`.

    Raises:
        UnsupportedAttention: what the kernels cannot serve: FP8 products on a GPU without FP8 tensor cores, a tile
            that is not a power of two from 16 to 256.
        ValueError: a kernel switch set to a value it does not take (``SAGE_LIGHTNING_HOPPER=fast``).

    Example::

        import torch
        from sage_lightning.kernels.plan import plan_attention

        q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16, device="cuda")
        plan = plan_attention(q, q, is_causal=True)
        print(plan.backend, plan.forward, plan.dkdv, plan.dq)   # hopper hopper_forward gluon_dkdv gluon_dq (H100)
    """
    precision = AttentionPrecision() if precision is None else precision
    shapes = (*q.shape, *k.shape)
    if torch.compiler.is_compiling() or not all(type(size) is int for size in shapes):
        # Traced: no cache (the tracer would guard on its contents), and no kernel chosen by size (module docstring).
        return _plan(q, k, precision, is_causal, scale, block_m, block_n, backend, traced=True)
    key = (shapes, q.dtype, q.device, precision, is_causal, scale, block_m, block_n, backend, _backend, settings())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(q, k, precision, is_causal, scale, block_m, block_n, backend)
    return plan


#: Plans made, by everything they read (the same call's plan costs a dict lookup, not tens of microseconds of
#: reasons); a refusal is not kept, so it is raised again on every call.
_PLANS: dict[tuple, KernelPlan] = {}
_PLANS_KEPT = 1024


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    precision: AttentionPrecision,
    is_causal: bool,
    scale: float | None,
    block_m: int | None,
    block_n: int | None,
    backend: str | None,
    traced: bool = False,
) -> KernelPlan:
    qat = precision.mode == "attn_qat"
    block_m = (QAT_BLOCK_M if qat else DEFAULT_BLOCK_M) if block_m is None else block_m
    block_n = DEFAULT_BLOCK_N if block_n is None else block_n
    if precision.mode == "full":
        why = "mode='full': torch.nn.functional.scaled_dot_product_attention"
        return KernelPlan(SDPA, SDPA, SDPA, SDPA, block_m, block_n, why, why, why, why)
    backend = _backend if backend is None else backend
    auto_reference = backend == "auto" and not (q.is_cuda and q.shape[-1] <= MAX_TRITON_HEAD_DIM)
    if TRITON_MISSING or backend == REFERENCE or auto_reference:
        why = _reference_reason(q)
        return KernelPlan(REFERENCE, REFERENCE, REFERENCE, REFERENCE, block_m, block_n, why, why, why, why)
    _check_tile("block_m", block_m)
    _check_tile("block_n", block_n)
    check_fp8_device(q, precision)
    switches = None if traced else settings()  # read (and refused when bad) where the kernels are chosen
    if qat:
        why = "Attn-QAT (simulated NVFP4) runs the portable Triton kernels"
        return KernelPlan(TRITON, TRITON_FORWARD, TRITON_DKDV, TRITON_DQ, block_m, block_n, why, why, why, why)
    if traced:
        why = "a traced call: the operators plan its kernels on their concrete tensors"
        return KernelPlan(TRITON, IN_OPERATOR, IN_OPERATOR, IN_OPERATOR, block_m, block_n, why, why, why, why)
    formats = {**precision.formats, "smooth_q": precision.smooth_q}
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    forward, forward_reason = _forward_kernel(q, k, formats, tau, block_m, block_n, switches)
    dkdv, dkdv_reason, dq, dq_reason = _backward_kernels(q, k, formats, is_causal, block_m, block_n, switches)
    hopper = (forward, dkdv, dq) != (TRITON_FORWARD, TRITON_DKDV, TRITON_DQ)
    return KernelPlan(
        HOPPER if hopper else TRITON, forward, dkdv, dq, block_m, block_n,
        _triton_reason(q, hopper, switches), forward_reason, dkdv_reason, dq_reason,
    )  # fmt: skip
