"""The share of attention calls SageBwd serves (the rest go to PyTorch's SDPA, counted), on the CPU.

Two workloads (issue 17):

* ``example``: ``examples/pretrain.py``'s model from ``examples/configs/tiny.yaml`` (made smaller: ``--max-bytes``
  of the built-in corpus), ``--steps`` training steps and ``--val-batches`` validation batches in a Lightning
  ``Trainer``, the mixin's swap and the config's controller.
* ``llama-generate``: a Hugging Face Llama built from a config (nothing downloaded), ``generate()`` of
  ``--new-tokens`` tokens, greedy, with a KV cache: a batch of equal-length prompts, then a left-padded batch.

Each row: the layers' summed ``calls``, ``fallback_calls``, the served share and the fallback reasons.

Example::

    python benchmarks/served_share.py             # prints the markdown table of docs/attention-support.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "examples"))

from sage_lightning import attention_layers, convert_to_sage_attention  # noqa: E402


def tally(model: torch.nn.Module) -> dict[str, Any]:
    """The layers' summed counters: ``calls``, ``fallback_calls``, ``served_share`` and ``reasons``.

    Example::

        tally(model)["served_share"]   # 1.0 when every call ran SageBwd
    """
    layers = attention_layers(model).values()
    calls = sum(layer.calls for layer in layers)
    fallbacks = sum(layer.fallback_calls for layer in layers)
    reasons: dict[str, int] = {}
    for layer in layers:
        for reason, count in layer.fallback_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + count
    share = (calls - fallbacks) / calls if calls else float("nan")
    return {"calls": calls, "fallback_calls": fallbacks, "served_share": share, "reasons": reasons}


def example(steps: int, val_batches: int, max_bytes: int) -> dict[str, Any]:
    """Train the example's tiny model ``steps`` steps (with validation) and return :func:`tally` of it."""
    import lightning as L
    import pretrain_compare
    from corpus import TextDataModule

    with tempfile.TemporaryDirectory() as workdir:
        changes = ["model.config.n_layers=2", "data.seq_len=64", f"data.max_bytes={max_bytes}"]
        changes.append(f"data.cache_dir={workdir}")
        config = pretrain_compare.load_config(REPO / "examples" / "configs" / "tiny.yaml", changes)
        data = TextDataModule(**config["data"])
        L.seed_everything(0)
        module = pretrain_compare.build_model(config, pretrain_compare.parse_run("sage"), data)
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=steps,
            limit_val_batches=val_batches,
            val_check_interval=steps,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=workdir,
        )
        trainer.fit(module, datamodule=data)
    return tally(module)


def llama_generate(new_tokens: int, padded: bool) -> dict[str, Any]:
    """``generate()`` on a Hugging Face Llama from a config; :func:`tally` of its layers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = convert_to_sage_attention(transformers.LlamaForCausalLM(config).eval())
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :4], mask[0, :4] = 0, 0  # left padding, as generate() wants for a decoder
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return tally(model)


def markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The table of docs/attention-support.md."""
    lines = [
        "| workload | attention calls | sent to SDPA | served by SageBwd | fallback reasons |",
        "|---|---:|---:|---:|---|",
    ]
    for name, row in rows:
        reasons = "; ".join(f"{reason} ({count})" for reason, count in row["reasons"].items()) or "none"
        lines.append(f"| {name} | {row['calls']} | {row['fallback_calls']} | {row['served_share']:.0%} | {reasons} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps of the example (default 5)")
    parser.add_argument("--val-batches", type=int, default=2, help="validation batches of the example (default 2)")
    parser.add_argument("--max-bytes", type=int, default=300_000, help="bytes of the built-in corpus (default 300000)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generate() adds (default 8)")
    args = parser.parse_args(argv)
    example_name = f"example (tiny.yaml, 2 layers): {args.steps} training steps + {args.val_batches} validation batches"
    generate_name = f"HF Llama generate(), {args.new_tokens} new tokens"
    rows = [
        (example_name, example(args.steps, args.val_batches, args.max_bytes)),
        (f"{generate_name}, unpadded batch", llama_generate(args.new_tokens, padded=False)),
        (f"{generate_name}, left-padded batch", llama_generate(args.new_tokens, padded=True)),
    ]
    print(markdown(rows))


if __name__ == "__main__":
    main()
