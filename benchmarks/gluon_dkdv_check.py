"""First GPU check of the Gluon dK/dV kernel (``kernels/hopper/gluon_backward.py``) against ``_dkdv_kernel``.

One device call on an H100/H200 (Triton 3.6), after ``python3 -m pip install --no-deps --no-build-isolation -e .``::

    python3 benchmarks/gluon_dkdv_check.py --out $OUT/gluon-dkdv.json [--crossover]

For each shape (small ones against the reference too) it builds the backward's real inputs with the real
forward (``sagebwd_forward``, SageBwd's default precision), then runs the portable dK/dV launch of
``backward()`` and the Gluon kernel (both variants: warp-specialised ``ws`` and one 8-warp partition ``plain``)
on the same inputs and prints, per output: max |diff|, rel_l2 and cosine against the portable kernel, the
fraction of bf16 values that are bitwise equal (every INT8 code and scale equal gives 100%: the int32
products are exact and both accumulate tiles in the same order; a code flipped by a last-bit difference in dP
or exp2 shows up below 100%), and rel_l2 against the reference where it is run. Then it times both kernels
with ``triton.testing.do_bench`` at the large shapes.

Exits 1 on a mismatch (non-finite values, cosine < 0.9999 or rel_l2 > 5e-3 against the portable kernel, an
error against the reference more than 5% above the portable kernel's, dS statistics off by more than 1e-3
relative), 2 on a compile or launch error, 3 when a step hangs past ``--hang-s`` (a barrier deadlock would
otherwise hold the device to the call's limit).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

os.environ["SAGE_LIGHTNING_GLUON_DKDV"] = "force"

import torch  # noqa: E402
import triton  # noqa: E402
from device_check import Watchdog, banner, check_parser, compare, crossover_row, finish, rel_l2  # noqa: E402
from sage_lightning.kernels import AttentionPrecision  # noqa: E402
from sage_lightning.kernels import backward as bwd  # noqa: E402
from sage_lightning.kernels.hopper import gluon_backward as gb  # noqa: E402
from sage_lightning.kernels.hopper import gluon_dkdv_wg as wg  # noqa: E402
from sage_lightning.kernels.ops import sagebwd_forward  # noqa: E402
from sage_lightning.kernels.quant import (
    backward_preprocess,
    dot_precision,
    padded_head_dim,
    seq_bucket,
    transpose_rows,
)  # noqa: E402
from sage_lightning.kernels.reference import sage_attention_reference  # noqa: E402
from sage_lightning.kernels.tiles import LOG2E  # noqa: E402

#: (batch, q heads, kv heads, queries, keys, head dim, run the reference)
SHAPES = [
    (1, 2, 2, 256, 256, 64, True),
    (1, 2, 2, 256, 256, 128, True),
    (1, 4, 2, 512, 512, 128, True),  # GQA: the program loops over the group's two query heads
    # More keys than queries (causal: the key blocks past the last query get no tile, total = 0) and fewer, GQA at
    # D=64: SEQ_Q and SEQ_K differ, so a mix-up of the two shows.
    (1, 4, 2, 256, 512, 64, True),
    (1, 2, 2, 512, 256, 128, True),
    (2, 4, 4, 1024, 1024, 64, False),
    (4, 16, 16, 4096, 4096, 128, False),  # the profile's shape: 16K tokens
    (4, 32, 32, 4096, 4096, 64, False),  # speed.py's D=64 shape
    (8, 10, 10, 4096, 4096, 64, False),  # the example's small config at sequence 4096
]
TIMED = {(4, 16, 16, 4096, 4096, 128), (2, 4, 4, 1024, 1024, 64), (4, 32, 32, 4096, 4096, 64),
         (8, 10, 10, 4096, 4096, 64)}  # fmt: skip
#: Gluon variants, safest first: one 8-warp partition or warp-specialised (a TMA load warp); ``-defer`` finishes
#: each tile's dV and dK products in the next iteration (spills a little at D=128: see gluon-dkdv.md); ``wg``: one
#: warpgroup per 64-key half (``gluon_dkdv_wg.py``; D=64, key counts a multiple of 128, skipped elsewhere).
VARIANTS = ("plain", "ws", "ws-defer", "plain-defer", "wg")


def tl_dkdv(x: dict, causal: bool, tau: float, stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``backward()``'s ``_dkdv_kernel`` launch alone (same arguments), for comparison and timing."""
    q_op, k_op, do = x["q_op"], x["k_op"], x["do"]
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    dk = torch.empty(batch, kv_heads, seq_k, head_dim, dtype=do.dtype, device=do.device)
    dv = torch.empty_like(dk)
    bwd._dkdv_kernel[(triton.cdiv(seq_k, 64), batch * kv_heads)](
        q_op, x["q_op_t"], x["q_scale"], x["q_scale"], k_op, x["k_scale"], x["v"], x["k_scale"],
        do, do, x["do_codes_t"], x["do_scale"], x["do_scale"], x["lse"], x["delta"], dk, dv,
        stats if stats is not None else x["delta"],
        *do.stride(),
        heads, heads // kv_heads, seq_q, seq_k, head_dim, seq_bucket(max(seq_q, seq_k)), seq_bucket(batch * heads),
        tau * LOG2E, tau,
        BLOCK_M=128, BLOCK_N=64, D_PAD=padded_head_dim(head_dim), CAUSAL=causal, QK_FMT="int8", DP_FMT="bf16",
        DS_FMT="int8", SMOOTH_Q=False, DOT_PRECISION=dot_precision(do.dtype), DV_FMT="int8",
        WITH_STATS=stats is not None,
    )  # fmt: skip
    return dk, dv


def serves(x: dict, variant: str) -> bool:
    """Whether ``variant`` takes this shape (``wg``: D=64, key counts a multiple of 128)."""
    return variant != "wg" or wg.gluon_dkdv_wg_serves(x["q_op"].shape[3], x["k_op"].shape[2])


def gluon(x: dict, causal: bool, tau: float, stats: torch.Tensor | None, variant: str) -> tuple:
    """dK and dV of the Gluon ``variant`` (:data:`VARIANTS`) on :func:`inputs`' tensors."""
    operands = (x["do"], x["delta"], x["do_codes_t"], x["do_scale"], x["q_op"], x["q_op_t"], x["q_scale"], x["k_op"],
                x["k_scale"], x["v"], x["lse"], stats)  # fmt: skip
    if variant == "wg":
        return wg.gluon_dkdv_wg(*operands, is_causal=causal, scale=tau)
    ws, defer = variant.startswith("ws"), variant.endswith("defer")
    return gb.gluon_dkdv(*operands, is_causal=causal, scale=tau, warp_specialize=ws, defer=defer)


def inputs(shape: tuple, causal: bool, seed: int = 0) -> tuple[dict, dict]:
    """The backward's inputs from the real forward, SageBwd's default precision (K-smoothing on)."""
    batch, heads, kv_heads, seq, seq_k, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, kv_heads, seq_k, head_dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, kv_heads, seq_k, head_dim, device="cuda", generator=gen).bfloat16()
    do = torch.randn(batch, heads, seq, head_dim, device="cuda", generator=gen).bfloat16()
    tau = head_dim**-0.5
    prec = AttentionPrecision()
    out, lse, q_op, q_scale, _q_mean, k_op, k_scale = sagebwd_forward(
        q, k, v, None, causal, tau, "int8", "int8", "int8", "bf16", "int8", prec.smooth_k, False, 128, 64
    )
    delta, _, do_codes_t, do_scale, _ = backward_preprocess(do, out, 128, codes=False, codes_t=True)
    x = dict(do=do, out=out, delta=delta, do_codes_t=do_codes_t, do_scale=do_scale, q_op=q_op,
             q_op_t=transpose_rows(q_op), q_scale=q_scale, k_op=k_op, k_scale=k_scale, v=v.contiguous(),
             lse=lse)  # fmt: skip
    return x, dict(q=q, k=k, v=v, do=do, tau=tau)


def run_backward(x: dict, raw: dict, causal: bool) -> tuple:
    """``backward.backward`` (what the autograd formula calls) on :func:`inputs`' tensors."""
    return bwd.backward(
        x["do"], x["out"], x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], raw["v"], x["lse"], None,
        is_causal=causal, scale=raw["tau"], block_m=128, block_n=64, qk="int8", dv="int8", dp="bf16",
        ds="int8",
    )  # fmt: skip


def full_backward(shape: tuple, causal: bool, setting: str) -> tuple:
    """:func:`run_backward` with :data:`gb.ENV` at ``setting``."""
    x, raw = inputs(shape, causal)
    os.environ[gb.ENV] = setting
    try:
        return run_backward(x, raw, causal)
    finally:
        os.environ[gb.ENV] = "force"


def check_dispatch() -> list[str]:
    """``backward.backward`` with the Gluon kernel forced and switched off, at one small GQA shape: dQ, dK and dV
    bitwise equal (dQ is the same kernel; dK and dV are the same numerics)."""
    shape = (1, 4, 2, 256, 256, 128)
    got, want = full_backward(shape, True, "force"), full_backward(shape, True, "off")
    torch.cuda.synchronize()
    bad = [
        f"backward(): d{n} differs with the Gluon kernel"
        for n, a, b in zip("QKV", got, want, strict=True)
        if not torch.equal(a, b)
    ]
    print(f"{'ok  ' if not bad else 'FAIL'} backward() dispatch (B=1 H=4/2 N=256 D=128 causal): bitwise", flush=True)
    return bad


#: (batch, heads, queries = keys, head dim) of the crossover sweep: scores from 2^22 to 2^30.
CROSSOVER = [(4, 16, 4096, 128), (4, 8, 2048, 128), (2, 8, 1024, 128), (4, 8, 2048, 64), (2, 16, 4096, 64),
             (1, 4, 1024, 128)]  # fmt: skip


def _set_dkdv(name: str) -> None:
    """The crossover's rows: the whole backward without the Gluon dK/dV kernel for ``bwd_off``, with the 64-key
    kernel for ``bwd_ws`` (the ``wg`` variant off), with what ``backward()`` picks else."""
    os.environ[gb.ENV] = "off" if name == "bwd_off" else "force"
    os.environ[wg.ENV] = "off" if name == "bwd_ws" else "auto"


def crossover(dog: Watchdog, shapes: list[tuple[int, int, int, int]] | None = None) -> list[dict]:
    """Over :data:`CROSSOVER`: milliseconds of the dK/dV kernel alone (portable and Gluon ``ws``) and of the whole
    ``backward.backward`` with the Gluon kernel and without (``do_bench``), and the host's milliseconds per call of
    each: where ``auto`` should start taking it (:data:`gb.AUTO_MIN_SCORES`)."""
    rows = []
    for batch, heads, seq, head_dim in shapes or CROSSOVER:
        for causal in (False, True):
            shape = (batch, heads, heads, seq, seq, head_dim)
            dog.set(f"crossover {shape} causal={causal}")
            x, raw = inputs(shape, causal)
            tau = raw["tau"]
            fns = {
                "dkdv_tl": lambda x=x, c=causal, t=tau: tl_dkdv(x, c, t, None),
                "dkdv_ws": lambda x=x, c=causal, t=tau: gluon(x, c, t, None, "ws"),
                "bwd_off": lambda x=x, raw=raw, c=causal: run_backward(x, raw, c),
                "bwd_force": lambda x=x, raw=raw, c=causal: run_backward(x, raw, c),
            }
            if serves(x, "wg"):
                fns["dkdv_wg"] = lambda x=x, c=causal, t=tau: gluon(x, c, t, None, "wg")
                fns["bwd_ws"] = lambda x=x, raw=raw, c=causal: run_backward(x, raw, c)
            rows.append(crossover_row((batch, heads, seq, head_dim), causal, fns, _set_dkdv))
            os.environ[gb.ENV] = "force"
            os.environ[wg.ENV] = "auto"
            x = raw = None
            torch.cuda.empty_cache()
    return rows


def time_case(x: dict, causal: bool, tau: float, variants: tuple[str, ...] = VARIANTS) -> dict:
    """Milliseconds of the portable dK/dV launch and of each Gluon variant that serves the shape (``do_bench``'s
    median)."""
    times = {"tl": triton.testing.do_bench(lambda: tl_dkdv(x, causal, tau, None))}
    for variant in [v for v in variants if serves(x, v)]:
        try:
            times[variant] = triton.testing.do_bench(lambda v=variant: gluon(x, causal, tau, None, v))
        except Exception as error:  # noqa: BLE001 - reported; the table goes on
            times[variant] = float("nan")
            print(f"ERROR timing {variant}: {error}", flush=True)
    return times


def _shape(text: str) -> tuple[int, int, int, int]:
    """``B,H,N,D`` as four positive ints (``--crossover-shapes``)."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--crossover-shapes takes B,H,N,D such as 2,16,4096,64; received {text!r}")
    return shape


def main(argv: list[str] | None = None) -> int:
    parser = check_parser(__doc__)
    parser.add_argument("--crossover", action="store_true", help="then time the whole backward with and without")
    parser.add_argument("--dispatch-only", action="store_true", help="skip the kernel cases (the dispatch check)")
    parser.add_argument(
        "--crossover-shapes", nargs="+", type=_shape, metavar="B,H,N,D", help="the crossover's shapes (CROSSOVER)"
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="Gluon variants")
    args = parser.parse_args(argv)
    dog = Watchdog(args.hang_s)
    print(banner(), flush=True)
    rows, failures, errors = [], [], 0
    shapes = [] if args.dispatch_only else [s for s in SHAPES if s[-1]] if args.quick else SHAPES
    for *shape, with_ref in shapes:
        shape = tuple(shape)
        for causal in (False, True):
            name = f"B={shape[0]} H={shape[1]}/{shape[2]} N={shape[3]}/{shape[4]} D={shape[5]} causal={causal}"
            dog.set(f"inputs {name}")
            x, raw = inputs(shape, causal)
            tau = raw["tau"]
            # The dS statistics at the small shapes (a second compile of each kernel; not timed).
            stats_tl = torch.zeros(2, device="cuda") if with_ref else None
            dog.set(f"tl {name}")
            dk_tl, dv_tl = tl_dkdv(x, causal, tau, stats_tl)
            torch.cuda.synchronize()
            ref = None
            if with_ref:
                dog.set(f"reference {name}")
                q, k, v = (raw[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
                out_ref, _ = sage_attention_reference(q, k, v, is_causal=causal, scale=tau)
                out_ref.backward(raw["do"])
                ref = (k.grad, v.grad)
                ref_err = {"dk": rel_l2(dk_tl, ref[0]), "dv": rel_l2(dv_tl, ref[1])}
            for variant in [v for v in args.variants if serves(x, v)]:
                case = f"{name} {variant}"
                dog.set(f"gluon {case}")
                stats_g = torch.zeros(2, device="cuda") if with_ref else None
                try:
                    dk_g, dv_g = gluon(x, causal, tau, stats_g, variant)
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - reported; the other cases go on
                    errors += 1
                    print(f"ERROR {case}: {type(error).__name__}: {error}", flush=True)
                    traceback.print_exc()
                    rows.append({"case": case, "error": f"{type(error).__name__}: {error}"[:2000]})
                    continue
                row = {"case": case, "dk": compare(dk_g, dk_tl), "dv": compare(dv_g, dv_tl)}
                row["stats_rel"] = (
                    ((stats_g - stats_tl).abs() / stats_tl.abs().clamp_min(1e-30)).max().item() if with_ref else 0.0
                )
                if ref is not None:
                    row["ref_rel_l2"] = {"dk": rel_l2(dk_g, ref[0]), "dv": rel_l2(dv_g, ref[1])}
                    row["tl_ref_rel_l2"] = ref_err
                bad = []
                for out in ("dk", "dv"):
                    c = row[out]
                    if not c["finite"] or c["cosine"] < 0.9999 or c["rel_l2"] > 5e-3:
                        bad.append(f"{out} vs tl {c}")
                    if ref is not None and row["ref_rel_l2"][out] > 1.05 * ref_err[out] + 1e-4:
                        bad.append(f"{out} vs reference {row['ref_rel_l2'][out]:.4g} (tl {ref_err[out]:.4g})")
                if not row["stats_rel"] <= 1e-3:
                    bad.append(f"stats {stats_g.tolist()} vs tl {stats_tl.tolist()}")  # type: ignore[union-attr]
                row["ok"] = not bad
                failures += [f"{case}: {b}" for b in bad]
                rows.append(row)
                refs = (
                    f" ref dk {row['ref_rel_l2']['dk']:.4f} (tl {ref_err['dk']:.4f}) dv {row['ref_rel_l2']['dv']:.4f}"
                    f" (tl {ref_err['dv']:.4f})"
                    if ref is not None
                    else ""
                )
                print(
                    f"{'ok  ' if not bad else 'FAIL'} {case:<44} "
                    + " ".join(
                        f"{o} max {row[o]['max_abs']:.3g} rel {row[o]['rel_l2']:.2e} cos {row[o]['cosine']:.6f} "
                        f"bits {100 * row[o]['bitwise_equal']:.2f}%"
                        for o in ("dk", "dv")
                    )
                    + f" stats {row['stats_rel']:.1e}{refs}",
                    flush=True,
                )
            if not args.quick and shape in TIMED:
                dog.set(f"timing {name}")
                times = time_case(x, causal, tau, tuple(args.variants))
                rows.append({"case": f"{name} timing", "ms": times})
                line = " ".join(f"{k} {v:.3f} ms" for k, v in times.items())
                speedups = " ".join(f"{v} {times['tl'] / times[v]:.2f}x" for v in times if v != "tl")
                print(f"TIME {name:<44} {line}  (tl / gluon: {speedups})", flush=True)
            x = raw = None
            torch.cuda.empty_cache()
    dog.set("backward() dispatch")
    failures += check_dispatch()
    cross = []
    if args.crossover:
        dog.set("crossover")
        cross = crossover(dog, args.crossover_shapes)
    dog.set("")
    print("\nSummary:")
    for row in rows:
        if "ms" in row:
            print(f"  {row['case']:<56} " + " ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()))
    return finish(args.out, {"rows": rows, "crossover": cross}, failures, errors)


if __name__ == "__main__":
    sys.exit(main())
