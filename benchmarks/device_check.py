"""What the GPU checks of the Gluon kernels share (``benchmarks/gluon_*_check.py``): a watchdog for hangs, the
comparison of two outputs, the host's time per call and one row of a crossover sweep.

Example::

    dog = Watchdog(90.0)
    dog.set("gluon B=1 N=256")  # a step running past 90 s ends the process with exit code 3
    print(compare(got, want)["bitwise_equal"], rel_l2(got, reference))
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections.abc import Callable
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


def check_parser(description: str) -> argparse.ArgumentParser:
    """The options every GPU check takes: ``--out`` (JSON), ``--hang-s`` (the :class:`Watchdog`'s limit) and
    ``--quick`` (the small shapes only); a check adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--hang-s", type=float, default=90.0, help="a step running longer is a hang (exit 3)")
    parser.add_argument(
        "--quick", action="store_true", help="the small shapes (run against the reference) only, no timing"
    )
    return parser


def header() -> dict:
    """The versions and the device, which every check's JSON starts with (printed once at its start too)."""
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}


def banner() -> str:
    """:func:`header` as the first line a check prints."""
    h = header()
    return f"torch {h['torch']}, triton {h['triton']}, {h['device']}"


def finish(out: Path | None, record: dict, failures: list[str], errors: int) -> int:
    """Write ``record`` (with the versions, the device, the failures and the error count) to ``out`` as JSON,
    print each failure, and return the exit code: 2 on compile or launch errors, 1 on mismatches, else 0."""
    if out:
        out.write_text(json.dumps({**header(), **record, "failures": failures, "errors": errors}, indent=1))
    for failure in failures:
        print("MISMATCH", failure)
    if errors:
        print(f"{errors} compile/launch errors")
        return 2
    return 1 if failures else 0


def host_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Host milliseconds per call of ``fn`` (launches queued, not waited for): above the GPU's time, the call is
    bound by the host and ``do_bench`` measures the host.

    Example::

        host_ms(lambda: torch.mm(a, b))   # about 0.01 on an idle host
    """
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return host


def crossover_row(
    shape: tuple[int, int, int, int],
    causal: bool,
    fns: dict[str, Callable[[], object]],
    before: Callable[[str], None] | None = None,
) -> dict:
    """One row of a crossover sweep: ``do_bench``'s milliseconds and the host's milliseconds per call of each of
    ``fns`` (``before(name)`` runs first, e.g. to set the environment variable that picks a kernel), printed on one
    line with the whole backward's speedup (``fns`` has ``bwd_off`` and ``bwd_force``).

    Args:
        shape: batch, heads, queries = keys, head dim.
        causal: whether the calls are causal (the scores are halved).
        fns: name to call, timed in order.
        before: called with each name before its call is timed.
    """
    import triton

    batch, heads, seq, head_dim = shape
    ms, host = {}, {}
    for name, fn in fns.items():
        if before is not None:
            before(name)
        fn()
        ms[name] = triton.testing.do_bench(fn)
        host[name] = host_ms(fn)
    scores = batch * heads * seq * seq // (2 if causal else 1)
    row = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
           "scores_log2": round(math.log2(scores), 2), "ms": ms, "host_ms": host}  # fmt: skip
    print(f"CROSS B={batch} H={heads} N={seq} D={head_dim} causal={causal:d} 2^{row['scores_log2']:<5} "
          + " ".join(f"{n} {ms[n]:.3f} (host {host[n]:.3f})" for n in fns)
          + f" bwd speedup {ms['bwd_off'] / ms['bwd_force']:.2f}x", flush=True)  # fmt: skip
    return row
