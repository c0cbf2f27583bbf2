"""The forward kernels alone, one tile configuration at a time: which candidates win, and by how much.

``benchmarks/speed.py`` times what a user calls (quantization, the autograd function, the kernels), so where a
forward is short its figure can be set by the host's launch work rather than the kernel. This script times the
kernels alone on quantized operands (random INT8 codes, no quantization, no autograd): the Hopper forward
(``kernels/hopper``) with each candidate of its autotuning list and a few more, then autotuned, and the portable
forward autotuned, at ``batch x seq = --tokens`` and ``heads = 2048 / head_dim``, causal and not.

Writes ``speed-<device>-<date>-forward-configs.json`` (format: ../shared/RESULTS.md, marked ``diagnostic``:
its rows are kernels, not what a user calls; ``impl`` names the kernel and configuration) and a ``.md`` table.

Example::

    python benchmarks/forward_configs.py --out-dir /tmp/configs
    python benchmarks/forward_configs.py --head-dim 128 --seq 2048 --seq 4096 --out-dir /tmp/configs
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import _commit, _versions, device_name, device_slug, to_json  # noqa: E402

#: Candidates tried beyond the autotuning list: (BLOCK_M, warps, stages).
EXTRA = ((128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 5), (128, 8, 5))


def operands(batch: int, heads: int, seq: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Random INT8 Q'^, K'^, V^ (V^ as ``[B, H, D, N]``) and plausible positive scales (Q per 128 rows, K and V
    per 64 keys)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8, generator=gen)

    def scales(blocks: int, low: float) -> torch.Tensor:
        return torch.rand(batch, heads, blocks, device="cuda", generator=gen) * low + low

    q, k, v = codes(batch, heads, seq, head_dim), codes(batch, heads, seq, head_dim), codes(batch, heads, head_dim, seq)
    return q, scales(seq // 128, 1e-3), k, scales(seq // 64, 1e-3), v, scales(seq // 64, 1e-2)


def measure(head_dim: int, seq: int, causal: bool, tokens: int) -> list[dict]:
    """One row per kernel and configuration at one shape (TFLOPS from ``do_bench``'s median)."""
    import triton
    from sage_lightning.kernels import forward as portable
    from sage_lightning.kernels.hopper import forward as hopper
    from triton.testing import do_bench

    batch, heads = tokens // seq, 2048 // head_dim
    q, q_scale, k, k_scale, v, v_scale = operands(batch, heads, seq, head_dim)
    tiles = {"out_dtype": torch.bfloat16, "is_causal": causal, "scale": head_dim**-0.5, "block_m": 128, "block_n": 64}
    flops = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    kernel = hopper._hopper_forward_kernel
    listed = list(kernel.configs)
    extra = [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=s, pre_hook=hopper._set_blocks) for m, w, s in EXTRA]

    def run_hopper() -> torch.Tensor:
        return hopper.hopper_forward(q, q_scale, None, k, k_scale, v, v_scale, **tiles)[0]

    def run_portable() -> torch.Tensor:
        return portable.forward(q, q_scale, None, k, k_scale, v, v_scale, **tiles, qk="int8", pv="int8")[0]

    timed: list[tuple[str, float, str | None]] = []
    try:
        for config in listed + extra:
            kernel.configs = [config]
            kernel.cache.clear()
            name = f"hopper BLOCK_M={config.kwargs['BLOCK_M']} warps={config.num_warps} stages={config.num_stages}"
            try:
                run_hopper()  # compiles it
            except triton.runtime.errors.OutOfResources as error:  # a candidate that does not fit: say so
                print(f"D={head_dim} N={seq} causal={causal} {name}: {error}")
                continue
            timed.append((name, do_bench(run_hopper, warmup=50, rep=200), None))
    finally:
        kernel.configs = listed
        kernel.cache.clear()
    run_hopper()
    chosen = next(iter(kernel.cache.values()))
    pick = f"BLOCK_M={chosen.kwargs['BLOCK_M']} warps={chosen.num_warps} stages={chosen.num_stages}"
    timed.append(("hopper autotuned", do_bench(run_hopper, warmup=50, rep=200), pick))
    run_portable()
    timed.append(("portable autotuned", do_bench(run_portable, warmup=50, rep=200), None))
    return [
        {"impl": name, "pass": "fwd", "batch": batch, "heads": heads, "kv_heads": heads, "seq": seq,
         "head_dim": head_dim, "causal": causal, "ms": ms, "tflops": flops / ms / 1e9, "autotuned_pick": pick}
        for name, ms, pick in timed
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq, fixed across seq lengths")
    parser.add_argument("--seq", type=int, action="append", help="repeatable; default 2048 4096")
    parser.add_argument("--head-dim", type=int, action="append", choices=(64, 128), help="repeatable; default both")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/forward_configs.py times CUDA kernels; no CUDA device is available.")
    rows = []
    for head_dim in args.head_dim or (128, 64):
        for seq in args.seq or (2048, 4096):
            for causal in (False, True):
                rows += measure(head_dim, seq, causal, args.tokens)
                print(f"D={head_dim} N={seq} causal={causal}: measured", flush=True)
    name, today = device_name("cuda"), datetime.date.today()
    result = {
        "kind": "speed",
        "diagnostic": True,
        "device": name,
        "date": today.isoformat(),
        "commit": _commit(),
        "command": shlex.join(["python", "benchmarks/forward_configs.py", *argv]),
        "versions": _versions(),
        "rows": rows,
    }
    out = args.out_dir / f"speed-{device_slug(name)}-{today:%Y%m%d}-forward-configs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_json(result))
    lines = ["| D | N | causal | kernel and configuration | TFLOPS |", "|---:|---:|:---:|---|---:|"]
    lines += [f"| {r['head_dim']} | {r['seq']} | {'yes' if r['causal'] else 'no'} | {r['impl']} | {r['tflops']:.0f} |"
              for r in rows]  # fmt: skip
    heading = f"# Forward kernels alone ({name}, commit {result['commit']})\n\n`{result['command']}`\n\n"
    out.with_suffix(".md").write_text(heading + "\n".join(lines) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
