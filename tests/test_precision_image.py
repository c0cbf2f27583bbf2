"""The precision image rebuilt from a run's decision log (``history_from_decisions``, ``save_decisions_picture``):
what a results page or a notebook draws after the run, from ``AdaptivePrecision.history`` or a result file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sage_lightning.policy import Decision
from sage_lightning.precision_image import (
    PALETTE,
    history_from_decisions,
    precision_image,
    save_decisions_picture,
)

LAYERS = ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
BASE, FP8_DS, BF16_DS = "sagebwd:int8=qk,pv,dv,ds", "sagebwd:int8=qk,pv,dv;fp8=ds", "sagebwd:int8=qk,pv,dv"


def _log() -> list[Decision]:
    """Layer 0 up to FP8 dS at step 10, then bf16 dS at 30 and back to FP8 dS at 60; layer 2 to bf16 dS at 20 and
    back to its base at 50; a global decision between; layer 1 never moves."""
    return [
        Decision(30, "blocks.0.attn", "precision", FP8_DS, BF16_DS, "ds_rel_err 0.3 > 0.2"),
        Decision(10, "blocks.0.attn", "precision", BASE, FP8_DS, "131,072 tokens per step"),
        Decision(20, "blocks.2.attn", "precision", BASE, BF16_DS, "noise_ratio 0.3 > 0.2"),
        Decision(25, None, "accumulate_grad_batches", "4", "2", "loss is nan"),
        Decision(50, "blocks.2.attn", "precision", BF16_DS, BASE, "calm for 1000 steps"),
        Decision(60, "blocks.0.attn", "precision", BF16_DS, FP8_DS, "calm for 1000 steps"),
    ]


@pytest.mark.parametrize("as_mappings", [False, True], ids=["decisions", "result-file-records"])
def test_levels_number_the_precisions_in_the_order_first_taken(as_mappings: bool) -> None:
    log = [dataclasses.asdict(d) for d in _log()] if as_mappings else _log()
    history, names = history_from_decisions(LAYERS, log)
    assert names == ["base", FP8_DS, BF16_DS]
    # Out of order in the log, in order in the history; a step back down returns to the level held before.
    assert history.changes["blocks.0.attn"] == [(0, 0), (10, 1), (30, 2), (60, 1)]
    assert history.changes["blocks.1.attn"] == [(0, 0)]
    assert history.changes["blocks.2.attn"] == [(0, 0), (20, 2), (50, 0)]


def test_the_picture_shows_each_layer_at_its_level_step_by_step() -> None:
    history, names = history_from_decisions(LAYERS, _log())
    bands = precision_image(history, last_step=99, levels=7, row_height=4, axes=False)  # [3, 12, 100]
    colour = bands.transpose(1, 2, 0)[::4]  # each layer's first pixel row: [3, 100, 3]
    assert (colour[0, :10] == PALETTE[0]).all() and (colour[0, 10:30] == PALETTE[1]).all()
    assert (colour[0, 30:60] == PALETTE[2]).all() and (colour[0, 60:] == PALETTE[1]).all()
    assert (colour[1] == PALETTE[0]).all()
    assert (colour[2, 20:50] == PALETTE[2]).all() and (colour[2, 50:] == PALETTE[0]).all()


def test_the_saved_picture_is_a_png_with_its_legend(tmp_path: Path) -> None:
    path = tmp_path / "new" / "precision.png"
    key = save_decisions_picture(path, LAYERS, _log(), last_step=99)
    assert key == [("base", "green"), (FP8_DS, "lime"), (BF16_DS, "yellow")]
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    for level in range(3):  # every level the run reached is in the picture, with the layer names beside it
        assert (pixels == PALETTE[level]).all(axis=1).any()
    assert not (pixels == PALETTE[-1]).all(axis=1).any()  # nothing drawn as the top rung (full precision)


def test_a_log_without_precision_decisions_draws_every_layer_at_its_base(tmp_path: Path) -> None:
    log = [Decision(5, None, "accumulate_grad_batches", "4", "2", "loss is nan")]
    history, names = history_from_decisions(LAYERS, log, start=3)
    assert names == ["base"] and all(points == [(3, 0)] for points in history.changes.values())
    assert save_decisions_picture(tmp_path / "p.png", LAYERS, log, last_step=9) == [("base", "green")]
