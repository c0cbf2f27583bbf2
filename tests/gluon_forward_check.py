"""Device check of the warp-specialised Gluon forward with FP8 P.V (``kernels/hopper/gluon_forward.py``, issue 42):
first its O and logsumexp against the ``tl`` Hopper forward's (``PV_FMT="fp8"``) on the same operands (bit for bit
or not, per case) and against the reference, then the forward kernels' speed (``triton.testing.do_bench`` median) beside
SDPA cuDNN's bf16 forward, on quantized operands made once (the kernels alone, as device run 13's probe)::

    python -m tests.gluon_forward_check --out /tmp/gluon-forward-fp8.json

Exit 0: every case within the gates; 1: a mismatch; 2: a compile or launch error; 3: a hang (the barrier protocol;
a watchdog ends the process). ``--quick`` checks only; ``--variant`` picks the Gluon variants timed; ``--profile
VARIANT`` only launches the kernels once each for Nsight Compute (``benchmarks/pending/ncu_forward.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.kernels.hopper import gluon_forward as gf
from sage_lightning.kernels.hopper.forward import hopper_forward
from sage_lightning.kernels.quant import NO_BAD_KEY, finite_mean, quantize_channels_fp8, quantize_rows
from sage_lightning.kernels.reference import sage_attention_reference
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Gluon variants: keyword arguments of :func:`gf.gluon_forward`.
VARIANTS = {
    "default": {},
    "pp-smem": {"consumers": 2, "pingpong": True},
    "free-smem": {"consumers": 2, "pingpong": False},
    "pp-regs": {"consumers": 2, "pingpong": True, "p_in_regs": True},
    "pp-smem-st2": {"consumers": 2, "pingpong": True, "stages": 2},
    "3wg-pp-smem": {"consumers": 3, "pingpong": True},
    "3wg-free-smem": {"consumers": 3, "pingpong": False},
}
#: Correctness cases (batch, hq, hkv, n, nk, d): GQA, ragged counts, one key tile, a 64-row half of padding.
CHECK_CASES = [
    (2, 4, 2, 512, 512, 128), (1, 2, 1, 192, 176, 128), (2, 4, 4, 1024, 1024, 64), (1, 3, 3, 160, 64, 64),
    (1, 8, 8, 2048, 2048, 128),
]  # fmt: skip
#: Timed cases (d, n): 16K tokens per batch, 2048 / d heads, as benchmarks/NOTES.md's tables.
TIMED = [(128, 2048), (128, 4096), (128, 8192), (64, 4096), (64, 2048)]
#: Per-case watchdog: a kernel that waits on an mbarrier forever never returns.
HANG_SECONDS = 120


def _watchdog(label: str) -> threading.Timer:
    def fire() -> None:
        print(f"HANG: {label} did not finish in {HANG_SECONDS} s (barrier protocol)", flush=True)
        os._exit(3)

    timer = threading.Timer(HANG_SECONDS, fire)
    timer.daemon = True
    timer.start()
    return timer


def _inputs(batch: int, hq: int, hkv: int, n: int, nk: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed + n + nk + d + hq)
    q = torch.randn(batch, hq, n, d, device="cuda", generator=gen).bfloat16()
    k = (torch.randn(batch, hkv, nk, d, device="cuda", generator=gen) + 0.5).bfloat16()
    v = torch.randn(batch, hkv, nk, d, device="cuda", generator=gen).bfloat16()
    return q, k, v


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, causal: bool) -> tuple[tuple, dict]:
    """The forward's operands as ``ops._sagebwd_forward`` makes them (confined, K-smoothed), and the keyword arguments
    both forwards take with them (FP8 P.V, 128 x 64 tiles, the poison buffers)."""
    row_poison = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    first_bad = torch.full((k.shape[0] * k.shape[1],), NO_BAD_KEY, dtype=torch.int32, device="cuda")
    q_op, q_scale, _ = quantize_rows(q, 128, fmt=qk, confine=True, row_poison=row_poison)
    k_op, k_scale, _ = quantize_rows(k, 64, fmt=qk, mean=finite_mean(k), confine=True, first_bad=first_bad)
    v_op, v_scale = quantize_channels_fp8(v, confine=True, first_bad=first_bad)
    kw = dict(out_dtype=torch.bfloat16, is_causal=causal, scale=q.shape[-1] ** -0.5, block_m=128, block_n=64, qk=qk,
              pv="fp8", row_poison=row_poison, first_bad=first_bad)  # fmt: skip
    return (q_op, q_scale, None, k_op, k_scale, v_op, v_scale), kw


def _timed_inputs(d: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V of a timed case: 16K tokens (``16384 / n`` sequences), ``2048 / d`` heads, as benchmarks/NOTES.md's."""
    return _inputs(16384 // n, 2048 // d, 2048 // d, n, n, d)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(variants: list[str]) -> tuple[list[dict], int]:
    """Every case x causal x qk x variant: Gluon against tl (bits, rel_l2, lse) and both against the reference."""
    rows, status = [], 0
    for batch, hq, hkv, n, nk, d in CHECK_CASES:
        q, k, v = _inputs(batch, hq, hkv, n, nk, d)
        for causal in (False, True):
            for qk in ("int8", "fp8"):
                operands, kw = _operands(q, k, v, qk, causal)
                precision = AttentionPrecision(qk=qk, pv="fp8")
                try:
                    tl_out, tl_lse = hopper_forward(*operands, **kw)
                    ref_out, ref_lse = sage_attention_reference(q, k, v, is_causal=causal, precision=precision)
                except Exception:  # noqa: BLE001 - reported; the case is skipped
                    traceback.print_exc()
                    status = max(status, 2)
                    continue
                for variant in variants:
                    label = f"B={batch} H={hq}/{hkv} N={n} Nk={nk} D={d} causal={int(causal)} qk={qk} {variant}"
                    timer = _watchdog(label)
                    try:
                        out, lse = gf.gluon_forward(*operands, **kw, **VARIANTS[variant])
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001 - reported, the other cases go on
                        traceback.print_exc()
                        status = max(status, 2)
                        continue
                    finally:
                        timer.cancel()
                    row = {
                        "case": label, "bits_o": bool(torch.equal(out, tl_out)),
                        "bits_lse": bool(torch.equal(lse, tl_lse)),
                        "o_differs": (out != tl_out).float().mean().item(), "rel_l2_tl": rel_l2(out, tl_out),
                        "lse_max_diff": (lse - tl_lse).abs().max().item(), "err_ref": rel_l2(out, ref_out),
                        "tl_err_ref": rel_l2(tl_out, ref_out), "lse_err_ref": rel_l2(lse, ref_lse),
                    }  # fmt: skip
                    ok = row["rel_l2_tl"] <= 1e-3 and row["lse_max_diff"] <= 1e-5 and row["err_ref"] < 1e-2
                    ok = ok and row["err_ref"] <= 1.05 * row["tl_err_ref"] + 1e-6 and torch.isfinite(out).all().item()
                    row["ok"] = bool(ok)
                    status = max(status, 0 if ok else 1)
                    rows.append(row)
                    print(f"{'ok ' if ok else 'BAD'} {label:<58} bits O/lse {int(row['bits_o'])}/"
                          f"{int(row['bits_lse'])} differ {row['o_differs']:.2e} rel_l2(tl) {row['rel_l2_tl']:.1e} "
                          f"lse {row['lse_max_diff']:.1e} err {row['err_ref']:.4f} (tl {row['tl_err_ref']:.4f})",
                          flush=True)  # fmt: skip
    return rows, status


def _tflops(ms: float, batch: int, heads: int, n: int, d: int, causal: bool) -> float:
    return 4 * batch * heads * n * n * d / (2 if causal else 1) / (ms * 1e-3) / 1e12


def timings(variants: list[str]) -> list[dict]:
    """TFLOPS of the tl FP8 forward, the Gluon variants and cuDNN (bf16), kernels alone on the same operands."""
    rows = []
    for d, n in TIMED:
        q, k, v = _timed_inputs(d, n)
        batch, heads = q.shape[:2]
        for causal in (False, True):
            for qk in ("int8", "fp8"):
                operands, kw = _operands(q, k, v, qk, causal)
                runs = {"tl": lambda: hopper_forward(*operands, **kw)}  # noqa: B023 - called in this iteration
                for variant in variants:
                    runs[variant] = lambda v_=variant: gf.gluon_forward(*operands, **kw, **VARIANTS[v_])  # noqa: B023
                if qk == "int8":

                    def cudnn() -> torch.Tensor:
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: B023

                    runs["cudnn"] = cudnn
                row = {"d": d, "n": n, "batch": batch, "heads": heads, "causal": causal, "qk": qk}
                for name, run in runs.items():
                    timer = _watchdog(f"timing {name} D={d} N={n}")
                    best = min(triton.testing.do_bench(run, warmup=50, rep=300) for _ in range(3))  # interleaving
                    timer.cancel()
                    row[name] = round(_tflops(best, batch, heads, n, d, causal), 1)
                gluon = max(row[v_] for v_ in variants)
                row["best_gluon_over_tl"] = round(gluon / row["tl"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def profiled_once(run: Callable[[], object], warmups: int = 3) -> None:
    """``run`` ``warmups`` times (compilation, autotuning), then once between ``cudaProfilerStart`` and ``Stop``: the
    launches ``ncu --profile-from-start off`` profiles (here and in ``benchmarks/pending/ncu_train_shape.sh``)."""
    for _ in range(warmups):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(variant: str, d: int = 128, n: int = 4096) -> None:
    """One launch each of the tl FP8 forward and a Gluon ``variant`` per QK format (INT8, FP8), non-causal, at 16K
    tokens and ``2048 / d`` heads, between ``cudaProfilerStart`` and ``Stop`` after three warm-up launches (the tl
    kernel's autotuning done): the target of ``ncu --profile-from-start off`` (``benchmarks/pending/ncu_forward.sh``).
    """
    q, k, v = _timed_inputs(d, n)
    for qk in ("int8", "fp8"):
        operands, kw = _operands(q, k, v, qk, False)
        runs = (lambda: hopper_forward(*operands, **kw), lambda: gf.gluon_forward(*operands, **kw, **VARIANTS[variant]))  # noqa: B023
        for run in runs:
            profiled_once(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="the correctness check only")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", choices=sorted(VARIANTS), help="only the launches ncu profiles (profile())")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.profile)
        return 0
    started = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}", flush=True)
    checked, status = check(args.variant)
    print(f"check: {sum(r['ok'] for r in checked)} of {len(checked)} ok, "
          f"{sum(r['bits_o'] and r['bits_lse'] for r in checked)} bitwise; status {status}", flush=True)  # fmt: skip
    timed = [] if args.quick or status else timings(args.variant)
    if args.out:
        found = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "check": checked,
                 "timings": timed, "seconds": round(time.time() - started, 1)}  # fmt: skip
        args.out.write_text(json.dumps(found, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
