"""Speed of SageBwd's Triton kernels against PyTorch's SDPA (flash and cuDNN backends), on one GPU.

After a check against the reference (``--no-check`` skips it), ``triton.testing.do_bench`` medians of forward,
backward and both per implementation (bf16, ``B x N = --tokens``, heads ``2048 / D``), TFLOPS, peak memory and our
ratio to each backend; ``--impl`` also takes :data:`FP8_IMPLS` and :data:`CUDNN_FP8`. Writes ``speed-*.json``, ``.md``.

Example::

    python -m benchmarks.kernels.speed                       # the full grid of issue #3
    python -m benchmarks.kernels.speed --seq 4096 --head-dim 128 --no-check
    python -m benchmarks.kernels.speed --impl sage --impl sage_fp8_pv --impl sage_fp8 --impl sdpa_cudnn
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.kernels.ops import sage_attention_triton
from sage_lightning.kernels.plan import HOPPER_ENV, refresh_settings
from sage_lightning.kernels.reference import sage_attention_reference
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.kernels.accuracy import compare
from benchmarks.kernels.profiling import kernel_ms
from benchmarks.result_file import default_path, device_name, header, write

BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
#: cuDNN's FP8 attention as the training baseline runs it (``benchmarks.training.cudnn_fp8``: the amaxes and casts of
#: delayed scaling in every call; head dim 128 on Hopper; needs ``nvidia-cudnn-frontend``).
CUDNN_FP8 = "sdpa_cudnn_fp8"
#: ``sage`` dispatches as a user's call does; ``sage_portable`` the portable kernels (``SAGE_LIGHTNING_HOPPER=off``
#: around the call). SageBwd with products in FP8 (e4m3), or dS in bf16, each dispatched as ``sage`` is.
FP8_IMPLS: dict[str, AttentionPrecision] = {
    "sage_fp8_pv": AttentionPrecision(pv="fp8"),
    "sage_fp8_ds": AttentionPrecision(ds="fp8"),
    "sage_bf16_ds": AttentionPrecision(ds="bf16"),
    "sage_fp8_pv_ds": AttentionPrecision(pv="fp8", ds="fp8"),
    "sage_fp8": AttentionPrecision.all_fp8(),
}
SAGE_IMPLS = ("sage", "sage_portable", *FP8_IMPLS)
#: The precision each SageBwd implementation runs.
PRECISIONS: dict[str, AttentionPrecision] = {"sage": AttentionPrecision(), "sage_portable": AttentionPrecision(),
                                             **FP8_IMPLS}  # fmt: skip
PASSES = ("fwd", "bwd", "fwd+bwd")


def flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool, which: str) -> float:
    """Matrix-product FLOPs of one pass (the convention of FlashAttention's benchmarks)."""
    forward = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[which] * forward


def check(device: str, impls: tuple[str, ...] = ("sage",)) -> list[dict]:
    """The Triton path against the reference at full sizes, a row per (implementation, shape, tensor) with ``rel_l2``
    and the ``precision`` both ran: agreement to rounding (a few flipped bf16 values or INT8 codes), far below the INT8
    error (~1e-2); looser for FP8 products, which sum in fp32 in an order of their own."""
    rows, seen = [], set()
    for impl in impls:
        precision = PRECISIONS[impl]
        if precision.short_name not in seen:
            seen.add(precision.short_name)
            rows += _check_precision(device, impl, precision)
    return rows


def _check_precision(device: str, impl: str, precision: AttentionPrecision) -> list[dict]:
    """:func:`check`'s rows of one precision (the same draws for every precision: the generator is seeded here)."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for seq in (1000, 1040, 4096, 8192):  # 1000: keys not a multiple of 16 (portable forward); 1040: ragged tiles
        for head_dim in (64, 128):
            for causal in (False, True):
                q = torch.randn(1, 4, seq, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
                k = torch.randn(1, 2, seq, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
                v = torch.randn(1, 2, seq, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
                do = torch.randn_like(q)
                got, ref = {}, {}
                for fn, into in ((sage_attention_triton, got), (sage_attention_reference, ref)):
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    stats = torch.zeros(2, device=device)
                    out, _ = fn(*leaves, is_causal=causal, precision=precision, stats=stats)
                    into.update(zip(("O", "dQ", "dK", "dV"), (out, *torch.autograd.grad(out, leaves, do)), strict=True))
                    into["ds_stats"] = stats
                for name in got:
                    rows.append(
                        {"impl": impl, "precision": precision.short_name, "seq": seq, "head_dim": head_dim,
                         "causal": causal, "kv_heads": 2, "heads": 4, "tensor": name,
                         "rel_l2": compare(got[name].detach(), ref[name].detach())[1]}
                    )  # fmt: skip
                del q, k, v, do, got, ref
                torch.cuda.empty_cache()
    return rows


def _attention(impl: str, **tiles: int) -> Callable[..., torch.Tensor]:
    """``attention(q, k, v, causal)`` of one implementation; ``tiles`` (``block_m``, ``block_n``) are sage's, unused
    by SDPA."""
    if impl == "sage" or impl in FP8_IMPLS:
        # sage keeps the default precision (no argument); an FP8 implementation passes its own.
        precision = {"precision": FP8_IMPLS[impl]} if impl in FP8_IMPLS else {}
        return lambda q, k, v, causal: sage_attention_triton(
            q, k, v, is_causal=causal, **precision, with_lse=False, **tiles
        )[0]
    if impl == CUDNN_FP8:
        from benchmarks.training.cudnn_fp8 import DelayedScaling, cudnn_fp8_attention

        scaling = DelayedScaling()  # one layer's amax history across the timed calls, as in training
        return lambda q, k, v, causal: cudnn_fp8_attention(q, k, v, scaling=scaling, is_causal=causal)
    if impl == "sage_portable":

        def portable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
            previous = os.environ.get(HOPPER_ENV)  # one variable set and restored: this runs inside the timing
            os.environ[HOPPER_ENV] = "off"
            refresh_settings()
            try:
                return sage_attention_triton(q, k, v, is_causal=causal, with_lse=False, **tiles)[0]
            finally:
                os.environ.pop(HOPPER_ENV) if previous is None else os.environ.update({HOPPER_ENV: previous})
                refresh_settings()

        return portable

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(BACKENDS[impl]):  # fewer key/value heads: as examples/llama.py calls it
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return sdpa


def pass_calls(
    impl: str, batch: int, heads: int, seq: int, head_dim: int, causal: bool, kv_heads: int | None = None
) -> dict[str, Callable]:
    """The three passes of one implementation on random bf16 CUDA inputs that need gradients, as callables:
    ``fwd``, ``bwd`` (the backward of one forward, its graph retained) and ``fwd+bwd``; ``kv_heads``: K's and V's
    heads (``heads`` when ``None``)."""
    attention = _attention(impl)
    q, k, v = (torch.randn(batch, h, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, kv_heads or heads, kv_heads or heads))  # fmt: skip
    do = torch.randn_like(q)

    def fwd() -> torch.Tensor:
        return attention(q, k, v, causal)

    def fwd_bwd() -> None:
        torch.autograd.grad(fwd(), (q, k, v), do)

    out = fwd()

    def bwd() -> None:
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def time_one(
    impl: str, batch: int, heads: int, seq: int, head_dim: int, causal: bool, kv_heads: int | None = None
) -> list[dict]:
    """Rows for the three passes of one implementation and shape (``ms`` median, ``tflops``, ``peak_mem_mb``)."""
    from triton.testing import do_bench

    passes = pass_calls(impl, batch, heads, seq, head_dim, causal, kv_heads)
    times = {which: do_bench(call, return_mode="median") for which, call in passes.items()}
    fwd_bwd, passes = passes["fwd+bwd"], None  # free the retained graph before measuring memory
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    return [
        {"impl": impl, "pass": which, "batch": batch, "heads": heads, "kv_heads": kv_heads or heads, "seq": seq,
         "head_dim": head_dim, "causal": causal, "ms": ms,
         "tflops": flops(batch, heads, seq, head_dim, causal, which) / ms / 1e9,
         "peak_mem_mb": peak_mb if which == "fwd+bwd" else None}
        for which, ms in times.items()
    ]  # fmt: skip


def heads_of(head_dim: int, heads: list[int] | None) -> tuple[int, int]:
    """Query and key/value heads of a timed shape: ``--heads``, else ``2048 / head_dim`` both."""
    return (heads[0], heads[1]) if heads else (2048 // head_dim,) * 2


def breakdown(
    seq: int, head_dim: int, causal: bool, tokens: int, heads: list[int] | None = None, iters: int = 10
) -> list[dict]:
    """Where SageBwd's forward+backward time goes: GPU time per kernel (torch.profiler), per iteration, at this
    benchmark's shape (``batch x seq = tokens``, :func:`heads_of`), after three warm-up calls (compile, autotune)."""
    from torch.profiler import ProfilerActivity, profile

    query_heads, kv_heads = heads_of(head_dim, heads)
    step = pass_calls("sage", tokens // seq, query_heads, seq, head_dim, causal, kv_heads)["fwd+bwd"]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    totals = kernel_ms(prof.key_averages(), iters)
    whole = sum(totals.values())
    return [
        {"kernel": name, "seq": seq, "head_dim": head_dim, "causal": causal, "ms": ms, "share": ms / whole}
        for name, ms in sorted(totals.items(), key=lambda item: -item[1])
    ]


def autotuned_configs() -> dict[str, str]:
    """The configuration autotuning chose for each kernel and key (warps, stages)."""
    from sage_lightning.kernels import backward, forward
    from sage_lightning.kernels.hopper import forward as hopper_forward

    chosen = {}
    for kernel in (forward._forward_kernel, hopper_forward._hopper_forward_kernel, backward._dkdv_kernel,
                   backward._dq_kernel):  # fmt: skip
        names = getattr(kernel, "keys", [])
        for key, config in getattr(kernel, "cache", {}).items():
            named = ", ".join(f"{name}={value}" for name, value in zip(names, key, strict=False))
            tiles = "".join(f"{name}={value} " for name, value in config.kwargs.items())
            chosen[f"{kernel.fn.__name__}[{named}]"] = f"{tiles}warps={config.num_warps} stages={config.num_stages}"
    return chosen


def table(rows: list[dict]) -> str:
    """Markdown: TFLOPS of each implementation and pass, our ratio to flash and cuDNN, peak memory (``nan`` or ``-``
    where not timed); then, where the run timed any of :data:`FP8_IMPLS`, :func:`fp8_table`."""
    text = sage_table(rows) if any(r["impl"] == "sage" for r in rows) else ""
    fp8 = fp8_table(rows)
    return "\n\n".join(part for part in (text, fp8) if part)


def _ratio(a: dict | None, b: dict | None) -> str:
    """``a``'s TFLOPS over ``b``'s (``b``'s time over ``a``'s), or ``-`` where either is missing."""
    return f"{a['tflops'] / b['tflops']:.2f}" if a and b and b["tflops"] else "-"


def fp8_table(rows: list[dict]) -> str:
    """Markdown: one row per (shape, pass, FP8 implementation) timed, with its TFLOPS, its ratio to flash, cuDNN and
    the INT8 ``sage`` of the same run, and its peak memory (forward+backward); empty when no FP8 implementation ran.
    """
    index = {(r["impl"], r["pass"], r["seq"], r["head_dim"], r["causal"]): r for r in rows}
    impls = [impl for impl in (*FP8_IMPLS, CUDNN_FP8) if any(r["impl"] == impl for r in rows)]
    if not impls:
        return ""
    legend = (f"{i}: `{PRECISIONS[i].short_name}`" if i in PRECISIONS else f"{i}: cuDNN's FP8" for i in impls)
    lines = [
        f"FP8 mixes ({'; '.join(legend)}):",
        "",
        "| D | N | causal | pass | impl | TFLOPS | /flash | /cuDNN | /sage (INT8) | mem MiB |",
        "|---:|---:|:---:|---|---|---:|---:|---:|---:|---:|",
    ]
    shapes = sorted({(r["head_dim"], r["seq"], r["causal"]) for r in rows if r["impl"] in impls})
    for head_dim, seq, causal in shapes:
        for which in PASSES:
            key = (which, seq, head_dim, causal)
            others = {impl: index.get((impl, *key)) for impl in ("sage", *BACKENDS)}
            for impl in impls:
                row = index.get((impl, *key))
                if row is None:
                    continue
                mem = row.get("peak_mem_mb")
                lines.append(
                    f"| {head_dim} | {seq} | {'yes' if causal else 'no'} | {which} | {impl} | {row['tflops']:.0f} | "
                    f"{_ratio(row, others['sdpa_flash'])} | {_ratio(row, others['sdpa_cudnn'])} | "
                    f"{_ratio(row, others['sage'])} | {'-' if mem is None else f'{mem:.0f}'} |"
                )
    return "\n".join(lines)


def sage_table(rows: list[dict]) -> str:
    """Markdown: ``sage``'s TFLOPS per shape and pass beside flash's and cuDNN's, the ratios, peak memory, and
    ``sage_portable``'s where the run timed it."""
    portable = any(r["impl"] == "sage_portable" for r in rows)
    lines = [
        "| D | N | causal | pass | sage TFLOPS | flash | cuDNN | sage/flash | sage/cuDNN | mem sage/flash/cuDNN MiB |"
        + (" portable TFLOPS | sage/portable |" if portable else ""),
        "|---:|---:|:---:|---|---:|---:|---:|---:|---:|---|" + ("---:|---:|" if portable else ""),
    ]
    index = {(r["impl"], r["pass"], r["seq"], r["head_dim"], r["causal"]): r for r in rows}
    shapes = sorted({(r["head_dim"], r["seq"], r["causal"]) for r in rows})
    for head_dim, seq, causal in shapes:
        for which in PASSES:
            got = {impl: index.get((impl, which, seq, head_dim, causal)) for impl in ("sage", *BACKENDS)}
            if got["sage"] is None:
                continue
            tf = {impl: (r["tflops"] if r else float("nan")) for impl, r in got.items()}
            mem = ""
            if which == "fwd+bwd":
                mem = " / ".join(f"{r['peak_mem_mb']:.0f}" if r else "-" for r in got.values())
            lines.append(
                f"| {head_dim} | {seq} | {'yes' if causal else 'no'} | {which} | {tf['sage']:.0f} | "
                f"{tf['sdpa_flash']:.0f} | {tf['sdpa_cudnn']:.0f} | {tf['sage'] / tf['sdpa_flash']:.2f} | "
                f"{tf['sage'] / tf['sdpa_cudnn']:.2f} | {mem} |"
            )
            if portable:
                ported = index.get(("sage_portable", which, seq, head_dim, causal))
                tp = ported["tflops"] if ported else float("nan")
                lines[-1] += f" {tp:.0f} | {tf['sage'] / tp:.2f} |"
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq, fixed across seq lengths")
    parser.add_argument("--seq", type=int, action="append", help="repeatable; default 1024 2048 4096 8192")
    parser.add_argument("--head-dim", type=int, action="append", help="repeatable; default 64 128")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--heads", type=int, nargs=2, metavar=("HQ", "HKV"), help="query and key/value heads "
                        "(default 2048 / D both); the breakdown then at the first --seq and --head-dim")  # fmt: skip
    parser.add_argument(
        "--impl", action="append", choices=(*SAGE_IMPLS, *BACKENDS, CUDNN_FP8),
        help="repeatable; default sage and the SDPA backends (sage_portable: the portable kernels on Hopper too; "
        "sage_fp8_pv, sage_fp8_ds, sage_fp8_pv_ds, sage_fp8: SageBwd with those products in FP8 e4m3, all of them "
        "for sage_fp8; sdpa_cudnn_fp8: cuDNN's FP8 attention as the training baseline runs it)",
    )  # fmt: skip
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels.speed times CUDA kernels; no CUDA device is available.")
    start = time.perf_counter()
    impls = tuple(args.impl or ("sage", *BACKENDS))
    checked = ("sage", *(impl for impl in impls if impl in FP8_IMPLS))
    check_rows = check("cuda", checked) if args.check else []
    for row in check_rows:
        print(f"check {row['impl']} N={row['seq']} D={row['head_dim']} causal={row['causal']} {row['tensor']}: "
              f"rel_l2 triton vs reference {row['rel_l2']:.2e}")  # fmt: skip
    rows = []
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for head_dim in args.head_dim or (64, 128):
        hq, hkv = heads_of(head_dim, args.heads)
        for seq in args.seq or (1024, 2048, 4096, 8192):
            for causal in causal_values:
                for impl in impls:
                    try:
                        rows += time_one(impl, args.tokens // seq, hq, seq, head_dim, causal, hkv)
                    except (RuntimeError, ValueError, ImportError) as error:  # a refused shape: say so, go on
                        print(f"{impl} D={head_dim} N={seq} causal={causal}: {str(error).splitlines()[0]}")
    seq, head_dim, causals = 4096, 128, (False, True)  # the breakdown's shape; with --heads, the first timed one
    if args.heads and args.seq and args.head_dim:
        seq, head_dim, causals = args.seq[0], args.head_dim[0], causal_values
    parts = [p for c in causals for p in breakdown(seq, head_dim, c, args.tokens, args.heads)] if args.breakdown else []
    tuned = autotuned_configs()
    name = device_name("cuda")
    out = args.out or default_path("speed", name)
    result = {**header("speed", name, __spec__.name, argv), "rows": rows, "check": check_rows}
    result.update(breakdown=parts, autotuned=tuned)
    write(result, out)
    text = table(rows)
    worst = {impl: max(r["rel_l2"] for r in check_rows if r["impl"] == impl) for impl in checked if check_rows}
    heading = (
        f"# Speed: SageBwd (Triton) vs SDPA flash and cuDNN\n\n{name}, {result['date']}, commit {result['commit']}"
        f"\n\n`{result['command']}`\n\nbf16, batch x seq = {args.tokens} tokens, heads (query/key-value) = "
        f"{'/'.join(map(str, args.heads)) if args.heads else '2048 / head_dim'}; "
        f"TFLOPS from the median time (`triton.testing.do_bench`). Peak memory: forward+backward above the "
        f"inputs. Correctness check first: worst rel_l2 of Triton vs reference over {len(check_rows)} tensors: "
        f"{', '.join(f'{impl} {value:.2e}' for impl, value in worst.items()) or 'nan'}.\n\n"
    )
    parts_text = "\n".join(
        f"| {p['head_dim']} | {p['seq']} | {'yes' if p['causal'] else 'no'} | `{p['kernel'][:60]}` | "
        f"{p['ms']:.3f} | {p['share']:.0%} |"
        for p in parts
    )
    if parts:
        text += (
            "\n\nWhere the time goes (forward+backward, GPU time per kernel and iteration):\n\n"
            "| D | N | causal | kernel | ms | share |\n|---:|---:|:---:|---|---:|---:|\n" + parts_text
        )
    text += "\n\nAutotuned: " + "; ".join(f"{k}: {v}" for k, v in tuned.items())
    out.with_suffix(".md").write_text(heading + text + "\n")
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
