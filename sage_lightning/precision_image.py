"""The precision of every attention layer over the steps, as one picture: layers by steps, coloured by rung.

``AdaptivePrecision`` keeps a :class:`LevelHistory` and writes :func:`precision_image` to TensorBoard's Images tab
(tag ``sage/precision``) at the start of training and at each step with a decision, so a person sees at a glance
which layers left the fast path, when, how far, and whether they came back. Numpy for the bands; the layer names
and the step axis are drawn with Pillow (TensorBoard's own dependency), no plotting package.

Example::

    history = LevelHistory(["blocks.0.attn", "blocks.1.attn"], start=0)
    history.record(40, {"blocks.0.attn": 3, "blocks.1.attn": 0})
    image = precision_image(history, last_step=100, levels=6)   # uint8 [3, H, W]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Colours by level: 0 (the base, low-bit) green, then warmer with each rung; the top rung (``full``) red.
PALETTE = np.array(
    [
        (46, 160, 67),  # base
        (163, 206, 39),
        (240, 200, 40),
        (247, 143, 30),
        (226, 88, 34),
        (160, 60, 170),
        (200, 30, 30),
    ],
    dtype=np.uint8,
)
#: Colour names in :data:`PALETTE`'s order, for the legend.
PALETTE_NAMES = ("green", "lime", "yellow", "orange", "red-orange", "purple", "red")


class LevelHistory:
    """Each layer's ladder level from a start step on, as the steps where it changed.

    Args:
        layers: the layers' names, top to bottom in the picture.
        start: the first step the history covers (a resumed run starts at its checkpoint's step).
    """

    def __init__(self, layers: Sequence[str], start: int) -> None:
        self.layers = list(layers)
        self.start = start
        self.changes: dict[str, list[tuple[int, int]]] = {name: [(start, 0)] for name in self.layers}

    def record(self, step: int, levels: Mapping[str, int]) -> bool:
        """Note each layer's level from ``step`` on; returns whether any changed.

        Example::

            history.record(40, {"blocks.0.attn": 3})   # True
        """
        changed = False
        for name, level in levels.items():
            points = self.changes.get(name)
            if points is None or points[-1][1] == level:
                continue
            if points[-1][0] == step:
                points[-1] = (step, level)
            else:
                points.append((step, level))
            changed = True
        return changed


def palette_index(level: int, levels: int) -> int:
    """Where ``level`` of ``levels`` (0 = base) is in :data:`PALETTE`: green at 0, red at the top, warmer between."""
    if level <= 0:
        return 0
    if level >= levels - 1:
        return len(PALETTE) - 1
    inner = len(PALETTE) - 2  # the colours between base and top
    return 1 + min(inner - 1, (level - 1) * inner // max(1, levels - 2))


def color_for(level: int, levels: int) -> np.ndarray:
    """The RGB colour of ``level`` out of ``levels`` (0 = base)."""
    return PALETTE[palette_index(level, levels)]


def precision_image(
    history: LevelHistory,
    last_step: int,
    levels: int,
    width: int = 512,
    row_height: int = 12,
    *,
    axes: bool = True,
    min_width: int = 256,
) -> np.ndarray:
    """The picture: one band of ``row_height`` pixels per layer (in ``history.layers``' order), one column per
    bin of steps from ``history.start`` to ``last_step`` (at most ``width`` columns), coloured by the level the
    layer held at the bin's last step; a one-pixel dark line between layers. With ``axes``, each band is named by
    its layer on the left and the steps are marked below, and a short run's columns are widened to ``min_width``
    pixels (each step as a block), so the picture reads without the legend.

    Args:
        history: the levels over time.
        last_step: the last step to draw.
        levels: how many levels there are (the ladder's rungs plus the base), for the colours.
        width: the most columns of steps.
        row_height: pixels per layer.
        axes: draw the layer names and the step axis (a white margin left and below the bands).
        min_width: with ``axes``, the least width of the bands in pixels.

    Returns:
        ``uint8`` array ``[3, H, W]`` (TensorBoard's ``CHW``); without ``axes``, ``H = layers * row_height`` and
        ``W`` the number of columns.

    Example::

        writer.add_image("sage/precision", precision_image(history, step, 6), step, dataformats="CHW")
    """
    steps = max(1, last_step - history.start + 1)
    columns = min(width, steps)
    # The step each column shows: the last step of its bin.
    ends = history.start + ((np.arange(columns) + 1) * steps + columns - 1) // columns - 1
    image = np.zeros((max(1, len(history.layers)) * row_height, columns, 3), dtype=np.uint8)
    for row, name in enumerate(history.layers):
        points = history.changes[name]
        starts = np.array([step for step, _ in points])
        held = np.array([level for _, level in points])[np.searchsorted(starts, ends, side="right") - 1]
        colours = np.stack([color_for(int(level), levels) for level in held])
        band = image[row * row_height : (row + 1) * row_height]
        band[:] = colours[None, :, :]
        if row_height > 2:
            band[-1] = 40  # the line between layers
    if axes:
        image = _with_axes(image, history.layers, history.start, last_step, row_height, min_width)
    return image.transpose(2, 0, 1).copy()


def _with_axes(
    bands: np.ndarray, layers: Sequence[str], first: int, last: int, row_height: int, min_width: int
) -> np.ndarray:
    """``bands`` (``[H, W, 3]``) widened to ``min_width``, with the layer names on the left and the steps below."""
    from PIL import Image, ImageDraw, ImageFont  # TensorBoard's own dependency, which its image summaries need

    scale = max(1, -(-min_width // bands.shape[1]))
    bands = np.repeat(bands, scale, axis=1)
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def text_size(text: str) -> tuple[int, int]:
        left, top, right, bottom = measure.textbbox((0, 0), text, font=font)
        return right - left, bottom

    name_width = max([text_size(name)[0] for name in layers] + [text_size("step")[0]])
    text_height = text_size("0123456789step")[1]
    left, below = name_width + 8, text_height + 7
    height, plot_width = bands.shape[0], bands.shape[1]
    canvas = Image.new("RGB", (left + plot_width + 4, height + below), (255, 255, 255))
    canvas.paste(Image.fromarray(bands), (left, 0))
    draw = ImageDraw.Draw(canvas)
    dark = (40, 40, 40)
    for row, name in enumerate(layers):
        y = row * row_height + (row_height - text_height) // 2
        draw.text((left - 4 - text_size(name)[0], y), name, fill=dark, font=font)
    steps = max(1, last - first + 1)
    ticks = _round_ticks(first, last)
    label_y = height + 5
    draw.text((left - 4 - text_size("step")[0], label_y), "step", fill=dark, font=font)
    right_edge = canvas.width - 1
    for step in ticks:
        x = left + int((step - first + 0.5) * plot_width / steps)
        draw.line([(x, height), (x, height + 3)], fill=dark)
        label = str(step)
        x_text = min(max(left, x - text_size(label)[0] // 2), right_edge - text_size(label)[0])
        draw.text((x_text, label_y), label, fill=dark, font=font)
    return np.asarray(canvas, dtype=np.uint8)


def _round_ticks(first: int, last: int, most: int = 6) -> list[int]:
    """At most ``most`` round steps (a multiple of 1, 2 or 5 times a power of ten) from ``first`` to ``last``."""
    span = max(1, last - first)
    magnitude = 10 ** math.floor(math.log10(span / (most - 1))) if span >= most - 1 else 1
    every = next(m * magnitude for m in (1, 2, 5, 10) if span / (m * magnitude) <= most - 1)
    every = max(1, int(every))
    return list(range(-(-first // every) * every, last + 1, every))


def history_from_decisions(
    layers: Sequence[str], decisions: Iterable[Any], start: int = 0
) -> tuple[LevelHistory, list[str]]:
    """A :class:`LevelHistory` rebuilt from a run's decision log, for a picture after the run (a results page, a
    notebook), with the name of each level: 0 is each layer's starting precision, then each other precision a
    layer took, in the order one was first taken (a layer stepping back down returns to its level).

    The levels number the precisions this run reached, not the ladder's rungs: a decision names the precision a
    layer moved to, not the rung. Global decisions and other layers' are passed over.

    Args:
        layers: the layers' names, top to bottom in the picture.
        decisions: :class:`~sage_lightning.policy.Decision` objects (``AdaptivePrecision.history``), or mappings
            with their fields (a result file's ``decision_log``), in any order.
        start: the first step of the picture.

    Example::

        history, names = history_from_decisions(["blocks.0.attn"], callback.history)
        names   # ['base', 'sagebwd:int8=qk,pv,dv;fp8=ds;smooth_k']
    """
    history, names, bases = LevelHistory(layers, start), ["base"], {}
    fields = [d if isinstance(d, Mapping) else dataclasses.asdict(d) for d in decisions]
    for d in sorted(fields, key=lambda d: d["step"]):
        if d["lever"] != "precision" or d["layer"] not in history.changes:
            continue
        base = bases.setdefault(d["layer"], d["old"])
        if d["new"] != base and d["new"] not in names:
            names.append(d["new"])
        history.record(d["step"], {d["layer"]: 0 if d["new"] == base else names.index(d["new"])})
    return history, names


def save_decisions_picture(
    path: Path, layers: Sequence[str], decisions: Iterable[Any], last_step: int, levels: int = 7
) -> list[tuple[str, str]]:
    """Draw :func:`history_from_decisions`' picture to ``path`` (PNG, Pillow); returns each level's name and
    colour, for the legend.

    Args:
        path: the PNG file to write (its folder is made).
        layers: the layers' names, top to bottom.
        decisions: as :func:`history_from_decisions` takes them.
        last_step: the last step drawn (the run's last).
        levels: the colour scale's levels (the default ladder's six rungs and the base: level 1 lime, 2 yellow).

    Example::

        save_decisions_picture(Path("precision.png"), layers, callback.history, trainer.global_step)
        # [('base', 'green'), ('sagebwd:int8=qk,pv,dv;fp8=ds;smooth_k', 'lime')]
    """
    from PIL import Image

    history, names = history_from_decisions(layers, decisions)
    levels = max(levels, len(names))
    image = precision_image(history, last_step, levels)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image.transpose(1, 2, 0)).save(path)
    return [(name, PALETTE_NAMES[palette_index(level, levels)]) for level, name in enumerate(names)]


def legend(rungs: Sequence[str], layers: Sequence[str]) -> str:
    """The markdown that explains the picture: each level's rung and colour, the layers top to bottom.

    Example::

        legend(["smooth_q", "qk_bf16", "ds_bf16", "dv_bf16", "full"], ["blocks.0.attn"])
    """
    names = ["base"] + list(rungs)
    lines = [
        "Layers top to bottom, steps left to right (each column the level at the end of its steps); colours:",
        "",
    ]
    for level, name in enumerate(names):
        lines.append(f"- level {level}, `{name}`: {PALETTE_NAMES[palette_index(level, len(names))]}")
    lines += ["", "Layers: " + ", ".join(f"`{name}`" for name in layers)]
    return "  \n".join(lines)
