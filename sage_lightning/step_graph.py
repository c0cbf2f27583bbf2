"""The usual optimizer step's device work for the controller, replayed as one CUDA graph.

A step that measures nothing optional needs, from the device: the squared gradient norm, the short signal vector
(:meth:`~sage_lightning.signals.SignalLayout.pack_short`: the loss sum, that norm, the layers' non-finite flags),
the flags cleared, and the fused optimizer's skip flag. Issued op by op that is a dozen launches and, above all,
a multi-tensor norm whose host cost grows with the number of parameters (about 0.15-0.25 ms for 83 on an H100
host): on a host-bound step every microsecond of it is step time. :class:`QuietStep` captures the work once and
replays it (one launch) while the gradients and flags stay at the addresses it was captured with, which is what
the caching allocator gives a training loop step after step; any change of address is seen before the replay
(the pointers are compared on every step) and the step runs eagerly and recaptures. A model whose addresses keep
moving runs eagerly for good after :data:`MAX_CAPTURES` captures. Off CUDA, or with gradients that are not plain
tensors on one device (DTensor shards), it always runs eagerly; the numbers are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sage_lightning.signals import squared_grad_norm

#: Captures after which a model whose gradients keep moving runs eagerly for the rest of the fit.
MAX_CAPTURES = 4


def quiet_step(
    loss_sum: torch.Tensor, grads: Sequence[torch.Tensor], flags: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device work of a quiet step, eagerly: ``(short, grad_norm2, found_inf)``, and ``flags`` cleared.

    Args:
        loss_sum: the step's loss sum, a float32 device scalar.
        grads: the gradients, at least one.
        flags: each layer's non-finite flag (a bool scalar on the device), in module order.

    Returns:
        ``short``: float32 ``[loss_sum, grad_norm2, flags...]``; ``grad_norm2``: the squared gradient norm
        (float32 scalar); ``found_inf``: 1.0 where that norm is non-finite, else 0.0 (float32 scalar, what a
        fused optimizer reads to skip its step).

    Example::

        short, norm2, found = quiet_step(torch.tensor(2.0), [torch.ones(4)], [torch.tensor(False)])
        short.tolist()   # [2.0, 4.0, 0.0]
    """
    grad_norm2 = squared_grad_norm(grads)
    if grad_norm2.device != loss_sum.device:  # gradients elsewhere than the loss (a model split over devices)
        grad_norm2 = grad_norm2.to(loss_sum.device)
    held = torch.stack(list(flags))
    torch._foreach_zero_(list(flags))
    short = torch.cat([torch.stack([loss_sum, grad_norm2]), held])
    # 0 * norm^2 is 0 for a finite norm and NaN for an infinite or NaN one, which becomes 1.
    found_inf = grad_norm2.mul(0.0).nan_to_num_(nan=1.0)
    return short, grad_norm2, found_inf


class QuietStep:
    """:func:`quiet_step`, replayed from a CUDA graph where the addresses allow (module docstring).

    Attributes:
        captures: graphs captured so far.
        replays: steps served by a replay.

    Example::

        step = QuietStep()
        short, norm2, found = step(loss_sum, grads, flags)   # every optimizer step
        step.release()                                        # when the fit ends
    """

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        self._key: tuple | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._loss: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self, loss_sum: torch.Tensor, grads: Sequence[torch.Tensor], flags: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :func:`quiet_step`; the returned tensors are the graph's own where replayed: read (or copy) them
        before the next call."""
        if not loss_sum.is_cuda:
            return quiet_step(loss_sum, grads, flags)
        key = (tuple(map(torch.Tensor.data_ptr, grads)), tuple(map(torch.Tensor.data_ptr, flags)))
        if key == self._key and self._graph is not None:
            self._loss.copy_(loss_sum)
            self._graph.replay()
            self.replays += 1
            return self._outputs
        result = quiet_step(loss_sum, grads, flags)
        self.release()
        if self.captures < MAX_CAPTURES and _capturable(loss_sum.device, grads, flags):
            self._capture(loss_sum, grads, flags)
            self._key = key
        return result

    def release(self) -> None:
        """Drop the graph and its memory (the next call runs eagerly and captures again)."""
        self._key = self._graph = self._loss = self._outputs = None

    def _capture(self, loss_sum: torch.Tensor, grads: Sequence[torch.Tensor], flags: Sequence[torch.Tensor]) -> None:
        # The eager call just before warmed every operator up (allocator, lazy initialisation); nothing runs during
        # the capture, so the flags it clears are not touched until the first replay.
        self.captures += 1
        self._loss = torch.empty_like(loss_sum)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._outputs = quiet_step(self._loss, grads, flags)
        self._graph = graph


def _capturable(device: torch.device, grads: Sequence[torch.Tensor], flags: Sequence[torch.Tensor]) -> bool:
    """Plain tensors, all on ``device`` (what the captured operators assume)."""
    tensors = [*grads, *flags]
    return all(type(tensor) is torch.Tensor and tensor.device == device for tensor in tensors)
