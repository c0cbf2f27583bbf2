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
of SDPA's cuDNN forward, interleaved in one process. Nothing dispatches to the probe's kernel and no GPU record
carries it: it is input for issue 15, not a shipped path.

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
import triton.language as tl  # noqa: E402
from sage_lightning.kernels.forward import LOG2E, key_range, tile_mask  # noqa: E402
from sage_lightning.kernels.hopper.forward import _configs, hopper_forward  # noqa: E402
from sage_lightning.kernels.quant import _ROUNDER, _ROUNDER_BITS, output_like, quantize_rows, seq_bucket  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

#: e4m3's largest finite value: ``P~ <= 1`` maps to at most this, ``V``'s per-channel max to this.
E4M3_MAX = tl.constexpr(448.0)


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "SEQ_BUCKET", "HEADS_BUCKET", "CAUSAL", "BLOCK_N"])
@triton.jit
def _fp8_pv_kernel(
    desc_q,
    desc_k,
    desc_vt,
    desc_o,
    Q_SCALE,
    K_SCALE,
    V_SCALE,
    HEADS,
    GROUP,
    SEQ_Q,
    SEQ_K,
    SEQ_BUCKET,
    HEADS_BUCKET,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """The Hopper forward's loop (no Q-smoothing, no lse) with ``P V`` in e4m3, accumulated in fp32 by the MMA."""
    if CAUSAL:
        pid_bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = pid_bh // HEADS
    kv_bh = b * (HEADS // GROUP) + (pid_bh % HEADS) // GROUP
    q_block = pid_m * BLOCK_M // Q_BLOCK
    k_blocks = tl.cdiv(SEQ_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q = desc_q.load([pid_bh, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    q_scale = tl.load(Q_SCALE + pid_bh * tl.cdiv(SEQ_Q, Q_BLOCK) + q_block)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi, full_hi = key_range(pid_m, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        tile = start_n // BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = desc_k.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        k_scale = tl.load(K_SCALE + kv_bh * k_blocks + tile)
        x = (tl.dot(q, tl.trans(k)) + _ROUNDER_BITS).to(tl.float32, bitcast=True) - _ROUNDER
        a = q_scale * k_scale * qk_scale
        if start_n >= full_hi:
            x = tl.where(tile_mask(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), float("-inf"), x)
        m_new = tl.maximum(m_i, tl.max(x, axis=1) * a)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(x * a - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = desc_vt.load([kv_bh, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        acc = tl.dot((p * E4M3_MAX).to(tl.float8e4nv), tl.trans(vt), acc * alpha[:, None])
        m_i = m_new
    v_scale = tl.load(V_SCALE + kv_bh * HEAD_DIM + cols)
    out = acc * (v_scale / E4M3_MAX)[None, :] / l_i[:, None]
    desc_o.store([b, pid_bh % HEADS, pid_m * BLOCK_M, 0], out.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))


def quantize_v_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V ``[B, H, N, D]`` as e4m3 ``[B, H, D, N]`` with one fp32 scale per channel ``[B, H, D]`` (max |V| / 448)."""
    vt = v.float().transpose(-1, -2)
    scale = vt.abs().amax(dim=-1).div(E4M3_MAX.value)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (vt / scale[..., None]).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


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
    """O of the probe's kernel from :func:`operands`."""
    q_op, k_op, v8 = x["q_op"], x["k_op"], x["v8"]
    batch, heads, seq_q, head_dim = q_op.shape
    kv_heads, seq_k = k_op.shape[1], k_op.shape[2]
    out = torch.empty(batch, heads, seq_q, head_dim, dtype=out_dtype, device=q_op.device)
    blocks = [1, 1, 1]
    desc_q = TensorDescriptor.from_tensor(q_op.view(batch * heads, seq_q, head_dim), blocks)
    desc_k = TensorDescriptor.from_tensor(k_op.view(batch * kv_heads, seq_k, head_dim), blocks)
    desc_vt = TensorDescriptor.from_tensor(v8.view(batch * kv_heads, head_dim, seq_k), blocks)
    desc_o = TensorDescriptor.from_tensor(out, [1, 1, 1, 1])

    def grid(meta: dict) -> tuple[int, int]:
        tiles = triton.cdiv(seq_q, meta["BLOCK_M"])
        return (batch * heads, tiles) if is_causal else (tiles, batch * heads)

    _fp8_pv_kernel[grid](
        desc_q, desc_k, desc_vt, desc_o, x["q_scale"], x["k_scale"], x["v8_scale"], heads, heads // kv_heads,
        seq_q, seq_k, seq_bucket(max(seq_q, seq_k)), seq_bucket(batch * heads), scale * LOG2E,
        HEAD_DIM=head_dim, Q_BLOCK=x["block_m"], BLOCK_N=x["block_n"], CAUSAL=is_causal,
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
    """Compile the probe's kernel for sm_90 offline (D=64 and 128, causal or not) and print ``sm90_compile``'s table
    of it: registers, spills, shared memory and the hot loop's instructions."""
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
        f"Triton {triton.__version__}, sm_90 offline", None, False, case_width=26, skip=("_quantize_rows_kernel",)
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
