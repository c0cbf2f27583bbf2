"""The noise ratio's threshold from training runs that measured it without acting (``docs/controller.md``).

Reads ``pretrain_compare`` results whose runs kept the controller's noise readings (``noise_readings`` in each
run's summary), groups them by tokens per step, and puts ``noise_ratio_high`` at the geometric mean of the
smallest group's 95th percentile (where low-bit dS costs no loss: it must stay quiet) and the lowest median of
the larger groups (where it does: it must act). Readings before ``--from-step`` (the first steps, random weights)
are left out. Prints ``threshold=<value>`` (``threshold=none`` where the groups do not separate) and a table.

Example::

    python -m benchmarks.controller.noise_calibration results/training-*-noise-observe-*.json --out calibration.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def readings(paths: list[Path], from_step: int) -> dict[tuple[int, str], list[float]]:
    """Base-precision noise ratios per ``(tokens per step, run)`` over every result file and layer."""
    found: dict[tuple[int, str], list[float]] = {}
    for path in paths:
        for summary in json.loads(path.read_text())["summary"]:
            values = [r[2] for r in summary.get("noise_readings") or [] if r[0] >= from_step and r[2] is not None]
            if values:
                key = (int(summary["tokens_per_step"]), f"{path.stem}/{summary['run']}")
                found.setdefault(key, []).extend(v for v in values if math.isfinite(v))
    return found


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def calibrate(found: dict[tuple[int, str], list[float]]) -> tuple[float | None, list[str]]:
    """``(threshold or None, table lines)``."""
    lines = ["| tokens per step | run | readings | median | 95th pct | max |", "|---:|---|---:|---:|---:|---:|"]
    for (tokens, run), values in sorted(found.items()):
        lines.append(
            f"| {tokens:,} | {run} | {len(values)} | {statistics.median(values):.3f} | "
            f"{quantile(values, 0.95):.3f} | {max(values):.3f} |"
        )
    if not found:
        return None, lines + ["", "No noise readings in these results."]
    smallest = min(tokens for tokens, _ in found)
    quiet = [v for (tokens, _), values in found.items() if tokens == smallest for v in values]
    loud = [statistics.median(values) for (tokens, _), values in found.items() if tokens > smallest]
    if not quiet or not loud:
        return None, lines + ["", "Need runs at two tokens per step at least."]
    ceiling, floor = quantile(quiet, 0.95), min(loud)
    if floor <= ceiling:
        note = f"No separation: larger groups' lowest median {floor:.3f} <= smallest group's 95th pct {ceiling:.3f}."
        return None, lines + ["", note]
    threshold = math.sqrt(ceiling * floor)
    note = f"noise_ratio_high = sqrt({ceiling:.3f} x {floor:.3f}) = {threshold:.3f} (margin {floor / ceiling:.2f}x)."
    return threshold, lines + ["", note]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="pretrain_compare result JSONs")
    parser.add_argument("--from-step", type=int, default=25, help="leave out readings before this step")
    parser.add_argument("--out", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    threshold, lines = calibrate(readings(args.results, args.from_step))
    text = "\n".join(lines)
    print(text)
    print(f"threshold={'none' if threshold is None else f'{threshold:.4f}'}")
    if args.out is not None:
        args.out.write_text(f"# Noise ratio calibration\n\n{text}\n")


if __name__ == "__main__":
    main()
