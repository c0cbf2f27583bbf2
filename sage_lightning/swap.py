"""Swap a model's attention to SageBwd without touching its classes or Parameters.

How a call is caught: a swapped module's ``forward`` runs inside a :class:`torch.overrides.TorchFunctionMode`
that owns the layer's :class:`~sage_lightning.layer.AttentionLayerState`. Every
``scaled_dot_product_attention`` call made while that forward runs (``F.scaled_dot_product_attention(...)``,
a ``from torch.nn.functional import scaled_dot_product_attention`` binding, a helper function the module
calls) reaches the mode, whatever name the model bound it to, so models nobody wrote for us (nanoGPT-,
litgpt-style) work unmodified. The mode is entered with ``with`` inside a wrapper stored as the instance's
``forward`` (the way ``accelerate`` hooks modules): it is left on every exit path, exceptions included, and
the module keeps its class, its Parameters and its ``state_dict``, so an optimizer built before the swap stays
valid. Hugging Face models are swapped through their own attention-function registry instead
(:mod:`sage_lightning.hf`), loaded only when ``transformers`` is already imported.

``torch.compile`` traces the wrapper, the mode and the routing without a graph break (tested with
``fullgraph=True``); the layer's precision is read as a guarded attribute, so assigning a new one costs one
recompile.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import STATE_ATTRIBUTE, AttentionLayerState, attention_layers

FilterFn = Callable[[nn.Module, str], bool]

#: Class-name fragments (case-insensitive) that mark an attention module for the default filter.
ATTENTION_NAME_PARTS: tuple[str, ...] = ("attention", "attn")


class SDPAInterceptor(TorchFunctionMode):
    """While active, sends every ``scaled_dot_product_attention`` call to one layer's state; other ops pass.

    The mode is popped while its handler runs, so the kernel's own torch calls (and SDPA itself, for a call
    that falls back) are not caught again.

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
        return func(*args, **kwargs)


class _InterceptedForward:
    """A swapped module's ``forward``: the original one, run inside the layer's :class:`SDPAInterceptor`.

    An object rather than a closure so a converted model deep-copies (the module reference maps to the copy)
    and pickles. The state is read from the module at each call, so a copy uses its own.
    """

    def __init__(self, module: nn.Module, original: Callable | None) -> None:
        self.module = module
        # An instance-level forward someone installed before us (another wrapper) is kept and called;
        # ``None`` means the class's forward.
        self.original = original

    def _target(self) -> Callable:
        if self.original is not None:
            return self.original
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with SDPAInterceptor(self.module.__dict__[STATE_ATTRIBUTE]):
            return self._target()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # Callers that inspect forward (Lightning's example-input checks, Hugging Face's generate) see the
        # original parameters.
        return inspect.signature(self._target())


def is_attention_module(module: nn.Module, fqn: str = "") -> bool:
    """The default filter: the innermost modules whose class name contains "Attention" or "Attn".

    Innermost, because the module that calls ``scaled_dot_product_attention`` is the attention module itself
    (nanoGPT's and litgpt's ``CausalSelfAttention``, Hugging Face's ``LlamaAttention``, ``GPT2Attention``),
    while the blocks around it (an ``AttentionBlock`` holding a ``SelfAttention``) must not claim the same
    call. Matching is case-insensitive. A module that calls SDPA under another name, or whose attention-named
    child does not call SDPA itself, needs a ``filter_fn``.

    Args:
        module: a candidate module.
        fqn: its path in the model (unused; the signature is ``filter_fn``'s).

    Returns:
        Whether to swap ``module``.

    Example::

        from sage_lightning.swap import is_attention_module

        def attention_but_not_cross(module, fqn):
            return is_attention_module(module, fqn) and "cross" not in fqn
    """
    if not _named_like_attention(module):
        return False
    return not any(_named_like_attention(child) for child in module.modules() if child is not module)


def _named_like_attention(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return any(part in name for part in ATTENTION_NAME_PARTS)


def convert_to_sage_attention(
    model: nn.Module,
    *,
    filter_fn: FilterFn | None = None,
    precision: AttentionPrecision | None = None,
) -> nn.Module:
    """Run a model's attention as SageBwd, in place, keeping its classes and Parameters.

    Every selected module gets an :class:`~sage_lightning.layer.AttentionLayerState` (``module.sage_attention_state``,
    named by its module path) and from then on each ``scaled_dot_product_attention`` call made inside it is
    served by ``sage_attention`` at the layer's precision. A call the kernel cannot serve (an ``attn_mask``,
    ``dropout_p > 0``, a head dim or dtype it refuses) runs PyTorch's SDPA unchanged, counted in the layer's
    ``fallback_calls`` and warned once per layer and reason, never silently wrong.

    Hugging Face ``transformers`` models (a ``PreTrainedModel`` anywhere in ``model``) are switched to the
    ``"sage"`` attention implementation registered in their ``AttentionInterface``; see
    :mod:`sage_lightning.hf`.

    Converting again changes nothing already swapped: layers keep their state (precision, counters); only
    newly selected modules are added. Change a layer's precision through its state instead.

    Args:
        model: the model, modified in place.
        filter_fn: ``filter_fn(module, fqn) -> bool`` picks the modules to swap, ``fqn`` their path in
            ``model`` (``""`` for ``model``). Default :func:`is_attention_module`: the innermost modules whose
            class name contains "Attention" or "Attn".
        precision: the starting precision of newly swapped layers; SageBwd defaults
            (``AttentionPrecision()``) when ``None``.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``filter_fn`` is not callable or returns a non-bool,
            ``precision`` is not an ``AttentionPrecision``.
        ValueError: no attention layer is found, or ``filter_fn`` selects a module inside another selected one
            (each SDPA call must belong to one layer).

    Example::

        import torch
        from sage_lightning import AttentionPrecision, attention_layers, convert_to_sage_attention

        model = MyTransformer()                        # any model whose attention calls SDPA
        optimizer = torch.optim.AdamW(model.parameters())
        convert_to_sage_attention(model)               # the optimizer stays valid: same Parameters
        convert_to_sage_attention(model, filter_fn=lambda m, fqn: fqn.startswith("blocks.0."))  # no-op here
        print(list(attention_layers(model)))           # ["blocks.0.attn", "blocks.1.attn", ...]
    """
    return _convert(model, filter_fn=filter_fn, precision=precision, caller="convert_to_sage_attention")


def _convert(
    model: nn.Module,
    *,
    filter_fn: FilterFn | None,
    precision: AttentionPrecision | None,
    caller: str,
    filter_name: str = "filter_fn",
    precision_name: str = "precision",
    hint: str = "",
) -> nn.Module:
    """:func:`convert_to_sage_attention`, with its error messages naming the caller's own arguments."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module; received {type(model).__name__}.")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(
            f"{caller}: {filter_name} must be a callable (module, fqn) -> bool or None for the default "
            f"(innermost modules whose class name contains 'Attention' or 'Attn'); received "
            f"{type(filter_fn).__name__}."
        )
    if precision is not None and not isinstance(precision, AttentionPrecision):
        raise TypeError(
            f"{caller}: {precision_name} must be a sage_lightning.AttentionPrecision or None (SageBwd "
            f"defaults); received {type(precision).__name__}."
        )
    chosen = is_attention_module if filter_fn is None else filter_fn
    precision = AttentionPrecision() if precision is None else precision

    selected: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if STATE_ATTRIBUTE in module.__dict__:
            continue  # already swapped: converting again changes nothing
        keep = chosen(module, fqn)
        if not isinstance(keep, bool):
            raise TypeError(
                f"{caller}: {filter_name} must return True or False; received {keep!r} for module "
                f"{fqn or type(model).__name__!r} ({type(module).__name__})."
            )
        if keep:
            selected.append((fqn, module))
    _refuse_nesting(model, [module for _, module in selected], caller, filter_name)

    registry_served: set[int] = set()
    if "transformers" in sys.modules and any(_from_transformers(module) for module in model.modules()):
        # A transformers model can only exist once transformers is imported, so the integration loads only
        # then, and only for a model that holds one: transformers stays optional.
        from sage_lightning import hf

        registry_served = hf.route_through_registry(model, [module for _, module in selected])

    for fqn, module in selected:
        state = AttentionLayerState(fqn or type(module).__name__, precision)
        module.__dict__[STATE_ATTRIBUTE] = state
        if id(module) not in registry_served:
            module.__dict__["forward"] = _InterceptedForward(module, module.__dict__.get("forward"))

    if not attention_layers(model):
        raise ValueError(
            f"{caller}: {filter_name} found no attention layer in {type(model).__name__}; received "
            f"{filter_name}={_describe(filter_fn)}. The default picks "
            "the innermost modules whose class name contains 'Attention' or 'Attn'; pass a "
            f"{filter_name}(module, fqn) -> bool that returns True for the modules that call "
            f"torch.nn.functional.scaled_dot_product_attention.{hint}"
        )
    return model


def _from_transformers(module: nn.Module) -> bool:
    # By the classes' modules rather than isinstance(PreTrainedModel): no lazy transformers import is triggered.
    return any(klass.__module__.startswith("transformers.") for klass in type(module).__mro__)


def _describe(filter_fn: FilterFn | None) -> str:
    if filter_fn is None:
        return "None (the default)"
    # A qualified name, not repr(): a bound method's repr prints the whole model.
    return getattr(filter_fn, "__qualname__", None) or repr(filter_fn)


def _refuse_nesting(model: nn.Module, selected: list[nn.Module], caller: str, filter_name: str) -> None:
    # Nested layers would make one SDPA call belong to two states (and each would catch the other's kernel ops).
    layers = {id(m): m for m in model.modules() if STATE_ATTRIBUTE in m.__dict__}
    layers.update({id(m): m for m in selected})
    paths = {id(m): fqn or type(model).__name__ for fqn, m in model.named_modules()}
    for outer in layers.values():
        for inner in outer.modules():
            if inner is not outer and id(inner) in layers:
                raise ValueError(
                    f"{caller}: {filter_name} selects {paths[id(inner)]!r} inside {paths[id(outer)]!r}, which is "
                    f"swapped too; received {filter_name} that returns True for both. Each "
                    "scaled_dot_product_attention call belongs to one layer: select the module that makes the "
                    "call, not the blocks around it."
                )
