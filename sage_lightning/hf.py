"""Hugging Face ``transformers`` models through their attention-function registry (the optional ``hf`` extra).

``transformers`` attention modules do not call SDPA themselves: their forward looks up
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` and calls the function found there
with the module as its first argument. We register one more, ``"sage"``: it runs transformers' own
``sdpa_attention_forward`` (so its calling convention stays theirs: ``is_causal`` derived from the module and
the mask, GQA through ``enable_gqa``, cache slicing, position-bias masks) with the module's layer state
catching the SDPA call it makes. The state lives on the attention module (``module.sage_attention_state``),
which is exactly the ``module`` argument the registry passes.

What it means for masks: transformers builds the ``"sage"`` masks with its SDPA mask function, so a batch
without padding gets no mask and ``is_causal=True`` (served by SageBwd), and a padded batch gets a boolean
mask (sent to SDPA for that call, counted, warned once). A continuation over a cache gets a mask aligned to the
last keys (bottom-right), which the kernel's top-left causal mask is not: sent to SDPA too, unless it keeps every
key (served).

This module imports ``transformers``; :func:`~sage_lightning.convert_to_sage_attention` loads it only when
``transformers`` is already imported, so the dependency stays optional.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as error:  # absent, or older than the attention and mask registries
    raise ImportError(
        "sage_lightning.hf: swapping a Hugging Face model needs transformers>=5.23 "
        f'(pip install "sage-lightning[hf]"); importing it failed: {error}'
    ) from error

from sage_lightning.interception import SDPAInterceptor
from sage_lightning.layer import STATE_ATTRIBUTE

#: The name of SageBwd attention in transformers' ``AttentionInterface`` (and ``config._attn_implementation``).
#: It must not contain "sdpa", "flash" or "flex": transformers checks implementations by substring.
SAGE_ATTENTION_NAME = "sage"


def sage_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"sage"`` attention function: transformers' SDPA attention, its SDPA call served by the layer's state.

    A module without a state (left out by ``filter_fn``) runs transformers' SDPA attention unchanged.

    Args:
        module: the attention module (transformers passes ``self``).
        query, key, value: ``[batch, heads, seq, head_dim]``, as transformers passes them.
        attention_mask: the mask from transformers' SDPA mask function, or ``None``.
        **kwargs: ``dropout``, ``scaling``, ``is_causal`` and the rest of transformers' attention kwargs.

    Returns:
        ``(attn_output [batch, seq, heads, head_dim], None)``, as ``sdpa_attention_forward``.

    Example::

        from sage_lightning.hf import register_sage_attention

        register_sage_attention()
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sage")
    """
    state = module.__dict__.get(STATE_ATTRIBUTE)
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with SDPAInterceptor(state):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_sage_attention() -> str:
    """Register ``"sage"`` in transformers' attention and mask registries (idempotent).

    The mask registration matters: transformers treats an implementation without a mask function as a custom
    kernel that needs no mask and drops the padding mask, which would silently attend to padding.

    Returns:
        The registered name, ``"sage"``.

    Example::

        from sage_lightning.hf import register_sage_attention

        model.set_attn_implementation(register_sage_attention())
    """
    AttentionInterface.register(SAGE_ATTENTION_NAME, sage_attention_forward)
    AttentionMaskInterface.register(SAGE_ATTENTION_NAME, sdpa_mask)
    return SAGE_ATTENTION_NAME


def route_through_registry(model: nn.Module, selected: list[nn.Module]) -> set[int]:
    """Switch the transformers models in ``model`` that hold a selected module to ``"sage"``.

    Args:
        model: the model being converted (a ``PreTrainedModel``, or a module holding some).
        selected: the modules chosen for swapping.

    Returns:
        The ``id()`` of every selected module the registry now serves: an attention module whose forward
        calls the registry and whose config now says ``"sage"``. The others (a model that cannot switch, a
        block chosen by a custom filter) are swapped by wrapping their forward, which catches the same call.
    """
    selected_ids = {id(module) for module in selected}
    switched: set[int] = set()
    for pretrained in _outermost_pretrained_models(model):
        if not any(id(module) in selected_ids for module in pretrained.modules()):
            continue  # nothing of it is swapped: its attention stays what the user chose
        register_sage_attention()
        if pretrained.config._attn_implementation != SAGE_ATTENTION_NAME:
            # Models that cannot switch log a warning and keep their implementation; their modules are
            # then wrapped instead (below).
            pretrained.set_attn_implementation(SAGE_ATTENTION_NAME)
        switched.update(id(module) for module in pretrained.modules())
    return {
        id(module)
        for module in selected
        if id(module) in switched
        and getattr(getattr(module, "config", None), "_attn_implementation", None) == SAGE_ATTENTION_NAME
        and _forward_calls_registry(type(module))
    }


def _outermost_pretrained_models(model: nn.Module) -> list[PreTrainedModel]:
    found: list[PreTrainedModel] = []
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not any(module in outer.modules() for outer in found):
            found.append(module)
    return found


@functools.cache
def _forward_calls_registry(cls: type) -> bool:
    # The same test transformers applies to decide whether a model can switch implementations: the attention
    # forward looks the function up in ALL_ATTENTION_FUNCTIONS. Unreadable source reads as "no", which is the
    # safe answer (the module is then wrapped, and the wrapper catches the call either way).
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source
