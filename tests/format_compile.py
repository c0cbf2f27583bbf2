"""Compile the kernels every product format reaches for sm_90 without a GPU, and exit 1 when one does not compile.

``benchmarks.kernels.sm90_compile`` compiles a forward and backward at the default precision (INT8 Q K, P V, dV, dS) and
the Gluon compile scripts compile the Gluon kernels with an INT8 dS. This adds the other formats (two precisions,
:data:`CHANGES`, between them every format of every product): a forward and backward through ``sage_attention_triton``
on the portable path and on the Hopper path (``SAGE_LIGHTNING_HOPPER=off`` and ``force``), and with ``--gluon`` the
Gluon dQ and dK/dV launchers with an FP8 and a bf16 dS (the variants the backward launches: one warpgroup per block at
D=64, two consumer warpgroups at D=128). Device run 46 is why: a change to a helper every backward kernel calls left the
portable kernels uncompilable with an FP8 dS, and neither the interpreter nor the default precision's compile saw it::

    python -m tests.format_compile --gluon --out /tmp/formats-sm90.json
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

#: The precisions compiled, between them every format of every product beside the default's: an FP8 dS against INT8
#: Q'^ and K'^ (their codes widened) with Q-smoothing, and FP8 Q K, P V, dV and dP with a bf16 dS.
CHANGES = (
    {"ds": "fp8", "smooth_q": True},
    {"qk": "fp8", "pv": "fp8", "dv": "fp8", "dp": "fp8", "ds": "bf16"},
)
#: The Gluon backward's dS formats beside INT8 (what the Gluon compile scripts take).
GLUON_DS = ("fp8", "bf16")


def _entry_points(seq: int, head_dim: int, failures: list[str]) -> None:
    """A causal forward and backward at every precision of :data:`CHANGES`, portable and Hopper paths
    (``sm90_compile``'s own entry-point call, given the precision)."""
    from sage_lightning.kernels import AttentionPrecision

    for path in ("portable", "hopper"):
        for change in CHANGES:
            offline._CASE["name"] = f"{path} D={head_dim} {change}"
            settings = dict(head_dim=head_dim, causal=True, tiles=(128, 64), path=path)
            try:
                offline._run_case({**settings, "precision": AttentionPrecision(**change)}, seq, 2, torch.bfloat16)
            except Exception:  # noqa: BLE001 - reported, the other cases go on
                failures.append(f"{offline._CASE['name']}:\n{traceback.format_exc()[-3000:]}")


def _gluon(seq: int, failures: list[str]) -> None:
    """The Gluon dQ and dK/dV launchers with each of :data:`GLUON_DS`, causal, at D=64 and D=128."""
    from sage_lightning.kernels.hopper import gluon_backward as gb
    from sage_lightning.kernels.hopper import gluon_dq as gq

    for head_dim in (64, 128):
        x = offline.backward_inputs(1, 4, 2, seq, head_dim)  # GQA: 2 query heads per kv head
        q_wide = x["q_op"].to(torch.bfloat16)
        for ds, name in ((ds, name) for ds in GLUON_DS for name in ("dq", "dkdv")):
            offline._CASE["name"] = f"gluon-{name} D={head_dim} ds={ds}"
            try:
                if name == "dq":
                    gq.gluon_dq(
                        x["grad_out"], x["delta"], x["q_op"], x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"],
                        is_causal=True, scale=head_dim**-0.5, ds_fmt=ds, wg=gq.gluon_dq_wg_serves(head_dim),
                    )  # fmt: skip
                else:
                    gb.gluon_dkdv(
                        x["grad_out"], x["delta"], x["do_codes_t"], x["do_scale"], x["q_op"], x["q_op_t"],
                        x["q_scale"], x["k_op"], x["k_scale"], x["v"], x["lse"], None, is_causal=True,
                        scale=head_dim**-0.5, ds_fmt=ds, wg=gb.gluon_dkdv_wg_serves(head_dim, seq), q_wide=q_wide,
                    )  # fmt: skip
            except Exception:  # noqa: BLE001 - reported, the other cases go on
                failures.append(f"{offline._CASE['name']}:\n{traceback.format_exc()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64, help="the entry points' head dim")
    parser.add_argument("--gluon", action="store_true", help="the Gluon launchers too (the GPU image's Triton)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    offline._install()
    failures: list[str] = []
    _entry_points(args.seq, args.head_dim, failures)
    if args.gluon:
        _gluon(args.seq, failures)
    offline.report(args.seq, args.out, case_width=44, kernel_width=20)
    print("\n\n".join(failures) or "every format compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
