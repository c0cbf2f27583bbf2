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
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.kernels import accuracy
from benchmarks.result_file import REPO, RESULTS, default_path, device_name, header, write
from benchmarks.training import runs, specs
from examples.corpus import TextDataModule, TokenWindows
from examples.pretrain import LlamaPretraining
from sage_lightning import AttentionPrecision, attention_layers

#: The gradients whose error the attribution table splits by product.
GRADIENTS: tuple[str, ...] = ("dQ", "dK", "dV")
#: Tensors captured per attention call, as accuracy.py names its inputs.
CAPTURED: tuple[str, ...] = ("q", "k", "v", "do")


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


# ----------------------------------------------------------------------------------------------- measurements


def input_statistics(inputs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Statistics of one layer's inputs that explain its errors (see the module docstring), in float64."""
    q, k, v, do = (inputs[name].double() for name in CAPTURED)
    stats: dict[str, float] = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        stats[f"{name}_max_abs"] = float(x.abs().max())
    for name, x in (("q", q), ("k", k)):
        stats[f"{name}_rms"] = float(x.square().mean().sqrt())
        bias = x.mean(dim=2).abs() / x.std(dim=2).clamp_min(torch.finfo(torch.float64).tiny)  # [B, H, D]
        stats[f"{name}_channel_bias_mean"] = float(bias.mean())
        stats[f"{name}_channel_bias_max"] = float(bias.max())
    centered = k - k.mean(dim=2, keepdim=True)
    stats["k_range_over_centered"] = float((k.abs().amax(dim=(2, 3)) / centered.abs().amax(dim=(2, 3))).mean())
    rms = do.square().mean().sqrt()
    stats["do_rms"], stats["do_max_abs"] = float(rms), float(do.abs().max())
    stats["do_max_over_rms"] = float(do.abs().max() / rms) if rms > 0 else math.nan
    row_max = ref["P"].amax(dim=-1)  # max_j S_ij = lse_i + log max_j P_ij
    stats["score_max"] = float((ref["lse"] + row_max.log()).max())
    stats["p_row_max_mean"] = float(row_max.mean())
    return stats


def layer_rows(
    inputs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], causal: bool, path: str, common: dict[str, Any]
) -> list[dict]:
    """accuracy.py's rows for one layer: every setting, K-smoothing on and off, every tensor."""
    rows = []
    for smooth_k in accuracy.SMOOTH_K["sagebwd"]:
        for label, precision in accuracy.settings(smooth_k):
            for tensor, (cos, rel) in accuracy.measure(inputs, ref, precision, causal, path).items():
                row = {**common, "setting": precision.short_name, "label": label, "smooth_k": smooth_k}
                rows.append({**row, "tensor": tensor, "cos": accuracy.finite(cos), "rel_l2": accuracy.finite(rel)})
    return rows


def measure_layers(
    captured: list[dict[str, Any]], layers: list[int], source: str, path: str
) -> tuple[list[dict], list[dict[str, Any]]]:
    """accuracy.py's rows and the input statistics of each chosen layer of a capture."""
    rows, activations = [], []
    for index in layers:
        layer = captured[index]
        inputs = {name: layer[name].to(torch.bfloat16) for name in CAPTURED}
        batch, heads, length, head_dim = inputs["q"].shape
        kind = f"activations layer={index} {source}"
        common = {
            "path": path,
            "inputs": kind,
            "layer": index,
            "layer_name": layer["name"],
            "batch": batch,
            "heads": heads,
            "kv_heads": inputs["k"].shape[1],
            "seq": length,
            "head_dim": head_dim,
            "causal": layer["is_causal"],
        }
        print(f"--- {kind} ({layer['name']}): q {list(inputs['q'].shape)}, k {list(inputs['k'].shape)}", flush=True)
        ref = accuracy.exact(inputs, layer["is_causal"])
        rows += layer_rows(inputs, ref, layer["is_causal"], path, common)
        stats = input_statistics(inputs, ref)
        activations.append({"layer": index, "layer_name": layer["name"], "inputs": kind, "stats": stats})
    return rows, activations


def verdicts(rows: list[dict]) -> list[dict[str, Any]]:
    """The attribution of each layer and K-smoothing setting, from the rows."""
    found = []
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        layer = next(row["layer"] for row in rows if row["inputs"] == kind)
        for smooth_k in accuracy.SMOOTH_K["sagebwd"]:
            table = accuracy.lookup(rows, kind, smooth_k)
            finite = all(table["sagebwd"][t]["rel_l2"] is not None for t in GRADIENTS)
            costliest = {}
            for tensor in GRADIENTS:
                label = accuracy.largest_product(table, tensor)
                share = accuracy.error_share(table, label, tensor)
                costliest[tensor] = {
                    "product": label.split()[1],
                    "rel_l2": table[label][tensor]["rel_l2"],
                    "share": share if math.isfinite(share) else None,
                }
            shares = {t: accuracy.error_share(table, "only ds", t) for t in ("dQ", "dK")}
            found.append(
                {
                    "layer": layer,
                    "smooth_k": smooth_k,
                    "ds_dominates": accuracy.ds_dominates(table) if finite else None,
                    "ds_share": {t: share if math.isfinite(share) else None for t, share in shares.items()},
                    "costliest": costliest,
                }
            )
    return found


# ---------------------------------------------------------------------------------------------------- reports


def _cell(row: dict) -> str:
    """``cos / rel_l2`` of one row."""
    return f"{accuracy.fmt(row['cos'], 4)} / {accuracy.fmt(row['rel_l2'], 4)}"


def _share_text(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def attribution_table(rows: list[dict], found: list[dict[str, Any]]) -> list[str]:
    """Markdown: per layer and K-smoothing, the default's gradient errors and the costliest INT8 product of each."""
    lines = [
        "| layer | smooth_k | sagebwd dQ cos / rel_l2 | dK | dV | costliest INT8 product for dQ | for dK | for dV "
        "| ds share of dQ, dK | dS dominates |",
        "|---|---|---:|---:|---:|---|---|---|---:|---|",
    ]
    kinds = {row["layer"]: row["inputs"] for row in rows}
    for verdict in found:
        table = accuracy.lookup(rows, kinds[verdict["layer"]], verdict["smooth_k"])
        sage = [_cell(table["sagebwd"][t]) for t in GRADIENTS]
        costliest = [
            f"{c['product']} ({accuracy.fmt(c['rel_l2'], 4)}, {_share_text(c['share'])})"
            for c in (verdict["costliest"][t] for t in GRADIENTS)
        ]
        shares = ", ".join(_share_text(verdict["ds_share"][t]) for t in ("dQ", "dK"))
        dominates = {True: "yes", False: "no", None: "not ranked"}[verdict["ds_dominates"]]
        lines.append(
            f"| {verdict['layer']} | {verdict['smooth_k']} | " + " | ".join(sage + costliest) + f" | {shares} | "
            f"{dominates} |"
        )
    return lines


def _layers_text(layers: list[int], of: int) -> str:
    """``"every layer measured (4)"``, ``"none of the 4 layers"`` or ``"3 of 4 layers (0, 2, 3)"``."""
    if of and len(layers) == of:
        return f"every layer measured ({of})"
    if not layers:
        return f"none of the {of} layers"
    return f"{len(layers)} of {of} layers ({', '.join(map(str, layers))})"


def summary_lines(found: list[dict[str, Any]]) -> list[str]:
    """The answer to "does dS dominate?", overall and per layer, for K-smoothing on and off, from the verdicts.

    Overall, per K-smoothing setting: "yes" when dS dominates (:func:`accuracy.ds_dominates`) in every layer whose
    gradients are finite, "no" in none, "partly" in between; beside it, in how many layers ds is the costliest
    single INT8 product of both dQ and dK.
    """
    lines = []
    for smooth_k in accuracy.SMOOTH_K["sagebwd"]:
        chosen = [v for v in found if v["smooth_k"] == smooth_k]
        ranked = [v for v in chosen if v["ds_dominates"] is not None]
        dominated = [v["layer"] for v in ranked if v["ds_dominates"]]
        costliest = [v["layer"] for v in ranked if {v["costliest"][t]["product"] for t in ("dQ", "dK")} == {"ds"}]
        if not ranked:
            answer = "not ranked (non-finite gradients)"
        else:
            answer = "yes" if len(dominated) == len(ranked) else "no" if not dominated else "partly"
            answer += (
                f": over half of the dQ and dK error in {_layers_text(dominated, len(ranked))}; the costliest single "
                f"INT8 product of both dQ and dK in {_layers_text(costliest, len(ranked))}"
            )
        lines.append(f"- smooth_k={smooth_k}: does dS dominate the dQ/dK error? {answer}.")
        for verdict in chosen:
            top = verdict["costliest"]
            lines.append(
                f"  - layer {verdict['layer']}: "
                f"{ {True: 'yes', False: 'no', None: 'not ranked'}[verdict['ds_dominates']] }; ds alone gives "
                f"{_share_text(verdict['ds_share']['dQ'])} of dQ's and {_share_text(verdict['ds_share']['dK'])} of "
                f"dK's squared rel_l2; costliest product: dQ {top['dQ']['product']}, dK {top['dK']['product']}, dV "
                f"{top['dV']['product']}."
            )
    return lines


STAT_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("q_max_abs", "max abs q", 2),
    ("k_max_abs", "max abs k", 2),
    ("v_max_abs", "max abs v", 2),
    ("k_channel_bias_mean", "K bias/std mean", 3),
    ("k_channel_bias_max", "K bias/std max", 2),
    ("k_range_over_centered", "K range / centered", 3),
    ("q_channel_bias_mean", "Q bias/std mean", 3),
    ("do_rms", "dO rms", 3),
    ("do_max_over_rms", "dO max/rms", 1),
    ("score_max", "score max", 2),
    ("p_row_max_mean", "mean row max P", 3),
)


def statistics_table(activations: list[dict[str, Any]]) -> list[str]:
    """Markdown: the input statistics of every layer (:data:`STAT_COLUMNS`)."""
    lines = ["| layer | " + " | ".join(title for _, title, _ in STAT_COLUMNS) + " |"]
    lines.append("|---|" + "---:|" * len(STAT_COLUMNS))
    for layer in activations:
        stats = layer["stats"]
        cells = [
            f"{stats[key]:.{digits}e}" if key == "do_rms" else f"{stats[key]:.{digits}f}"
            for key, _, digits in STAT_COLUMNS
        ]
        lines.append(f"| {layer['layer']} | " + " | ".join(cells) + " |")
    return lines


def report(rows: list[dict], found: list[dict[str, Any]], activations: list[dict[str, Any]]) -> str:
    """The markdown body: the answer, the attribution table, the input statistics, accuracy.py's summary and tables."""
    return "\n".join(
        [
            "## Does dS dominate?",
            "",
            f'"dS dominates": INT8 dS alone reproduces more than {accuracy.DOMINANT_SHARE:.0%} of the SageBwd '
            "default's squared rel_l2 of dQ and of dK (accuracy.py's rule).",
            "",
            *summary_lines(found),
            "",
            "## Attribution per layer",
            "",
            "The SageBwd default's gradient errors against float64 attention (cos / rel_l2), and for each gradient "
            "the single INT8 product of the default whose `only` setting costs the most (its rel_l2, and its share of "
            "the default's squared rel_l2).",
            "",
            *attribution_table(rows, found),
            "",
            "## Inputs",
            "",
            "Per layer, over every captured token (definitions in benchmarks.training.attribution's docstring).",
            "",
            *statistics_table(activations),
            "",
            *accuracy.summarize(rows),
            "",
            "## Full tables",
            "",
            accuracy.format_tables(rows),
        ]
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
