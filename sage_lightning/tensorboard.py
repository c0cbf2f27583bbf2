"""What ``AdaptivePrecision`` writes: its scalar tags, the decision text events and a custom-scalars dashboard.

Scalars go to every logger of the Trainer (``logger.log_metrics``, which Lightning's loggers write on rank 0
only). Text events and the custom-scalars layout exist only in TensorBoard, so they go to the
``SummaryWriter`` of each :class:`~lightning.pytorch.loggers.TensorBoardLogger`, and only from global rank 0:
decisions are identical on every rank, one copy is enough.

Tags, all under ``sage/``, named so that TensorBoard's Time Series (which sorts a group's charts by tag) opens on
what matters: after each layer's dS error and the gradient norm (``sage/ds_rel_err/...``, ``sage/grad_norm``: names
the benchmarks read) come ``sage/int8_fraction``, ``sage/loss`` and the picture ``sage/precision``, then the detail,
the flat counters last.

* per layer: ``sage/ds_rel_err/<layer>``, ``sage/qk_rel_err/<layer>`` (the forward's health),
  ``sage/noise_ratio/<layer>`` (the base precision's gradient error over the gradient noise; ``noise_ratio_ran``
  for the precision that ran, where it differs), ``sage/noise_scale/<layer>`` (the gradient noise scale in
  sequences, from the same measurement, where it resolves one) and ``sage/noise_scale_ratio/<layer>`` (the step's
  sequences over it: the noise-scale rule's reading),
  ``sage/probe/<tensor>_cos/<layer>`` and ``sage/probe/<tensor>_rel_l2/<layer>`` (tensor one of O, dQ, dK, dV),
  ``sage/precision_level/<layer>`` (0 at the base, ``i + 1`` on the ladder's rung ``i``: a position on the ladder,
  not a number format, so it means the same whatever the base's formats are; a base with FP8 products is level 0
  too);
* global: ``sage/int8_fraction`` (the share of layer-steps on their base's low-bit products, INT8 or FP8:
  :attr:`~sage_lightning.AdaptivePrecision.int8_fraction`), ``sage/loss`` (per optimizer step), ``sage/grad_norm``,
  ``sage/spike/loss`` (0 none, 1 soft, 2 hard), ``sage/spike/loss_z``, ``sage/spike/grad_norm`` (0 or 1),
  ``sage/spike/grad_norm_z``, ``sage/skipped_steps``, ``sage/rollbacks``, ``sage/rollbacks_without_progress`` (the
  rollback budget's count), ``sage/tokens_per_step``, ``sage/tokens_seen``, ``sage/tokens/accumulate_grad_batches``;
* text: ``sage/decisions``, one event per step with decisions, a line per decision; ``sage/precision_legend``
  once, what the picture's colours mean;
* image: ``sage/precision``, every layer's level over the steps (layers by steps, coloured by rung,
  :mod:`sage_lightning.precision_image`), at the start and at each step where a level changed.

Hyperparameters: the controller's settings join the module's in every logger, under ``adaptive_precision``
(:func:`log_hyperparams`), so ``hparams.yaml`` and TensorBoard's HParams hold the thresholds beside the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from tensorboard.compat.proto.event_pb2 import Event, SessionLog

from sage_lightning.detectors import LEVELS
from sage_lightning.policy import Decision, StepOutcome, StepSignals
from sage_lightning.precision_image import LevelHistory, legend, precision_image

#: The text tag every decision is written under.
DECISIONS_TAG = "sage/decisions"
#: The image of every layer's precision over the steps, and the text that explains its colours.
PRECISION_IMAGE_TAG, PRECISION_LEGEND_TAG = "sage/precision", "sage/precision_legend"
#: The key of the controller's settings in the loggers' hyperparameters.
HPARAMS_KEY = "adaptive_precision"


def custom_scalars_layout() -> dict[str, dict[str, list]]:
    """The dashboard of TensorBoard's "Custom Scalars" tab: one chart per signal, every layer in it.

    Charts select tags by regular expression, so the layout does not depend on the layer names.

    Example::

        writer.add_custom_scalars(custom_scalars_layout())
    """
    return {
        "sage: precision": {
            "level per layer (0 = base)": ["Multiline", [r"sage/precision_level/.*"]],
            "share of layer-steps on INT8/FP8": ["Multiline", [r"sage/int8_fraction"]],
        },
        "sage: signals": {
            "dS relative error per layer": ["Multiline", [r"sage/ds_rel_err/.*"]],
            "Quantization error over gradient noise per layer": ["Multiline", [r"sage/noise_ratio/.*"]],
            "step's sequences over the gradient noise scale per layer": ["Multiline", [r"sage/noise_scale_ratio/.*"]],
            "Q'K' INT8 error per layer (forward health)": ["Multiline", [r"sage/qk_rel_err/.*"]],
            "probe cosine per layer": ["Multiline", [r"sage/probe/.*_cos/.*"]],
            "probe relative L2 per layer": ["Multiline", [r"sage/probe/.*_rel_l2/.*"]],
        },
        "sage: stability": {
            "loss per optimizer step": ["Multiline", [r"sage/loss$"]],
            "gradient norm": ["Multiline", [r"sage/grad_norm$"]],
            "spikes": ["Multiline", [r"sage/spike/.*"]],
            "skipped steps and rollbacks": [
                "Multiline",
                [r"sage/skipped_steps", r"sage/rollbacks$", r"sage/rollbacks_without_progress"],
            ],
        },
        "sage: tokens": {
            "tokens per step": ["Multiline", [r"sage/tokens_per_step", r"sage/tokens/accumulate_grad_batches"]],
            "tokens seen": ["Multiline", [r"sage/tokens_seen"]],
        },
    }


def step_metrics(
    signals: StepSignals,
    outcome: StepOutcome,
    *,
    levels: Mapping[str, int],
    counters: Mapping[str, float],
    every: int,
) -> dict[str, float]:
    """The scalars of one optimizer step, by tag: measurements always; the levels, counters and the step's loss,
    gradient norm and spike readings on steps with a measurement, a spike or a decision, and every ``every`` steps.

    Args:
        signals: the step's reduced signals.
        outcome: the policy's verdict on it.
        levels: every layer's ladder level.
        counters: ``tokens_per_step``, ``tokens_seen``, ``int8_fraction``, ``tokens/accumulate_grad_batches``,
            ``skipped_steps``, ``rollbacks``, ``rollbacks_without_progress`` (logged as ``sage/<name>``).
        every: the cadence of the quiet steps' logs.

    Example::

        tensorboard.log_scalars(trainer, step_metrics(signals, outcome, levels=..., counters=..., every=50), step)
    """
    metrics: dict[str, float] = {}
    measured = False
    for name, layer in signals.layers.items():
        if layer.ds_rel_err is not None:
            metrics[f"sage/ds_rel_err/{name}"] = layer.ds_rel_err
            measured = True
        if layer.qk_rel_err is not None:
            metrics[f"sage/qk_rel_err/{name}"] = layer.qk_rel_err
            measured = True
        if layer.noise_ratio is not None:
            metrics[f"sage/noise_ratio/{name}"] = layer.noise_ratio
            if layer.noise_ratio_ran is not None and layer.noise_ratio_ran != layer.noise_ratio:
                metrics[f"sage/noise_ratio_ran/{name}"] = layer.noise_ratio_ran
            measured = True
        if layer.noise_scale is not None:
            metrics[f"sage/noise_scale/{name}"] = layer.noise_scale
        if layer.noise_scale_ratio is not None:
            metrics[f"sage/noise_scale_ratio/{name}"] = layer.noise_scale_ratio
        if layer.probe is not None:
            for tensor, values in layer.probe.items():
                metrics[f"sage/probe/{tensor}_cos/{name}"] = values["cos"]
                metrics[f"sage/probe/{tensor}_rel_l2/{name}"] = values["rel_l2"]
            measured = True
    spiking = (outcome.loss is not None and outcome.loss.level != "none") or (
        outcome.grad_norm is not None and outcome.grad_norm.level != "none"
    )
    if not (measured or spiking or outcome.decisions or signals.step % every == 0):
        return metrics
    for name, level in levels.items():
        metrics[f"sage/precision_level/{name}"] = float(level)
    for name, value in counters.items():
        metrics[f"sage/{name}"] = float(value)
    if signals.loss is not None:
        metrics["sage/loss"] = signals.loss
    if signals.grad_norm is not None:
        metrics["sage/grad_norm"] = signals.grad_norm
    if outcome.loss is not None:
        metrics["sage/spike/loss"] = float(LEVELS.index(outcome.loss.level))
        if outcome.loss.z is not None:
            metrics["sage/spike/loss_z"] = outcome.loss.z
    if outcome.grad_norm is not None:
        metrics["sage/spike/grad_norm"] = float(outcome.grad_norm.level != "none")
        if outcome.grad_norm.z is not None:
            metrics["sage/spike/grad_norm_z"] = outcome.grad_norm.z
    return metrics


def log_step(
    trainer: pl.Trainer,
    signals: StepSignals,
    outcome: StepOutcome,
    *,
    levels: Mapping[str, int],
    counters: Mapping[str, float],
    every: int,
    history: LevelHistory | None,
    colours: int,
) -> None:
    """Log one optimizer step: its scalars (:func:`step_metrics`), its decisions, and the precision picture where a
    level changed (``history``: the levels so far; ``colours``: the levels the picture colours)."""
    log_scalars(trainer, step_metrics(signals, outcome, levels=levels, counters=counters, every=every), signals.step)
    log_decisions(trainer, outcome.decisions, signals.step)
    if history is not None and history.record(signals.step, levels):
        log_precision_image(trainer, history, signals.step, colours)


def decisions_markdown(decisions: Iterable[Decision]) -> str:
    """One markdown line per decision: ``step 12 · blocks.0.attn · precision: old -> new · reason``.

    Example::

        decisions_markdown(outcome.decisions)
    """
    lines = []
    for d in decisions:
        lines.append(f"step {d.step} · {d.layer or 'global'} · {d.lever}: `{d.old}` -> `{d.new}` · {d.reason}")
    # Two trailing spaces: a markdown line break, so each decision renders on its own line.
    return "  \n".join(lines)


def tensorboard_writers(trainer: pl.Trainer) -> list:
    """The ``SummaryWriter`` of every TensorBoard logger of ``trainer``, on global rank 0; ``[]`` elsewhere."""
    if not trainer.is_global_zero:
        return []
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def purge_from(trainer: pl.Trainer, step: int) -> None:
    """Tell TensorBoard that this run restarts at ``step``: the events of its earlier files at ``step`` or later are
    dropped when it reads them (rank 0, TensorBoard loggers).

    A run resumed from the checkpoint of step 100, after its first attempt had logged to step 144 in the same folder,
    would otherwise show steps 100-144 twice. This writes what ``SummaryWriter(purge_step=step)`` writes when it opens
    its file, a ``SessionLog.START`` event at ``step``, which TensorBoard's reader takes as a restart; it is done here
    because Lightning's logger opens its writer before the checkpoint's step is known. Events written before it in the
    new file (the hyperparameters, at step 0) stay.

    Args:
        trainer: the Trainer, its checkpoint restored.
        step: the first step the resumed run logs (``trainer.global_step``).

    Example::

        tensorboard.purge_from(trainer, trainer.global_step)   # in on_train_start of a resumed fit
    """
    for writer in tensorboard_writers(trainer):
        writer._get_file_writer().add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """``metrics`` at ``step`` to every logger of ``trainer`` (Lightning's loggers write on rank 0 only)."""
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)


def log_decisions(trainer: pl.Trainer, decisions: Iterable[Decision], step: int) -> None:
    """The decisions of one step as a text event under :data:`DECISIONS_TAG` (rank 0, TensorBoard loggers)."""
    decisions = list(decisions)
    if not decisions:
        return
    text = decisions_markdown(decisions)
    for writer in tensorboard_writers(trainer):
        writer.add_text(DECISIONS_TAG, text, global_step=step)


def log_layout(trainer: pl.Trainer) -> None:
    """Write :func:`custom_scalars_layout` once per TensorBoard logger (rank 0)."""
    for writer in tensorboard_writers(trainer):
        writer.add_custom_scalars(custom_scalars_layout())


def log_precision_legend(trainer: pl.Trainer, rungs: Iterable[str], layers: Iterable[str]) -> None:
    """What the precision picture's colours and rows mean, once, as a text event (rank 0, TensorBoard loggers)."""
    text = legend(list(rungs), list(layers))
    for writer in tensorboard_writers(trainer):
        writer.add_text(PRECISION_LEGEND_TAG, text, global_step=0)


def log_precision_image(trainer: pl.Trainer, history: LevelHistory, step: int, levels: int) -> None:
    """The picture of every layer's level up to ``step`` under :data:`PRECISION_IMAGE_TAG` (rank 0, TensorBoard)."""
    writers = tensorboard_writers(trainer)
    if not writers:
        return
    image = precision_image(history, step, levels)
    for writer in writers:
        writer.add_image(PRECISION_IMAGE_TAG, image, global_step=step, dataformats="CHW")


def log_hyperparams(trainer: pl.Trainer, settings: Mapping[str, Any]) -> None:
    """Give every logger of ``trainer`` the controller's ``settings`` under :data:`HPARAMS_KEY`, beside the
    LightningModule's and the datamodule's hyperparameters; to be called before Lightning logs those (``setup``).

    Each logger gets all of them in one ``log_hyperparams`` call, because TensorBoard's HParams tab shows the first
    session a run writes and ignores later ones: with ``TensorBoardLogger(default_hp_metric=True)`` this call writes
    that session, and Lightning's own call after it (the module's hyperparameters, a subset) changes nothing.
    With ``default_hp_metric=False`` neither writes a session (the user writes their own, from
    ``logger.hparams``, which then holds the settings too); ``hparams.yaml`` has them either way. Nothing is
    logged when the Trainer's ``enable_autolog_hparams`` is off, as for the module; where the user's
    hyperparameters already have the key, theirs stay and a warning says so.

    Args:
        trainer: the Trainer, set up for fitting.
        settings: plain values (``AdaptivePrecision.hparams``).

    Example::

        tensorboard.log_hyperparams(trainer, controller.hparams)
    """
    if not trainer.loggers or not getattr(trainer, "enable_autolog_hparams", True):
        return
    # What Lightning logs at the start of a run (lightning.pytorch.loggers.utilities._log_hyperparams): the module's
    # and the datamodule's hyperparameters, each when saved with logger=True, without LightningCLI's class path.
    params: dict[str, Any] = {}
    for owner in (trainer.lightning_module, trainer.datamodule):
        if owner is not None and getattr(owner, "_log_hyperparams", False):
            params.update(owner.hparams_initial)
    params.pop("_class_path", None)
    if HPARAMS_KEY in params:
        rank_zero_warn(
            f"AdaptivePrecision: the hyperparameters already have {HPARAMS_KEY!r}, so the controller's settings are "
            "not logged beside them; rename that hyperparameter to see both."
        )
        return
    params[HPARAMS_KEY] = dict(settings)
    for logger in trainer.loggers:
        logger.log_hyperparams(params)
