"""What the GPU checks of the Gluon kernels share (``benchmarks/gluon_*_check.py``): a watchdog for hangs and the
comparison of two outputs.

Example::

    dog = Watchdog(90.0)
    dog.set("gluon B=1 N=256")  # a step running past 90 s ends the process with exit code 3
    print(compare(got, want)["bitwise_equal"], rel_l2(got, reference))
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch


class Watchdog:
    """Ends the process (exit 3) when a step runs past ``seconds``: a hung kernel cannot be interrupted.

    Args:
        seconds: the longest a step (between two :meth:`set` calls) may take; an empty step name is never timed.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds, self.step, self.started = seconds, "", time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def set(self, step: str) -> None:
        """Start timing ``step`` (``""``: stop timing)."""
        self.step, self.started = step, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self.step and time.monotonic() - self.started > self.seconds:
                print(f"HANG: {self.step!r} ran past {self.seconds:.0f} s; exiting", flush=True)
                os._exit(3)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """``a`` against ``b`` (same shape and dtype): max |diff|, relative L2, cosine, the fraction of bitwise-equal
    values (2- or 4-byte dtypes) and whether ``a`` is finite."""
    a32, b32 = a.float(), b.float()
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return {
        "max_abs": (a32 - b32).abs().max().item(),
        "rel_l2": ((a32 - b32).norm() / b32.norm().clamp_min(1e-30)).item(),
        "cosine": torch.nn.functional.cosine_similarity(a32.flatten(), b32.flatten(), dim=0).item(),
        "bitwise_equal": (a.view(view) == b.view(view)).float().mean().item(),
        "finite": bool(torch.isfinite(a32).all().item()),
    }


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``ref``, in float64."""
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def finish(out: Path | None, record: dict, failures: list[str], errors: int) -> int:
    """Write ``record`` (with the versions, the device, the failures and the error count) to ``out`` as JSON,
    print each failure, and return the exit code: 2 on compile or launch errors, 1 on mismatches, else 0."""
    import triton

    if out:
        header = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
        out.write_text(json.dumps({**header, **record, "failures": failures, "errors": errors}, indent=1))
    for failure in failures:
        print("MISMATCH", failure)
    if errors:
        print(f"{errors} compile/launch errors")
        return 2
    return 1 if failures else 0
