"""First GPU check of the Gluon forward (``kernels/hopper/gluon_forward.py``) against ``_hopper_forward_kernel``.

One device call on an H100/H200 (Triton 3.6), about 3 minutes, after the patch is applied and installed::

    git apply benchmarks/pending/issue-14-gluon-forward.patch && \\
        python3 -m pip install --no-deps --no-build-isolation -e . && \\
        python3 benchmarks/gluon_forward_check.py --out $OUT/gluon-forward.json

For each shape (GQA, causal or not, Nk != N, N and Nk not multiples of the tiles, D = 64 and 128) it quantizes
real inputs as ``sagebwd_forward`` does (SageBwd's default precision: INT8 QK and PV, K-smoothing), runs
``hopper_forward`` (the tl kernel) and every Gluon variant on the same operands and prints, for O and the base-2
lse: the fraction of bitwise-equal values (100% expected: same codes, same scales, same order of additions per
row), max |diff|, rel_l2 and cosine against the tl kernel, and O's rel_l2 against the reference
(``kernels/reference.py``) at the small shapes. Then ``sagebwd_forward`` with the Gluon kernel forced and switched
off (the dispatch: all seven outputs bitwise equal, or O and lse within the gates), and the timing: both kernels
alone and the whole forward (quantization included) against SDPA cuDNN, ``triton.testing.do_bench``, at B=4 H=16
N=4096 and B=2 H=16 N=8192 (16K tokens, as ``speed.py``), D=128, causal and not; TFLOPS count ``4 B H N Nk D``,
halved when causal.

Exits 1 on a mismatch (non-finite values; O cosine < 0.9999 or rel_l2 > 5e-3 against the tl kernel; lse max
|diff| > 1e-3; O's error against the reference more than 5% above the tl kernel's), 2 on a compile or launch
error, 3 when a step hangs past ``--hang-s`` (a barrier deadlock would otherwise hold the device to the call's
limit).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

os.environ["SAGE_LIGHTNING_GLUON_FWD"] = "force"
os.environ.setdefault("SAGE_LIGHTNING_HOPPER", "force")

import torch  # noqa: E402
import triton  # noqa: E402
from device_check import Watchdog, compare, finish, rel_l2  # noqa: E402
from sage_lightning.kernels import AttentionPrecision  # noqa: E402
from sage_lightning.kernels.hopper import gluon_forward as gf  # noqa: E402
from sage_lightning.kernels.hopper.forward import hopper_forward  # noqa: E402
from sage_lightning.kernels.ops import sagebwd_forward  # noqa: E402
from sage_lightning.kernels.quant import quantize_rows  # noqa: E402
from sage_lightning.kernels.reference import sage_attention_reference  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

#: (batch, q heads, kv heads, queries, keys, head dim, run the reference)
SHAPES = [
    (1, 2, 2, 256, 256, 64, True),
    (1, 2, 2, 256, 256, 128, True),
    (1, 4, 2, 512, 512, 128, True),  # GQA
    (1, 4, 2, 256, 512, 64, True),  # more keys than queries
    (1, 2, 2, 512, 256, 128, True),  # fewer keys than queries
    (1, 2, 2, 320, 208, 128, True),  # N not a multiple of 128, Nk of 64: padded rows and keys, masked tiles
    (1, 2, 1, 192, 176, 128, True),  # GQA 2:1, an odd number of key tiles (3; causal 2 and 3), a partial one
    (1, 3, 3, 160, 64, 64, True),  # one key tile (n_tiles = 1: no loop), odd head count, a 64-row half all padding
    (2, 4, 4, 1024, 1024, 64, False),
    (4, 16, 16, 4096, 4096, 128, False),
]
#: (batch, heads, N = Nk, head dim) timed: speed.py's 16K tokens at D=128.
TIMED = [(4, 16, 4096, 128), (2, 16, 8192, 128)]
#: Gluon variants, the default first: ``pp`` the consumer warpgroups take turns on the tensor cores, ``free`` they
#: do not; ``-smem`` P's codes go through shared memory (the wrapper's default), ``-regs`` they stay in registers.
VARIANTS = ("pp-smem", "free-smem", "pp-regs", "free-regs")


def inputs(shape: tuple, causal: bool, seed: int = 0) -> tuple[dict, dict]:
    """The forward's operands as ``sagebwd_forward`` builds them (SageBwd's default precision, K-smoothing)."""
    batch, heads, kv_heads, seq, seq_k, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, kv_heads, seq_k, head_dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, kv_heads, seq_k, head_dim, device="cuda", generator=gen).bfloat16()
    tau = head_dim**-0.5
    k_mean = k.mean(dim=2, dtype=torch.float32)
    q_op, q_scale, _ = quantize_rows(q, 128, int8=True)
    k_op, k_scale, _ = quantize_rows(k, 64, int8=True, mean=k_mean)
    v_op, v_scale, _ = quantize_rows(v, 64, int8=True, transposed=True)
    ops = (q_op, q_scale, None, k_op, k_scale, v_op, v_scale)
    tiles = {"out_dtype": q.dtype, "is_causal": causal, "scale": tau, "block_m": 128, "block_n": 64}
    return {"ops": ops, "tiles": tiles}, {"q": q, "k": k, "v": v, "tau": tau}


def run_tl(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return hopper_forward(*x["ops"], **x["tiles"])


def run_gluon(x: dict, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    return gf.gluon_forward(
        *x["ops"], **x["tiles"], pingpong=variant.startswith("pp"), p_in_regs=variant.endswith("regs")
    )


def check_dispatch() -> list[str]:
    """``sagebwd_forward`` (what the model calls) with the Gluon forward forced and switched off, one small causal
    GQA shape: all seven outputs (O, lse, the saved operands) bitwise equal."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 4, 384, 128, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, 2, 384, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, 2, 384, 128, device="cuda", generator=gen).bfloat16()
    prec = AttentionPrecision()
    outs = {}
    for setting in ("force", "off"):
        os.environ[gf.ENV] = setting
        outs[setting] = sagebwd_forward(q, k, v, None, True, 128**-0.5, True, True, True, False, True,
                                        prec.smooth_k, False, 128, 64)  # fmt: skip
    os.environ[gf.ENV] = "force"
    torch.cuda.synchronize()
    names = ("O", "lse", "q_op", "q_scale", "q_mean", "k_op", "k_scale")
    diff = [n for n, a, b in zip(names, outs["force"], outs["off"], strict=True) if not torch.equal(a, b)]
    print(f"{'ok  ' if not diff else 'DIFF'} sagebwd_forward dispatch (B=1 H=4/2 N=384 D=128 causal): "
          f"{'bitwise equal' if not diff else 'differ: ' + ', '.join(diff)}", flush=True)  # fmt: skip
    bad = []
    if diff:  # not bitwise: still within the kernel gates?
        o, lse = compare(outs["force"][0], outs["off"][0]), compare(outs["force"][1], outs["off"][1])
        if o["cosine"] < 0.9999 or o["rel_l2"] > 5e-3 or lse["max_abs"] > 1e-3:
            bad.append(f"sagebwd_forward dispatch: O {o} lse {lse}")
    return bad


def timing(dog: Watchdog, variants: list[str]) -> list[dict]:
    """Milliseconds and TFLOPS of the tl kernel, each Gluon variant, the whole forward (quantization included)
    with and without the Gluon kernel, and SDPA cuDNN, at :data:`TIMED`."""
    rows = []
    for batch, heads, seq, head_dim in TIMED:
        for causal in (False, True):
            name = f"B={batch} H={heads} N={seq} D={head_dim} causal={causal:d}"
            dog.set(f"timing {name}")
            x, raw = inputs((batch, heads, heads, seq, seq, head_dim), causal)
            q, k, v, tau = raw["q"], raw["k"], raw["v"], raw["tau"]
            smooth_k = AttentionPrecision().smooth_k

            def whole(setting: str, q=q, k=k, v=v, tau=tau, causal=causal, smooth_k=smooth_k) -> None:
                os.environ[gf.ENV] = setting
                sagebwd_forward(q, k, v, None, causal, tau, True, True, True, False, True, smooth_k, False, 128,
                                64)  # fmt: skip

            def cudnn(q=q, k=k, v=v, causal=causal) -> None:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            fns = {"tl": lambda x=x: run_tl(x)}
            fns.update({v_: (lambda x=x, v_=v_: run_gluon(x, v_)) for v_ in variants})
            fns.update({"fwd_off": lambda: whole("off"), "fwd_gluon": lambda: whole("force"), "cudnn": cudnn})
            ms = {}
            for key, fn in fns.items():
                try:
                    fn()
                    ms[key] = triton.testing.do_bench(fn)
                except Exception as error:  # noqa: BLE001 - reported; the table goes on
                    ms[key] = float("nan")
                    print(f"ERROR timing {key} {name}: {type(error).__name__}: {error}", flush=True)
            os.environ[gf.ENV] = "force"
            flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            tflops = {key: flops / (t * 1e-3) / 1e12 for key, t in ms.items()}
            rows.append({"case": name, "ms": ms, "tflops": tflops})
            first = variants[0]
            print(f"TIME {name}: " + " ".join(f"{key} {ms[key]:.3f} ms {tflops[key]:.0f} TF" for key in fns)
                  + f" | {first}/tl {ms['tl'] / ms[first]:.2f}x {first}/cudnn {ms['cudnn'] / ms[first]:.2f}x "
                  f"fwd_gluon/cudnn {ms['cudnn'] / ms['fwd_gluon']:.2f}x "
                  f"fwd_off/cudnn {ms['cudnn'] / ms['fwd_off']:.2f}x",
                  flush=True)  # fmt: skip
            x = raw = None
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--hang-s", type=float, default=90.0, help="a step running longer is a hang (exit 3)")
    parser.add_argument("--quick", action="store_true", help="the small shapes only, no timing")
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args(argv)
    dog = Watchdog(args.hang_s)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows, failures, errors = [], [], 0
    shapes = [s for s in SHAPES if s[-1]] if args.quick else SHAPES
    for *shape, with_ref in shapes:
        shape = tuple(shape)
        for causal in (False, True):
            name = f"B={shape[0]} H={shape[1]}/{shape[2]} N={shape[3]}/{shape[4]} D={shape[5]} causal={causal:d}"
            try:  # the tl kernel and the reference: an error here skips the shape (exit 2), not the whole check
                dog.set(f"inputs {name}")
                x, raw = inputs(shape, causal)
                dog.set(f"tl {name}")
                out_tl, lse_tl = run_tl(x)
                torch.cuda.synchronize()
                ref_err = None
                if with_ref:
                    dog.set(f"reference {name}")
                    out_ref, _ = sage_attention_reference(raw["q"], raw["k"], raw["v"], is_causal=causal,
                                                          scale=raw["tau"])  # fmt: skip
                    ref_err = rel_l2(out_tl, out_ref)
            except Exception as error:  # noqa: BLE001 - reported; the other shapes go on
                errors += 1
                print(f"ERROR tl/reference {name}: {type(error).__name__}: {error}", flush=True)
                rows.append({"case": name, "error": f"tl/reference: {type(error).__name__}: {error}"[:2000]})
                continue
            for variant in args.variant:
                case = f"{name} {variant}"
                dog.set(f"gluon {case}")
                try:
                    out_g, lse_g = run_gluon(x, variant)
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - reported; the other cases go on
                    errors += 1
                    print(f"ERROR {case}: {type(error).__name__}: {error}", flush=True)
                    traceback.print_exc()
                    rows.append({"case": case, "error": f"{type(error).__name__}: {error}"[:2000]})
                    continue
                row = {"case": case, "o": compare(out_g, out_tl), "lse": compare(lse_g, lse_tl)}
                bad = []
                o, lse = row["o"], row["lse"]
                if not o["finite"] or o["cosine"] < 0.9999 or o["rel_l2"] > 5e-3:
                    bad.append(f"O vs tl {o}")
                if not lse["finite"] or lse["max_abs"] > 1e-3:
                    bad.append(f"lse vs tl {lse}")
                if ref_err is not None:
                    row["ref_rel_l2"], row["tl_ref_rel_l2"] = rel_l2(out_g, out_ref), ref_err
                    if row["ref_rel_l2"] > 1.05 * ref_err + 1e-4:
                        bad.append(f"O vs reference {row['ref_rel_l2']:.4g} (tl {ref_err:.4g})")
                row["ok"] = not bad
                failures += [f"{case}: {b}" for b in bad]
                rows.append(row)
                refs = f" ref {row['ref_rel_l2']:.4f} (tl {ref_err:.4f})" if ref_err is not None else ""
                print(
                    f"{'ok  ' if not bad else 'FAIL'} {case:<48} "
                    + " ".join(
                        f"{n} bits {100 * c['bitwise_equal']:.3f}% max {c['max_abs']:.3g} rel {c['rel_l2']:.2e} "
                        f"cos {c['cosine']:.7f}"
                        for n, c in (("O", o), ("lse", lse))
                    )
                    + refs,
                    flush=True,
                )
            x = raw = None
            torch.cuda.empty_cache()
    dog.set("sagebwd_forward dispatch")
    try:
        failures += check_dispatch()
    except Exception as error:  # noqa: BLE001 - reported
        errors += 1
        print(f"ERROR dispatch: {type(error).__name__}: {error}", flush=True)
    times = []
    if not args.quick and not errors:
        try:
            times = timing(dog, args.variant)
        except Exception as error:  # noqa: BLE001 - reported; exit 2
            errors += 1
            print(f"ERROR timing: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
    dog.set("")
    print("\nSummary:")
    for row in times:
        print(f"  {row['case']:<40} " + " ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items()) + " TFLOPS")
    return finish(args.out, {"rows": rows, "timing": times}, failures, errors)


if __name__ == "__main__":
    sys.exit(main())
