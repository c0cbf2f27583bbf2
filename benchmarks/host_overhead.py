"""Is SageBwd's attention call bound by the host? GPU time against host time per call, forward and backward.

On a CUDA GPU, at ``speed.py``'s shapes (bf16, ``batch x seq = --tokens``, ``heads = 2048 / head_dim``), for the
forward (inputs that need gradients, as in training) and the backward of one ``sage_attention_triton`` call:

- ``bench_ms``: ``triton.testing.do_bench``'s median, what ``speed.py`` reports;
- ``gpu_ms``: the sum of the kernels' device time per call (``torch.profiler``);
- ``host_ms``: the host's milliseconds per call with 20 launches queued and not waited for. Where it is above
  ``gpu_ms`` the call is bound by the host, and ``bench_ms`` measures Python, not the kernels.

Then ``cProfile``'s top functions (cumulative time) of 50 forward and 50 backward calls at ``--profile-seq``, causal:
where the host's time goes. Writes ``--out`` (JSON) and prints a table::

    python3 benchmarks/host_overhead.py --out $OUT/host-overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from device_check import host_ms  # noqa: E402
from profiling import kernel_ms  # noqa: E402
from speed import pass_calls  # noqa: E402


def gpu_ms(fn, calls: int = 10) -> float:
    """Device milliseconds per call of ``fn``: the kernels' self time in a ``torch.profiler`` profile."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(kernel_ms(prof.key_averages(), calls).values())


def calls(seq: int, head_dim: int, causal: bool, tokens: int) -> dict:
    """The forward and the backward of one SageBwd call at ``speed.py``'s shape, warmed (compiled, tuned)."""
    passes = pass_calls("sage", tokens // seq, 2048 // head_dim, seq, head_dim, causal)
    for _ in range(3):
        passes["fwd"]()
        passes["bwd"]()
    torch.cuda.synchronize()
    return {"fwd": passes["fwd"], "bwd": passes["bwd"]}


def top_functions(fn, calls: int = 50, lines: int = 25) -> str:
    """``cProfile``'s top ``lines`` functions by cumulative time over ``calls`` calls of ``fn``."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--profile-seq", type=int, default=4096)
    args = parser.parse_args(argv)
    rows = []
    print("| D | N | causal | pass | bench ms | gpu ms | host ms | host/gpu |")
    print("|---:|---:|:---:|---|---:|---:|---:|---:|")
    for head_dim in args.head_dim:
        for seq in args.seq:
            for causal in (False, True):
                fns = calls(seq, head_dim, causal, args.tokens)
                for name, fn in fns.items():
                    row = {"head_dim": head_dim, "seq": seq, "causal": causal, "pass": name,
                           "bench_ms": do_bench(fn, return_mode="median"), "gpu_ms": gpu_ms(fn),
                           "host_ms": host_ms(fn)}  # fmt: skip
                    rows.append(row)
                    print(f"| {head_dim} | {seq} | {causal:d} | {name} | {row['bench_ms']:.3f} | {row['gpu_ms']:.3f} "
                          f"| {row['host_ms']:.3f} | {row['host_ms'] / row['gpu_ms']:.2f} |", flush=True)  # fmt: skip
                fns = None
                torch.cuda.empty_cache()
    fns = calls(args.profile_seq, 128, True, args.tokens)
    profiles = {name: top_functions(fn) for name, fn in fns.items()}
    for name, text in profiles.items():
        print(f"\ncProfile, {name}, N={args.profile_seq} D=128 causal, 50 calls:\n{text}")
    if args.out:
        record = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows,
                  "profiles": profiles}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
