"""First GPU check of the Gluon dQ kernel (``kernels/hopper/gluon_dq.py``) against ``_dq_kernel``.

One device call on an H100/H200 (Triton 3.6), after ``git apply benchmarks/pending/issue-14-gluon-dq.patch`` and
``python3 -m pip install --no-deps --no-build-isolation -e .``::

    python3 benchmarks/gluon_dq_check.py --out $OUT/gluon-dq.json

For each shape (small ones against the reference too) it builds the backward's real inputs with the real forward
(``sagebwd_forward``, SageBwd's default precision), then runs the portable dQ launch of ``backward()`` and the
Gluon kernel's variants (warp-specialised ``ws`` or one 8-warp partition ``plain``; the dS codes from registers or,
``-smem``, through shared memory) on the same inputs and prints max |diff|, rel_l2 and cosine against the portable
kernel, the fraction of bf16 values that are bitwise equal (every INT8 code and scale equal gives 100%: the int32
products are exact and both add the tiles in the same order), and rel_l2 against the reference where it is run.
Then it checks ``backward.backward`` with the Gluon dQ kernel forced and off, and times ``_dq_kernel`` against
each variant (and the whole backward with and without it) with ``triton.testing.do_bench`` at the large shapes.

Exits 1 on a mismatch (non-finite values, cosine < 0.9999 or rel_l2 > 5e-3 against the portable kernel, an error
against the reference more than 5% above the portable kernel's, dK or dV changed by the dispatch, the forced
dispatch not taking the kernel), 2 on a compile or launch error, 3 when a step hangs past ``--hang-s`` (a barrier
deadlock would otherwise hold the device to the call's limit). A launch error that leaves the CUDA context unusable
(an illegal address, a trap) ends the run at once with 2, so the first error is the last thing printed. ``--out``
is rewritten after every shape, so a run cut short by the caller's ``timeout`` still leaves its rows.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ["SAGE_LIGHTNING_GLUON_DQ"] = "force"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from device_check import banner, check_parser, crossover_row, finish, header  # noqa: E402
from gluon_dkdv_check import CROSSOVER, Watchdog, compare, inputs, rel_l2  # noqa: E402  (dK/dV: force)
from sage_lightning.kernels import backward as bwd  # noqa: E402
from sage_lightning.kernels.hopper import gluon_dq as gq  # noqa: E402
from sage_lightning.kernels.hopper import gluon_dq_wg as gqw  # noqa: E402
from sage_lightning.kernels.quant import dot_precision, padded_head_dim, seq_bucket, transpose_rows  # noqa: E402
from sage_lightning.kernels.reference import sage_attention_reference  # noqa: E402
from sage_lightning.kernels.tiles import LOG2E  # noqa: E402

#: (batch, q heads, kv heads, queries, keys, head dim, run the reference)
SHAPES = [
    (1, 2, 2, 256, 256, 64, True),
    (1, 2, 2, 256, 256, 128, True),
    (1, 4, 2, 512, 512, 128, True),  # GQA: two query heads read each kv head
    # More keys than queries (causal: the last query tile stops at its diagonal, the keys past it unread) and
    # fewer (causal: the query tiles past the last key read every key unmasked), GQA at D=64.
    (1, 4, 2, 256, 512, 64, True),
    (1, 2, 2, 512, 256, 128, True),
    (2, 4, 4, 1024, 1024, 64, False),
    (4, 16, 16, 4096, 4096, 128, False),  # the profile's shape: 16K tokens
    # D=64 for the one-warpgroup-per-block kernel (``wg``): an odd number of query blocks (the last program's upper
    # warpgroup has none), GQA with more keys and an odd count, more queries than keys (causal: the upper block
    # reads every key tile, the lower one fewer), and the example's training shape (8 x 10 heads at 4096).
    (1, 2, 2, 384, 384, 64, True),
    (1, 4, 2, 640, 768, 64, True),
    (1, 2, 2, 1024, 320, 64, True),
    (2, 16, 16, 4096, 4096, 64, False),
    (8, 10, 10, 4096, 4096, 64, False),
]
TIMED = {(4, 16, 16, 4096, 4096, 128), (2, 4, 4, 1024, 1024, 64), (2, 16, 16, 4096, 4096, 64),
         (8, 10, 10, 4096, 4096, 64)}  # fmt: skip
#: Gluon variants, safest first: one 8-warp partition or warp-specialised (a TMA load warp); ``-smem``: the dS
#: codes through shared memory (the A operand of the dQ product) instead of registers; ``-defer``: each tile's dQ
#: product finished in the next iteration (spills 44 B at D=128 causal, none elsewhere: gluon-dq.md); ``wg``: one
#: warpgroup per 128-query block (``gluon_dq_wg.py``, D=64 only).
VARIANTS = ("plain-smem", "plain", "ws-smem", "ws", "ws-defer", "wg")


def tl_dq(x: dict, causal: bool, tau: float) -> torch.Tensor:
    """``backward()``'s ``_dq_kernel`` launch alone (same arguments), for comparison and timing."""
    q_op, k_op, do = x["q_op"], x["k_op"], x["do"]
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    dq = torch.empty(batch, heads, seq_q, head_dim, dtype=do.dtype, device=do.device)
    bwd._dq_kernel[(triton.cdiv(seq_q, 128), batch * heads)](
        q_op, x["q_scale"], x["q_scale"], k_op, x["k_op_t"], x["k_scale"], x["v"], x["k_scale"],
        do, do, x["delta"], x["lse"], x["delta"], dq,
        *do.stride(),
        heads, heads // kv_heads, seq_q, seq_k, head_dim, seq_bucket(max(seq_q, seq_k)), seq_bucket(batch * heads),
        tau * LOG2E, tau,
        BLOCK_M=128, BLOCK_N=64, D_PAD=padded_head_dim(head_dim), CAUSAL=causal, QK_FMT="int8", DP_FMT="bf16",
        DS_FMT="int8", SMOOTH_Q=False, DOT_PRECISION=dot_precision(do.dtype),
    )  # fmt: skip
    return dq


def serves(variant: str, head_dim: int) -> bool:
    """Whether ``variant`` runs at ``head_dim`` (``wg``: D=64 only)."""
    return variant != "wg" or gqw.gluon_dq_wg_serves(head_dim)


def gluon(x: dict, causal: bool, tau: float, variant: str) -> torch.Tensor:
    if variant == "wg":
        return gqw.gluon_dq_wg(
            x["do"], x["delta"], x["q_op"], x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"],
            is_causal=causal, scale=tau,
        )  # fmt: skip
    return gq.gluon_dq(
        x["do"], x["delta"], x["q_op"], x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"],
        is_causal=causal, scale=tau, warp_specialize=variant.startswith("ws"),
        codes_in_registers="smem" not in variant, defer=variant.endswith("defer"),
    )  # fmt: skip


def dq_inputs(shape: tuple, causal: bool) -> tuple[dict, dict]:
    """:func:`gluon_dkdv_check.inputs` (the real forward) and K'^'s ``[D, Nk]`` copy."""
    x, raw = inputs(shape, causal)
    x["k_op_t"] = transpose_rows(x["k_op"])
    return x, raw


def run_backward(x: dict, raw: dict, causal: bool, setting: str) -> tuple:
    """``backward.backward`` (what the autograd formula calls) with :data:`gq.ENV` at ``setting``."""
    os.environ[gq.ENV] = setting
    try:
        return bwd.backward(
            x["do"], x["out"], x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], raw["v"], x["lse"], None,
            is_causal=causal, scale=raw["tau"], block_m=128, block_n=64, qk="int8", dv="int8", dp="bf16",
            ds="int8",
        )  # fmt: skip
    finally:
        os.environ[gq.ENV] = "force"


def check_dispatch() -> list[str]:
    """``backward.backward`` with the Gluon dQ kernel forced and off, at one small GQA causal shape: the forced
    call takes it (counted), dK and dV bitwise equal (same kernel), dQ within the gates (and its bitwise fraction)."""
    shape = (1, 4, 2, 256, 256, 128)
    x, raw = dq_inputs(shape, True)
    calls = []
    original = bwd.gluon_dq

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    bwd.gluon_dq = counted
    try:
        got = run_backward(x, raw, True, "force")
        forced = len(calls)
        want = run_backward(x, raw, True, "off")
    finally:
        bwd.gluon_dq = original
    torch.cuda.synchronize()
    bad = [] if forced == 1 and len(calls) == 1 else [f"backward(): gluon_dq called {forced}, {len(calls)} times"]
    same = [torch.equal(a, b) for a, b in zip(got[1:], want[1:], strict=True)]
    bad += [f"backward(): d{n} differs with the Gluon dQ kernel" for n, ok in zip("KV", same, strict=True) if not ok]
    c = compare(got[0], want[0])
    if not c["finite"] or c["cosine"] < 0.9999 or c["rel_l2"] > 5e-3:
        bad.append(f"backward(): dQ vs _dq_kernel {c}")
    print(f"{'ok  ' if not bad else 'FAIL'} backward() dispatch (B=1 H=4/2 N=256 D=128 causal): dK dV bitwise, "
          f"dQ bits {100 * c['bitwise_equal']:.2f}% rel {c['rel_l2']:.2e}", flush=True)  # fmt: skip
    return bad


def time_case(x: dict, raw: dict, causal: bool, tau: float, variants: list[str]) -> dict:
    """Milliseconds of the portable dQ launch, of each Gluon variant, and of the whole backward with the Gluon dQ
    kernel and without (``do_bench``'s median; the dK/dV work is the Gluon dK/dV kernel in both)."""
    times = {"tl": triton.testing.do_bench(lambda: tl_dq(x, causal, tau))}
    for variant in [v for v in variants if serves(v, x["q_op"].shape[3])]:
        try:
            times[variant] = triton.testing.do_bench(lambda v=variant: gluon(x, causal, tau, v))
        except Exception as error:  # noqa: BLE001 - reported; the table goes on
            times[variant] = float("nan")
            print(f"ERROR timing {variant}: {error}", flush=True)
    for setting in ("off", "force"):
        times[f"bwd_{setting}"] = triton.testing.do_bench(lambda s=setting: run_backward(x, raw, causal, s))
    return times


#: The crossover's shapes: the dK/dV sweep's (scores 2^22 to 2^30), the speed table's N=2048 at D=128, and at D=64
#: 2^26, 2^28 and the example's training shape.
DQ_CROSSOVER = [*CROSSOVER, (2, 16, 2048, 128), (4, 16, 2048, 128), (8, 16, 2048, 128), (2, 8, 2048, 64),
                (1, 16, 4096, 64), (8, 10, 4096, 64)]  # fmt: skip


def crossover(dog: Watchdog) -> list[dict]:
    """Over :data:`DQ_CROSSOVER`, causal and not: milliseconds of ``_dq_kernel`` and of the Gluon ``ws`` kernel
    alone (and ``wg`` at D=64), and of the whole ``backward.backward`` with the Gluon dQ kernel it picks and without
    (the dK/dV kernel at ``auto``, as users get it), with the host's milliseconds per call: where ``auto`` should
    take it (:data:`gq.AUTO_MIN_SCORES`)."""
    os.environ["SAGE_LIGHTNING_GLUON_DKDV"] = "auto"
    rows = []
    for batch, heads, seq, head_dim in DQ_CROSSOVER:
        for causal in (False, True):
            shape = (batch, heads, heads, seq, seq, head_dim)
            dog.set(f"crossover {shape} causal={causal}")
            x, raw = dq_inputs(shape, causal)
            tau = raw["tau"]
            fns = {
                "dq_tl": lambda x=x, c=causal, t=tau: tl_dq(x, c, t),
                "dq_ws": lambda x=x, c=causal, t=tau: gluon(x, c, t, "ws"),
                **({"dq_wg": lambda x=x, c=causal, t=tau: gluon(x, c, t, "wg")} if serves("wg", head_dim) else {}),
                "bwd_off": lambda x=x, raw=raw, c=causal: run_backward(x, raw, c, "off"),
                "bwd_force": lambda x=x, raw=raw, c=causal: run_backward(x, raw, c, "force"),
            }
            rows.append(crossover_row((batch, heads, seq, head_dim), causal, fns))
            x = raw = None
            torch.cuda.empty_cache()
    os.environ["SAGE_LIGHTNING_GLUON_DKDV"] = "force"
    return rows


def cuda_usable() -> bool:
    """Whether the CUDA context still works after a caught error (an illegal address or trap is sticky: every later
    call fails with it)."""
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001 - the answer is the point
        return False


def main(argv: list[str] | None = None) -> int:
    parser = check_parser(__doc__)
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--crossover", action="store_true", help="only the crossover sweep (whole backward, Gluon dQ on and off)"
    )
    args = parser.parse_args(argv)
    variants = [v for v in VARIANTS if v in args.variant]
    dog = Watchdog(args.hang_s)
    print(banner(), flush=True)
    rows, failures, errors = [], [], 0  # errors: those outside the rows (a row with "error" counts too)
    shapes = [s for s in SHAPES if s[-1]] if args.quick else SHAPES
    if args.crossover:
        rows = crossover(dog)
        dog.set("")
        return finish(args.out, {"crossover": rows}, [], 0)

    def save() -> None:
        if args.out:
            record = {**header(), "rows": rows, "failures": failures, "errors": errors + row_errors()}
            args.out.write_text(json.dumps(record, indent=1))

    def row_errors() -> int:
        return sum(1 for row in rows if "error" in row)

    try:
        run_cases(args, variants, shapes, dog, rows, failures, save)
    except Exception as error:  # noqa: BLE001 - a launch error outside a variant's own try, or a sticky one
        errors += 1
        print(f"ERROR (run stopped): {type(error).__name__}: {error}", flush=True)
        traceback.print_exc()
        save()
        print(f"{errors + row_errors()} compile/launch errors")
        return 2
    dog.set("backward() dispatch")
    try:
        failures += check_dispatch()
    except Exception as error:  # noqa: BLE001 - reported as a launch error
        errors += 1
        print(f"ERROR backward() dispatch: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc()
    dog.set("")
    print("\nSummary:")
    for row in rows:
        if "ms" in row:
            print(f"  {row['case']:<56} " + " ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()))
    save()
    for failure in failures:
        print("MISMATCH", failure)
    if errors + row_errors():
        print(f"{errors + row_errors()} compile/launch errors")
        return 2
    return 1 if failures else 0


def run_cases(args, variants: list[str], shapes: list, dog: Watchdog, rows: list, failures: list, save) -> None:
    """Every shape, causal and not: the portable dQ, the reference (small shapes), each Gluon variant against them,
    and the timings; rows and failures are appended to the caller's lists. Raises when a caught launch error left
    the CUDA context unusable."""
    for *shape, with_ref in shapes:
        shape = tuple(shape)
        for causal in (False, True):
            name = f"B={shape[0]} H={shape[1]}/{shape[2]} N={shape[3]}/{shape[4]} D={shape[5]} causal={causal}"
            dog.set(f"inputs {name}")
            x, raw = dq_inputs(shape, causal)
            tau = raw["tau"]
            dog.set(f"tl {name}")
            dq_tl = tl_dq(x, causal, tau)
            torch.cuda.synchronize()
            ref = ref_err = None
            if with_ref:
                dog.set(f"reference {name}")
                q, k, v = (raw[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
                out_ref, _ = sage_attention_reference(q, k, v, is_causal=causal, scale=tau)
                out_ref.backward(raw["do"])
                ref = q.grad
                ref_err = rel_l2(dq_tl, ref)
            for variant in [v for v in variants if serves(v, shape[5])]:
                case = f"{name} {variant}"
                dog.set(f"gluon {case}")
                try:
                    dq_g = gluon(x, causal, tau, variant)
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - reported; the other cases go on
                    print(f"ERROR {case}: {type(error).__name__}: {error}", flush=True)
                    traceback.print_exc()
                    rows.append({"case": case, "error": f"{type(error).__name__}: {error}"[:2000]})
                    if not cuda_usable():
                        raise RuntimeError(f"the CUDA context is unusable after {case}") from error
                    continue
                row = {"case": case, "dq": compare(dq_g, dq_tl)}
                c = row["dq"]
                bad = []
                if not c["finite"] or c["cosine"] < 0.9999 or c["rel_l2"] > 5e-3:
                    bad.append(f"dq vs tl {c}")
                refs = ""
                if ref is not None:
                    row["ref_rel_l2"], row["tl_ref_rel_l2"] = rel_l2(dq_g, ref), ref_err
                    refs = f" ref {row['ref_rel_l2']:.4f} (tl {ref_err:.4f})"
                    if row["ref_rel_l2"] > 1.05 * ref_err + 1e-4:
                        bad.append(f"dq vs reference {row['ref_rel_l2']:.4g} (tl {ref_err:.4g})")
                row["ok"] = not bad
                failures += [f"{case}: {b}" for b in bad]
                rows.append(row)
                print(
                    f"{'ok  ' if not bad else 'FAIL'} {case:<52} dq max {c['max_abs']:.3g} rel {c['rel_l2']:.2e} "
                    f"cos {c['cosine']:.6f} bits {100 * c['bitwise_equal']:.2f}%{refs}",
                    flush=True,
                )
            if not args.quick and shape in TIMED:
                dog.set(f"timing {name}")
                times = time_case(x, raw, causal, tau, variants)
                rows.append({"case": f"{name} timing", "ms": times})
                line = " ".join(f"{k} {v:.3f} ms" for k, v in times.items())
                speedups = " ".join(f"{v} {times['tl'] / times[v]:.2f}x" for v in variants if v in times)
                print(f"TIME {name:<44} {line}  (tl / gluon: {speedups}; backward "
                      f"{times['bwd_off'] / times['bwd_force']:.2f}x)", flush=True)  # fmt: skip
            x = raw = None
            torch.cuda.empty_cache()
            save()


if __name__ == "__main__":
    sys.exit(main())
