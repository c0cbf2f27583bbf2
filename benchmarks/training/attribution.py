"""Per-tensor error of SageBwd on real attention inputs: activations captured from a trained checkpoint.

``benchmarks.kernels.accuracy`` asks on synthetic inputs whether INT8 dS dominates the gradient error; this asks it
of a trained model (issue #7). The model is ``--checkpoint`` (a ``.ckpt`` of ``examples.pretrain``'s
``LlamaPretraining``) or the config's model trained ``--train-steps`` steps with full-precision attention first.
``--batches`` held-out batches are run through it with every attention layer in full precision keeping its calls (q,
k, v as they enter SDPA, and dO from one backward of the LM loss); each chosen layer's inputs then go through the
accuracy harness's measurement (every setting, K-smoothing on and off). "dS dominates" is the harness's rule
(``accuracy.ds_dominates``); a tensor's costliest product is the INT8 product whose ``only`` setting alone reproduces
the largest share of its error.

Writes ``accuracy-<device>-<date>-activations.{json,md}`` (``benchmarks/results/``, or ``$OUT``): the harness's rows
with ``inputs`` ``"activations layer=<i> ckpt=<name> step=<n>"``, and in the header the checkpoint, the capture, the
input statistics per layer and the verdicts. Input statistics (float64, every captured token): max and RMS of q, k,
v and dO; the per-channel bias ``|mean| / std`` over tokens of q and k (what smoothing removes); ``max |K|`` over
``max |K - mean(K)|`` (how much K-smoothing shrinks K's INT8 step); the largest scaled score; the mean row maximum
of P.

Example::

    python -m benchmarks.training.attribution --config examples/configs/tiny.yaml --train-steps 20 --out /tmp/acc.json
    python -m benchmarks.training.attribution --config examples/configs/small.yaml --device cuda --layers 0 7 \\
        --checkpoint runs/small/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.result_file import REPO, RESULTS, default_path, device_name, header, write
from benchmarks.training import runs, specs
from benchmarks.training.attribution_report import CAPTURED, measure_layers, report, summary_lines, verdicts
from examples.corpus import TextDataModule, TokenWindows
from examples.pretrain import LlamaPretraining
from sage_lightning import AttentionPrecision, attention_layers


class UsageError(ValueError):
    """A command-line argument that does not fit the checkpoint, the config or the data (exits like argparse)."""


# --------------------------------------------------------------------------------------------------- the model


def train_checkpoint(config: dict[str, Any], data: TextDataModule, steps: int, device: str, path: Path) -> Path:
    """Train the config's model ``steps`` steps with full-precision attention and save a Lightning checkpoint.

    The config's seed, optimizer, schedule (over ``steps``), precision and gradient clipping; no validation, no
    logger, no controller. The checkpoint is what ``Trainer.save_checkpoint`` writes, as ``ModelCheckpoint`` does.
    """
    L.seed_everything(int(config.get("seed_everything", 0) or 0), workers=True)
    module = runs.build_model(config, specs.parse_run("full"), data)
    own = specs.TRAINER_OWN
    trainer_args = {key: value for key, value in (config.get("trainer") or {}).items() if key not in own}
    trainer_args.update(
        accelerator="gpu" if torch.device(device).type == "cuda" else "cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    trainer = L.Trainer(
        **trainer_args,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(path.parent),
    )
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(path)
    return path


def checkpoint_name(path: Path) -> str:
    """A short name for a checkpoint: ``<logger name>/<version>/<file>`` for ``ModelCheckpoint``'s layout under a
    logger's ``version_N`` folder, else the file name (e.g. ``pretrain_compare --save-checkpoint`` files).
    """
    if path.parent.name == "checkpoints" and len(path.parts) >= 4 and path.parent.parent.name.startswith("version_"):
        return f"{path.parent.parent.parent.name}/{path.parent.parent.name}/{path.name}"
    return path.name


def load_checkpoint(path: Path, config: dict[str, Any], data: TextDataModule) -> tuple[LlamaPretraining, int]:
    """The ``LlamaPretraining`` of a Lightning checkpoint (on the CPU) and its global step, checked against the config.

    The module is built from the checkpoint's own hyperparameters (``load_from_checkpoint``, which runs
    ``configure_model``: the mixin's swap). Every swapped layer is then set to ``mode="full"``, the ladder's last
    rung, which calls PyTorch's SDPA with the model's own arguments: the attention runs in full precision whatever
    the checkpoint was trained with.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        step = int(checkpoint["global_step"])
        # A Lightning checkpoint is a pickle (its hyperparameters are not plain tensors): load only your own.
        module = LlamaPretraining.load_from_checkpoint(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001  (any failure to read it is the argument's fault)
        raise UsageError(
            f"--checkpoint: {str(path)!r} is not a checkpoint of examples/pretrain.py's LlamaPretraining "
            f"({type(error).__name__}: {error}); give the .ckpt that ModelCheckpoint wrote (e.g. "
            "runs/small/version_0/checkpoints/last.ckpt), or --train-steps N to train one."
        ) from error
    for layer in attention_layers(module).values():
        layer.precision = AttentionPrecision(mode="full")
    given = (config.get("model") or {}).get("config") or {}
    for field, value in given.items():
        if field in ("vocab_size", "max_seq_len"):
            continue  # the command line links them to the data
        if getattr(module.config, field, value) != value:
            raise UsageError(
                f"--config: model.config.{field} is {value!r} there but {getattr(module.config, field)!r} in "
                f"--checkpoint {str(path)!r}; give the config the checkpoint was trained with."
            )
    if module.config.vocab_size != data.vocab_size:
        raise UsageError(
            f"--config: its tokenizer has {data.vocab_size} tokens but --checkpoint {str(path)!r} was trained with "
            f"vocab_size={module.config.vocab_size}; give the config the checkpoint was trained with."
        )
    return module, step


# ------------------------------------------------------------------------------------------------- the capture


def held_out_batches(data: TextDataModule, seq: int, batches: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The first ``batches * batch_size`` windows of ``seq`` tokens of the data's validation split, in order.

    The split is the one training held out (``data.setup`` with the config's own ``seq_len``); only the window
    length is ``seq``.
    """
    data.setup("fit")
    val = data.val_set
    assert val is not None
    windows = TokenWindows(val.path, val.dtype, val.start, val.stop, seq)
    if len(windows) < batches * batch_size:
        raise UsageError(
            f"--batches/--batch-size/--seq: {batches} x {batch_size} windows of {seq} tokens need "
            f"{batches * batch_size * seq + 1} held-out tokens; the validation split holds {val.stop - val.start} "
            f"({len(windows)} windows). Ask for fewer, or raise data.val_fraction in the config (and retrain)."
        )
    return [
        torch.utils.data.default_collate([windows[b * batch_size + i] for i in range(batch_size)])
        for b in range(batches)
    ]


def capture(
    module: LlamaPretraining, batches: list[dict[str, torch.Tensor]], device: str, autocast: torch.dtype | None
) -> list[dict[str, Any]]:
    """Every attention call's q, k, v and dO (the LM loss's gradient of its output), batches concatenated."""
    layers = attention_layers(module)
    per_batch: list[list[dict[str, Any]]] = []
    device_type = torch.device(device).type
    for layer in layers.values():
        layer.keep_calls, layer.kept_calls = True, []
    try:
        for batch in batches:
            batch = {name: tensor.to(device) for name, tensor in batch.items()}
            context = torch.autocast(device_type, dtype=autocast) if autocast is not None else nullcontext()
            fallbacks = {name: layer.fallback_calls for name, layer in layers.items()}
            with context:
                loss = module.loss(batch)
            calls = [(name, call) for name, layer in layers.items() for call in layer.kept_calls]
            for layer in layers.values():
                layer.kept_calls = []
            _refuse_unmeasurable(layers, fallbacks, calls)
            grads = torch.autograd.grad(loss, [call.out for _, call in calls])
            per_batch.append(
                [
                    {
                        "name": name,
                        "q": call.q,
                        "k": call.k,
                        "v": call.v,
                        "do": grad.detach(),
                        "is_causal": call.is_causal,
                    }
                    for (name, call), grad in zip(calls, grads, strict=True)
                ]
            )
    finally:
        for layer in layers.values():
            layer.keep_calls, layer.kept_calls = False, []
    layers = []
    for index, first in enumerate(per_batch[0]):
        calls = [calls[index] for calls in per_batch]
        layer = {"name": first["name"], "is_causal": first["is_causal"]}
        layer.update({name: torch.cat([call[name] for call in calls]) for name in CAPTURED})
        layers.append(layer)
    return layers


def _refuse_unmeasurable(layers: dict[str, Any], fallbacks: dict[str, int], calls: list[tuple[str, Any]]) -> None:
    """Refuse a forward whose attention calls the harness cannot measure as accuracy.py does."""
    for name, layer in layers.items():
        if layer.fallback_calls != fallbacks[name]:
            raise RuntimeError(
                f"capture: a call in {name} went to SDPA ({', '.join(layer.fallback_reasons)}); this harness measures "
                "SDPA calls without attn_mask, custom scale or dropout (as accuracy.py does)."
            )
    if not calls:
        raise RuntimeError(
            "capture: the forward made no scaled_dot_product_attention call that reached a swapped attention layer; "
            "is the model's attention swapped (the mixin's configure_model)?"
        )
    for name, call in calls:
        if call.scale is not None:
            raise RuntimeError(
                f"capture: a call in {name} passes scale={call.scale}; this harness measures SDPA calls without "
                "attn_mask, custom scale or dropout (as accuracy.py does)."
            )


# ----------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "small.yaml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one config entry (as pretrain_compare's --set), e.g. data.max_bytes=300000",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, default=None, help="a Lightning .ckpt of LlamaPretraining")
    source.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="no checkpoint: train the config's model this many steps first (full-precision attention)",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="attention layer indices (default: all)")
    parser.add_argument("--batches", type=int, default=1, help="held-out batches captured")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per held-out batch")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the config's seq_len)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--path", choices=("reference", "triton"), default="reference", help="as accuracy.py's")
    parser.add_argument("--note", default="", help="a line for the top of the markdown (e.g. what the run is for)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path; the .md is written beside it")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse and check what needs no model: exactly one source, positive sizes, an existing checkpoint file."""
    args = parser.parse_args(argv)
    if args.checkpoint is None and args.train_steps is None:
        parser.error(
            "give --checkpoint PATH (a Lightning .ckpt of LlamaPretraining) or --train-steps N; received neither."
        )
    for name in ("train_steps", "batches", "batch_size", "seq"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer; received {value}.")
    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(
            f"--checkpoint: no file at {str(args.checkpoint)!r}; give an existing .ckpt written by ModelCheckpoint "
            "(e.g. runs/small/version_0/checkpoints/last.ckpt), or --train-steps N to train one first."
        )
    if not args.config.is_file():
        parser.error(f"--config: no file at {str(args.config)!r}; give a YAML of examples/configs/.")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Load or train the model, capture, measure, write the JSON and markdown; returns the JSON dict."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parse_args(parser, argv)
    start = time.perf_counter()
    try:
        config = specs.load_config(args.config, args.set)
        data = TextDataModule(**(config.get("data") or {}))
        data.prepare_data()
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = args.checkpoint
            if checkpoint is None:
                checkpoint = Path(folder) / f"{args.config.stem}-full-{args.train_steps}steps.ckpt"
                train_checkpoint(config, data, args.train_steps, args.device, checkpoint)
            module, step = load_checkpoint(checkpoint, config, data)
        ckpt_name = checkpoint_name(checkpoint) if args.checkpoint is not None else checkpoint.name
        n_layers = module.config.n_layers
        layers = list(dict.fromkeys(args.layers)) if args.layers else list(range(n_layers))
        bad = [index for index in layers if not 0 <= index < n_layers]
        if bad:
            raise UsageError(
                f"--layers: received {' '.join(map(str, args.layers))}; {', '.join(map(str, bad))} out of range for "
                f"the checkpoint's model, which has {n_layers} attention layers (valid: 0 to {n_layers - 1})."
            )
        seq = args.seq or data.seq_len
        if seq > module.config.max_seq_len:
            raise UsageError(
                f"--seq: received {seq}; the checkpoint's model covers at most max_seq_len="
                f"{module.config.max_seq_len} tokens (its training seq_len)."
            )
        batches = held_out_batches(data, seq, args.batches, args.batch_size)
    except UsageError as error:
        parser.error(str(error))

    precision = str((config.get("trainer") or {}).get("precision", "32-true"))
    autocast = torch.bfloat16 if "bf16" in precision else None
    module = module.to(args.device).float().eval()
    captured = capture(module, batches, args.device, autocast)
    if len(captured) != module.config.n_layers:
        raise RuntimeError(f"capture: {len(captured)} attention calls for {module.config.n_layers} layers.")

    rows, activations = measure_layers(captured, layers, f"ckpt={ckpt_name} step={step}", args.path)
    found = verdicts(rows)

    device = device_name(args.device)
    default_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    out = args.out or default_dir / default_path("accuracy", device, "-activations").name
    config_path = args.config.resolve()
    result = {
        **header("accuracy", device, "benchmarks.training.attribution", argv),
        "config": str(config_path.relative_to(REPO)) if config_path.is_relative_to(REPO) else str(config_path),
        "checkpoint": {
            "name": ckpt_name,
            "step": step,
            "trained_with": module.attention,
            "source": "--checkpoint" if args.checkpoint is not None else f"--train-steps {args.train_steps}",
        },
        "capture": {
            "split": "validation (held out)",
            "batches": args.batches,
            "batch_size": args.batch_size,
            "seq": seq,
            "dtype": "bf16 autocast" if autocast is not None else "float32",
            "measured_as": "bf16",
        },
        "activations": activations,
        "verdicts": found,
        "rows": rows,
    }
    text = report(rows, found, activations)
    print("\n".join(summary_lines(found)))
    write(result, out)
    note = f"{args.note}\n\n" if args.note else ""
    source = result["checkpoint"]
    heading = (
        f"# Accuracy on real activations: SageBwd ({args.path}) vs float64\n\n{device}, {result['date']}, commit "
        f"{result['commit']}\n\n`{result['command']}`\n\n{note}Checkpoint `{source['name']}` (step {step}, trained "
        f"with attention={source['trained_with']}; from {source['source']}), config `{result['config']}`, model "
        f"{n_layers} layers, {module.config.n_heads} query heads, {module.config.kv_heads} key/value heads, head dim "
        f"{module.config.head_dim}. Inputs: {args.batches} held-out batch(es) of {args.batch_size} x {seq} tokens, "
        f"captured in {result['capture']['dtype']}, measured in bf16; dO is the gradient of the LM loss.\n\n"
    )
    out.with_suffix(".md").write_text(heading + text)
    print(f"wrote {out} and {out.with_suffix('.md')} ({time.perf_counter() - start:.1f} s)")
    return result


if __name__ == "__main__":
    main()
