"""One SageBwd forward and backward for Nsight Compute to profile (``benchmarks/ncu_kernels.sh`` runs it).

The kernels are autotuned first, outside the profiled range (``--warmup`` calls, with the profiler off), then one
forward and backward run between ``cudaProfilerStart`` and ``cudaProfilerStop``, so ``ncu --profile-from-start off``
sees exactly the kernels of one training call at the speed benchmark's shape (``batch x seq = --tokens``, ``heads
= 2048 / head_dim``, bf16).

Example::

    ncu --profile-from-start off --kernel-name regex:_dkdv_kernel python benchmarks/ncu_target.py --seq 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (autotuning)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.tokens % args.seq:
        parser.error(f"--tokens must be a multiple of --seq; received {args.tokens} and {args.seq}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ncu_target.py runs the CUDA kernels for ncu; no CUDA device is available.")
    from speed import training_call

    call = training_call(args.seq, args.head_dim, args.causal, args.tokens, warmup=args.warmup)
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    shape = f"{args.tokens} tokens, N={args.seq}, D={args.head_dim}, causal={args.causal}"
    print(f"profiled one forward and backward: {shape}")


if __name__ == "__main__":
    main()
