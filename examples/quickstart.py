"""SageBwd attention end to end on the built-in path, in a few seconds (`make demo` runs the pretraining example).

1. A causal GQA attention layer's forward and backward through ``sage_attention`` (bf16, the reference path
   on CPU), compared with PyTorch's own attention in float32, with the layer's dS quantization error.
2. The per-tensor error table against float64 (``benchmarks.kernels.accuracy`` at a small size).

Run from the repository root: ``python -m examples.quickstart`` (add ``--seq 1024`` for the harness's default size).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_lightning import AttentionPrecision, sage_attention


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    return F.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0).item()


def attention_layer_demo(device: str) -> None:
    """One attention call as a LLaMA-style layer makes it: 8 query heads sharing 2 kv heads, causal."""
    torch.manual_seed(0)
    shape_q, shape_kv = (2, 8, 384, 64), (2, 2, 384, 64)
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(shape_q, device=device, dtype=torch.bfloat16)

    stats = torch.zeros(2, device=device)
    start = time.perf_counter()
    out = sage_attention(q, k, v, is_causal=True, precision=AttentionPrecision(), stats=stats)
    out.backward(grad_out)
    seconds = time.perf_counter() - start
    ours = [out.detach(), q.grad, k.grad, v.grad]

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    ref.backward(grad_out.float())
    refs = [ref.detach(), q32.grad, k32.grad, v32.grad]

    print(f"sage_attention on {device}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, causal, bf16, {seconds:.2f} s")
    print(f"precision: {AttentionPrecision().short_name}")
    print(
        "cosine similarity to fp32 SDPA: "
        + ", ".join(
            f"{name} {cosine(x, r):.5f}" for name, x, r in zip(("O", "dQ", "dK", "dV"), ours, refs, strict=True)
        )
    )
    print(f"dS INT8 relative error of this layer: {(stats[0] / stats[1]).sqrt().item():.4f}\n")


def accuracy_table(seq: int) -> None:
    """The accuracy harness at a small size; its files go to a temporary folder, not benchmarks/results."""
    from benchmarks.kernels import accuracy

    with tempfile.TemporaryDirectory() as tmp:
        accuracy.main(["--seq", str(seq), "--out", str(Path(tmp) / "accuracy-demo.json")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the accuracy table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    attention_layer_demo(args.device)
    accuracy_table(args.seq)


if __name__ == "__main__":
    main()
