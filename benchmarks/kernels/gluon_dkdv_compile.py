"""Compile the Gluon dK/dV kernel (``kernels/hopper/gluon_backward.py``) for sm_90 without a GPU, beside the portable
``_dkdv_kernel``, and print both kernels' resources (``sm90_compile``'s stand-in driver and report; nothing runs).
Run it with the GPU image's Triton (3.6); exits 1 when a Gluon case fails to compile or does not fit::

    python -m benchmarks.kernels.gluon_dkdv_compile --head-dim 64 128 --out /tmp/gluon-sm90.json
"""

from __future__ import annotations

import os
import sys

from benchmarks.kernels import sm90_compile as offline  # sets a fresh Triton cache before triton is imported
from benchmarks.kernels.gluon_dq_compile import compile_parser, record_failure, start_offline, unfit_cases

#: Gluon variants: warp-specialised (a load warp) or one 8-warp partition; ``-defer`` finishes each tile's dV and dK
#: in the next iteration; ``wg``: one warpgroup per 64-key half (``gluon_dkdv(wg=True)``, D=64 only).
VARIANTS = ("ws", "plain", "ws-defer", "plain-defer", "wg")


def main(argv: list[str] | None = None) -> int:
    parser = compile_parser(__doc__, "_dkdv_kernel")
    parser.add_argument(
        "--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS),
        help="Gluon variants: warp-specialised (a load warp) or one 8-warp partition; -defer finishes each tile's "
        "dV and dK in the next iteration",
    )  # fmt: skip
    args = parser.parse_args(argv)
    start_offline(args)
    os.environ["SAGE_LIGHTNING_GLUON_DKDV"] = "force"
    from sage_lightning.kernels.backward import backward
    from sage_lightning.kernels.hopper import gluon_backward as gb
    from sage_lightning.kernels.plan import plan_attention

    failures = 0
    for head_dim in args.head_dim:
        for causal in (False, True):
            for with_stats in (False, True):
                x = offline.backward_inputs(1, 2, 2, args.seq, head_dim)
                stats = x["stats"] if with_stats else None
                for stages, variant in [(st, va) for va in args.variant for st in args.stages]:
                    if variant == "wg" and not gb.gluon_dkdv_wg_serves(head_dim, args.seq):
                        continue
                    offline._CASE["name"] = (
                        f"gluon-{variant} D={head_dim} causal={causal} stats={with_stats} st={stages}"
                    )
                    try:
                        planned = plan_attention(x["grad_out"], x["k_op"], is_causal=causal, backend="triton").dkdv
                        assert planned.startswith("gluon_dkdv"), planned
                        operands = (
                            x["grad_out"], x["delta"], x["do_codes_t"], x["do_scale"], x["q_op"], x["q_op_t"],
                            x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"], stats,
                        )  # fmt: skip
                        gb.gluon_dkdv(
                            *operands, is_causal=causal, scale=head_dim**-0.5, stages=stages or None,
                            warp_specialize=variant.startswith("ws") or variant == "wg",
                            defer=variant.endswith("defer"), wg=variant == "wg",
                        )  # fmt: skip
                    except Exception as error:  # noqa: BLE001 - reported, the other cases go on
                        failures += 1
                        record_failure("_gluon_dkdv_kernel", stages, error)
                if args.no_portable or with_stats:
                    continue
                offline._CASE["name"] = f"portable D={head_dim} causal={causal}"
                backward(  # backward() itself, with the portable _dkdv_kernel
                    x["grad_out"], x["out"], x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], x["v"], x["lse"],
                    None, is_causal=causal, scale=head_dim**-0.5, block_m=128, block_n=64, qk="int8",
                    dv="int8", dp="bf16", ds="int8",
                )  # fmt: skip
    failures += unfit_cases("_gluon_dkdv")
    offline.report(args.seq, args.out, args.verbose, case_width=48, kernel_width=20, skip=("_dq_kernel",))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
