"""Each layer's host-side bookkeeping (call counters, fallback warnings), exact under ``torch.compile`` too.

A counter bumped in traced code is a Python side effect: Dynamo guards on the counter's value (a recompile per
call) and a graph break replays it. So the bookkeeping never runs in traced code. In eager mode
:func:`record` calls the layer's handler directly; while Dynamo traces it records one call of the
``sage_lightning_ledger::layer_event`` custom op instead, whose Python body runs the same handler each time the
compiled graph runs: counters stay exact, warnings are issued outside the traced region, and
``fullgraph=True`` holds. The op mutates a shared CPU anchor tensor so no compiler pass drops it; a mutated CPU
input also makes Inductor's CUDA graphs (``mode="reduce-overhead"``) skip such a graph, which is required: a
replayed CUDA graph would skip the Python body and the counts with it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

#: Events a layer handles (plus ``FALLBACK_PREFIX + reason``).
SERVED = "served"
FALLBACK_PREFIX = "fallback:"
FORWARD_START = "forward_start"
FORWARD_END = "forward_end"


class _Handler(Protocol):
    def handle_event(self, event: str) -> None: ...


_LAYERS: dict[int, weakref.ref[_Handler]] = {}
_KEYS = itertools.count()
# Shared by every layer; never read. Declared mutated so the op is kept and ordered.
_ANCHOR = torch.zeros(1)


def register(layer: _Handler) -> int:
    """A process-wide key for ``layer`` (held by a weak reference), for the compiled path to find it by.

    Example::

        key = register(state)   # AttentionLayerState does this itself
    """
    key = next(_KEYS)
    _LAYERS[key] = weakref.ref(layer, lambda _ref, key=key: _LAYERS.pop(key, None))
    return key


@torch.library.custom_op("sage_lightning_ledger::layer_event", mutates_args=("anchor",))
def _layer_event(anchor: torch.Tensor, layer: int, event: str) -> None:
    ref = _LAYERS.get(layer)
    handler = None if ref is None else ref()
    if handler is not None:
        handler.handle_event(event)


@_layer_event.register_fake
def _layer_event_fake(anchor: torch.Tensor, layer: int, event: str) -> None:
    return None


def record(layer: _Handler, key: int, event: str) -> None:
    """Run ``layer.handle_event(event)`` now (eager) or each time the compiled graph runs (under Dynamo).

    Args:
        layer: the layer state.
        key: its key from :func:`register`.
        event: :data:`SERVED`, :data:`FORWARD_START`, :data:`FORWARD_END` or ``FALLBACK_PREFIX + reason``.

    Example::

        record(state, state.ledger_key, SERVED)
    """
    if torch.compiler.is_compiling():
        torch.ops.sage_lightning_ledger.layer_event(_ANCHOR, key, event)
    else:
        layer.handle_event(event)
