"""What one run of the pretraining comparison is: the config with its changes, the run specs of ``--runs``, and
the groups of a matrix."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from examples.pretrain import ATTENTION_MODES

#: Trainer entries of a config that this script sets itself.
TRAINER_OWN = ("callbacks", "logger", "default_root_dir", "enable_checkpointing", "enable_progress_bar")
#: The ``sdpa=`` value that routes full precision's SDPA calls to cuDNN's FP8 attention.
CUDNN_FP8 = "cudnn_fp8"
#: ``--sdpa-backend`` / ``sdpa=`` values -> ``torch.nn.attention.SDPBackend`` member names (``None``: none forced;
#: ``cudnn_fp8``: the full layers' SDPA calls run cuDNN's FP8 attention, ``benchmarks.training.cudnn_fp8``).
SDPA_BACKENDS: dict[str, str | None] = {
    "default": None,
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    CUDNN_FP8: None,
}
#: Keys of a ``--runs`` entry.
RUN_KEYS = ("name", "controller", "seed", "smooth_k", "smooth_q", "sdpa")
#: ``--matrix`` values.
MATRICES = ("evidence",)
_SWITCH = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class RunSpec:
    """One training run of a comparison: its name (letters, digits, ``.``, ``_``, ``+``, ``-``), its attention (a key
    of ``ATTENTION_MODES``) and what else differs from the config; ``None``: the config's (``sdpa_backend``:
    ``--sdpa-backend``'s; ``smooth_k``, ``smooth_q``: the attention's default)."""

    name: str
    attention: str
    controller: bool | None = None
    seed: int | None = None
    smooth_k: bool | None = None
    smooth_q: bool | None = None
    sdpa_backend: str | None = None


@dataclass
class Group:
    """A group of runs of the matrix that share a config: ``changes`` (``SECTION.KEY=VALUE``), ``runs`` in the order
    they train; a ``speed`` group takes ``--speed-steps`` steps, no validation and no token plan."""

    name: str
    title: str
    changes: list[str]
    runs: tuple[RunSpec, ...]
    speed: bool = False


def load_config(path: Path, changes: list[str]) -> dict[str, Any]:
    """The YAML config at ``path`` with ``SECTION.KEY=VALUE`` changes applied (values parsed as YAML)."""
    return apply_changes(yaml.safe_load(path.read_text()), changes, str(path))


def apply_changes(config: dict[str, Any], changes: Sequence[str], where: str = "the config") -> dict[str, Any]:
    """``config`` (changed in place and returned) with ``SECTION.KEY=VALUE`` changes, the values read as YAML."""
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
    """One ``--runs`` entry, ``ATTENTION[:KEY=VALUE,...]``, as a :class:`RunSpec`."""
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
            if value == CUDNN_FP8 and attention != "full":
                raise ValueError(f"--runs {text!r}: sdpa=cudnn_fp8 replaces full precision's SDPA: full runs only.")
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
    """The name a run gets from what sets it apart, e.g. ``sage-fixed-no-smooth-k`` or ``full-seed1235``."""
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
    """The runs ``--attention`` or ``--runs`` asks for, names made unique (``-2``, ``-3`` for repeats)."""
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
