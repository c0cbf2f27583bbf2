"""SpikeDetector: robust z-scores over a sliding window, as tables of values and expected levels."""

from __future__ import annotations

import math
import random

import pytest

from sage_lightning.detectors import MAD_TO_SIGMA, SpikeDetector

# Sixteen calm values, 2.01 and 1.99 in turn: median 2.0, MAD 0.01, so the spread is 1.4826 * 0.01 = 0.0148.
CALM = [2.0 + 0.01 * (-1) ** i for i in range(16)]


def warmed(**kwargs) -> SpikeDetector:
    detector = SpikeDetector(window=32, min_history=16, soft_z=6.0, hard_z=20.0, **kwargs)
    for value in CALM:
        assert detector.update(value).level == "none"
    return detector


@pytest.mark.parametrize(
    ("value", "level"),
    [
        (2.0, "none"),
        (2.05, "none"),  # z = 3.4
        (2.095, "soft"),  # z = 6.4
        (2.25, "soft"),  # z = 16.9
        (2.31, "hard"),  # z = 20.9
        (1.5, "none"),  # a falling loss is never a spike
        (1e6, "hard"),
    ],
)
def test_levels(value: float, level: str) -> None:
    reading = warmed().update(value)
    assert reading.level == level
    assert reading.median == pytest.approx(2.0)
    assert reading.z == pytest.approx((value - 2.0) / (1.4826 * 0.01))


def test_warm_up_flags_nothing() -> None:
    detector = SpikeDetector(window=8, min_history=4, soft_z=3.0)
    readings = [detector.update(v) for v in (1.0, 1.0, 1.0, 100.0)]
    assert [r.level for r in readings] == ["none"] * 4
    assert all(r.z is None for r in readings)
    assert detector.update(1000.0).level == "soft"


def test_hard_values_stay_out_of_the_window_soft_ones_go_in() -> None:
    detector = warmed()
    detector.update(3.0)  # hard
    assert len(detector) == 16
    detector.update(2.1)  # soft
    assert len(detector) == 17


def test_a_lasting_shift_becomes_the_new_normal() -> None:
    detector = SpikeDetector(window=16, min_history=8, soft_z=6.0)
    for i in range(16):
        detector.update(1.0 + 0.01 * (-1) ** i)
    levels = [detector.update(1.5 + 0.01 * (-1) ** i).level for i in range(16)]
    assert levels[0] == "soft" and levels[-1] == "none"


def test_spread_floors() -> None:
    # A constant series: MAD 0, spread = rel_floor * median = 0.01, so 2.1 is z = 10.
    detector = SpikeDetector(window=16, min_history=4, soft_z=6.0, rel_floor=0.005)
    for _ in range(4):
        detector.update(2.0)
    assert detector.update(2.1).z == pytest.approx(10.0)
    # All zeros (a gradient norm of exactly 0): the absolute floor keeps z finite.
    zeros = SpikeDetector(window=16, min_history=4, soft_z=6.0, rel_floor=0.0)
    for _ in range(4):
        zeros.update(0.0)
    reading = zeros.update(1.0)
    assert reading.level == "soft" and math.isfinite(reading.z)


def test_non_finite_values_are_not_scored_or_kept() -> None:
    detector = warmed()
    for value in (math.nan, math.inf):
        reading = detector.update(value)
        assert reading.level == "none" and reading.z is None
    assert len(detector) == 16


def test_state_dict_round_trip_scores_identically() -> None:
    detector = warmed()
    restored = SpikeDetector(window=32, min_history=16, soft_z=6.0, hard_z=20.0)
    restored.load_state_dict(detector.state_dict())
    for value in (2.0, 2.2, 2.5, 1.9):
        assert restored.update(value) == detector.update(value)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"window": 2}, "window"),
        ({"window": 8, "min_history": 9}, "min_history"),
        ({"soft_z": 0}, "soft_z"),
        ({"soft_z": 6.0, "hard_z": 5.0}, "hard_z"),
        ({"rel_floor": 1.0}, "rel_floor"),
        ({"window": True}, "window"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names) as info:
        SpikeDetector(**kwargs)
    assert "received" in str(info.value)


def _reference_readings(values: list[float], **kwargs: float) -> list[tuple]:
    """The detector as it was written with ``statistics.median`` over the window (before the sorted window)."""
    import statistics
    from collections import deque

    detector = SpikeDetector(**kwargs)
    window: deque[float] = deque(maxlen=detector.window)
    readings = []
    for value in values:
        if not math.isfinite(value):
            readings.append((value, None, None, "none"))
            continue
        if len(window) < detector.min_history:
            window.append(value)
            readings.append((value, None, None, "none"))
            continue
        median = statistics.median(window)
        mad = statistics.median(abs(x - median) for x in window)
        spread = max(MAD_TO_SIGMA * mad, detector.rel_floor * abs(median), 1e-12)
        z = (value - median) / spread
        level = (
            "hard" if detector.hard_z is not None and z > detector.hard_z else "soft" if z > detector.soft_z else "none"
        )
        if level != "hard":
            window.append(value)
        readings.append((value, median, z, level))
    return readings


@pytest.mark.parametrize("seed", range(12))
def test_the_sorted_window_reads_exactly_as_the_sorting_one(seed: int) -> None:
    rng = random.Random(seed)
    values = []
    for _ in range(400):
        roll = rng.random()
        if roll < 0.03:
            values.append(rng.choice([math.nan, math.inf]))
        elif roll < 0.08:
            values.append(rng.uniform(5, 50))  # spikes, hard and soft
        elif roll < 0.3:
            values.append(rng.choice([1.0, 1.5, 2.0]))  # repeated values in the window
        else:
            values.append(2.0 + rng.gauss(0, 0.05) - 0.001 * len(values))
    kwargs = {"window": rng.choice([3, 8, 32, 64]), "min_history": 3, "soft_z": 4.0, "hard_z": 12.0}
    detector = SpikeDetector(**kwargs)
    got = [(r.value, r.median, r.z, r.level) for r in (detector.update(v) for v in values)]
    expected = _reference_readings(values, **kwargs)
    assert [repr(x) for x in got] == [repr(x) for x in expected]
    restored = SpikeDetector(**kwargs)
    restored.load_state_dict(detector.state_dict())
    assert restored.update(2.0) == detector.update(2.0)
