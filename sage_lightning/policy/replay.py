"""Replay recorded noise readings through the policy: which layers the noise rules would have moved, and when.

A run with the controller observing (``PolicyConfig(noise_ratio_high=1e6, ds_tokens_per_step_high=None)``, or any
run with a noise rule on) records every noise measurement in ``policy.noise_readings`` (``benchmarks/`` keeps them
in each result file's ``summary``). Feeding them to a fresh :class:`~sage_lightning.policy.PrecisionPolicy` with
the settings to try shows what those settings would have done on that run, without training again: how a
threshold from :func:`sage_lightning.noise.calibrate_threshold` is checked (``docs/controller.md``, Noise scale).

What a replay cannot show: the readings carry no loss, gradient norm, probe or dS statistics, so only the noise
rules act, and a rung once taken is never left (stepping down waits for a low ``ds_rel_err``); and the readings
are those of the precision the run kept, not of the one a decision would have moved it to.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sage_lightning.policy._precision import AttentionPrecision
from sage_lightning.policy.config import PolicyConfig
from sage_lightning.policy.engine import PrecisionPolicy
from sage_lightning.policy.vocabulary import Decision, LayerSignals, StepSignals


def replay_noise_readings(
    readings: Iterable[Sequence[Any]],
    config: PolicyConfig,
    precisions: Mapping[str, AttentionPrecision] | None = None,
) -> list[Decision]:
    """The decisions a policy with ``config`` takes from ``readings`` alone, in step order.

    Args:
        readings: noise readings as ``policy.noise_readings`` holds them: ``(step, layer, noise ratio at the base
            precision, at the precision that ran, noise scale, steps' sequences over it)``; readings of four
            entries (recorded before the noise scale) read as having no scale.
        config: the settings to try; a noise rule must be on (``noise_scale_ratio_high`` or
            ``noise_ratio_high``). The tokens-per-step rule never acts in a replay (the readings carry no tokens
            per step), whatever ``ds_tokens_per_step_high`` says.
        precisions: each layer's base precision; ``None``: SageBwd's default (``AttentionPrecision()``) for every
            layer the readings name.

    Returns:
        The decisions, each with its step, layer and reason, as the callback would have logged them.

    Raises:
        ValueError: no readings, a reading of another shape, a config with no noise rule on, or a layer the
            readings name that ``precisions`` lacks.

    Example::

        from sage_lightning.policy import PolicyConfig, replay_noise_readings

        readings = [(0, "blocks.0.attn", 0.1, 0.1, 10.0, 6.4), (25, "blocks.0.attn", 0.1, 0.1, 8.0, 8.0)]
        config = PolicyConfig(noise_scale_ratio_high=4.0, ds_tokens_per_step_high=None)
        [d.step for d in replay_noise_readings(readings, config)]   # [25]: two readings over 4 in a row
    """
    if not isinstance(config, PolicyConfig):
        raise ValueError(f"replay_noise_readings: config must be a PolicyConfig; received {type(config).__name__}.")
    if config.noise_scale_ratio_high is None and config.noise_ratio_high is None:
        raise ValueError(
            "replay_noise_readings: config turns no noise rule on (noise_scale_ratio_high and noise_ratio_high are "
            "both None), so the readings could decide nothing; set one of them."
        )
    by_step: dict[int, dict[str, LayerSignals]] = {}
    for index, reading in enumerate(readings):
        if not isinstance(reading, Sequence) or len(reading) not in (4, 6) or isinstance(reading, str):
            raise ValueError(
                "replay_noise_readings: each reading must be (step, layer, base ratio, ran ratio[, scale, scale "
                f"ratio]); readings[{index}] is {reading!r}."
            )
        step, layer, *values = reading
        values += [None] * (4 - len(values))  # recorded before the noise scale: no scale
        try:
            base, ran, scale, ratio = (None if v is None else _number(v) for v in values)
            step = int(step)
        except (TypeError, ValueError):
            raise ValueError(
                f"replay_noise_readings: readings[{index}] must hold an int step and numbers or None; received "
                f"{reading!r}."
            ) from None
        by_step.setdefault(step, {})[str(layer)] = LayerSignals(
            noise_ratio=base, noise_ratio_ran=ran, noise_scale=scale, noise_scale_ratio=ratio
        )
    if not by_step:
        raise ValueError("replay_noise_readings: readings is empty; pass a run's policy.noise_readings.")
    names = sorted({layer for layers in by_step.values() for layer in layers})
    if precisions is None:
        precisions = dict.fromkeys(names, AttentionPrecision())
    missing = [name for name in names if name not in precisions]
    if missing:
        raise ValueError(
            f"replay_noise_readings: precisions lacks layers the readings name: {missing}; give every layer's base "
            "precision, or None for SageBwd's default."
        )
    policy = PrecisionPolicy(dict(precisions), config=config)
    decisions: list[Decision] = []
    for step in sorted(by_step):
        signals = StepSignals(step=step, loss=None, grad_norm=None, layers=by_step[step])
        decisions += policy.decide(signals).decisions
    return decisions


def _number(value: Any) -> float:
    """A reading's entry as a float (a non-finite one as ``nan``, as the policy reads it); a bool or text raises."""
    if isinstance(value, (bool, str)):
        raise TypeError(value)
    number = float(value)
    return number if math.isfinite(number) else math.nan
