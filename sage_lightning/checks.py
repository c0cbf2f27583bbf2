"""The callback's checks: its arguments, the Trainer and module it is fitted with, and a checkpoint's state
(:data:`STATE_VERSION`, the previous layout upgraded), each refused with a message that says what would work."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from sage_lightning.kernels import AttentionPrecision
from sage_lightning.kernels.plan import FP8_CAPABILITY, device_capability, verified_here
from sage_lightning.kernels.plan import settings as kernel_settings
from sage_lightning.layer import AttentionLayerState, attention_layers
from sage_lightning.mixin import SageAttentionMixin
from sage_lightning.policy import PolicyConfig
from sage_lightning.signals import HEAD_FIELDS, PREVIOUS_LAYER_WIDTH

#: The version of :meth:`AdaptivePrecision.state_dict`'s layout.
STATE_VERSION = 3
STATE_KEYS = (
    "version",
    "policy",
    "bases",
    "accumulate_grad_batches",
    "history",
    "tokens_seen",
    "tokens_per_step",
    "layer_steps",
    "int8_layer_steps",
    "skipped_steps",
    "rollbacks",
    "pending",
    "snapshots",
)


def check_arguments(
    init: Callable[..., None],
    unexpected: Mapping[str, Any],
    *,
    config: object,
    snapshot_every_n_steps: object,
    tokens_fn: object,
    log_every_n_steps: object,
    progress_bar: object,
    verbose: object,
    check_before_step: object,
    snapshot_in_checkpoint: object,
    last_good_checkpoint: object,
) -> None:
    """Raise the ``TypeError`` or ``ValueError`` that says what is wrong with ``AdaptivePrecision``'s arguments
    (``init``: its ``__init__``, whose signature names the arguments it takes)."""
    if unexpected:
        # Python's own refusal ("unexpected keyword argument") would not say where thresholds live.
        name = next(iter(unexpected))
        raise TypeError(unknown_argument_message(name, unexpected[name], _arguments(init)))
    if config is not None and not isinstance(config, PolicyConfig):
        raise ValueError(
            "AdaptivePrecision: config must be a sage_lightning.PolicyConfig or None; "
            f"received {type(config).__name__}."
        )
    _check_positive_int("snapshot_every_n_steps", snapshot_every_n_steps)
    if log_every_n_steps is not None:
        _check_positive_int("log_every_n_steps", log_every_n_steps)
    if tokens_fn is not None and not callable(tokens_fn):
        raise ValueError(
            "AdaptivePrecision: tokens_fn must be a callable batch -> number of tokens, or None; "
            f"received {type(tokens_fn).__name__}."
        )
    for name, value in (
        ("progress_bar", progress_bar),
        ("verbose", verbose),
        ("snapshot_in_checkpoint", snapshot_in_checkpoint),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"AdaptivePrecision: {name} must be True or False; received {value!r}.")
    if check_before_step is not None and not isinstance(check_before_step, bool):
        raise ValueError(
            "AdaptivePrecision: check_before_step must be True, False or None (decide from the optimizers); "
            f"received {check_before_step!r}."
        )
    if last_good_checkpoint is not None and not isinstance(last_good_checkpoint, (str, os.PathLike)):
        raise ValueError(
            "AdaptivePrecision: last_good_checkpoint must be a path (str or os.PathLike) or None; "
            f"received {type(last_good_checkpoint).__name__}."
        )


def check_fit(
    trainer: pl.Trainer, pl_module: pl.LightningModule, config: PolicyConfig
) -> tuple[dict[str, AttentionLayerState], PolicyConfig]:
    """The model's attention layers and the config this fit runs with (the tokens lever off where the strategy
    accumulates gradients itself, with a warning); a ``MisconfigurationException`` where the fit cannot be
    controlled."""
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(
            "AdaptivePrecision needs automatic optimization (it skips and rolls back optimizer steps "
            "and changes accumulate_grad_batches); set `self.automatic_optimization = True`."
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        raise MisconfigurationException(
            "AdaptivePrecision sets accumulate_grad_batches itself; remove the GradientAccumulationScheduler "
            "callback, or turn the tokens lever off with PolicyConfig(min_accumulate_grad_batches=None) and "
            "use the scheduler without AdaptivePrecision's tokens lever."
        )
    layers = attention_layers(pl_module)
    if not layers:
        raise MisconfigurationException(
            "AdaptivePrecision found no SageBwd attention layer in the model; add SageAttentionMixin to the "
            "LightningModule (`class MyModel(SageAttentionMixin, LightningModule)`) or call "
            "sage_lightning.convert_to_sage_attention(model) before fitting."
        )
    if trainer.strategy.handles_gradient_accumulation and config.min_accumulate_grad_batches is not None:
        rank_zero_warn(
            f"AdaptivePrecision: {type(trainer.strategy).__name__} accumulates gradients itself, so the "
            "tokens-per-step lever is off for this run (precision levers still work)."
        )
        config = dataclasses.replace(config, min_accumulate_grad_batches=None)
    return layers, for_device(config, trainer.strategy.root_device)


def for_device(config: PolicyConfig, device: torch.device) -> PolicyConfig:
    """``config`` as a fit on ``device`` runs it. Where the device has no FP8 tensor cores (a CUDA GPU below compute
    capability 8.9) the ladder's rungs that set a product to FP8 (``ds_fp8``) are left out, and the two large-step
    rules take the first rung that changes ``ds`` alone, ``ds_bf16``. Where ``large_step_rung`` is ``None`` and the
    Hopper kernels run (:func:`~sage_lightning.kernels.plan.verified_here`, ``SAGE_LIGHTNING_HOPPER`` not ``off``), it
    becomes the ladder's bf16 dS rung: there bf16 dS's backward runs 1.20-1.29x as fast as FP8 dS's
    (``docs/controller.md``, Which dS rung).

    Example::

        for_device(PolicyConfig(), torch.device("cpu")).large_step_rung   # None: the reference's FP8 rung
    """
    capability = device_capability(device)
    if capability is None:
        return config
    if capability < FP8_CAPABILITY:
        ladder = tuple(rung for rung in config.ladder if "fp8" not in rung.fields.values())
        if len(ladder) == len(config.ladder):
            return config
        kept = config.large_step_rung in {rung.name for rung in ladder}
        return dataclasses.replace(config, ladder=ladder, large_step_rung=config.large_step_rung if kept else None)
    bf16 = [rung.name for rung in config.ladder if rung.fields == {"ds": "bf16"}]
    if config.large_step_rung is None and bf16 and verified_here(device) and kernel_settings().hopper != "off":
        return dataclasses.replace(config, large_step_rung=bf16[0])
    return config


def fit_hparams(hparams: dict[str, Any], config: PolicyConfig, device: torch.device) -> dict[str, Any]:
    """The callback's ``hparams`` with the ladder and the large-step rung a fit on ``device`` runs
    (:func:`for_device`), as the loggers get them: an A100's HParams show no ``ds_fp8`` rung.

    Example::

        fit_hparams({"config": {"ladder": []}}, PolicyConfig(), torch.device("cpu"))["config"]["ladder"][2]  # 'ds_fp8'
    """
    fitted = for_device(config, device)
    ladder = [rung.name for rung in fitted.ladder]
    return {**hparams, "config": {**hparams["config"], "ladder": ladder, "large_step_rung": fitted.large_step_rung}}


def checkpoint_bases(
    state: Mapping[str, Any],
    layers: Mapping[str, AttentionLayerState],
    pl_module: pl.LightningModule,
    *,
    module_warned: bool,
) -> dict[str, AttentionPrecision]:
    """The checkpoint's base precisions, checked against the model's layers; a warning where the configured start
    differs (the checkpoint's is kept, so the resumed run decides as the uninterrupted one), unless the module's own
    checkpoint hooks warned already (``module_warned``)."""
    saved, known = list(state["bases"]), list(layers)
    if set(saved) != set(known):
        raise MisconfigurationException(
            f"AdaptivePrecision: the checkpoint's controller state is for attention layers {saved}, this model "
            f"has {known} (only in the checkpoint: {sorted(set(saved) - set(known))}; only in the model: "
            f"{sorted(set(known) - set(saved))}). Resume with the model the checkpoint was saved from, or fit "
            "this model without ckpt_path (load the weights with model.load_state_dict(..., strict=False))."
        )
    bases = {name: AttentionPrecision(**state["bases"][name]) for name in known}
    if isinstance(pl_module, SageAttentionMixin):
        # The mixin restored the layers from the checkpoint (and warned, where it found its entry): what was
        # configured is sage_precision.
        configured = dict.fromkeys(known, pl_module.sage_precision or AttentionPrecision())
    else:
        configured = {name: layer.precision for name, layer in layers.items()}
    differ = [name for name in known if configured[name] != bases[name] and not module_warned]
    if differ:
        first = differ[0]
        rank_zero_warn(
            f"AdaptivePrecision: the configured starting precision of {differ} ({configured[first].short_name} "
            f"for {first!r}) differs from the checkpoint's ({bases[first].short_name}); the run resumes from the "
            "checkpoint's, with its escalations. To start from the configured precision, fit without ckpt_path "
            "and load the weights alone."
        )
    return bases


def upgrade_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A controller state saved by the previous layout (version 2) in this version's (3); any other as it is.

    Version 2 kept one pending verdict and one snapshot candidate (verdicts one step late), and its signal vectors
    had no per-layer non-finite flag. Its pending record becomes a list of one whose vector gains a 0 flag per layer
    (version 2 read the flags from the layers when the verdict came and did not save them, so a non-finite step
    pending at the checkpoint is judged without knowing which layer started it), with its layers' precisions during
    the step unknown (the check for stale measurements skips it); its candidate becomes a list of one. The resumed
    run concludes that step at its new lag, one step later than version 2 would have.
    """
    if not isinstance(state, Mapping) or state.get("version") != 2:
        return state
    upgraded = dict(state, version=STATE_VERSION)
    pending = state.get("pending")
    if (
        isinstance(pending, Mapping)
        and isinstance(pending.get("values"), list)
        and isinstance(state.get("bases"), Mapping)
    ):
        # Version 2's layer rows: the next layout's (PREVIOUS_LAYER_WIDTH, which unpack reads) less the flag.
        values, head, width = list(pending["values"]), len(HEAD_FIELDS), PREVIOUS_LAYER_WIDTH - 1
        expected = head + len(state["bases"]) * width
        if len(values) != expected:
            raise ValueError(
                f"AdaptivePrecision.load_state_dict: the checkpoint's pending verdict (layout version 2) holds "
                f"{len(values)} signal values; one of {len(state['bases'])} layers holds {expected}. The state was not "
                "written by AdaptivePrecision.state_dict(): fit without ckpt_path and load the weights alone."
            )
        rows = [values[head + i * width : head + (i + 1) * width] + [0.0] for i in range(len(state["bases"]))]
        upgraded["pending"] = [dict(pending, values=values[:head] + [v for row in rows for v in row], precisions=[])]
    elif pending is None:
        upgraded["pending"] = []
    snapshots = state.get("snapshots")
    if isinstance(snapshots, Mapping) and "candidate" in snapshots:
        candidate = snapshots["candidate"]
        upgraded["snapshots"] = {"good": snapshots.get("good"), "candidates": [] if candidate is None else [candidate]}
    return upgraded


def check_state(state: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` that says what is wrong with a checkpoint's controller state."""
    where = "AdaptivePrecision.load_state_dict"
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: the state must be a dict from state_dict(); received {type(state).__name__}.")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"{where}: the checkpoint's controller state has version {state.get('version')!r}; this version of "
            f"sage-lightning reads version {STATE_VERSION}. Resume with the version that saved it, or fit without "
            "ckpt_path and load the weights alone."
        )
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"{where}: the checkpoint's controller state lacks {missing} (it has {sorted(state)}); it was not "
            "written by AdaptivePrecision.state_dict()."
        )
    bases = state["bases"]
    if not isinstance(bases, Mapping) or not bases or not all(isinstance(b, Mapping) for b in bases.values()):
        raise ValueError(
            f"{where}: 'bases' must map each layer name to its AttentionPrecision fields; received {bases!r}."
        )
    for name, fields in bases.items():
        try:
            AttentionPrecision(**fields)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: the base precision of layer {name!r} is refused: {error}") from None
    for key in ("tokens_seen", "tokens_per_step", "layer_steps", "int8_layer_steps", "skipped_steps", "rollbacks"):
        if isinstance(state[key], bool) or not isinstance(state[key], int):
            raise ValueError(f"{where}: {key!r} must be an int; received {state[key]!r}.")
    if not isinstance(state["history"], list) or not all(isinstance(d, Mapping) for d in state["history"]):
        raise ValueError(f"{where}: 'history' must be a list of decisions (dicts); received {state['history']!r}.")
    if not isinstance(state["pending"], list) or not all(isinstance(r, Mapping) for r in state["pending"]):
        raise ValueError(
            f"{where}: 'pending' must be a list of pending steps (dicts, oldest first); received {state['pending']!r}."
        )


def unknown_argument_message(name: str, value: object, arguments: tuple[str, ...]) -> str:
    """What to say about ``AdaptivePrecision(name=value)`` when ``name`` is not one of its ``arguments``: a
    :class:`~sage_lightning.PolicyConfig` field is shown in ``PolicyConfig``, anything else gets the closest names."""
    fields = [field.name for field in dataclasses.fields(PolicyConfig)]
    if name in fields:
        return (
            f"AdaptivePrecision: {name} is a threshold or cadence of the policy, not an argument of the callback; "
            f"received {name}={value!r}. Thresholds live in PolicyConfig: "
            f"AdaptivePrecision(PolicyConfig({name}={value!r}))."
        )
    close = difflib.get_close_matches(name, [*arguments, *fields], n=1, cutoff=0.6)
    hint = ""
    if close and close[0] in fields:
        hint = f" Did you mean the PolicyConfig field {close[0]!r}: AdaptivePrecision(PolicyConfig({close[0]}=...))?"
    elif close:
        hint = f" Did you mean {close[0]!r}?"
    return (
        f"AdaptivePrecision: unexpected argument {name}={value!r}.{hint} It takes {', '.join(arguments)}; "
        "thresholds and cadences go in its config, a PolicyConfig."
    )


def _arguments(init: Callable[..., None]) -> tuple[str, ...]:
    """The arguments ``init`` takes by name, for the message about a name that is not one of them."""
    return tuple(
        name
        for name, parameter in inspect.signature(init).parameters.items()
        if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AdaptivePrecision: {name} must be an int >= 1; received {value!r}.")
