"""Compile the Gluon dQ kernel (``kernels/hopper/gluon_dq.py``) for sm_90 without a GPU, beside the portable
``_dq_kernel``, and print both kernels' resources (``sm90_compile``'s stand-in driver and report, and ``serial``:
ptxas's note C7514 that it serialized the wgmma; nothing runs). Run it with the GPU image's Triton (3.6); exits 1
when a Gluon case fails to compile or does not fit::

    python -m benchmarks.kernels.gluon_dq_compile --head-dim 64 128 --out /tmp/gluon-dq-sm90.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

# isort: off
from benchmarks.kernels import sm90_compile as offline  # first: it sets a fresh Triton cache before triton is imported
import torch
# isort: on

#: Gluon variants: warp-specialised (a load warp) or one 8-warp partition; ``-smem``: the dS codes through shared
#: memory instead of registers; ``-defer``: each tile's dQ product finished in the next iteration; ``wg``: one
#: warpgroup per 128-query block (``gluon_dq(wg=True)``, D=64 only).
VARIANTS = ("ws", "plain", "ws-smem", "plain-smem", "ws-defer", "plain-defer", "ws-smem-defer", "wg")


def start_offline(args: argparse.Namespace) -> None:
    """Install ``sm90_compile``'s stand-in driver (PTX and SASS to ``args.dump``), before the kernels' modules are
    imported: their JIT functions keep the patched compile."""
    offline._DUMP["dir"] = args.dump
    offline._install()


def unfit_cases(prefix: str) -> int:
    """How many cases of the kernels named ``prefix...`` compiled but do not fit sm_90's shared memory."""
    return sum(1 for r in offline._RECORDS if r.kernel.startswith(prefix) and not r.error and not r.fits)


def record_failure(kernel: str, num_stages: int | None, error: BaseException) -> None:
    """In an ``except``: a Gluon case that failed to compile, as a report row of 8 warps (the other cases go on)."""
    message = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"[-12000:]
    offline._RECORDS.append(offline.Compiled(kernel=kernel, case=offline._CASE["name"], constants={}, num_warps=8,
                                             num_stages=num_stages, fits=False, error=message))  # fmt: skip


def compile_parser(doc: str, portable: str) -> argparse.ArgumentParser:
    """The Gluon compile scripts' shared options (``--variant`` and what differs are added by each)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--stages", type=int, nargs="+", default=[0], help="Gluon TMA ring depths to compile (0: the wrapper's default)"
    )
    parser.add_argument("--no-portable", action="store_true", help=f"skip the portable {portable}")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--verbose", action="store_true", help="print failures' tracebacks")
    parser.add_argument("--dump", type=Path, help="write each kernel's PTX and SASS here")
    return parser


def _portable(x: dict, causal: bool) -> None:
    """``backward()``'s ``_dq_kernel`` launch (every autotuning candidate is compiled)."""
    from sage_lightning.kernels import backward as bwd
    from sage_lightning.kernels.quant import dot_precision, padded_head_dim, seq_bucket
    from sage_lightning.kernels.tiles import LOG2E

    q_op, k_op, do = x["q_op"], x["k_op"], x["grad_out"]
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    dq = torch.empty_like(do)
    tau = head_dim**-0.5
    bwd._dq_kernel[(seq_q // 128, batch * heads)](
        q_op, x["q_scale"], x["q_scale"], k_op, x["k_op_t"], x["k_scale"], x["v"], x["k_scale"],
        do, do, x["delta"], x["lse"], x["delta"], dq, *do.stride(),
        heads, heads // kv_heads, seq_q, seq_k, head_dim, seq_bucket(max(seq_q, seq_k)), seq_bucket(batch * heads),
        tau * LOG2E, tau,
        BLOCK_M=128, BLOCK_N=64, D_PAD=padded_head_dim(head_dim), CAUSAL=causal, QK_FMT="int8", DP_FMT="bf16",
        DS_FMT="int8", SMOOTH_Q=False, DOT_PRECISION=dot_precision(do.dtype),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = compile_parser(__doc__, "_dq_kernel")
    parser.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1])
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args(argv)
    start_offline(args)
    from sage_lightning.kernels.hopper import gluon_dq as gq

    failures = 0
    for head_dim in args.head_dim:
        for causal in (bool(c) for c in args.causal):
            x = offline.backward_inputs(1, 4, 2, args.seq, head_dim)  # GQA: 2 query heads per kv head
            for stages, variant in [(st, va) for va in args.variant for st in args.stages]:
                if variant == "wg" and not gq.gluon_dq_wg_serves(head_dim):
                    continue
                offline._CASE["name"] = f"gluon-dq-{variant} D={head_dim} causal={causal} st={stages}"
                try:
                    gq.gluon_dq(
                        x["grad_out"], x["delta"], x["q_op"], x["q_scale"], x["k_op"], x["k_scale"],
                        x["v"], x["lse"], is_causal=causal, scale=head_dim**-0.5, stages=stages or None,
                        warp_specialize=variant.startswith("ws") or variant == "wg",
                        codes_in_registers="smem" not in variant, defer=variant.endswith("defer"),
                        wg=variant == "wg",
                    )  # fmt: skip
                except Exception as error:  # noqa: BLE001 - reported, the other cases go on
                    failures += 1
                    record_failure("_gluon_dq_kernel", stages, error)
            if not args.no_portable:
                offline._CASE["name"] = f"portable D={head_dim} causal={causal}"
                _portable(x, causal)
    failures += unfit_cases("_gluon_dq")
    offline.report(args.seq, args.out, args.verbose, case_width=40, kernel_width=18)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
