"""Measurement probe for issue 14's forward bar: what would an FP8 ``P V`` be worth in the Hopper forward?

The Hopper forward (``kernels/hopper/forward.py``) spends, per score at D=128, about 6 of its 20 instructions on the
INT8 ``P^ V^`` product's output: its accumulator set to the mantissa-trick constant before each tile's product, the
int32 result converted and scaled by one fused multiply-add, and the running O rescaled and added (``D / BLOCK_N``
elements of O per score, two or three instructions each). An FP8 (e4m3) product accumulates in fp32 inside the
tensor core, so O takes only the running-max rescale; that is why issue 15 asks for FP8 formats, and why issue 14
names FP8 ``P V`` as what would close its forward bar. Before issue 15 builds the format, this probe measures both
sides of that one product in the kernel we ship, everything else unchanged (INT8 ``Q'^ K'^T`` with the same scales
and tiles, the same online softmax in base 2, the same TMA descriptors and autotuning candidates):

* ``P`` as e4m3 of ``448 * P~`` with ``P~ = exp2(S - m)`` relative to the running max (so ``P~ <= 1`` and one static
  scale serves every tile, as in SageAttention2's FP8 ``P V``), summed into O inside the product;
* ``V`` as e4m3 with one scale per channel over the keys (``max |V[:, d]| / 448``), applied once at the end with
  ``1 / (448 l)``; stored ``[D, N]`` like ``V^`` (8-bit products on Hopper take the summed-over keys contiguous).

It reports O's relative L2 error against float64 attention for the shipped INT8 forward and the probe, over inputs
that stress each format (normal; K with outlier channels; V with outlier channels; sharp attention), and the time of
the forward kernel alone (operands quantized beforehand, the same for both), of the whole SageBwd forward call and
of SDPA's cuDNN forward, interleaved in one process. The probe's own kernel of device run 13 has since become the
Hopper forward's ``pv="fp8"`` path (issue 15), which the probe now calls: the figures of
``results/speed-h200-20261126-fp8-pv-probe.md`` are of that kernel before it shipped.

Run on the device (Triton 3.6), from the project root after ``pip install -e .``::

    python3 benchmarks/fp8_pv_probe.py --out $OUT/speed-<device>-<date>-fp8-pv-probe.json

and offline, registers, spills and the hot loop for sm_90 without a GPU (``sm90_compile``'s stand-in driver)::

    python benchmarks/fp8_pv_probe.py --compile-only
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--compile-only" in sys.argv:
    import sm90_compile as offline  # sets a fresh Triton cache before triton is imported

    offline._install()

import torch  # noqa: E402
import triton  # noqa: E402
from sage_lightning.kernels.hopper.forward import hopper_forward  # noqa: E402
from sage_lightning.kernels.quant import FP8_MAX, output_like, quantize_channels_fp8, quantize_rows  # noqa: E402

#: e4m3's largest finite value: ``P~ <= 1`` maps to at most this, ``V``'s per-channel max to this.
E4M3_MAX = FP8_MAX


def quantize_v_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V ``[B, H, N, D]`` as e4m3 ``[B, H, D, N]`` with one fp32 scale per channel ``[B, H, D]`` (max |V| / 448): the
    shipped :func:`sage_lightning.kernels.quant.quantize_channels_fp8`."""
    return quantize_channels_fp8(v)


def operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 128, block_n: int = 64) -> dict:
    """The quantized operands of both forwards: Q'^, K'^ (K-smoothed) and their scales as SageBwd makes them; V^ for
    the INT8 product and V in e4m3 for the probe."""
    q_op, q_scale, _ = quantize_rows(q, block_m, fmt="int8")
    k_op, k_scale, _ = quantize_rows(k, block_n, fmt="int8", mean=k.mean(dim=2, dtype=torch.float32))
    v_op, v_scale, _ = quantize_rows(v, block_n, fmt="int8", transposed=True)
    v8, v8_scale = quantize_v_fp8(v)
    return {"q_op": q_op, "q_scale": q_scale, "k_op": k_op, "k_scale": k_scale, "v_op": v_op, "v_scale": v_scale,
            "v8": v8, "v8_scale": v8_scale, "block_m": block_m, "block_n": block_n}  # fmt: skip


def fp8_pv_forward(x: dict, *, is_causal: bool, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """O of the shipped Hopper forward with ``pv="fp8"`` from :func:`operands` (the probe's kernel, shipped since)."""
    out, _ = hopper_forward(
        x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], x["v8"], x["v8_scale"], out_dtype=out_dtype,
        is_causal=is_causal, scale=scale, block_m=x["block_m"], block_n=x["block_n"], pv="fp8",
    )  # fmt: skip
    return out


def int8_forward(x: dict, *, is_causal: bool, scale: float, out_dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """O of the shipped Hopper forward kernel from the same :func:`operands`."""
    out, _ = hopper_forward(
        x["q_op"], x["q_scale"], None, x["k_op"], x["k_scale"], x["v_op"], x["v_scale"], out_dtype=out_dtype,
        is_causal=is_causal, scale=scale, block_m=x["block_m"], block_n=x["block_n"], out=output_like(like),
    )  # fmt: skip
    return out


def inputs(kind: str, shape: tuple[int, int, int, int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 q, k, v ``[B, H, N, D]`` of one input kind."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen) for _ in range(3))
    if kind == "k_outliers":
        k[..., :4] = k[..., :4] * 4 + 8
    elif kind == "v_outliers":
        v[..., :4] = v[..., :4] * 20
    elif kind == "sharp":
        q = q * 4
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def compile_only() -> int:
    """Compile the Hopper forward's FP8 ``P V`` for sm_90 offline (D=64 and 128, causal or not) and print
    ``sm90_compile``'s table of it: registers, spills, shared memory and the hot loop's instructions."""
    failures = 0
    for head_dim in (128, 64):
        shape = (1, 2, 1024, head_dim)
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(3))
        x = operands(q, k, v)
        for causal in (False, True):
            offline._CASE["name"] = f"fp8 P.V D={head_dim} causal={causal}"
            try:
                fp8_pv_forward(x, is_causal=causal, scale=head_dim**-0.5, out_dtype=q.dtype)
            except Exception as error:  # noqa: BLE001 - reported, the other cases go on
                failures += 1
                print(f"{offline._CASE['name']}: {type(error).__name__}: {error}"[:4000])
    offline.report_gluon_compile(
        f"Triton {triton.__version__}, sm_90 offline",
        None,
        False,
        case_width=26,
        skip=("_quantize_rows_kernel", "_quantize_channels_fp8_kernel"),
    )
    return 1 if failures else 0


def time_shape(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> dict:
    """One speed row: the two forward kernels alone (operands quantized beforehand), the whole SageBwd forward call
    and SDPA's cuDNN forward, in three interleaved ``do_bench`` rounds (the best of each kept)."""
    import torch.nn.functional as F
    from sage_lightning.kernels.ops import sage_attention_triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    q, k, v = inputs("normal", (batch, heads, seq, head_dim))
    tau = head_dim**-0.5
    x = operands(q, k, v)

    def cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    calls = {
        "int8_kernel": lambda: int8_forward(x, is_causal=causal, scale=tau, out_dtype=q.dtype, like=q),
        "fp8_kernel": lambda: fp8_pv_forward(x, is_causal=causal, scale=tau, out_dtype=q.dtype),
        "sage_call": lambda: sage_attention_triton(q, k, v, is_causal=causal, with_lse=False),
        "cudnn": cudnn,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(3):
        for name, fn in calls.items():
            times[name].append(do_bench(fn, warmup=25, rep=150))
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    row = {"what": "speed", "pass": "fwd", "batch": batch, "heads": heads, "kv_heads": heads, "seq": seq,
           "head_dim": head_dim, "causal": causal}  # fmt: skip
    for name, ms in times.items():
        row[f"{name}_ms"] = round(min(ms), 4)
        row[f"{name}_tflops"] = round(flops / min(ms) / 1e9, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 offline, print resources")
    args = parser.parse_args(argv)
    if args.compile_only:
        return compile_only()
    import torch.nn.functional as F
    from accuracy import _commit, _versions, to_json
    from device_check import rel_l2

    rows = []
    for kind in ("normal", "k_outliers", "v_outliers", "sharp"):
        for head_dim in (128, 64):
            for causal in (False, True):
                q, k, v = inputs(kind, (1, 8, 2048, head_dim))
                tau = head_dim**-0.5
                x = operands(q, k, v)
                exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
                err = {
                    "int8": int8_forward(x, is_causal=causal, scale=tau, out_dtype=q.dtype, like=q),
                    "fp8": fp8_pv_forward(x, is_causal=causal, scale=tau, out_dtype=q.dtype),
                }
                row = {"what": "accuracy", "inputs": kind, "head_dim": head_dim, "seq": 2048, "causal": causal}
                for name, out in err.items():
                    row[f"o_rel_l2_{name}"] = round(rel_l2(out, exact), 6)
                rows.append(row)
                print(row, flush=True)
    for head_dim in (128, 64):
        for seq in (2048, 4096, 8192):
            for causal in (False, True):
                row = time_shape(16384 // seq, 2048 // head_dim, seq, head_dim, causal)
                rows.append(row)
                print(row, flush=True)
    print("\n| D | N | causal | INT8 P.V kernel | FP8 P.V kernel | FP8 / INT8 | sage call | cuDNN "
          "| FP8 kernel / cuDNN |")  # fmt: skip
    print("|---:|---:|:-:|---:|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["what"] == "speed"):
        print(f"| {r['head_dim']} | {r['seq']} | {'yes' if r['causal'] else 'no'} | {r['int8_kernel_tflops']:.0f} | "
              f"{r['fp8_kernel_tflops']:.0f} | {r['int8_kernel_ms'] / r['fp8_kernel_ms']:.3f}x | "
              f"{r['sage_call_tflops']:.0f} | {r['cudnn_tflops']:.0f} | "
              f"{r['cudnn_ms'] / r['fp8_kernel_ms']:.3f}x |")  # fmt: skip
    print("\n| inputs | D | causal | O rel L2 vs fp64, INT8 P.V | FP8 P.V |")
    print("|---|---:|:-:|---:|---:|")
    for r in (r for r in rows if r["what"] == "accuracy"):
        print(f"| {r['inputs']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['o_rel_l2_int8']:.5f} | "
              f"{r['o_rel_l2_fp8']:.5f} |")  # fmt: skip
    if args.out:
        result = {"kind": "speed", "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                  "commit": _commit(),
                  "command": " ".join(["python3 benchmarks/fp8_pv_probe.py", *(argv or sys.argv[1:])]),
                  "versions": _versions(), "rows": rows}  # fmt: skip
        args.out.write_text(to_json(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
