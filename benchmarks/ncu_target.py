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

import torch


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
    from sage_lightning.kernels.ops import sage_attention_triton

    batch, heads = args.tokens // args.seq, 2048 // args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(
            batch, heads, args.seq, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(batch, heads, args.seq, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def call() -> None:
        out = sage_attention_triton(q, k, v, is_causal=args.causal, with_lse=False)[0]
        torch.autograd.grad(out, (q, k, v), grad)

    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward and backward: B={batch} H={heads} N={args.seq} D={args.head_dim} causal={args.causal}")


if __name__ == "__main__":
    main()
