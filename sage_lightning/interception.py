"""The one place an attention call is caught: SDPA's argument binder and the mode that routes calls to a layer.

Everything that reads a ``scaled_dot_product_attention`` call (the layer's routing, the swap's module wrapper,
the Hugging Face registry function) goes through :func:`bind_sdpa_arguments` and :class:`SDPAInterceptor`, so a
call is read one way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from sage_lightning.layer import AttentionLayerState

#: ``scaled_dot_product_attention``'s parameters, in order.
SDPA_PARAMETERS: tuple[str, ...] = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
#: Its defaults.
SDPA_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def bind_sdpa_arguments(args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A ``scaled_dot_product_attention`` call's arguments by name, defaults filled in.

    Written without :mod:`inspect` so ``torch.compile`` traces it.

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments.

    Returns:
        ``(bound, problem)``: ``bound`` maps every SDPA parameter to its value; ``problem`` is ``None``, or why
        the call does not bind (then ``bound`` is ``{}`` and SDPA itself will raise on the call).

    Example::

        bound, problem = bind_sdpa_arguments((q, k, v), {"is_causal": True})
        assert problem is None and bound["is_causal"] and bound["scale"] is None
    """
    if len(args) > len(SDPA_PARAMETERS):
        return {}, "more positional arguments than scaled_dot_product_attention takes"
    bound = dict(zip(SDPA_PARAMETERS, args, strict=False))
    for key, value in kwargs.items():
        if key not in SDPA_PARAMETERS or key in bound:
            return {}, f"argument {key!r} that scaled_dot_product_attention does not take"
        bound[key] = value
    if not all(name in bound for name in ("query", "key", "value")):
        return {}, "query, key or value missing"
    for key, value in SDPA_DEFAULTS.items():
        bound.setdefault(key, value)
    return bound, None


class SDPAInterceptor(TorchFunctionMode):
    """While active, sends every ``scaled_dot_product_attention`` call to one layer's state; other ops pass.

    The mode is popped while its handler runs, so the kernel's own torch calls (and SDPA itself, for a call
    that falls back) are not caught again. A ``multi_head_attention_forward`` call made under the mode (a module
    calling the functional form itself) runs unchanged and is counted as a fallback: the SDPA call inside it
    cannot be caught (the function dispatches to the mode before reaching it), and a layer must not look served
    when it is not. ``nn.MultiheadAttention`` modules are served by :mod:`sage_lightning.mha` instead.

    Args:
        state: the layer that owns the calls.

    Example::

        with SDPAInterceptor(state):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # served by state
    """

    def __init__(self, state: AttentionLayerState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = {} if kwargs is None else kwargs
        if func is F.scaled_dot_product_attention:
            return self.state.scaled_dot_product_attention(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            self.state.count_unserved(MULTI_HEAD_FORWARD_REASON)
        return func(*args, **kwargs)


#: The fallback reason of a ``multi_head_attention_forward`` call caught by the mode.
MULTI_HEAD_FORWARD_REASON = (
    "torch.nn.functional.multi_head_attention_forward called inside the layer (its attention cannot be caught; "
    "swap the nn.MultiheadAttention module itself, which is served)"
)


class WrappedForward:
    """The base of a swapped module's instance ``forward``: the module and the ``forward`` it replaces.

    An object rather than a closure so a converted model deep-copies (the module reference maps to the copy)
    and pickles.

    Args:
        module: the swapped module.
        original: an instance-level ``forward`` someone installed before (another wrapper), kept and called; ``None``
            for the class's.
    """

    def __init__(self, module: nn.Module, original: Callable | None) -> None:
        self.module = module
        self.original = original

    def _target(self) -> Callable:
        """The ``forward`` this one replaced (for its signature; calls go through :meth:`_call`)."""
        if self.original is not None:
            return self.original
        return type(self.module).forward.__get__(self.module)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """Call the ``forward`` this one replaced. The class's is called as a plain function with the module first:
        torch 2.11's dynamo cannot trace ``function.__get__`` (a graph break, an error under ``fullgraph=True``)."""
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)
