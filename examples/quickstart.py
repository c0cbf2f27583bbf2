"""SageBwd end to end on the built-in path, in a few seconds (`make demo` runs the pretraining example).

1. A causal GQA attention layer's forward and backward through ``sage_attention`` (bf16, the reference path
   on CPU), compared with PyTorch's own attention in float32, with the layer's dS quantization error.
2. The README's two lines in a LightningModule and a Trainer: four optimizer steps of a tiny model, ending with the
   line that says what ran on SageBwd (:func:`sage_lightning.attention_summary`).
3. With ``--verbose``: the per-tensor error table against float64 (``benchmarks.kernels.accuracy`` at a small size),
   and Lightning's own console output for step 2.

Run from the repository root: ``python -m examples.quickstart`` (``--verbose`` for the table, ``--seq 1024`` for
the harness's default size).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from sage_lightning import AdaptivePrecision, AttentionPrecision, SageAttentionMixin, attention_summary, sage_attention


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
    print(f"dS INT8 relative error of this layer: {(stats[0] / stats[1]).sqrt().item():.4f}")


class Attention(nn.Module):
    """The README's attention module: any module that calls SDPA is swapped."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class TinyLM(SageAttentionMixin, L.LightningModule):  # 1. the mixin, before LightningModule
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(64, 32), Attention(), nn.Linear(32, 64)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        return F.cross_entropy(self.head(self.attn(self.embed(x[:, :-1]))).flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def lightning_demo(verbose: bool) -> None:
    """The two lines in a Lightning run: four optimizer steps, then the summary line."""
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 33))), batch_size=4)
    model, controller = TinyLM(), AdaptivePrecision(verbose=verbose)  # 2. the controller
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    if not verbose:  # Lightning's banner lines ("GPU available: ...") say nothing about attention
        lightning_log.setLevel(logging.WARNING)
    try:
        trainer = L.Trainer(
            max_steps=4,
            callbacks=[controller],
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=verbose,
            enable_model_summary=verbose,
        )
        trainer.fit(model, data)
    finally:
        lightning_log.setLevel(level)
    if not verbose:  # a verbose controller printed it as training ended
        print(attention_summary(model, controller))


def accuracy_table(seq: int) -> None:
    """The accuracy harness at a small size; its files go to a temporary folder, not benchmarks/results."""
    from benchmarks.kernels import accuracy

    with tempfile.TemporaryDirectory() as tmp:
        accuracy.main(["--seq", str(seq), "--out", str(Path(tmp) / "accuracy-demo.json")])


def main(argv: list[str] | None = None) -> None:
    """Run the quickstart (``argv`` instead of ``sys.argv[1:]`` when given).

    Example::

        main(["--verbose"])
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the accuracy table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--verbose", action="store_true", help="print the accuracy table and Lightning's own console output too"
    )
    args = parser.parse_args(argv)
    attention_layer_demo(args.device)
    lightning_demo(args.verbose)
    if args.verbose:
        print()
        accuracy_table(args.seq)
    else:
        print("(--verbose adds the per-tensor error table against float64, benchmarks.kernels.accuracy)")


if __name__ == "__main__":
    main()
