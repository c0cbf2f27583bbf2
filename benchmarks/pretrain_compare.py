"""Pretraining with SageBwd against full-precision attention: the same config run once per attention setting.

Reads an example config (``examples/configs/small.yaml`` by default) and trains it once per ``--attention`` value,
everything else equal: the same seed (so the same initial weights and data order), the same callbacks
(``AdaptivePrecision`` as the config gives it, and the throughput log), the same step budget. Only the layers'
starting precision differs (``LlamaPretraining``'s ``attention``). It records each run's training loss per
optimizer step, its validation loss, its tokens per second, its peak GPU memory and the controller's decisions,
and writes

* ``training-<device>-<date>-<tag>.json`` in the format of the project's result files (kind ``training``, one row
  per logged window of steps, see below),
* ``training-<device>-<date>-<tag>.md``: a summary table (steady-state tokens/s, losses at the last common
  step, the ratio of speeds),
* ``training-<device>-<date>-<tag>.png``: loss and throughput curves, where matplotlib is installed (else
  ``--plot-only`` draws them later from the JSON),
* the runs' TensorBoard logs under ``tensorboard/``,

into ``--out-dir`` (default ``$OUT`` when set, else ``benchmarks/results``).

Runs that differ in more than the attention go in ``--runs`` instead, one ``ATTENTION[:KEY=VALUE,...]`` each:
``controller=on|off`` (``AdaptivePrecision`` attached or not; default: as the config says), ``seed=N``,
``smooth_k=on|off`` and ``smooth_q=on|off`` (SageBwd's K- and Q-smoothing, for ``sage`` and the ``sage_fp8*``
settings), ``sdpa=BACKEND`` (the backend of PyTorch's SDPA, which ``full`` layers call: ``default``, ``cudnn``,
``flash``, ``efficient``, ``math``) and ``name=NAME`` (the run's name in the files; made from the other keys when
left out). ``--sdpa-backend`` sets the SDPA backend of every run. ``ATTENTION`` is a key of ``examples/pretrain.py``'s
``ATTENTION_MODES``: ``sage``, ``sage_fp8_pv``, ``sage_fp8_ds``, ``sage_fp8_pv_ds``, ``sage_fp8`` (SageBwd with
``pv``, ``ds``, both, or every product in FP8), ``attn_qat``, ``attn_qat_dropin``, ``full``; e.g.
``sage_fp8_pv:controller=off``.

``--matrix evidence`` runs issue #7's whole matrix (:func:`evidence_groups`): full precision with two seeds,
SageBwd fixed and SageBwd with the controller, at a large and a small number of tokens per step, with and
without QK-norm, once without K-smoothing, and an end-to-end speed group at twice the sequence length
(``e2e-seq4096`` for small.yaml, issue #4) against SDPA's cuDNN and flash backends. Every run of the training
groups sees the same number of tokens: planned from ``--budget-minutes`` with throughputs measured during the
warm-ups (or fixed by ``--tokens-per-run``). One result file per group,
``training-<device>-<date>-<tag>-<group>.json`` (tag ``evidence`` by default), each rewritten after every run, so
what finished survives an interrupted matrix. ``benchmarks/gpu_evidence.sh`` runs it on the device;
``benchmarks/results_doc.py`` turns the files into ``docs/results.md``.

``--save-checkpoint RUN`` (``GROUP/RUN`` under ``--matrix``) keeps one run's final model:
``<out-dir>/checkpoints/<tag>-[<group>-]<run>.ckpt`` (``Trainer.save_checkpoint``, weights only) and the config it
trained with beside it (``.yaml``, every ``--set`` and group change applied), what ``benchmarks/attribution.py
--checkpoint ... --config ...`` needs to capture real activations from it. No other run writes a checkpoint.

The model, data and callbacks are built here in Python from the config, without LightningCLI, so the script needs
only what the package itself needs (torch, lightning, tensorboard, numpy; PyYAML comes with lightning), not
jsonargparse. ``--set section.key=value`` changes one config entry (the value read as YAML) for every run.

Rows (one per ``trainer.log_every_n_steps`` optimizer steps and run): ``run`` (the run's name), ``attention``,
``tokens_per_step``, ``qk_norm``, ``seed``, ``step`` (optimizer steps done), ``tokens_seen``, ``train_loss`` (mean
of the per-step training losses in the window), ``tokens_per_s`` (the window's, validation excluded),
``val_loss`` at the steps that ran validation, ``seconds`` (the window's training wall time) and, on a GPU,
``peak_mem_mb`` (the run's peak memory, as speed rows carry it). The header's ``summary`` has one entry per run
(steady tokens/s, peak memory, the controller's share of layer-steps on INT8 or FP8, skipped steps, rollbacks, an
``error`` where the run failed), ``decisions`` each run's decisions as text and ``decision_log`` the same as
records (``step``, ``layer``, ``lever``, ``old``, ``new``, ``reason``).

Example::

    # on one GPU, both runs in one call, each stopped after 2000 steps or 3.3 minutes:
    python benchmarks/pretrain_compare.py --max-steps 2000 --max-minutes 3.3
    # SageBwd without the controller, with it, and without K-smoothing:
    python benchmarks/pretrain_compare.py --runs full sage:controller=off sage:controller=on \\
        sage:controller=off,smooth_k=off --max-steps 1000
    # end-to-end tokens/s at sequence 4096 against SDPA's cuDNN backend:
    python benchmarks/pretrain_compare.py --runs sage:controller=off full:controller=off,sdpa=cudnn \\
        --set data.seq_len=4096 --set data.batch_size=8 --max-steps 100 --tag seq4096
    # issue #7's matrix in 20 minutes, keeping the first full-precision run's model (benchmarks/gpu_evidence.sh):
    python benchmarks/pretrain_compare.py --matrix evidence --budget-minutes 20 --save-checkpoint large-qknorm/full
    # on a CPU, tiny:
    python benchmarks/pretrain_compare.py --config examples/configs/tiny.yaml --max-steps 20 --tag tiny \\
        --out-dir /tmp/compare
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import statistics
import sys
import textwrap
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from sage_lightning import AdaptivePrecision, PolicyConfig, Rung, attention_layers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "examples"))
import accuracy  # noqa: E402  (benchmarks/ and examples/ are folders of scripts: their helpers are imported so)
import results_doc  # noqa: E402
from corpus import TextDataModule  # noqa: E402
from llama import LlamaConfig  # noqa: E402
from pretrain import ATTENTION_MODES, LlamaPretraining, PretrainLogger, TokensPerSecond  # noqa: E402

#: Trainer entries of a config that this script sets itself.
_TRAINER_OWN = ("callbacks", "logger", "default_root_dir", "enable_checkpointing", "enable_progress_bar")
#: ``--sdpa-backend`` / ``sdpa=`` values -> ``torch.nn.attention.SDPBackend`` member names (``default``: none forced).
SDPA_BACKENDS: dict[str, str | None] = {
    "default": None,
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
#: Keys of a ``--runs`` entry.
RUN_KEYS = ("name", "controller", "seed", "smooth_k", "smooth_q", "sdpa")
#: ``--matrix`` values.
MATRICES = ("evidence",)
_SWITCH = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class LossCurve(Callback):
    """Each optimizer step's training loss (kept on the device, read once at the end) and each validation loss.

    Lightning hands ``on_train_batch_end`` the micro-batch loss divided by ``accumulate_grad_batches``; their sum
    over one optimizer step is the step's mean loss.
    """

    def __init__(self) -> None:
        super().__init__()
        self._losses: list[torch.Tensor] = []
        self._current: torch.Tensor | None = None
        self._step = 0
        #: ``{step: validation loss}``.
        self.val_losses: dict[int, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach().float()
        self._current = loss if self._current is None else self._current + loss
        if trainer.global_step != self._step:  # this micro-batch closed an optimizer step
            self._losses.append(self._current)
            self._current, self._step = None, trainer.global_step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val_losses[trainer.global_step] = float(trainer.callback_metrics["val/loss"])

    def losses(self) -> list[float]:
        """The training loss of every optimizer step, in order (one host sync)."""
        return torch.stack(self._losses).tolist() if self._losses else []


@dataclass(frozen=True)
class RunSpec:
    """One training run of a comparison: the attention setting and what else differs from the config.

    Attributes:
        name: the run's name in the result files and TensorBoard (letters, digits, ``.``, ``_``, ``+``, ``-``).
        attention: ``LlamaPretraining``'s ``attention``, a key of ``ATTENTION_MODES`` (``sage``, ``sage_fp8_pv``,
            ``sage_fp8_ds``, ``sage_fp8_pv_ds``, ``sage_fp8``, ``attn_qat``, ``attn_qat_dropin``, ``full``).
        controller: ``AdaptivePrecision`` attached (``True``), not (``False``), or as the config says (``None``).
        seed: ``seed_everything``'s seed (initial weights and data order); the config's when ``None``.
        smooth_k: SageBwd's K-smoothing; the attention's default when ``None``.
        smooth_q: SageBwd's Q-smoothing; the attention's default when ``None``.
        sdpa_backend: a key of :data:`SDPA_BACKENDS` forced while the run trains; ``--sdpa-backend``'s when ``None``.

    Example::

        RunSpec(name="sage-fixed-no-smooth-k", attention="sage", controller=False, smooth_k=False)
    """

    name: str
    attention: str
    controller: bool | None = None
    seed: int | None = None
    smooth_k: bool | None = None
    smooth_q: bool | None = None
    sdpa_backend: str | None = None


@dataclass
class Group:
    """A group of runs of the matrix that share a config (tokens per step, QK-norm, sequence length).

    Attributes:
        name: file-name part, e.g. ``large-qknorm``.
        title: one line saying what the group is.
        changes: ``SECTION.KEY=VALUE`` changes applied to the config for this group.
        runs: the runs, in the order they train.
        speed: a speed group: a fixed number of steps (``--speed-steps``), no validation, no token plan.
    """

    name: str
    title: str
    changes: list[str]
    runs: tuple[RunSpec, ...]
    speed: bool = False


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "small.yaml")
    parser.add_argument("--attention", nargs="+", default=None, help="one run per value, in this order")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=None,
        metavar="ATTENTION[:KEY=VALUE,...]",
        help=f"one run per entry; keys {', '.join(RUN_KEYS)} (see the module docstring); instead of --attention",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (the config's if unset)")
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-clock cap per run (Trainer.max_time)")
    parser.add_argument(
        "--sdpa-backend",
        default="default",
        help=f"PyTorch SDPA backend forced in every run ({', '.join(SDPA_BACKENDS)}); full layers call SDPA",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one config entry for every run, e.g. data.seq_len=1024 or model.config.n_layers=4",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="untimed steps per attention setting first, on a throwaway model (compilation, autotuning); 0: none",
    )
    parser.add_argument(
        "--tag", default=None, help="file-name tag (default: the config's name; 'evidence' for --matrix)"
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: $OUT when set, else benchmarks/results")
    parser.add_argument("--plot-only", type=Path, default=None, help="draw the PNG of an existing result JSON")
    parser.add_argument("--corpus-note", default=None, help="what the corpus is, kept in the result's header")
    parser.add_argument(
        "--save-checkpoint",
        default=None,
        metavar="RUN | GROUP/RUN",
        help="save this run's final model as <out-dir>/checkpoints/<tag>-<run>.ckpt (GROUP/RUN and "
        "<tag>-<group>-<run>.ckpt under --matrix), its config beside it as .yaml, for benchmarks/attribution.py",
    )
    matrix = parser.add_argument_group("matrix (--matrix evidence)")
    matrix.add_argument("--matrix", default=None, help=f"run a whole matrix of groups: {', '.join(MATRICES)}")
    matrix.add_argument("--groups", default=None, help="comma-separated group names to run (default: all)")
    matrix.add_argument("--large-batch", type=int, default=64, help="sequences per step of the large groups")
    matrix.add_argument("--small-batch", type=int, default=8, help="sequences per step of the small group")
    matrix.add_argument("--budget-minutes", type=float, default=None, help="wall time for the whole matrix")
    matrix.add_argument("--tokens-per-run", type=int, default=None, help="tokens per training run (else planned)")
    matrix.add_argument("--calibration-steps", type=int, default=8, help="timed warm-up steps that plan the budget")
    matrix.add_argument("--evals", type=int, default=10, help="validations per training run (the last at its end)")
    matrix.add_argument("--val-sequences", type=int, default=64, help="validation sequences per validation")
    matrix.add_argument("--speed-steps", type=int, default=100, help="steps per run of the speed group")
    args = parser.parse_args(argv)

    def refuse(name: str, value: Any, works: str) -> None:
        parser.error(f"{name} must be {works}; received {value!r}.")

    for name, value, minimum in (
        ("--max-steps", args.max_steps, 1),
        ("--warmup-steps", args.warmup_steps, 0),
        ("--large-batch", args.large_batch, 1),
        ("--small-batch", args.small_batch, 1),
        ("--tokens-per-run", args.tokens_per_run, 1),
        ("--calibration-steps", args.calibration_steps, 0),
        ("--evals", args.evals, 1),
        ("--val-sequences", args.val_sequences, 1),
        ("--speed-steps", args.speed_steps, 1),
    ):
        if value is not None and value < minimum:
            refuse(name, value, f"an integer >= {minimum}")
    for name, value in (("--max-minutes", args.max_minutes), ("--budget-minutes", args.budget_minutes)):
        if value is not None and not (math.isfinite(value) and value > 0):
            refuse(name, value, "a positive number of minutes")
    if args.sdpa_backend not in SDPA_BACKENDS:
        refuse("--sdpa-backend", args.sdpa_backend, f"one of {', '.join(SDPA_BACKENDS)}")
    if args.attention is not None and args.runs is not None:
        parser.error("give --attention or --runs, not both; received both (--runs takes ATTENTION[:KEY=VALUE,...]).")
    if args.matrix is not None:
        if args.matrix not in MATRICES:
            refuse("--matrix", args.matrix, f"one of {', '.join(MATRICES)}")
        if args.attention is not None or args.runs is not None or args.max_steps is not None:
            parser.error(
                "--matrix plans its own runs and steps; received --attention, --runs or --max-steps with it "
                "(use --groups, --budget-minutes or --tokens-per-run)."
            )
        if args.budget_minutes is None and args.tokens_per_run is None:
            parser.error("--matrix needs --budget-minutes (planned from measured throughput) or --tokens-per-run.")
        if args.large_batch % args.small_batch:
            refuse("--large-batch", args.large_batch, f"a multiple of --small-batch ({args.small_batch})")
        if args.save_checkpoint is not None and args.save_checkpoint.count("/") != 1:
            refuse("--save-checkpoint", args.save_checkpoint, "GROUP/RUN under --matrix, e.g. large-qknorm/full")
    elif args.groups is not None:
        parser.error(f"--groups selects groups of --matrix; received --groups {args.groups!r} without --matrix.")
    elif args.save_checkpoint is not None and "/" in args.save_checkpoint:
        refuse("--save-checkpoint", args.save_checkpoint, "a run's name without --matrix (GROUP/RUN is --matrix's)")
    if args.attention is None and args.runs is None:
        args.attention = ["sage", "full"]
    return args


def load_config(path: Path, changes: list[str]) -> dict[str, Any]:
    """The YAML config at ``path`` with ``SECTION.KEY=VALUE`` changes applied (values parsed as YAML).

    Example::

        load_config(Path("examples/configs/tiny.yaml"), ["trainer.max_steps=10"])["trainer"]["max_steps"]   # 10
    """
    return apply_changes(yaml.safe_load(path.read_text()), changes, str(path))


def apply_changes(config: dict[str, Any], changes: Sequence[str], where: str = "the config") -> dict[str, Any]:
    """``config`` (changed in place and returned) with ``SECTION.KEY=VALUE`` changes, the values read as YAML.

    Example::

        apply_changes({"data": {"seq_len": 128}}, ["data.seq_len=256"])   # {"data": {"seq_len": 256}}
    """
    for change in changes:
        key, sep, value = change.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes SECTION.KEY=VALUE, e.g. data.seq_len=1024; received {change!r}.")
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
            if node is None:
                raise ValueError(f"--set {change!r}: {part!r} is not a section of {where}.")
        node[last] = yaml.safe_load(value)
    return config


def parse_run(text: str) -> RunSpec:
    """One ``--runs`` entry, ``ATTENTION[:KEY=VALUE,...]``, as a :class:`RunSpec`.

    Raises:
        ValueError: an unknown attention, key or value; the message names it and what works.

    Example::

        parse_run("sage:controller=off,smooth_k=off")
        # RunSpec(name="sage-fixed-no-smooth-k", attention="sage", controller=False, smooth_k=False)
    """
    attention, _, options = text.partition(":")
    if attention not in ATTENTION_MODES:
        raise ValueError(
            f"--runs {text!r}: the attention must be one of {', '.join(ATTENTION_MODES)}; received {attention!r}."
        )
    fields: dict[str, Any] = {}
    for option in filter(None, options.split(",")):
        key, sep, value = option.partition("=")
        if not sep or key not in RUN_KEYS:
            raise ValueError(
                f"--runs {text!r}: each option is KEY=VALUE with KEY one of {', '.join(RUN_KEYS)}; received {option!r}."
            )
        if key == "name":
            if not _NAME.match(value):
                raise ValueError(
                    f"--runs {text!r}: name must be letters, digits, '.', '_', '+' or '-'; received {value!r}."
                )
            fields["name"] = value
        elif key == "seed":
            try:
                fields["seed"] = int(value)
            except ValueError:
                raise ValueError(f"--runs {text!r}: seed must be an integer; received {value!r}.") from None
        elif key == "sdpa":
            if value not in SDPA_BACKENDS:
                raise ValueError(
                    f"--runs {text!r}: sdpa must be one of {', '.join(SDPA_BACKENDS)}; received {value!r}."
                )
            fields["sdpa_backend"] = value
        else:
            if value.lower() not in _SWITCH:
                raise ValueError(f"--runs {text!r}: {key} must be on or off; received {value!r}.")
            fields[key] = _SWITCH[value.lower()]
    sagebwd = [name for name, precision in ATTENTION_MODES.items() if precision.mode == "sagebwd"]
    if attention not in sagebwd and (fields.get("smooth_k") is not None or fields.get("smooth_q") is not None):
        raise ValueError(
            f"--runs {text!r}: smooth_k and smooth_q are SageBwd's; give them to {', '.join(sagebwd)} runs only."
        )
    name = fields.pop("name", None) or run_name(attention, **fields)
    return RunSpec(name=name, attention=attention, **fields)


def run_name(
    attention: str,
    controller: bool | None = None,
    seed: int | None = None,
    smooth_k: bool | None = None,
    smooth_q: bool | None = None,
    sdpa_backend: str | None = None,
) -> str:
    """The name a run gets from what sets it apart, e.g. ``sage-fixed-no-smooth-k`` or ``full-seed1235``.

    Example::

        run_name("sage", controller=True)   # "sage-controller"
    """
    parts = [attention]
    if controller is True:
        parts.append("controller")
    elif controller is False and attention != "full":
        parts.append("fixed")
    if seed is not None:
        parts.append(f"seed{seed}")
    if smooth_k is False:
        parts.append("no-smooth-k")
    if smooth_q is True:
        parts.append("smooth-q")
    if sdpa_backend not in (None, "default"):
        parts.append(str(sdpa_backend))
    return "-".join(parts)


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The runs ``--attention`` or ``--runs`` asks for, names made unique (``-2``, ``-3`` for repeats).

    Example::

        [spec.name for spec in run_specs(parse_args(["--attention", "sage", "full"]))]   # ["sage", "full"]
    """
    if args.runs is not None:
        specs = [parse_run(text) for text in args.runs]
    else:
        for attention in args.attention:
            if attention not in ATTENTION_MODES:
                raise ValueError(f"--attention must be among {', '.join(ATTENTION_MODES)}; received {attention!r}.")
        specs = [RunSpec(name=attention, attention=attention) for attention in args.attention]
    seen: dict[str, int] = {}
    unique = []
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        unique.append(
            spec if seen[spec.name] == 1 else dataclasses.replace(spec, name=f"{spec.name}-{seen[spec.name]}")
        )
    return unique


def build_controller(spec: dict[str, Any] | None) -> AdaptivePrecision | None:
    """``AdaptivePrecision`` from the config's ``adaptive_precision`` entry (``class_path`` and ``init_args``).

    Example::

        build_controller({"class_path": "sage_lightning.AdaptivePrecision", "init_args": {"config": {}}})
    """
    if spec is None:
        return None
    if spec.get("class_path", "sage_lightning.AdaptivePrecision") not in (
        "sage_lightning.AdaptivePrecision",
        "sage_lightning.callback.AdaptivePrecision",
    ):
        raise ValueError(f"adaptive_precision: this script builds sage_lightning.AdaptivePrecision; received {spec}.")
    kwargs = dict(spec.get("init_args") or {})
    policy = dict(kwargs.pop("config", None) or {})
    if "ladder" in policy:
        policy["ladder"] = tuple(Rung(**rung) for rung in policy["ladder"])
    kwargs.setdefault("progress_bar", False)
    return AdaptivePrecision(PolicyConfig(**policy), **kwargs)


def run_controller(config: dict[str, Any], spec: RunSpec) -> AdaptivePrecision | None:
    """The run's controller: the config's, unless the run turns it off; the defaults where the config has none.

    Example::

        run_controller({"adaptive_precision": None}, RunSpec("sage", "sage", controller=True))   # defaults
    """
    entry = config.get("adaptive_precision")
    if spec.controller is False:
        return None
    if spec.controller is True and entry is None:
        entry = {"class_path": "sage_lightning.AdaptivePrecision"}
    return build_controller(entry)


def model_config(config: dict[str, Any], data: TextDataModule) -> LlamaConfig:
    """The model's shape from the config's ``model.config``, its vocabulary and length from the data.

    Example::

        model_config(load_config(Path("examples/configs/tiny.yaml"), []), data).n_layers   # 4
    """
    return LlamaConfig(
        **{
            **((config.get("model") or {}).get("config") or {}),
            "vocab_size": data.vocab_size,
            "max_seq_len": data.seq_len,
        }
    )


def build_model(config: dict[str, Any], spec: RunSpec, data: TextDataModule) -> LlamaPretraining:
    """``LlamaPretraining`` from the config's ``model`` entry, with the run's attention and smoothing.

    Example::

        build_model(load_config(Path("examples/configs/tiny.yaml"), []), parse_run("sage:smooth_k=off"), data)
    """
    model_args = {**(config.get("model") or {}), "config": model_config(config, data), "attention": spec.attention}
    model = LlamaPretraining(**model_args)
    changes = {k: v for k, v in (("smooth_k", spec.smooth_k), ("smooth_q", spec.smooth_q)) if v is not None}
    if changes:
        # SageAttentionMixin reads the layers' starting precision in configure_model, when the Trainer starts.
        model.sage_precision = model.sage_precision.replace(**changes)
    return model


@contextlib.contextmanager
def sdpa_backend(name: str | None) -> Iterator[None]:
    """Force PyTorch's SDPA onto one backend (a key of :data:`SDPA_BACKENDS`) while the block runs.

    Example::

        with sdpa_backend("cudnn"):
            trainer.fit(model, datamodule=data)
    """
    member = SDPA_BACKENDS[name or "default"]
    if member is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, member)]):
        yield


def check_sdpa_backend(name: str | None, cfg: LlamaConfig, seq_len: int, device: str, dtype: torch.dtype) -> None:
    """Refuse a forced SDPA backend that cannot run this model's attention call, before any training.

    One forward and backward of SDPA with the model's shapes (one sequence, its query and key/value heads, causal,
    ``enable_gqa`` as the model calls it) under the backend.

    Args:
        name: a key of :data:`SDPA_BACKENDS`; ``None`` or ``"default"`` checks nothing.
        cfg: the model's shape.
        seq_len: the training sequence length.
        device: ``"cuda"`` or ``"cpu"``, where the run trains.
        dtype: the attention's dtype under the run's precision (bf16 under ``bf16-mixed``).

    Raises:
        ValueError: the backend has no kernel for the call; the message names it and what works.

    Example::

        check_sdpa_backend("flash", LlamaConfig.from_name("small"), 2048, "cuda", torch.bfloat16)
    """
    if SDPA_BACKENDS[name or "default"] is None:
        return
    head_dim = cfg.d_model // cfg.n_heads
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    # Its own generator: the global one, seeded for the run, also shuffles the data.
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, cfg.n_heads, seq_len, head_dim, device=device, dtype=dtype, generator=generator)
    kv = torch.randn(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype, generator=generator)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    try:
        with sdpa_backend(name):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=kv_heads != cfg.n_heads
            )
            out.sum().backward()
    except RuntimeError as error:
        raise ValueError(
            f"sdpa={name}: PyTorch's SDPA has no {name} kernel for this model's attention ({cfg.n_heads} query and "
            f"{kv_heads} key/value heads of {head_dim}, sequence {seq_len}, {dtype}, causal, on {device}): "
            f"{str(error).splitlines()[0]} Use one of {', '.join(SDPA_BACKENDS)} that runs here (default lets "
            "PyTorch choose)."
        ) from None


def _device(config: dict[str, Any]) -> str:
    accelerator = (config.get("trainer") or {}).get("accelerator", "auto")
    return "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu"


def _dtype(config: dict[str, Any]) -> torch.dtype:
    precision = str((config.get("trainer") or {}).get("precision", "32-true"))
    return torch.bfloat16 if "bf16" in precision else torch.float16 if precision.startswith("16") else torch.float32


def warm_up(
    config: dict[str, Any],
    spec: RunSpec | str,
    steps: int,
    data: TextDataModule,
    timed_steps: int = 0,
    sdpa: str | None = None,
) -> float | None:
    """Train ``steps`` untimed steps, then ``timed_steps`` timed ones, with the run's settings, and throw the model
    away: the Triton kernels compile and autotune (once per process and shape; minutes on a fresh machine) and
    CUDA initialises before any run is timed, so no run's time budget pays for them.

    A controller in the warm-up measures dS on every step, so the kernels' statistics variant compiles here too.

    Args:
        config: the run's config (``load_config``).
        spec: the run (or an attention name, for a run of the config as it is).
        steps: untimed steps.
        data: the data module (prepared).
        timed_steps: timed steps after them.
        sdpa: the SDPA backend when the run names none (``--sdpa-backend``).

    Returns:
        The median tokens/s of the timed steps (validation off), or ``None`` when ``timed_steps`` is 0.

    Example::

        warm_up(config, parse_run("sage:controller=off"), 2, data, timed_steps=8)   # e.g. 446000.0
    """
    spec = RunSpec(name=spec, attention=spec) if isinstance(spec, str) else spec
    model = build_model(config, spec, data)
    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k not in _TRAINER_OWN}
    trainer_args.update(
        max_steps=steps + timed_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    trainer_args.pop("max_time", None)
    entry = copy.deepcopy(config.get("adaptive_precision"))
    if entry is not None:
        entry.setdefault("init_args", {}).setdefault("config", {})["ds_stats_every_n_steps"] = 1
    controller = run_controller({**config, "adaptive_precision": entry}, spec)
    if controller is not None:
        controller.verbose = False
    clock = TokensPerSecond(log_every_n_steps=1)
    trainer = L.Trainer(
        **trainer_args,
        callbacks=[clock] + ([controller] if controller is not None else []),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with sdpa_backend(spec.sdpa_backend or sdpa):
        trainer.fit(model, datamodule=data)
    timed = [w["tokens_per_s"] for w in clock.windows[steps:] if math.isfinite(w["tokens_per_s"])]
    return statistics.median(timed) if timed_steps and timed else None


def run_one(
    config: dict[str, Any],
    spec: RunSpec | str,
    args: argparse.Namespace,
    data: TextDataModule,
    log_dir: Path,
    run: str,
    *,
    max_steps: int | None = None,
    max_minutes: float | None = None,
    save_to: Path | None = None,
    changes: Sequence[str] = (),
) -> dict[str, Any]:
    """Train the config once as ``spec`` says; return its rows, summary and decisions.

    Args:
        config: the config (``load_config``), the Trainer's entries included.
        spec: the run (or an attention name, for a run of the config as it is).
        args: the command line (``--sdpa-backend``, and ``--max-steps``/``--max-minutes`` as defaults).
        data: the data module (prepared).
        log_dir: the TensorBoard folder; the run logs to ``<run>-<spec.name>/version_0`` in it.
        run: prefix of the run's TensorBoard name (the file's tag).
        max_steps: optimizer steps (``--max-steps`` when ``None``; then the config's).
        max_minutes: wall-clock cap (``--max-minutes`` when ``None``).
        save_to: where to save the final model (:func:`save_final_model`, the config beside it); ``None``: nowhere.
        changes: the ``SECTION.KEY=VALUE`` changes that made ``config`` from ``args.config``, for the saved config's
            header.

    Returns:
        ``{"rows", "summary", "decisions", "decision_log"}``; the summary has ``checkpoint`` (its path) where the
        final model was saved.

    Raises:
        ValueError: a forced SDPA backend that cannot run the model (:func:`check_sdpa_backend`).

    Example::

        run_one(config, parse_run("sage:controller=off"), parse_args([]), data, Path("/tmp/tb"), "tiny", max_steps=4)
    """
    spec = RunSpec(name=spec, attention=spec) if isinstance(spec, str) else spec
    backend = spec.sdpa_backend or args.sdpa_backend
    seed = spec.seed if spec.seed is not None else int(config.get("seed_everything", 0) or 0)
    max_steps = args.max_steps if max_steps is None else max_steps
    max_minutes = args.max_minutes if max_minutes is None else max_minutes
    L.seed_everything(seed, workers=True)
    model = build_model(config, spec, data)
    check_sdpa_backend(backend, model.config, data.seq_len, _device(config), _dtype(config))

    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k not in _TRAINER_OWN}
    if max_steps is not None:
        trainer_args["max_steps"] = max_steps
    if max_minutes is not None:
        trainer_args["max_time"] = datetime.timedelta(minutes=max_minutes)
    throughput, curve = TokensPerSecond(), LossCurve()
    controller = run_controller(config, spec)
    callbacks: list[Callback] = [throughput, curve] + ([controller] if controller is not None else [])
    trainer = L.Trainer(
        **trainer_args,
        callbacks=callbacks,
        logger=PretrainLogger(str(log_dir), name=f"{run}-{spec.name}", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(log_dir),
    )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with sdpa_backend(backend):
        trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start
    saved = None
    if save_to is not None:
        try:
            saved, config_path = save_final_model(
                trainer, config, spec, seed, save_to, f"{args.config} with {', '.join(changes) or 'no changes'}"
            )
            print(
                f"--- {run}-{spec.name}: final model (step {trainer.global_step}) in {saved}, config {config_path}",
                flush=True,
            )
        except Exception as error:  # noqa: BLE001  (the run's results matter more than its checkpoint)
            print(f"--- {run}-{spec.name}: checkpoint failed, not saved: {type(error).__name__}: {error}", flush=True)

    losses = curve.losses()
    tokens_per_step = data.batch_size * data.seq_len * trainer.accumulate_grad_batches * trainer.world_size
    common = {
        "run": spec.name,
        "attention": spec.attention,
        "tokens_per_step": tokens_per_step,
        "qk_norm": model.config.qk_norm,
        "seed": seed,
    }
    rows = []
    previous = 0
    for window in throughput.windows:
        step = int(window["step"])
        window_losses = losses[previous:step]
        row = {
            **common,
            "step": step,
            "tokens_seen": int(window["tokens_seen"]),
            "train_loss": statistics.fmean(window_losses) if window_losses else None,
            "tokens_per_s": window["tokens_per_s"],
            "seconds": window["seconds"],
        }
        if step in curve.val_losses:
            row["val_loss"] = curve.val_losses[step]
        rows.append(row)
        previous = step
    logged = {row["step"] for row in rows}
    for step, value in sorted(curve.val_losses.items()):
        if step not in logged:
            rows.append({**common, "step": step, "tokens_seen": step * tokens_per_step, "val_loss": value})
    rows.sort(key=lambda row: row["step"])
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    if peak is not None:
        for row in rows:  # the run's peak on each of its rows, as speed rows carry it (benchmarks/readme_perf.py)
            row["peak_mem_mb"] = peak
    history = [] if controller is None else list(controller.history)
    layers = attention_layers(model)
    summary = {
        "run": spec.name,
        "attention": spec.attention,
        "controller": controller is not None,
        "seed": seed,
        "precision": model.sage_precision.short_name if model.sage_precision is not None else None,
        "sdpa_backend": backend,
        "qk_norm": model.config.qk_norm,
        "tokens_per_step": tokens_per_step,
        "max_steps": trainer.max_steps,
        "steps": trainer.global_step,
        "wall_s": wall,
        "tokens_per_s": steady_tokens_per_s(throughput.windows),
        "tokens_seen": throughput.tokens_seen,
        "int8_fraction": None if controller is None else controller.int8_fraction,
        "decisions": len(history),
        "skipped_steps": None if controller is None else controller.skipped_steps,
        "rollbacks": None if controller is None else controller.rollbacks,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "nonfinite_losses": sum(not math.isfinite(loss) for loss in losses),
        "fallback_calls": sum(layer.fallback_calls for layer in layers.values()),
        "final_precisions": {name: layer.precision.short_name for name, layer in layers.items()},
        "peak_memory_gb": None if peak is None else peak / 2**10,
    }
    if saved is not None:
        summary["checkpoint"] = str(saved)
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "rows": rows,
        "summary": summary,
        "decisions": [str(decision) for decision in history],
        "decision_log": [dataclasses.asdict(decision) for decision in history],
    }


def save_final_model(
    trainer: L.Trainer, config: dict[str, Any], spec: RunSpec, seed: int, path: Path, source: str
) -> tuple[Path, Path]:
    """Save a run's final model as a Lightning checkpoint and, beside it, the config it trained with.

    The checkpoint is ``Trainer.save_checkpoint``'s with ``weights_only`` (the weights, the hyperparameters and the
    global step; no optimizer state): ``LlamaPretraining.load_from_checkpoint`` rebuilds the model from it, as
    ``benchmarks/attribution.py --checkpoint`` does. The YAML beside it (``path`` with ``.yaml``) is the config as
    the run used it, every change applied, with the run's seed, attention and steps: give it to attribution.py's
    ``--config``, which takes the data (corpus, tokenizer, held-out split) and the precision from it and checks its
    ``model.config`` against the checkpoint.

    Args:
        trainer: the run's Trainer, after ``fit``.
        config: the run's config (:func:`load_config` and the changes).
        spec: the run.
        seed: the seed it trained with.
        path: the ``.ckpt`` to write (its folder is made).
        source: where the config came from, for the YAML's header comment.

    Returns:
        ``(checkpoint, config YAML)``.

    Example::

        save_final_model(trainer, config, parse_run("full"), 1234, Path("/tmp/ckpt/tiny-full.ckpt"), "tiny.yaml")
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path, weights_only=True)
    effective = copy.deepcopy(config)
    effective["seed_everything"] = seed
    effective["model"] = {**(effective.get("model") or {}), "attention": spec.attention}
    effective["trainer"] = {**(effective.get("trainer") or {}), "max_steps": trainer.max_steps}
    smoothing = {k: v for k, v in (("smooth_k", spec.smooth_k), ("smooth_q", spec.smooth_q)) if v is not None}
    config_path = path.with_suffix(".yaml")
    text = (
        f"The config of run {spec.name} as it trained (benchmarks/pretrain_compare.py --save-checkpoint): {source}; "
        f"the run's seed, attention and steps. Its final model, step {trainer.global_step}, is {path.name} beside it."
        + (f" The run's SageBwd smoothing, which is no config entry: {smoothing}." if smoothing else "")
    )
    command = f"  python benchmarks/attribution.py --config {config_path} --checkpoint {path}"
    header = [*textwrap.wrap(text, 116), command]
    config_path.write_text("".join(f"# {line}\n" for line in header) + yaml.safe_dump(effective, sort_keys=False))
    return path, config_path


def steady_tokens_per_s(windows: list[dict[str, float]]) -> float | None:
    """Median tokens/s over the windows after the first tenth of the run (and never the first window, which holds
    the kernels' compilation and autotuning).

    Example::

        steady_tokens_per_s([{"step": s, "tokens_per_s": 100.0} for s in range(10, 110, 10)])   # 100.0
    """
    if not windows:
        return None
    last = windows[-1]["step"]
    steady = [w["tokens_per_s"] for w in windows[1:] if w["step"] > 0.1 * last and math.isfinite(w["tokens_per_s"])]
    return statistics.median(steady) if steady else windows[-1]["tokens_per_s"]


def compare(result: dict[str, Any]) -> list[str]:
    """The markdown summary: one line per run, then the losses at the last step every run reached."""
    summaries = result["summary"]
    lines = [
        "| run | steps | wall s | tokens/s (steady) | int8 share | decisions | peak GPU memory GB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        name = s.get("run", s["attention"])
        if s.get("error"):
            lines.append(f"| {name} | failed: {s['error'][:120]} | | | | | |")
            continue
        memory = "" if s.get("peak_memory_gb") is None else f"{s['peak_memory_gb']:.1f}"
        # Measured against each layer's starting precision: a full-precision run has no INT8 to keep.
        int8 = "" if s["int8_fraction"] is None or s["attention"] == "full" else f"{s['int8_fraction']:.3f}"
        speed = "" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
        lines.append(f"| {name} | {s['steps']} | {s['wall_s']:.0f} | {speed} | {int8} | {s['decisions']} | {memory} |")
    by_run = {
        name: rows
        for name, rows in results_doc.rows_by_run(result).items()
        if any(r.get("train_loss") is not None for r in rows)
    }
    if len(by_run) > 1:
        common_step = min(max(r["step"] for r in rows if r.get("train_loss") is not None) for rows in by_run.values())
        val_steps = set.intersection(*({r["step"] for r in rows if "val_loss" in r} for rows in by_run.values()))
        lines += ["", f"At step {common_step} (the last every run reached):", ""]
        header = "| run | train loss (window mean) |"
        rule = "|---|---:|"
        if val_steps:
            last_val = max(val_steps)
            header += f" val loss at step {last_val} |"
            rule += "---:|"
        lines += [header, rule]
        for name, rows in by_run.items():
            train = next((r["train_loss"] for r in rows if r["step"] == common_step), None)
            line = f"| {name} | {'' if train is None else f'{train:.4f}'} |"
            if val_steps:
                line += f" {next(r['val_loss'] for r in rows if r['step'] == last_val):.4f} |"
            lines.append(line)
        speeds = {s.get("run", s["attention"]): s["tokens_per_s"] for s in summaries if not s.get("error")}
        ratios = [
            f"Speed, {name} / full: {speed / speeds['full']:.3f}x (steady-state tokens/s)."
            for name, speed in speeds.items()
            if name != "full" and speed and speeds.get("full")
        ]
        lines += ["", *ratios] if ratios else []
    return lines


def plot(result: dict[str, Any], path: Path) -> bool:
    """Loss against step and tokens/s against step, one line per run; ``False`` where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (loss_axis, speed_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results_doc.rows_by_run(result).items():
        train = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        speed = [(r["step"], r["tokens_per_s"]) for r in rows if r.get("tokens_per_s") is not None]
        if not train:
            continue
        (line,) = loss_axis.plot(*zip(*train, strict=True), label=f"{name} train", linewidth=1)
        if val:
            loss_axis.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{name} val")
        if speed:
            speed_axis.plot(*zip(*speed, strict=True), color=line.get_color(), label=name, linewidth=1)
    loss_axis.set(xlabel="optimizer step", ylabel="loss (nats per token)", title="loss")
    speed_axis.set(xlabel="optimizer step", ylabel="tokens / s", title="throughput (validation excluded)")
    for axis in (loss_axis, speed_axis):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.suptitle(textwrap.fill(f"{result['device']}, {result['date']}: {result['command']}", 160), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def new_result(args: argparse.Namespace, argv: list[str], data: TextDataModule, device: str) -> dict[str, Any]:
    """The header of a training result file (``rows`` empty)."""
    config = args.config.resolve()
    return {
        "kind": "training",
        "device": accuracy.device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": accuracy._commit(),
        "command": shlex.join(["python", "benchmarks/pretrain_compare.py", *argv]),
        "versions": accuracy._versions(),
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else "",
        "corpus": {
            **{key: data.meta.get(key) for key in ("tokens", "documents", "text_bytes", "tokenizer", "files")},
            **({"note": args.corpus_note} if args.corpus_note else {}),
        },
        "warmup_s": {},
        "runs": [],
        "summary": [],
        "decisions": {},
        "decision_log": {},
        "rows": [],
    }


def add_outcome(result: dict[str, Any], spec: RunSpec, outcome: dict[str, Any]) -> None:
    """Put one run's rows, summary and decisions into ``result``."""
    result["runs"].append(dataclasses.asdict(spec))
    result["rows"] += outcome["rows"]
    result["summary"].append(outcome["summary"])
    result["decisions"][spec.name] = outcome["decisions"]
    result["decision_log"][spec.name] = outcome["decision_log"]


def write_result(result: dict[str, Any], out: Path, tag: str, quiet: bool = False, draw: bool = True) -> None:
    """Write ``out`` (the JSON), its markdown summary and, where matplotlib is installed and ``draw``, its plot.

    Args:
        result: the result dict.
        out: the JSON's path; the summary and plot go beside it (``.md``, ``.png``).
        tag: the summary's title.
        quiet: do not print the summary.
        draw: draw the plot (the matrix draws it once per group).
    """
    out.write_text(accuracy.to_json(result))
    lines = compare(result)
    decisions = [f"- {name}: {d}" for name, items in result["decisions"].items() for d in items]
    matrix = result.get("matrix")
    intro = f"Group `{matrix['group']}`: {matrix['title']}. " if matrix else ""
    heading = (
        f"# Pretraining: SageBwd against full-precision attention ({tag})\n\n{result['device']}, {result['date']}, "
        f"commit {result['commit']}\n\n`{result['command']}`\n\n{intro}Config `{result['config']}`; corpus "
        f"{result['corpus']['tokens']:,} tokens ({result['corpus']['tokenizer']}). Same seed, data order and callbacks "
        "in every run unless the run's name says otherwise. Untimed warm-up first (kernel compilation and "
        f"autotuning), seconds: {result['warmup_s'] or 'none'}.\n\n"
    )
    text = "\n".join(lines) + "\n\nDecisions of AdaptivePrecision:\n\n" + ("\n".join(decisions) or "none") + "\n"
    drawn = draw and plot(result, out.with_suffix(".png"))
    if drawn:
        text += f"\n![loss and throughput]({out.with_suffix('.png').name})\n"
    out.with_suffix(".md").write_text(heading + text)
    if not quiet:
        print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {out.with_suffix('.png')}" if drawn else " (no matplotlib)"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison (or ``--matrix``) and write its files; returns the result dict (the matrix: by group).

    Example::

        main(["--config", "examples/configs/tiny.yaml", "--max-steps", "4", "--out-dir", "/tmp/compare"])
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.plot_only is not None:
        result = json.loads(args.plot_only.read_text())
        png, markdown = args.plot_only.with_suffix(".png"), args.plot_only.with_suffix(".md")
        if not plot(result, png):
            print("matplotlib is not installed: no plot")
            return result
        link = f"\n![loss and throughput]({png.name})\n"
        if markdown.is_file() and link not in markdown.read_text():
            markdown.write_text(markdown.read_text() + link)  # the summary written where matplotlib was missing
        print(f"wrote {png}")
        return result
    if args.matrix is not None:
        return run_matrix(args, argv)
    try:
        specs = run_specs(args)
    except ValueError as error:
        raise SystemExit(f"pretrain_compare.py: error: {error}") from None
    if args.save_checkpoint is not None and args.save_checkpoint not in {spec.name for spec in specs}:
        raise SystemExit(
            "pretrain_compare.py: error: --save-checkpoint must name one of the runs, "
            f"{', '.join(spec.name for spec in specs)}; received {args.save_checkpoint!r}."
        )
    config = load_config(args.config, args.set)
    tag = args.tag or args.config.stem
    out_dir = args.out_dir or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)

    data = TextDataModule(**(config.get("data") or {}))
    data.prepare_data()
    result = new_result(args, argv, data, _device(config))
    if args.warmup_steps:
        for spec in {(s.attention, s.smooth_k, s.smooth_q, s.sdpa_backend): s for s in specs}.values():
            print(f"--- {tag}: warm-up, {spec.name}, {args.warmup_steps} steps", flush=True)
            start = time.perf_counter()
            warm_up(config, spec, args.warmup_steps, data, sdpa=args.sdpa_backend)
            result["warmup_s"][spec.name] = round(time.perf_counter() - start, 1)
    for spec in specs:
        print(f"--- {tag}: {spec.name}", flush=True)
        save_to = out_dir / "checkpoints" / f"{tag}-{spec.name}.ckpt" if spec.name == args.save_checkpoint else None
        outcome = run_one(config, spec, args, data, out_dir / "tensorboard", tag, save_to=save_to, changes=args.set)
        add_outcome(result, spec, outcome)

    out = out_dir / f"training-{accuracy.device_slug(result['device'])}-{date_stamp(result)}-{tag}.json"
    write_result(result, out, tag)
    return result


def date_stamp(result: dict[str, Any]) -> str:
    """``YYYYMMDD`` of the result's date."""
    return result["date"].replace("-", "")


# ------------------------------------------------------------------------------------------------------ the matrix


def evidence_groups(seed: int, large_batch: int, small_batch: int, seq_len: int) -> list[Group]:
    """Issue #7's matrix: which runs, in which groups, in the order they train.

    The large and small groups differ by ``large_batch / small_batch`` in tokens per step (the study compared
    2.1M and 260K, 8x; 64 and 8 sequences of 2048 are 131K and 16K). Full precision runs twice, with seeds
    ``seed`` and ``seed + 1``, for the noise floor; every other run uses ``seed``, so the compared runs share
    initial weights and data order. Full precision and SageBwd fixed train without the controller; K-smoothing off
    is SageBwd fixed. The speed group (issue #4) trains at ``2 * seq_len`` with ``small_batch`` sequences: SageBwd
    against SDPA's cuDNN and flash backends, tokens/s and peak memory.

    Example::

        [group.name for group in evidence_groups(1234, 64, 8, 2048)]
        # ["large-qknorm", "small-qknorm", "large-no-qknorm", "e2e-seq4096"]
    """
    full = RunSpec(name="full", attention="full", controller=False)
    full_b = RunSpec(name=f"full-seed{seed + 1}", attention="full", controller=False, seed=seed + 1)
    fixed = RunSpec(name="sage-fixed", attention="sage", controller=False)
    adaptive = RunSpec(name="sage-controller", attention="sage", controller=True)
    no_smooth_k = RunSpec(name="sage-fixed-no-smooth-k", attention="sage", controller=False, smooth_k=False)
    large, small = large_batch * seq_len, small_batch * seq_len
    long_seq = 2 * seq_len
    return [
        Group(
            "large-qknorm",
            f"{large:,} tokens per step ({large_batch} x {seq_len}), QK-norm",
            [f"data.batch_size={large_batch}", "model.config.qk_norm=true"],
            (full, fixed, adaptive, full_b, no_smooth_k),
        ),
        Group(
            "small-qknorm",
            f"{small:,} tokens per step ({small_batch} x {seq_len}), QK-norm",
            [f"data.batch_size={small_batch}", "model.config.qk_norm=true"],
            (full, fixed, adaptive, full_b),
        ),
        Group(
            "large-no-qknorm",
            f"{large:,} tokens per step ({large_batch} x {seq_len}), no QK-norm",
            [f"data.batch_size={large_batch}", "model.config.qk_norm=false"],
            (full, fixed, adaptive),
        ),
        Group(
            f"e2e-seq{long_seq}",
            f"speed at sequence {long_seq} ({small_batch} x {long_seq} tokens per step), QK-norm: SageBwd against "
            "SDPA cuDNN and flash",
            [f"data.batch_size={small_batch}", f"data.seq_len={long_seq}", "model.config.qk_norm=true"],
            (
                fixed,
                RunSpec(name="full-cudnn", attention="full", controller=False, sdpa_backend="cudnn"),
                RunSpec(name="full-flash", attention="full", controller=False, sdpa_backend="flash"),
            ),
            speed=True,
        ),
    ]


def plan_steps(
    seconds: float, groups: Sequence[tuple[str, int, Sequence[float]]], multiple: int
) -> tuple[int, dict[str, int]]:
    """Steps per group so that every run sees the same tokens and all of them train in ``seconds``.

    Args:
        seconds: training time available for all runs together.
        groups: ``(name, tokens_per_step, [tokens/s of each run])`` per group.
        multiple: the largest group's steps are a multiple of this (the validations fall on whole steps).

    Returns:
        ``(tokens per run, {group: steps})``.

    Raises:
        ValueError: ``seconds`` is too short for ``multiple`` steps of the largest group; the message says how much
            would do.

    Example::

        plan_steps(100.0, [("large", 1000, [1e4, 1e4]), ("small", 250, [5e3])], multiple=10)
        # (250000, {"large": 250, "small": 1000}): 100 s / (2 / 1e4 + 1 / 5e3) s per token
    """
    unit = max(tokens for _, tokens, _ in groups)
    for name, tokens, _ in groups:
        if unit % tokens:
            raise ValueError(
                f"group {name}: its {tokens} tokens per step do not divide the largest group's {unit}; give batch "
                "sizes that divide each other (--large-batch a multiple of --small-batch)."
            )
    seconds_per_token = sum(1 / speed for _, _, speeds in groups for speed in speeds)
    tokens = seconds / seconds_per_token
    large_steps = int(tokens // unit // multiple) * multiple
    if large_steps < multiple:
        needed = multiple * unit * seconds_per_token
        raise ValueError(
            f"--budget-minutes leaves {seconds:.0f} s of training, too little for {multiple} steps of {unit} tokens "
            f"in each of the {sum(len(s) for _, _, s in groups)} runs (about {needed:.0f} s needed at the measured "
            "speeds); give a larger budget, fewer --groups or --tokens-per-run."
        )
    return large_steps * unit, {name: large_steps * unit // tokens_per_step for name, tokens_per_step, _ in groups}


def run_matrix(args: argparse.Namespace, argv: list[str]) -> dict[str, dict[str, Any]]:
    """Run ``--matrix evidence``: warm up and time every setting, plan the steps, then train group by group.

    Args:
        args: the command line (``--groups``, the batch sizes, ``--budget-minutes`` or ``--tokens-per-run``, ...).
        argv: the arguments as given, for the files' ``command``.

    Returns:
        ``{group name: result dict}``, each also written as ``training-<device>-<date>-<tag>-<group>.json``.
    """
    start = time.perf_counter()
    deadline = None if args.budget_minutes is None else start + 60 * args.budget_minutes
    tag = args.tag or "evidence"
    out_dir = args.out_dir or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, args.set)
    seed = int(base.get("seed_everything", 0) or 0)
    seq_len = int((base.get("data") or {}).get("seq_len", 256))
    groups = evidence_groups(seed, args.large_batch, args.small_batch, seq_len)
    save = None
    if args.save_checkpoint is not None:
        save = tuple(args.save_checkpoint.split("/"))
        if save not in {(g.name, r.name) for g in groups for r in g.runs}:
            raise SystemExit(
                "pretrain_compare.py: error: --save-checkpoint must name a run of the matrix as GROUP/RUN, e.g. "
                f"{groups[0].name}/{groups[0].runs[0].name}; received {args.save_checkpoint!r}. Runs: "
                + ", ".join(f"{g.name}/{r.name}" for g in groups for r in g.runs)
                + "."
            )
    if args.groups is not None:
        names = [name.strip() for name in args.groups.split(",") if name.strip()]
        unknown = [name for name in names if name not in {g.name for g in groups}]
        if unknown or not names:
            raise SystemExit(
                f"pretrain_compare.py: error: --groups must name groups among {', '.join(g.name for g in groups)}; "
                f"received {args.groups!r}."
            )
        groups = [g for g in groups if g.name in names]
        if save is not None and save[0] not in names:
            print(
                f"--- {tag}: --save-checkpoint {args.save_checkpoint}: its group is left out (--groups): no checkpoint"
            )

    configs = {g.name: load_config(args.config, [*args.set, *g.changes]) for g in groups}
    datas = {g.name: TextDataModule(**(configs[g.name].get("data") or {})) for g in groups}
    for data in datas.values():
        data.prepare_data()

    speeds, warmup_s, overheads = warm_up_groups(args, groups, configs, datas, tag)
    try:
        steps, tokens_per_run, plan = plan_matrix(args, groups, datas, speeds, overheads, deadline)
    except ValueError as error:
        raise SystemExit(f"pretrain_compare.py: error: {error}") from None
    print(f"--- {tag}: plan {json.dumps(plan)}", flush=True)

    results: dict[str, dict[str, Any]] = {}
    for g in groups:
        config, data = configs[g.name], datas[g.name]
        group_steps = steps[g.name]
        evals = 0 if g.speed else min(args.evals, group_steps)
        val_batches = 0 if g.speed else max(1, args.val_sequences // data.batch_size)
        run_changes = [
            f"trainer.max_steps={group_steps}",
            "trainer.accumulate_grad_batches=1",
            "trainer.num_sanity_val_steps=0",
            f"trainer.limit_val_batches={val_batches}",
            f"trainer.val_check_interval={max(1, group_steps // max(1, evals))}",
            # Speed runs: fewer windows, fewer host syncs; training runs: about 50 points per curve.
            f"trainer.log_every_n_steps={max(1, group_steps // (10 if g.speed else 50))}",
            f"model.warmup_steps={max(1, group_steps // 10)}",
        ]
        apply_changes(config, run_changes)
        result = new_result(args, argv, data, _device(config))
        result["warmup_s"] = warmup_s[g.name]
        result["matrix"] = {
            "name": args.matrix,
            "group": g.name,
            "title": g.title,
            "speed": g.speed,
            "tokens_per_run": None if g.speed else tokens_per_run,
            "steps": group_steps,
            "changes": [*args.set, *g.changes],
            "validation_sequences": val_batches * data.batch_size,
            "plan": plan,
        }
        out = out_dir / f"training-{accuracy.device_slug(result['device'])}-{date_stamp(result)}-{tag}-{g.name}.json"
        for spec in g.runs:
            planned = plan["run_seconds"].get(f"{g.name}/{spec.name}")
            cap = None if planned is None else 1.5 * planned / 60 + 0.5
            if deadline is not None:
                left = (deadline - time.perf_counter()) / 60
                if left < 0.25:
                    print(f"--- {tag}/{g.name}: {spec.name} not run, the budget is spent", flush=True)
                    add_failure(result, spec, f"not run: the budget of {args.budget_minutes} minutes was spent")
                    write_result(result, out, f"{tag}-{g.name}", quiet=True, draw=spec is g.runs[-1])
                    continue
                cap = left if cap is None else min(cap, left)
            print(f"--- {tag}/{g.name}: {spec.name}, {group_steps} steps, cap {cap or 0:.1f} min", flush=True)
            save_to = None
            if save == (g.name, spec.name):
                save_to = out_dir / "checkpoints" / f"{tag}-{g.name}-{spec.name}.ckpt"
            try:
                outcome = run_one(
                    config, spec, args, data, out_dir / "tensorboard", f"{tag}-{g.name}", max_steps=group_steps,
                    max_minutes=cap, save_to=save_to, changes=[*args.set, *g.changes, *run_changes],
                )  # fmt: skip
                add_outcome(result, spec, outcome)
            except Exception as error:  # noqa: BLE001  (record the failure, go on with the next run)
                traceback.print_exc()
                add_failure(result, spec, f"{type(error).__name__}: {error}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            # After every run, so an interrupted matrix keeps what finished; the plot once the group is done.
            write_result(result, out, f"{tag}-{g.name}", quiet=True, draw=spec is g.runs[-1])
        results[g.name] = result
    print(f"--- {tag}: done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return results


def warm_up_groups(
    args: argparse.Namespace,
    groups: Sequence[Group],
    configs: dict[str, dict[str, Any]],
    datas: dict[str, TextDataModule],
    tag: str,
) -> tuple[dict[tuple[str, str], float | None], dict[str, dict[str, float]], list[float]]:
    """Warm up every (attention, controller, SDPA backend) of each group once, timed when the steps are planned.

    Args:
        args: the command line (``--warmup-steps``, ``--calibration-steps``, ``--tokens-per-run``).
        groups: the matrix's groups.
        configs: each group's config, by group name.
        datas: each group's data module (prepared), by group name.
        tag: the progress lines' prefix.

    Returns:
        ``{(group, run): tokens/s}`` (``None`` where not timed or failed: a backend that cannot run is found here
        first), ``{group: {run: warm-up seconds}}``, and each timed warm-up's seconds beyond its steps (the fixed
        cost of a run: building the model and the Trainer).
    """
    timed = args.calibration_steps if args.tokens_per_run is None else 0
    speeds: dict[tuple[str, str], float | None] = {}
    warmup_s: dict[str, dict[str, float]] = {g.name: {} for g in groups}
    overheads: list[float] = []
    for g in groups:
        config, data = configs[g.name], datas[g.name]
        settings: dict[tuple[Any, ...], list[RunSpec]] = {}
        for run in g.runs:
            settings.setdefault((run.attention, run.controller, run.sdpa_backend), []).append(run)
        for runs in settings.values():
            spec = runs[0]
            speed = None
            if args.warmup_steps or timed:
                print(
                    f"--- {tag}/{g.name}: warm-up, {spec.name}, {args.warmup_steps} + {timed} timed steps", flush=True
                )
                begin = time.perf_counter()
                try:
                    backend = spec.sdpa_backend or args.sdpa_backend
                    check_sdpa_backend(
                        backend, model_config(config, data), data.seq_len, _device(config), _dtype(config)
                    )
                    speed = warm_up(config, spec, args.warmup_steps, data, timed, args.sdpa_backend)
                except Exception as error:  # noqa: BLE001  (one bad setting must not end the matrix)
                    print(f"warm-up of {g.name}/{spec.name} failed: {type(error).__name__}: {error}", flush=True)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                warmup_s[g.name][spec.name] = round(time.perf_counter() - begin, 1)
                if speed:
                    steps_s = (args.warmup_steps + timed) * data.batch_size * data.seq_len / speed
                    overheads.append(warmup_s[g.name][spec.name] - steps_s)
            speeds.update({(g.name, run.name): speed for run in runs})
    return speeds, warmup_s, overheads


def add_failure(result: dict[str, Any], spec: RunSpec, error: str) -> None:
    """Record a run that failed or was not run: a summary entry with ``error``, no rows."""
    result["runs"].append(dataclasses.asdict(spec))
    result["summary"].append(
        {"run": spec.name, "attention": spec.attention, "controller": spec.controller, "error": error}
    )
    result["decisions"][spec.name] = []
    result["decision_log"][spec.name] = []


def plan_matrix(
    args: argparse.Namespace,
    groups: Sequence[Group],
    datas: dict[str, TextDataModule],
    speeds: dict[tuple[str, str], float | None],
    overheads: Sequence[float],
    deadline: float | None,
) -> tuple[dict[str, int], int, dict[str, Any]]:
    """Steps per group, the tokens per training run, and the plan as recorded in the result files.

    The speed groups take ``--speed-steps``. The training groups share what is left of the budget after the speed
    runs, a fixed cost per run (the warm-ups' median beyond their steps, at least 3 s) and the validations, with a
    margin of 15%, at the measured speeds (:func:`plan_steps`); or ``--tokens-per-run`` fixes their tokens.

    Args:
        args: the command line.
        groups: the groups to run.
        datas: each group's data module (batch size and sequence length), by group name.
        speeds: ``{(group, run): tokens/s}`` from the warm-ups; ``None`` where not measured.
        overheads: the warm-ups' seconds beyond their steps.
        deadline: ``time.perf_counter()`` at which the budget ends (``None`` with ``--tokens-per-run`` only).

    Returns:
        ``({group: steps}, tokens per training run, plan)``.

    Raises:
        ValueError: the budget is too short (:func:`plan_steps`).
    """
    training = [g for g in groups if not g.speed]
    tokens_per_step = {g.name: datas[g.name].batch_size * datas[g.name].seq_len for g in groups}
    overhead = max(3.0, statistics.median(overheads)) if overheads else 5.0
    plan: dict[str, Any] = {
        "budget_minutes": args.budget_minutes,
        "tokens_per_s": {f"{g}/{r}": s for (g, r), s in speeds.items()},
        "run_overhead_s": round(overhead, 1),
        "run_seconds": {},
    }
    steps = {g.name: args.speed_steps for g in groups if g.speed}
    fallback = [s for s in speeds.values() if s] or [1.0]
    speed_of = {key: value or min(fallback) for key, value in speeds.items()}
    fixed_s = sum(
        args.speed_steps * tokens_per_step[g.name] / speed_of.get((g.name, r.name), min(fallback)) + overhead
        for g in groups
        if g.speed
        for r in g.runs
    )
    if args.tokens_per_run is not None:
        unit = max((tokens_per_step[g.name] for g in training), default=1)
        large_steps = max(1, args.tokens_per_run // unit)
        tokens_per_run = large_steps * unit
        steps.update({g.name: tokens_per_run // tokens_per_step[g.name] for g in training})
    elif training:
        assert deadline is not None
        runs = sum(len(g.runs) for g in training)
        val_tokens = args.evals * args.val_sequences * max(datas[g.name].seq_len for g in training)
        left = deadline - time.perf_counter() - fixed_s - runs * overhead
        # Validation (forward only, about a third of a training step's cost) and a safety margin of 15%.
        left -= runs * val_tokens / (3 * min(fallback))
        tokens_per_run, planned = plan_steps(
            0.85 * left,
            [(g.name, tokens_per_step[g.name], [speed_of[(g.name, r.name)] for r in g.runs]) for g in training],
            multiple=args.evals,
        )
        steps.update(planned)
    else:
        tokens_per_run = 0
    for g in groups:
        for r in g.runs:
            speed = speeds.get((g.name, r.name))
            if speed:
                plan["run_seconds"][f"{g.name}/{r.name}"] = round(
                    steps[g.name] * tokens_per_step[g.name] / speed + overhead, 1
                )
    plan["tokens_per_run"] = tokens_per_run
    plan["steps"] = steps
    return steps, tokens_per_run, plan


if __name__ == "__main__":
    main()
