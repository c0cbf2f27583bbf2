"""Compile the warp-specialised Gluon forward with FP8 P.V (``kernels/hopper/gluon_forward.py``) for sm_90 without a
GPU, beside the ``tl`` Hopper forward's FP8 P.V candidates (``_hopper_forward_kernel``, ``PV_FMT="fp8"``), and print
their resources (``sm90_compile``'s stand-in driver and report: shared memory, registers, spills, the hot loop's SASS
and ptxas's C7514; nothing runs). Run it with the GPU image's Triton (3.6); exits 1 when a Gluon case fails to compile
or does not fit::

    python -m tests.gluon_fwd_compile --head-dim 64 128 --qk int8 fp8 --out /tmp/gluon-fwd-sm90.json

Per case the Gluon consumer loop handles 64 rows x 64 keys per warpgroup (32 scores per thread), as each thread of the
``tl`` kernel's candidates does per iteration (``BLOCK_M=64`` with 4 warps, ``128`` with 8): the loop counts compare
per score.
"""

from __future__ import annotations

import sys

# isort: off
from benchmarks.kernels import sm90_compile as offline  # first: it sets a fresh Triton cache before triton is imported
from benchmarks.kernels.gluon_dq_compile import compile_parser, record_failure, start_offline, unfit_cases
import torch
# isort: on

#: Gluon variants: ``pp`` the consumer warpgroups take turns (ping-pong), ``free`` they issue freely; ``-smem`` P's
#: codes through shared memory (two buffers per warpgroup), ``-regs`` from registers; ``3wg-`` three consumer
#: warpgroups a program (192 rows) instead of two.
VARIANTS = ("pp-smem", "pp-regs", "free-smem", "free-regs", "3wg-pp-smem", "3wg-free-smem")


def forward_inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, qk: str) -> dict:
    """CPU tensors of the shapes and dtypes the forward's launch takes with FP8 P.V (values never read)."""
    codes = torch.int8 if qk == "int8" else torch.float8_e4m3fn
    f32 = torch.float32
    return dict(
        q_op=torch.zeros(batch, heads, seq, head_dim, dtype=codes),
        q_scale=torch.zeros(batch, heads, seq // 128, dtype=f32),
        k_op=torch.zeros(batch, kv_heads, seq, head_dim, dtype=codes),
        k_scale=torch.zeros(batch, kv_heads, seq // 64, dtype=f32),
        v_op=torch.zeros(batch, kv_heads, head_dim, seq, dtype=torch.float8_e4m3fn),
        v_scale=torch.zeros(batch, kv_heads, head_dim, dtype=f32),
        row_poison=torch.zeros(batch, heads, seq, dtype=f32),
        first_bad=torch.zeros(batch * kv_heads, dtype=torch.int32),
    )


def main(argv: list[str] | None = None) -> int:
    parser = compile_parser(__doc__, "_hopper_forward_kernel (FP8 P.V)")
    parser.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1])
    parser.add_argument("--qk", nargs="+", choices=("int8", "fp8"), default=["int8", "fp8"])
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args(argv)
    start_offline(args)
    from sage_lightning.kernels.hopper import forward as hf
    from sage_lightning.kernels.hopper import gluon_forward as gf

    failures = 0
    for head_dim in args.head_dim:
        for causal in (bool(c) for c in args.causal):
            for qk in args.qk:
                x = forward_inputs(1, 4, 2, args.seq, head_dim, qk)  # GQA: 2 query heads per kv head
                operands = (x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], x["v_op"], x["v_scale"])
                tiles = dict(out_dtype=torch.bfloat16, is_causal=causal, scale=head_dim**-0.5, block_m=128,
                             block_n=64, qk=qk, pv="fp8", row_poison=x["row_poison"],
                             first_bad=x["first_bad"])  # fmt: skip
                for stages, variant in [(st, va) for va in args.variant for st in args.stages]:
                    offline._CASE["name"] = f"gluon-fwd-{variant} D={head_dim} c={int(causal)} qk={qk} st={stages}"
                    try:
                        gf.gluon_forward(
                            *operands, **tiles, stages=stages or None, pingpong="pp" in variant,
                            p_in_regs=variant.endswith("regs"), consumers=3 if variant.startswith("3wg") else 2,
                        )  # fmt: skip
                    except Exception as error:  # noqa: BLE001 - reported, the other cases go on
                        failures += 1
                        record_failure("_gluon_forward_kernel", stages, error)
                if not args.no_portable:
                    offline._CASE["name"] = f"tl D={head_dim} c={int(causal)} qk={qk}"
                    hf.hopper_forward(*operands, **tiles)
    failures += unfit_cases("_gluon_forward_kernel")
    offline.report(args.seq, args.out, args.verbose, case_width=40, kernel_width=22)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
