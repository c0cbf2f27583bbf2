"""What will run here: ``python -m sage_lightning`` (or the ``sage-lightning`` command) prints one screen for a bug
report: versions, the device, which kernels each precision serves on it, and whether the installed kernels are the
files that passed GPU verification.

Example::

    from sage_lightning.report import environment_report

    print(environment_report())
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

#: The packages whose versions the report gives, in order.
PACKAGES = ("torch", "triton", "lightning", "transformers")
#: The call the kernel table describes: one batch of 16 heads, 4096 queries and keys, bf16, causal.
SHAPE = (1, 16, 4096)
HEAD_DIMS = (128, 64)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def precisions() -> list[tuple[str, object]]:
    """The precisions the report describes: the default, each rung of the controller's default ladder applied to it
    (what an escalation runs), and the named presets.

    Example::

        [name for name, _ in precisions()][:2]   # ['default (INT8)', 'rung smooth_q']
    """
    from sage_lightning.kernels import AttentionPrecision
    from sage_lightning.policy import DEFAULT_LADDER

    default = AttentionPrecision()
    rows: list[tuple[str, object]] = [("default (INT8)", default)]
    rows += [(f"rung {rung.name}", default.replace(**dict(rung.changes))) for rung in DEFAULT_LADDER]
    rows += [
        ("pv=fp8", default.replace(pv="fp8")),
        ("ds=fp8", default.replace(ds="fp8")),
        ("all_fp8()", AttentionPrecision.all_fp8()),
        ("attn_qat()", AttentionPrecision.attn_qat()),
    ]
    return rows


def _call(device: torch.device, head_dim: int) -> torch.Tensor:
    # The described call's q (and k): kernel_path reads shapes, dtype and device only, so one element, expanded.
    return torch.empty((1,), dtype=torch.bfloat16, device=device).expand(*SHAPE, head_dim)


def _device_lines() -> tuple[list[str], torch.device]:
    if not torch.cuda.is_available():
        return ["device     none with CUDA: every call runs the PyTorch reference (correct, slow)"], torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    count = torch.cuda.device_count()
    return [f"device     {device} {name}, compute capability {major}.{minor} ({count} visible)"], device


def _kernel_lines(device: torch.device) -> list[str]:
    from sage_lightning.kernels import kernel_path

    if device.type != "cuda":
        q = _call(device, HEAD_DIMS[0])
        reason = kernel_path(q, q).reason
        return [f"kernels    every precision runs the PyTorch reference here ({reason}); mode='full' runs SDPA"]
    return kernel_table(device)


def kernel_table(device: torch.device) -> list[str]:
    """The kernels of each of :func:`precisions` at one bf16 causal call per head dim on ``device``, with the reasons
    as numbered notes.

    Args:
        device: where the call would run (a CUDA device; a CPU device gives the reference, or the portable kernels
            under ``use_backend("triton")``).

    Example::

        print("\n".join(kernel_table(torch.device("cuda"))))
    """
    from sage_lightning.kernels import kernel_path

    lines = []
    reasons: dict[str, int] = {}
    for head_dim in HEAD_DIMS:
        q = _call(device, head_dim)
        lines.append(f"kernels    B={SHAPE[0]} H={SHAPE[1]} N={SHAPE[2]} D={head_dim}, bf16, causal:")
        lines.append(f"  {'precision':<16} {'forward':<16} {'dK/dV':<15} {'dQ':<13} why")
        for name, precision in precisions():
            try:
                path = kernel_path(q, q, is_causal=True, precision=precision)
            except ValueError as error:  # a precision this GPU cannot serve (FP8 before Ada), or a bad switch
                lines.append(f"  {name:<16} cannot run here: {error}")
                continue
            note = reasons.setdefault(path.reason, len(reasons) + 1)
            lines.append(f"  {name:<16} {path.forward:<16} {path.dkdv:<15} {path.dq:<13} [{note}]")
    lines += [f"  [{n}] {reason}" for reason, n in reasons.items()]
    return lines


def environment_report() -> str:
    """The report ``python -m sage_lightning`` prints.

    Returns:
        Lines of text: the package and where it is installed from, versions, the device, the kernels per precision
        at one bf16 causal call per head dim, and the GPU record's verdict on the installed kernel files.

    Example::

        from sage_lightning.report import environment_report

        print(environment_report())
    """
    import sage_lightning
    import sage_lightning.kernels as kernels
    from sage_lightning.gpu_record import verification_line

    where = Path(sage_lightning.__file__).parent
    versions = " · ".join(f"{name} {_version(name)}" for name in PACKAGES)
    cuda = torch.version.cuda or "none: torch is a CPU build"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
    lines = [
        f"sage-lightning {sage_lightning.__version__} from {where} (kernels from {Path(kernels.__file__).parent})",
        f"python     {platform.python_version()} on {platform.system()} {platform.machine()}",
        f"packages   {versions}",
        f"CUDA       {cuda} · cuDNN {cudnn}",
    ]
    device_lines, device = _device_lines()
    lines += device_lines
    lines += _kernel_lines(device)
    lines.append(f"verified   {verification_line()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print :func:`environment_report`.

    Args:
        argv: the arguments (``sys.argv[1:]`` when ``None``); only ``--help`` is taken.

    Example::

        python -m sage_lightning
    """
    parser = argparse.ArgumentParser(
        prog="python -m sage_lightning",
        description="Print what sage-lightning will run here (versions, device, kernels per precision, whether the "
        "installed kernels are the GPU-verified files); paste it into a bug report.",
    )
    parser.parse_args(argv)
    print(environment_report())
    return 0


if __name__ == "__main__":  # pragma: no cover - python -m sage_lightning.report
    sys.exit(main())
