"""Spike detection over a sliding window: pure Python, no torch, so it is tested with plain lists of numbers.

A value is compared with the median of the values before it, in units of their spread measured by the
median absolute deviation (MAD). Median and MAD ignore a few outliers in the window, so one spike does not
hide the next, and a slow trend (the loss falling during training) moves the median with it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

#: MAD of a normal distribution times this is its standard deviation, so ``z`` reads like a normal z-score.
MAD_TO_SIGMA = 1.4826
#: Spike levels, from calm to the one that makes the controller roll back.
LEVELS: tuple[str, ...] = ("none", "soft", "hard")


@dataclass(frozen=True)
class SpikeReading:
    """What :meth:`SpikeDetector.update` saw in one value.

    Attributes:
        value: the value passed in.
        median: median of the window before this value; ``None`` while warming up.
        z: ``(value - median) / spread``, the robust z-score; ``None`` while warming up.
        level: ``"none"``, ``"soft"`` (``z > soft_z``) or ``"hard"`` (``z > hard_z``).
    """

    value: float
    median: float | None
    z: float | None
    level: str


class SpikeDetector:
    """Flags upward spikes of a series (the per-step loss, the gradient norm) against a sliding window.

    The spread is ``1.4826 * MAD``, floored at ``rel_floor * |median|``: a series that barely moves (a loss on
    a plateau, identical values in a test) would otherwise turn a change in its last digit into a huge
    z-score. Only upward moves count: a falling loss is good news. Values flagged ``"hard"`` are not added to
    the window, since the controller undoes the step that produced them; ``"soft"`` ones are (training went
    on with them, and a lasting shift in level must become the new normal). Non-finite values are neither
    scored nor added: the controller handles them before asking.

    Args:
        window: how many recent values the median and MAD are taken over.
        min_history: values needed in the window before anything is flagged.
        soft_z: robust z-score above which a value is a soft spike.
        hard_z: robust z-score above which a value is a hard spike; ``None`` for no hard level.
        rel_floor: the spread is at least this fraction of ``|median|``.

    Raises:
        ValueError: an argument out of range; the message names it, the value received and what works.

    Example::

        from sage_lightning.detectors import SpikeDetector

        detector = SpikeDetector(window=32, min_history=8, soft_z=6.0, hard_z=20.0)
        for loss in [2.0, 2.01, 1.99, 2.02, 1.98, 2.0, 2.01, 1.99]:
            detector.update(loss)
        print(detector.update(3.0).level)   # "hard"
    """

    def __init__(
        self,
        *,
        window: int = 64,
        min_history: int = 16,
        soft_z: float = 6.0,
        hard_z: float | None = None,
        rel_floor: float = 0.005,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise ValueError(f"SpikeDetector: window must be an int >= 3; received {window!r}.")
        if isinstance(min_history, bool) or not isinstance(min_history, int) or not 3 <= min_history <= window:
            raise ValueError(
                f"SpikeDetector: min_history must be an int from 3 to window ({window}); received {min_history!r}."
            )
        if not _positive(soft_z):
            raise ValueError(f"SpikeDetector: soft_z must be a positive finite number; received {soft_z!r}.")
        if hard_z is not None and (not _positive(hard_z) or hard_z <= soft_z):
            raise ValueError(
                f"SpikeDetector: hard_z must be None or a finite number above soft_z ({soft_z}); received {hard_z!r}."
            )
        if isinstance(rel_floor, bool) or not isinstance(rel_floor, (int, float)) or not 0 <= rel_floor < 1:
            raise ValueError(f"SpikeDetector: rel_floor must be a number in [0, 1); received {rel_floor!r}.")
        self.window = window
        self.min_history = min_history
        self.soft_z = float(soft_z)
        self.hard_z = None if hard_z is None else float(hard_z)
        self.rel_floor = float(rel_floor)
        self._values: deque[float] = deque(maxlen=window)
        # The same values kept sorted, so the median and the MAD need no sort per step (the controller asks every
        # optimizer step, and on a host-bound step its Python is step time).
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._values)

    def update(self, value: float) -> SpikeReading:
        """Score ``value`` against the window, then add it (unless it is hard or non-finite).

        Args:
            value: the newest value of the series.

        Returns:
            The :class:`SpikeReading`; ``level`` is ``"none"`` while fewer than ``min_history`` values were seen.

        Example::

            reading = detector.update(2.5)
            if reading.level != "none":
                print(f"spike: z={reading.z:.1f}")
        """
        value = float(value)
        if not math.isfinite(value):
            return SpikeReading(value=value, median=None, z=None, level="none")
        if len(self._values) < self.min_history:
            self._append(value)
            return SpikeReading(value=value, median=None, z=None, level="none")
        median = _median(self._sorted)
        mad = _median_distance(self._sorted, median)
        # The absolute floor keeps an all-zero window (a gradient norm of exactly 0) from dividing by zero.
        spread = max(MAD_TO_SIGMA * mad, self.rel_floor * abs(median), 1e-12)
        z = (value - median) / spread
        level = "none"
        if self.hard_z is not None and z > self.hard_z:
            level = "hard"
        elif z > self.soft_z:
            level = "soft"
        if level != "hard":
            self._append(value)
        return SpikeReading(value=value, median=median, z=z, level=level)

    def _append(self, value: float) -> None:
        if len(self._values) == self.window:
            del self._sorted[bisect.bisect_left(self._sorted, self._values[0])]
        self._values.append(value)
        bisect.insort(self._sorted, value)

    def state_dict(self) -> dict[str, Any]:
        """The window, so a resumed run scores the next value as the uninterrupted run would."""
        return {"values": list(self._values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the window saved by :meth:`state_dict` (keeping at most ``window`` newest values)."""
        self._values = deque((float(x) for x in state["values"]), maxlen=self.window)
        self._sorted = sorted(self._values)


def _median(ordered: list[float]) -> float:
    """The median of sorted values, as :func:`statistics.median` computes it (the mean of the middle two)."""
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


def _median_distance(ordered: list[float], centre: float) -> float:
    """``statistics.median(abs(x - centre) for x in ordered)`` from sorted values without sorting: the distances
    below ``centre`` and those above are each already in order, and the middle ones are the k-th smallest of the
    two, found by bisection. ``centre - x`` is ``abs(x - centre)`` exactly for ``x < centre`` (IEEE subtraction is
    antisymmetric)."""
    n = len(ordered)
    split = bisect.bisect_left(ordered, centre)
    if n % 2:
        return _kth_distance(ordered, centre, split, n // 2)
    return (_kth_distance(ordered, centre, split, n // 2 - 1) + _kth_distance(ordered, centre, split, n // 2)) / 2


def _kth_distance(ordered: list[float], centre: float, split: int, k: int) -> float:
    """The ``k``-th smallest (from 0) of the distances to ``centre``: ``centre - ordered[split - 1 - i]`` (the
    values below, nearest first) merged with ``ordered[split + j] - centre`` (the others)."""
    below, above = split, len(ordered) - split
    # Take i of the distances below and k + 1 - i of those above: the largest i whose last one does not exceed
    # the first above left out.
    low, high = max(0, k + 1 - above), min(below, k + 1)
    while low < high:
        i = (low + high) // 2
        if centre - ordered[split - 1 - i] < ordered[split + k - i] - centre:
            low = i + 1
        else:
            high = i
    i, j = low, k + 1 - low
    last_below = centre - ordered[split - i] if i > 0 else -math.inf
    last_above = ordered[split + j - 1] - centre if j > 0 else -math.inf
    return max(last_below, last_above)


def _positive(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0
