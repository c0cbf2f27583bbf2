"""Hysteresis in time, shared by every lever that goes up on trouble and comes back after calm."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Backoff:
    """When a lever that was tightened (a layer's rung raised, the tokens per step lowered) may relax again.

    A lever relaxes after ``calm_steps * 2**level`` steps without a change; tightening it again within that calm
    period after a relax raises ``level`` by one (up to ``max_backoff``), so a setting that relapses waits longer
    each time and decisions do not flap.

    Args:
        calm_steps: steps without a change before relaxing, at level 0.
        max_backoff: the highest level.

    Example::

        from sage_lightning.policy import Backoff

        backoff = Backoff(calm_steps=100, max_backoff=4)
        backoff.tighten(step=10)
        backoff.ready(step=110)   # True: calm for 100 steps
        backoff.relax(step=110)
        backoff.tighten(step=150) # within 100 steps of the relax: level 1, the next wait is 200
    """

    calm_steps: int
    max_backoff: int
    level: int = 0
    last_change: int | None = None
    last_relax: int | None = None

    @property
    def period(self) -> int:
        """Steps without a change needed before relaxing."""
        return self.calm_steps * 2**self.level

    def calm_for(self, step: int) -> int | None:
        """Steps since the last change, ``None`` when there was none."""
        return None if self.last_change is None else step - self.last_change

    def tighten(self, step: int) -> bool:
        """Record a tightening at ``step``; ``True`` when it came within the calm period after a relax (the
        level went up)."""
        relapse = self.last_relax is not None and step - self.last_relax < self.period
        if relapse:
            self.level = min(self.level + 1, self.max_backoff)
        self.last_change = step
        return relapse

    def ready(self, step: int) -> bool:
        """Whether the lever has been calm long enough to relax at ``step``."""
        calm = self.calm_for(step)
        return calm is not None and calm >= self.period

    def relax(self, step: int) -> None:
        """Record a relaxing at ``step``."""
        self.last_change = step
        self.last_relax = step

    def state_dict(self) -> dict[str, Any]:
        """The counters (not the configuration)."""
        state = asdict(self)
        del state["calm_steps"], state["max_backoff"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counters."""
        self.level = int(state["level"])
        self.last_change = state["last_change"]
        self.last_relax = state["last_relax"]
