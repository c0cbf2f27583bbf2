"""The precision of every attention layer over the steps, as one picture: layers by steps, coloured by rung.

``AdaptivePrecision`` keeps a :class:`LevelHistory` and writes :func:`precision_image` to TensorBoard's Images tab
(tag ``sage/precision``) at the start of training and at each step with a decision, so a person sees at a glance
which layers left the fast path, when, how far, and whether they came back. Pure numpy: no plotting package.

Example::

    history = LevelHistory(["blocks.0.attn", "blocks.1.attn"], start=0)
    history.record(40, {"blocks.0.attn": 3, "blocks.1.attn": 0})
    image = precision_image(history, last_step=100, levels=6)   # uint8 [3, H, W]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    history: LevelHistory, last_step: int, levels: int, width: int = 512, row_height: int = 12
) -> np.ndarray:
    """The picture: one band of ``row_height`` pixels per layer (in ``history.layers``' order), one column per
    bin of steps from ``history.start`` to ``last_step`` (at most ``width`` columns), coloured by the level the
    layer held at the bin's last step; a one-pixel dark line between layers.

    Args:
        history: the levels over time.
        last_step: the last step to draw.
        levels: how many levels there are (the ladder's rungs plus the base), for the colours.
        width: the most columns.
        row_height: pixels per layer.

    Returns:
        ``uint8`` array ``[3, layers * row_height, columns]`` (TensorBoard's ``CHW``).

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
    return image.transpose(2, 0, 1).copy()


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
