"""Per-kernel time from a ``torch.profiler`` profile, shared by ``speed``'s breakdown and ``overhead_profile``:
``kernel_ms(prof.key_averages(), iterations)`` is ``{"_dkdv_kernel": 4.2, ...}``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def kernel_ms(events: Iterable[Any], iterations: int, *, cpu_time: bool = False) -> dict[str, float]:
    """Milliseconds per iteration of each kernel in a profile's key averages (its self device time)."""
    totals: dict[str, float] = {}
    for event in events:
        us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if us <= 0 and cpu_time:
            us = event.self_cpu_time_total
        if us > 0:
            totals[event.key] = totals.get(event.key, 0.0) + us / 1000 / iterations
    return totals
