"""Host-memory snapshots of model and optimizer state, what a rollback restores.

A snapshot is taken into reused (pinned, for CUDA tensors) host buffers on a side stream, with ``non_blocking``
copies and a CUDA event recorded after them, so on a GPU it overlaps the next forward and backward and the host
never waits for it; the next optimizer step, the first writer of the parameters, makes the device wait for it
(:meth:`Snapshots.wait_before_write`), and only a rollback or a checkpoint waits for it on the host. Without the
check before each step (``check_before_step=False``) a snapshot is taken ahead of its step's verdict: it stays a
*candidate* until the verdict, then becomes the good one (:meth:`Snapshots.settle`) or is dropped with every later
candidate; the good one is never written into before a newer one replaces it. The good snapshot and the candidates
go into checkpoints, so a resumed run rolls back to the same weights as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class Snapshots:
    """The last good snapshot, candidates awaiting their verdicts (oldest first), and spare buffers.

    Example::

        snapshots = Snapshots()
        snapshots.take(trainer, pl_module)          # at the start of training
        ...
        snapshots.restore(trainer, pl_module)       # a divergence: back to it
    """

    def __init__(self) -> None:
        self.good: dict[str, Any] | None = None
        self.candidates: list[dict[str, Any]] = []
        self._spares: list[dict[str, Any]] = []
        self._copy_stream: torch.cuda.Stream | None = None
        # The last snapshot's copies: the next optimizer step's stream waits for _unwritten (then dropped), a host
        # read of the buffers (a rollback, a checkpoint) for _copied.
        self._unwritten: torch.cuda.Event | None = None
        self._copied: torch.cuda.Event | None = None
        # Pinned buffers set aside for optimizer state (reserve), taken by copies that find none of their own.
        self._pool: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self.reserved = False

    @property
    def step(self) -> int | None:
        """The optimizer step the good snapshot was taken at (``trainer.global_step`` then)."""
        return None if self.good is None else self.good["step"]

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, candidate: bool = False) -> None:
        """Copy model and optimizer state to host memory, overlapping the next forward and backward on CUDA.

        Args:
            candidate: keep it apart from the good snapshot (in spare buffers) until :meth:`settle`.
        """
        if candidate:
            previous = self._spares.pop() if self._spares else {}
        else:
            previous = self.good or {}
        device = trainer.strategy.root_device

        def copy() -> dict[str, Any]:
            # Into the previous snapshot's buffers (pinned host memory for CUDA tensors), without waiting:
            # allocating and page-faulting fresh host memory each time cost more than the copies.
            return {
                "step": trainer.global_step,
                "model": copy_to_host(pl_module.state_dict(), previous.get("model"), self._pool),
                "optimizers": copy_to_host(
                    [optimizer.state_dict() for optimizer in trainer.optimizers], previous.get("optimizers"), self._pool
                ),
            }

        if device.type != "cuda":
            self._keep(copy(), candidate)
            return
        # On a side stream, the copies overlap the next forward and backward (which only read the parameters);
        # the next optimizer step, the first writer, waits for them (wait_before_write).
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._copy_stream):
            self._keep(copy(), candidate)
        self._copied = torch.cuda.Event()
        self._copied.record(self._copy_stream)
        self._unwritten = self._copied

    def allocate_spare(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Allocate a candidate's buffers now rather than in the middle of training (pinning a gigabyte of host
        memory takes a while)."""
        candidates = list(self.candidates)
        self.take(trainer, pl_module, candidate=True)
        self._spares.append(self.candidates.pop())
        self.candidates = candidates

    def reserve(self, trainer: pl.Trainer) -> None:
        """Once the optimizers hold state (after the first optimizer step; Adam's moments are created there), pin
        host buffers for it, one set per snapshot kept without it (the one taken when training started, the spare),
        so that no later snapshot pins memory in the middle of training: pinning the moments of a 100M-parameter
        model took about 0.65 s on an H100 host, a stall that landed on whichever step took the next snapshot.
        Does nothing off CUDA, before the optimizers have state, or once done."""
        if self.reserved or trainer.strategy.root_device.type != "cuda":
            return
        states = [optimizer.state_dict()["state"] for optimizer in trainer.optimizers]
        if not any(states):
            return
        self.reserved = True
        kept = [snapshot for snapshot in (self.good, *self.candidates, *self._spares) if snapshot is not None]
        lacking = sum(not any(saved["state"] for saved in snapshot["optimizers"]) for snapshot in kept)
        tensors = [value for state in states for per_param in state.values() for value in per_param.values()]
        for _ in range(lacking):
            for value in tensors:
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    self._pool.setdefault((value.shape, value.dtype), []).append(buffer)

    def wait_before_write(self, device: torch.device) -> None:
        """Make the current stream wait for the last snapshot's copies (call before the optimizer step); the host
        does not wait."""
        if self._unwritten is not None:
            torch.cuda.current_stream(device).wait_event(self._unwritten)
            self._unwritten = None

    def settle(self, step: int, undone: bool) -> None:
        """The verdict of ``step`` is in: the candidate taken after it becomes the good snapshot; if the step was
        undone, every candidate (all taken after it) is dropped."""
        if undone:
            self._spares += self.candidates
            self.candidates = []
        elif self.candidates and self.candidates[0]["step"] == step + 1:
            if self.good is not None:
                self._spares.append(self.good)
            self.good = self.candidates.pop(0)

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Load the good snapshot into the model and the optimizers (keeping their current hyperparameters)."""
        snapshot = self.good
        if snapshot is None:
            raise RuntimeError("Snapshots.restore: no snapshot was taken; take() one when training starts.")
        self._wait_for_copies()
        pl_module.load_state_dict(snapshot["model"])
        for optimizer, saved in zip(trainer.optimizers, snapshot["optimizers"], strict=True):
            # Keep the schedule's current hyperparameters (lr, ...): only parameters and moments go back.
            hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            # A fresh copy: load_state_dict keeps tensors already on the right device as the optimizer's own
            # state (CPU training) and would update the snapshot in place, spoiling it for the next rollback.
            optimizer.load_state_dict(copy_to_host(saved, None))
            for group, values in zip(optimizer.param_groups, hyper, strict=True):
                group.update(values)

    def state_dict(self) -> dict[str, Any]:
        """The good snapshot and the candidates (host tensors, waited for), for a checkpoint."""
        self._wait_for_copies()
        return {"good": self.good, "candidates": list(self.candidates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s snapshots."""
        self.good, self.candidates = state["good"], list(state["candidates"])

    def _wait_for_copies(self) -> None:
        # The host is about to read the buffers: the last snapshot's copies (on the side stream) must be done.
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _keep(self, snapshot: dict[str, Any], candidate: bool) -> None:
        if candidate:
            self.candidates.append(snapshot)
        else:
            self.good = snapshot


def copy_to_host(
    value: Any, buffers: Any, pool: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] | None = None
) -> Any:
    """A copy of ``value`` with every tensor copied to host memory, reusing ``buffers`` (a previous result of
    the same structure) where shapes and dtypes match, else a buffer of the right shape and dtype from ``pool``
    (taken out of it). Copies from CUDA go to pinned memory and do not block.

    Example::

        saved = copy_to_host(model.state_dict(), None)
        saved = copy_to_host(model.state_dict(), saved)   # into the same buffers
    """
    if isinstance(value, torch.Tensor):
        source = value.detach()
        reusable = isinstance(buffers, torch.Tensor) and buffers.shape == source.shape
        spare = pool.get((source.shape, source.dtype)) if pool is not None and source.is_cuda else None
        if reusable and buffers.dtype == source.dtype:
            target = buffers
        elif spare:
            target = spare.pop()
        else:
            target = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
        target.copy_(source, non_blocking=source.is_cuda)
        return target
    if isinstance(value, dict):
        buffers = buffers if isinstance(buffers, dict) else {}
        return {key: copy_to_host(item, buffers.get(key), pool) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        buffers = buffers if isinstance(buffers, (list, tuple)) and len(buffers) == len(value) else [None] * len(value)
        items = [copy_to_host(item, buffer, pool) for item, buffer in zip(value, buffers, strict=True)]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value
