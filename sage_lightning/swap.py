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

``torch.nn.MultiheadAttention`` (inside ``nn.TransformerEncoderLayer`` and friends) is served through an adapter of
its own (:mod:`sage_lightning.mha`): its functional form cannot be caught this way.

``torch.compile`` traces the wrapper, the mode and the routing without a graph break, served and falling-back
calls alike (tested with ``fullgraph=True`` and ``False``); the counters and warnings are kept outside the traced
region (:mod:`sage_lightning.ledger`), so they count each call once and cost no recompile. The layer's precision
is read as a guarded attribute, so assigning a new one costs one recompile.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sage_lightning.interception import SDPAInterceptor, WrappedForward
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import STATE_ATTRIBUTE, AttentionLayerState, attention_layers, check_precision
from sage_lightning.ledger import FORWARD_END, FORWARD_START, record
from sage_lightning.mha import MultiheadAttentionForward, watch_encoder_layers

FilterFn = Callable[[nn.Module, str], bool]

#: Class-name fragments (case-insensitive) that mark an attention module for the default filter.
ATTENTION_NAME_PARTS: tuple[str, ...] = ("attention", "attn")


class NoAttentionLayerError(ValueError):
    """:func:`convert_to_sage_attention` found nothing to swap (a ``ValueError``; callers may reword it)."""


class _InterceptedForward(WrappedForward):
    """A swapped module's ``forward``: the original one, run inside the layer's :class:`SDPAInterceptor`. The state
    is read from the module at each call, so a copy uses its own."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state: AttentionLayerState = self.module.__dict__[STATE_ATTRIBUTE]
        # A training forward that makes no attention call is warned about (once): the layer is swapped for nothing.
        training = self.module.training and torch.is_grad_enabled()
        if training:
            record(state, state.ledger_key, FORWARD_START)
        with SDPAInterceptor(state):
            out = self._call(*args, **kwargs)
        if training:
            record(state, state.ledger_key, FORWARD_END)
        return out

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
    served by ``sage_attention`` at the layer's precision. A call the kernel cannot serve (an ``attn_mask`` other
    than a boolean causal or all-true one, ``dropout_p > 0``, a head dim or dtype it refuses) runs PyTorch's SDPA
    unchanged, counted in the layer's ``fallback_calls`` and warned once per layer and reason, never silently
    wrong. ``nn.MultiheadAttention``
    modules (and so ``nn.TransformerEncoderLayer``'s ``self_attn``) are served through
    :mod:`sage_lightning.mha`. A swapped layer whose training forward makes no attention call is warned about
    once (:class:`~sage_lightning.layer.SilentAttentionWarning`).

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
            ``precision`` is not an ``AttentionPrecision`` (or holds a field that is not a plain ``str``/``bool``).
        ValueError: no attention layer is found (:class:`NoAttentionLayerError`), ``filter_fn`` selects a module
            inside another selected one (each SDPA call must belong to one layer), or a module that holds an
            ``nn.MultiheadAttention`` (select the ``MultiheadAttention`` itself: it is served).

    Example::

        import torch
        from sage_lightning import AttentionPrecision, attention_layers, convert_to_sage_attention

        model = MyTransformer()                        # any model whose attention calls SDPA
        optimizer = torch.optim.AdamW(model.parameters())
        convert_to_sage_attention(model)               # the optimizer stays valid: same Parameters
        convert_to_sage_attention(model, filter_fn=lambda m, fqn: fqn.startswith("blocks.0."))  # no-op here
        print(list(attention_layers(model)))           # ["blocks.0.attn", "blocks.1.attn", ...]
    """
    caller = "convert_to_sage_attention"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module; received {type(model).__name__}.")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(
            f"{caller}: filter_fn must be a callable (module, fqn) -> bool or None for the default "
            f"(innermost modules whose class name contains 'Attention' or 'Attn'); received "
            f"{type(filter_fn).__name__}."
        )
    if precision is not None:
        check_precision(precision, f"{caller}: precision")
    chosen = is_attention_module if filter_fn is None else filter_fn
    precision = AttentionPrecision() if precision is None else precision

    selected: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if STATE_ATTRIBUTE in module.__dict__:
            continue  # already swapped: converting again changes nothing
        keep = chosen(module, fqn)
        if not isinstance(keep, bool):
            raise TypeError(
                f"{caller}: filter_fn must return True or False; received {keep!r} for module "
                f"{fqn or type(model).__name__!r} ({type(module).__name__})."
            )
        if keep:
            selected.append((fqn, module))
    _refuse_nesting(model, [module for _, module in selected], caller)
    _refuse_hidden_multihead(model, [module for _, module in selected], caller)

    registry_served: set[int] = set()
    if "transformers" in sys.modules and any(_from_transformers(module) for module in model.modules()):
        # A transformers model can only exist once transformers is imported, so the integration loads only
        # then, and only for a model that holds one: transformers stays optional.
        from sage_lightning import hf

        registry_served = hf.route_through_registry(model, [module for _, module in selected])

    for fqn, module in selected:
        state = AttentionLayerState(fqn or type(module).__name__, precision)
        module.__dict__[STATE_ATTRIBUTE] = state
        if id(module) in registry_served:
            continue
        wrapper = MultiheadAttentionForward if isinstance(module, nn.MultiheadAttention) else _InterceptedForward
        module.__dict__["forward"] = wrapper(module, module.__dict__.get("forward"))
    watch_encoder_layers(model)

    if not attention_layers(model):
        raise NoAttentionLayerError(
            f"{caller}: filter_fn found no attention layer in {type(model).__name__}; received "
            f"filter_fn={_describe(filter_fn)}. The default picks the innermost modules whose class name contains "
            "'Attention' or 'Attn'; pass a filter_fn(module, fqn) -> bool that returns True for the modules that "
            "call torch.nn.functional.scaled_dot_product_attention."
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


def _refuse_nesting(model: nn.Module, selected: list[nn.Module], caller: str) -> None:
    # Nested layers would make one SDPA call belong to two states (and each would catch the other's kernel ops).
    layers = {id(m): m for m in model.modules() if STATE_ATTRIBUTE in m.__dict__}
    layers.update({id(m): m for m in selected})
    paths = {id(m): fqn or type(model).__name__ for fqn, m in model.named_modules()}
    for outer in layers.values():
        for inner in outer.modules():
            if inner is not outer and id(inner) in layers:
                raise ValueError(
                    f"{caller}: filter_fn selects {paths[id(inner)]!r} inside {paths[id(outer)]!r}, which is "
                    "swapped too; received filter_fn that returns True for both. Each "
                    "scaled_dot_product_attention call belongs to one layer: select the module that makes the "
                    "call, not the blocks around it."
                )


def _refuse_hidden_multihead(model: nn.Module, selected: list[nn.Module], caller: str) -> None:
    # An nn.MultiheadAttention inside a selected module would run its attention where no wrapper can see it.
    paths = {id(m): fqn or type(model).__name__ for fqn, m in model.named_modules()}
    for outer in selected:
        if isinstance(outer, nn.MultiheadAttention):
            continue
        for inner in outer.modules():
            if isinstance(inner, nn.MultiheadAttention):
                raise ValueError(
                    f"{caller}: filter_fn selects {paths[id(outer)]!r}, which holds the nn.MultiheadAttention "
                    f"{paths[id(inner)]!r}; received a filter_fn that returns True for {paths[id(outer)]!r}. "
                    "Its attention runs in torch.nn.functional.multi_head_attention_forward, where a wrapper around "
                    f"{paths[id(outer)]!r} cannot serve it: select {paths[id(inner)]!r} itself (the default "
                    "filter does), which is served."
                )
