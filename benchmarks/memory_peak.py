"""What is live at the peak of one attention forward and backward: the caching allocator's history replayed to its
highest point, each live block with the innermost frame of ours (or of the benchmark) that allocated it.

It found, before a724585, 66 MiB of zero gradients autograd allocated for the forward's non-differentiable
outputs (blocks with no Python frame: a second Q'^, K'^, their scales and lse), now spared
(``benchmarks/NOTES.md``, device run 12). On the GPU, from the repository root::

    python3 benchmarks/memory_peak.py --impl sage --impl sdpa_cudnn --head-dim 64 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _where(frames: list[dict]) -> str:
    """The innermost frame in this repository's code (the package, the kernels, the benchmarks), else the first."""
    for frame in frames:
        name = frame.get("filename", "")
        if "site-packages/torch" not in name and any(p in name for p in ("sage_lightning", "/kernels/", "benchmarks")):
            return f"{Path(name).name}:{frame.get('line')} {frame.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def live_at_peak(snapshot: dict) -> tuple[int, list[tuple[int, str]]]:
    """``(bytes, [(size, where), ...])`` of the allocations live at the highest point of ``snapshot``'s history
    (``torch.cuda.memory._snapshot()`` taken with the history recorded), largest first.

    Example::

        peak, blocks = live_at_peak(torch.cuda.memory._snapshot())
    """
    live: dict[int, tuple[int, str]] = {}
    current, best, best_live = 0, 0, {}
    for event in (e for trace in snapshot["device_traces"] for e in trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            current += event["size"]
            if current > best:
                best, best_live = current, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    return best, sorted(best_live.values(), key=lambda block: -block[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", action="append", choices=("sage", "sdpa_cudnn", "sdpa_flash"))
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens % args.seq:
        parser.error(f"--tokens must be a multiple of --seq; received {args.tokens} and {args.seq}")
    if not torch.cuda.is_available():
        print(
            "benchmarks/memory_peak.py reads the CUDA caching allocator; no CUDA device is available.", file=sys.stderr
        )
        return 1
    from speed import pass_calls

    for impl in args.impl or ["sage"]:
        for head_dim in args.head_dim:
            # speed.py's forward+backward on its inputs; its other passes (one holds a retained graph) are dropped.
            batch, heads = args.tokens // args.seq, 2048 // head_dim
            step = pass_calls(impl, batch, heads, args.seq, head_dim, args.causal)["fwd+bwd"]
            step()
            step()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=200000)
            step()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            traced, blocks = live_at_peak(snapshot)
            print(f"\n{impl} D={head_dim} N={args.seq}: peak above the inputs {peak:.1f} MiB; live at the traced peak "
                  f"{traced / 2**20:.1f} MiB:")  # fmt: skip
            for size, where in blocks:
                print(f"  {size / 2**20:8.2f} MiB  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
