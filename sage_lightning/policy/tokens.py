"""The global lever: tokens per optimizer step, through ``accumulate_grad_batches``."""

from __future__ import annotations

from typing import Any

from sage_lightning.policy.backoff import Backoff
from sage_lightning.policy.vocabulary import Decision


class TokensLever:
    """``accumulate_grad_batches``: halved on a divergence nothing else answers, doubled back after calm.

    Halving keeps the new window a divisor of the old one, so the change can land at the next step; it never goes
    below ``floor`` nor, coming back, above the run's own setting. The calm periods follow a :class:`Backoff`.

    Args:
        start: the run's ``accumulate_grad_batches`` (the ceiling).
        floor: the lowest setting; ``None`` turns the lever off.
        backoff: the lever's calm periods.

    Example::

        from sage_lightning.policy import Backoff, TokensLever

        lever = TokensLever(start=4, floor=1, backoff=Backoff(calm_steps=100, max_backoff=4))
        lever.lower(step=10, cause="loss is nan")   # one decision: 4 -> 2
        lever.raise_after_calm(step=110)            # 2 -> 4
    """

    def __init__(self, start: int, floor: int | None, backoff: Backoff) -> None:
        self.start = start
        self.floor = floor
        self.value = start
        self.backoff = backoff

    def lower(self, step: int, cause: str) -> list[Decision]:
        """Halve the setting (one decision), or nothing when the lever is off or at its floor."""
        if self.floor is None or self.value <= self.floor:
            return []
        old = self.value
        self.backoff.tighten(step)
        self.value = max(self.floor, old // 2)
        reason = (
            f"{cause}; every attention layer already has dS in high precision, so tokens per step go down "
            "(the SageBwd study: fewer tokens per step close the gap to full precision)"
        )
        return [Decision(step, None, "accumulate_grad_batches", str(old), str(self.value), reason)]

    def raise_after_calm(self, step: int) -> list[Decision]:
        """Double the setting back (one decision) once calm long enough, up to the run's own setting."""
        if self.value >= self.start or not self.backoff.ready(step):
            return []
        old, calm_for, period = self.value, self.backoff.calm_for(step), self.backoff.period
        self.value = min(self.start, old * 2)
        self.backoff.relax(step)
        reason = f"calm for {calm_for} steps >= {period}"
        return [Decision(step, None, "accumulate_grad_batches", str(old), str(self.value), reason)]

    def state_dict(self) -> dict[str, Any]:
        """The setting, the ceiling and the backoff's counters."""
        return {"start": self.start, "value": self.value, "backoff": self.backoff.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.start = int(state["start"])
        self.value = int(state["value"])
        self.backoff.load_state_dict(state["backoff"])
