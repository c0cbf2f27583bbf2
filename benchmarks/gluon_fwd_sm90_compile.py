"""Compile the Gluon forward (``kernels/hopper/gluon_forward.py``) for sm_90 on a machine without a GPU, beside
``_hopper_forward_kernel`` (``kernels/hopper/forward.py``) it would replace, and print both kernels' resources.

It reuses :mod:`sm90_compile`'s stand-in CUDA driver and per-kernel report (registers and spills from ``ptxas
-v``, shared memory, CTAs per SM, the hot loop's SASS size and wgmma shapes); nothing runs and no value is
checked (``benchmarks/gluon_forward_check.py`` does that on a GPU). Run it with the GPU image's Triton (3.6) and
``sage_lightning.kernels`` resolving to a tree with the Gluon forward (main with
``benchmarks/pending/issue-14-gluon-forward.patch`` applied)::

    python benchmarks/gluon_fwd_sm90_compile.py --head-dim 64 128 --out /tmp/gluon-fwd-sm90.json

The tl kernel's rows are one per autotuning candidate; the ``loop`` column counts the innermost loop that issues
wgmma and the softmax's exp2 (a consumer warpgroup's loop in the Gluon kernel). Exits 1 when a Gluon case fails
to compile or does not fit.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sm90_compile as offline  # noqa: E402  (sets a fresh Triton cache before triton is imported)
import torch  # noqa: E402

#: Gluon variants: ``pp`` the consumer warpgroups take turns issuing wgmma, ``free`` they do not; ``-smem`` P's
#: codes go through shared memory (the wrapper's default), ``-regs`` they stay in registers as the A operand.
VARIANTS = ("pp-smem", "free-smem", "pp-regs", "free-regs")


def _softmax_loop(sass: str) -> dict | None:
    """:func:`sm90_compile.hot_loop`, but the innermost loop that issues wgmma *and* at least 16 ``MUFU`` (the
    softmax's exp2): a warp-specialised kernel's SASS wraps its partitions in a dispatch loop, and the shortest
    span with a GMMA can be the epilogue's or the prologue's rather than the consumers' loop."""
    lines = [(int(addr, 16), op, rest) for addr, op, rest in offline._SASS_LINE.findall(sass)]
    branches = [
        (a, int(t.group(1), 16)) for a, o, r in lines if o == "BRA" and (t := offline._BRANCH_TARGET.search(o + r))
    ]
    loops = []
    for addr, target in branches:
        if target < addr:
            body = [(a, o) for a, o, _ in lines if target <= a <= addr]
            if any(o.endswith("GMMA") for _, o in body) and sum(o == "MUFU" for _, o in body) >= 16:
                loops.append((target, addr, body))
    if not loops:
        return None
    start, end, body = min(loops, key=lambda loop: len(loop[2]))
    opcodes = offline.collections.Counter(o for _, o in body)
    skipped = set()
    for addr, target in branches:
        if start <= addr < target <= end:
            skipped.update(a for a, _ in body if addr < a < target)
    return {
        "instructions": len(body),
        "fast_path": len(body) - len(skipped),
        "quarter_rate": sum(n for o, n in opcodes.items() if o in offline.QUARTER_RATE),
        "opcodes": dict(opcodes.most_common()),
    }


def _inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int) -> dict:
    """CPU tensors of the shapes and dtypes the forward takes (values never read)."""
    i8, f32 = torch.int8, torch.float32
    return dict(
        q_op=torch.zeros(batch, heads, seq, head_dim, dtype=i8),
        q_scale=torch.zeros(batch, heads, seq // 128, dtype=f32),
        k_op=torch.zeros(batch, kv_heads, seq, head_dim, dtype=i8),
        k_scale=torch.zeros(batch, kv_heads, seq // 64, dtype=f32),
        v_op=torch.zeros(batch, kv_heads, head_dim, seq, dtype=i8),
        v_scale=torch.zeros(batch, kv_heads, seq // 64, dtype=f32),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--stages", type=int, nargs="+", default=[0], help="K/V ring depths (0: the wrapper's)")
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--no-tl", action="store_true", help="skip _hopper_forward_kernel")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--verbose", action="store_true", help="print failures' tracebacks")
    parser.add_argument("--dump", type=Path, help="write each kernel's PTX and SASS here")
    args = parser.parse_args(argv)
    offline._DUMP["dir"] = args.dump
    offline.hot_loop = _softmax_loop  # _describe looks it up at call time
    offline._install()  # before the kernels' modules are imported: their JIT functions keep the patched compile
    os.environ["SAGE_LIGHTNING_GLUON_FWD"] = "force"
    os.environ["SAGE_LIGHTNING_HOPPER"] = "force"
    from sage_lightning.kernels.hopper import gluon_forward as gf
    from sage_lightning.kernels.hopper.forward import hopper_forward

    failures = 0
    for head_dim in args.head_dim:
        for causal in (False, True):
            x = _inputs(1, 2, 2, args.seq, head_dim)
            tiles = dict(out_dtype=torch.bfloat16, is_causal=causal, scale=head_dim**-0.5, block_m=128, block_n=64)
            for stages, variant in [(st, va) for va in args.variant for st in args.stages]:
                offline._CASE["name"] = f"gluon-{variant} D={head_dim} causal={causal} st={stages}"
                try:
                    assert gf.gluon_forward_applies(
                        x["q_op"], None, x["k_op"], qk_int8=True, pv_int8=True,
                        **{k: v for k, v in tiles.items() if k != "is_causal"},
                    )  # fmt: skip
                    gf.gluon_forward(
                        x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], x["v_op"], x["v_scale"], **tiles,
                        stages=stages or None, pingpong=variant.startswith("pp"),
                        p_in_regs=variant.endswith("regs"),
                    )  # fmt: skip
                except Exception as error:  # noqa: BLE001 - reported, the other cases go on
                    failures += 1
                    message = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"[-12000:]
                    offline._RECORDS.append(
                        offline.Compiled(kernel="_gluon_forward_kernel", case=offline._CASE["name"], constants={},
                                         num_warps=4, num_stages=stages, fits=False, error=message)
                    )  # fmt: skip
            if not args.no_tl:
                offline._CASE["name"] = f"tl D={head_dim} causal={causal}"
                hopper_forward(x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], x["v_op"], x["v_scale"], **tiles)
    failures += sum(1 for r in offline._RECORDS if r.kernel == "_gluon_forward_kernel" and not r.error and not r.fits)

    import triton

    offline.report_gluon_compile(
        f"Triton {triton.__version__}, target sm_90 (offline), seq {args.seq}, bf16 out, INT8 QK and PV",
        args.out,
        args.verbose,
        case_width=40,
        kernel_width=22,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
