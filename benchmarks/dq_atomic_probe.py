"""Measurement probe for issue 14's "dQ by atomics" lever: how fast can an H100's L2 take the fp32 dQ partial sums
that the dK/dV kernel would add, if dQ were accumulated there instead of recomputed by a separate kernel?

FlashAttention-3 computes dQ in its dK/dV program: each program (a block of keys) adds ``dS K`` for every query
tile into an fp32 dQ accumulator. With SageBwd's dK/dV programs of ``key_block`` keys that is ``128 x D`` fp32 per
(query tile, key block): ``4 x D / key_block`` bytes per score, 8 at D=128 and 64-key programs (8.6 GB at B=4,
H=16, N=4096). This probe adds exactly that traffic, nothing else, in the same grid shape: one program per
(key block, head) walking every 128-query tile, with

* ``red``: ``tl.atomic_add`` (relaxed) of the register tile, one reduction per element (``RED`` in SASS);
* ``tma``: the tensor descriptor's ``atomic_add`` (a bulk TMA reduce-add of the tile from shared memory);
* ``store``: plain stores of the same tiles (the write bandwidth they would have without the reduction);

and, in the same run and at the same shape, times the Gluon dQ kernel that the lever would remove, the Gluon dK/dV
kernel it would be added to (each the one ``backward()`` takes there), and the whole backward. If the reduction alone
takes about as long as the dQ kernel, the lever cannot pay at that key block.

Run on the device (Triton 3.6), from the project root after ``pip install -e .``::

    python3 benchmarks/dq_atomic_probe.py --out $OUT/dq-atomic-probe.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

os.environ.setdefault("SAGE_LIGHTNING_GLUON_DQ", "force")
os.environ.setdefault("SAGE_LIGHTNING_GLUON_DKDV", "force")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from accuracy import _commit, _versions, to_json  # noqa: E402

MODES = {"red": 0, "tma": 1, "store": 2}
BLOCK_M = 128


@triton.jit
def _reduce_probe(ACC, desc, seq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr):
    """Program (key block, head): every 128-query tile of its head gets one ``[128, D]`` fp32 tile added."""
    pid_k = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    val = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32) + (pid_k + 1).to(tl.float32)
    for m in range(0, seq // BLOCK_M):
        row0 = bh * seq + m * BLOCK_M
        if MODE == 0:
            tl.atomic_add(ACC + (row0 + rows)[:, None] * HEAD_DIM + cols[None, :], val, sem="relaxed")
        elif MODE == 1:
            desc.atomic_add([row0, 0], val)
        else:
            tl.store(ACC + (row0 + rows)[:, None] * HEAD_DIM + cols[None, :], val)


def reduce_tiles(acc: torch.Tensor, seq: int, key_block: int, mode: str) -> None:
    """One launch of :func:`_reduce_probe` over ``acc`` ``[B*H*N, D]`` fp32."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, head_dim = acc.shape
    desc = TensorDescriptor.from_tensor(acc, [BLOCK_M, head_dim])
    grid = (seq // key_block, rows // seq)
    _reduce_probe[grid](acc, desc, seq, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, MODE=MODES[mode], num_warps=8)


def check_sum(seq: int, head_dim: int, key_block: int, mode: str) -> bool:
    """After one launch every element holds ``1 + 2 + ... + seq / key_block`` (``store``: some program's value)."""
    acc = torch.zeros(2 * seq, head_dim, device="cuda")
    reduce_tiles(acc, seq, key_block, mode)
    n = seq // key_block
    if mode == "store":
        return bool(((acc >= 1) & (acc <= n)).all())
    return bool((acc == n * (n + 1) / 2).all())


def kernel_times(shape: tuple, causal: bool) -> dict[str, float]:
    """Milliseconds of the Gluon dQ and dK/dV kernels that ``backward()`` takes at ``shape`` (the ``wg`` ones
    where they serve), and of the whole backward."""
    import gluon_dkdv_check as dkdv
    import gluon_dq_check as dq
    from sage_lightning.kernels.hopper import gluon_dq_wg as gqw

    x, raw = dkdv.inputs(shape, causal)
    tau = raw["tau"]
    dq_variant = "wg" if gqw.gluon_dq_wg_serves(shape[-1]) else "ws"
    dkdv_variant = "wg" if dkdv.serves(x, "wg") else "ws"
    bench = triton.testing.do_bench
    return {
        "gluon_dq_ms": bench(lambda: dq.gluon(x, causal, tau, dq_variant)),
        "gluon_dkdv_ms": bench(lambda: dkdv.gluon(x, causal, tau, None, dkdv_variant)),
        "backward_ms": bench(lambda: dkdv.run_backward(x, raw, causal)),
    }


#: (batch, heads, seq, head dim): the speed table's 16K-token shape at D=128 and the example's training shape.
SHAPES = [(4, 16, 4096, 128), (8, 10, 4096, 64)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON (a .md table is written beside it)")
    parser.add_argument("--key-block", type=int, nargs="+", default=[64, 128], help="keys per dK/dV program")
    args = parser.parse_args(argv)
    rows, lines = [], []
    for batch, heads, seq, head_dim in SHAPES:
        times = kernel_times((batch, heads, heads, seq, seq, head_dim), False)
        acc = torch.zeros(batch * heads * seq, head_dim, device="cuda")
        for key_block in args.key_block:
            for mode in MODES:
                ok = check_sum(seq, head_dim, key_block, mode)
                ms = triton.testing.do_bench(lambda a=acc, n=seq, kb=key_block, m=mode: reduce_tiles(a, n, kb, m))
                nbytes = batch * heads * (seq // key_block) * seq * head_dim * 4
                row = {"impl": f"dq_{mode}", "pass": "dq_reduce", "batch": batch, "heads": heads,
                       "kv_heads": heads, "seq": seq, "head_dim": head_dim, "causal": False,
                       "key_block": key_block, "ms": ms, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6,
                       "sum_ok": ok, **times}  # fmt: skip
                rows.append(row)
                lines.append(
                    f"| {batch}x{heads} N={seq} D={head_dim} | {key_block} | {mode} | {ok} | {nbytes / 1e9:.2f} | "
                    f"{ms:.3f} | {nbytes / ms / 1e6:.0f} | {times['gluon_dq_ms']:.3f} | {times['gluon_dkdv_ms']:.3f} | "
                    f"{times['backward_ms']:.3f} |"
                )
                print(lines[-1], flush=True)
    result = {
        "kind": "speed", "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "commit": _commit(), "command": "python3 benchmarks/dq_atomic_probe.py " + " ".join(argv or sys.argv[1:]),
        "versions": _versions(), "rows": rows,
    }  # fmt: skip
    args.out.write_text(to_json(result))
    table = [
        "| shape | keys per program | mode | sum right | GB | reduce ms | GB/s | Gluon dQ ms | Gluon dK/dV ms | "
        "backward ms |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
        *lines,
    ]
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    return 0 if all(r["sum_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
