"""How much of the backward's INT8 error is the choice of scale blocks? One product at a time, exact operands.

SageBwd quantizes the backward's P and dS with one scale per 128 x 64 tile, so that one set of dS codes
serves both dQ = dS K (a sum over keys) and dK = dS^T Q (a sum over queries). A scale may vary along every
dimension a product keeps, so finer blocks are allowed:

* ``dV = P^T dO`` sums over queries: P may take one scale per key column of the tile;
* ``dQ = dS K`` sums over keys: dS may take one scale per query row of the tile;
* ``dK = dS^T Q`` sums over queries: dS may take one scale per key column (a second set of codes);
* any of them may take its scale over fewer queries: a 64 x 64 tile for dS, a key column of 64 queries for P (what
  a kernel walking 64 queries at a time computes alone, FA3's shape).

This script isolates each product: the float64 reference's P and dS (no upstream error), quantized per
tile or per row/column, times the bf16 inputs quantized as SageBwd does (dO per 128 rows, K and Q not at
all, so only the block choice of P or dS differs), against the float64 gradient. It writes an accuracy
JSON (``path`` "reference", settings "dv: P per tile" and so on) and prints a table.

Example::

    python benchmarks/granularity.py                    # CPU, ~10 s
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy  # noqa: E402  (benchmarks/ is not a package; same header, inputs and metrics)
from sage_lightning.kernels.reference import exact_attention, quantize_int8  # noqa: E402

BLOCK_M, BLOCK_N = 128, 64
#: name: (query rows of a block, the dims of ``[B, H, N / rows, rows, Nk / 64, 64]`` one scale spans). The 64-row
#: schemes are what a kernel that walks 64 queries at a time can compute alone (FA3's backward at D=128: one
#: warpgroup owns 64 keys, each iteration 64 queries); SageBwd's tile is 128 x 64.
SCHEMES = {
    "per tile": (BLOCK_M, (-3, -1)),
    "per 64 x 64 tile": (64, (-3, -1)),
    "per query row": (BLOCK_M, (-1,)),
    "per key column": (BLOCK_M, (-3,)),
    "per key column of 64 queries": (64, (-3,)),
}
PRODUCTS = {  # product: the schemes allowed for it (the contraction must not cross a scale)
    "dv": ("per tile", "per key column", "per key column of 64 queries"),
    "dq": ("per tile", "per 64 x 64 tile", "per query row"),
    "dk": ("per tile", "per 64 x 64 tile", "per key column"),
}


def quantized(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """``deq(psi(x))`` for ``x`` ``[B, H, N, Nk]`` (N, Nk multiples of the tile) with the scheme's blocks."""
    b, h, n, nk = x.shape
    rows, dims = SCHEMES[scheme]
    blocks = x.reshape(b, h, n // rows, rows, nk // BLOCK_N, BLOCK_N)
    codes, scale = quantize_int8(blocks, dims)
    return (codes * scale).reshape(b, h, n, nk)


def product_errors(inputs: dict[str, torch.Tensor], causal: bool) -> list[dict]:
    """Rows ``{"product", "scheme", "tensor", "cos", "rel_l2"}`` for one input kind."""
    ref = exact_attention(inputs["q"], inputs["k"], inputs["v"], inputs["do"], is_causal=causal)
    do = inputs["do"].double()
    b, h, n, d = do.shape
    do_codes, do_scale = quantize_int8(do.reshape(b, h, n // BLOCK_M, BLOCK_M, d), (-2, -1))
    do_q = (do_codes * do_scale).reshape(b, h, n, d)
    tau = 1.0 / math.sqrt(d)
    rows = []
    for product, schemes in PRODUCTS.items():
        for scheme in schemes:
            if product == "dv":
                got, tensor = quantized(ref["P"], scheme).transpose(-1, -2) @ do_q, "dV"
            elif product == "dq":
                got, tensor = tau * quantized(ref["dS"], scheme) @ inputs["k"].double(), "dQ"
            else:
                got, tensor = tau * quantized(ref["dS"], scheme).transpose(-1, -2) @ inputs["q"].double(), "dK"
            cos, rel = accuracy.compare(got, ref[tensor])
            rows.append({"product": product, "scheme": scheme, "tensor": tensor, "cos": cos, "rel_l2": rel})
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run every input kind of the accuracy harness, print a table, write JSON beside the harness's results.

    Args:
        argv: command-line arguments (``--seq``, ``--head-dim``, ``--seed``, ``--causal``, ``--out``).

    Example::

        main(["--seq", "256", "--out", "/tmp/granularity.json"])
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024, help="a multiple of 128")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seq % BLOCK_M:
        parser.error(f"--seq must be a multiple of {BLOCK_M}; received {args.seq}")
    shape_args = accuracy.parse_args(
        ["--seq", str(args.seq), "--head-dim", str(args.head_dim), "--seed", str(args.seed)]
    )
    rows, lines = [], ["| inputs | product | scheme | cos | rel_l2 |", "|---|---|---|---:|---:|"]
    for kind in accuracy.input_kinds():
        for row in product_errors(accuracy.make_inputs(kind, shape_args), args.causal):
            setting = f"{row['product']}: {'P' if row['product'] == 'dv' else 'dS'} {row['scheme']}"
            rows.append(
                {
                    "path": "reference",
                    "setting": setting,
                    "inputs": kind,
                    "seq": args.seq,
                    "head_dim": args.head_dim,
                    "causal": args.causal,
                    "tensor": row["tensor"],
                    "cos": row["cos"],
                    "rel_l2": row["rel_l2"],
                }
            )
            lines.append(f"| {kind} | {row['product']} | {row['scheme']} | {row['cos']:.6f} | {row['rel_l2']:.5f} |")
    today = datetime.date.today()
    result = {
        "kind": "accuracy",
        "device": "cpu",
        "date": today.isoformat(),
        "commit": accuracy._commit(),
        "command": "python benchmarks/granularity.py" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
        "versions": accuracy._versions(),
        "rows": rows,
    }
    out = args.out or accuracy.REPO / "benchmarks" / "results" / f"accuracy-cpu-{today:%Y%m%d}-granularity.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(
        f"# INT8 scale blocks of the backward products\n\n{result['date']}, commit {result['commit']}\n\n"
        f"`{result['command']}`\n\n{table}\n"
    )
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
