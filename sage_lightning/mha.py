"""``torch.nn.MultiheadAttention`` (and the ``nn.TransformerEncoderLayer``/``DecoderLayer`` that hold it), served.

Its forward cannot be caught the way other modules are: ``F.multi_head_attention_forward`` hands itself to the
active ``TorchFunctionMode`` before it reaches its SDPA call, so the SDPA call inside runs unseen. A swapped
``nn.MultiheadAttention`` therefore gets :class:`MultiheadAttentionForward` as its instance ``forward``: the
same projections as PyTorch's attention (its own ``in_proj``/``out_proj`` Parameters), with the attention step
sent to the layer's state. What that path cannot express runs the module's own forward, counted as a fallback
with its reason: attention weights asked for (``need_weights=True``, the module's default; the Transformer
layers pass ``False``), a ``key_padding_mask``, an ``attn_mask`` without the ``is_causal`` hint, ``bias_k``/
``bias_v``, ``add_zero_attn``, unbatched input.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from sage_lightning.interception import WrappedForward
from sage_lightning.layer import STATE_ATTRIBUTE, AttentionLayerState


class MultiheadAttentionForward(WrappedForward):
    """A swapped ``nn.MultiheadAttention``'s ``forward``: PyTorch's computation, its attention step served.

    Same arguments and return value as ``nn.MultiheadAttention.forward``; a served call returns ``(output,
    None)``, as PyTorch does with ``need_weights=False``. In ``mode="full"`` the result is bit-identical to the
    module's own forward.

    Args:
        module: the ``nn.MultiheadAttention``.
        original: an instance-level ``forward`` installed before (kept and used for the calls not served), or
            ``None`` for the class's.

    Example::

        layer = nn.TransformerEncoderLayer(64, 4, dropout=0.0, batch_first=True)
        convert_to_sage_attention(layer)            # swaps layer.self_attn through this adapter
        layer(x, src_mask=causal, is_causal=True)   # served with is_causal=True
    """

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.module
        state: AttentionLayerState = module.__dict__[STATE_ATTRIBUTE]
        reason = unserved_reason(module, query, key_padding_mask, need_weights, attn_mask, is_causal)
        if reason is not None:
            state.count_unserved(reason)
            return self._call(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        return _served_forward(module, state, query, key, value, is_causal), None

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._target())


def unserved_reason(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    need_weights: bool,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
) -> str | None:
    """Why a ``nn.MultiheadAttention`` call cannot go through the served path (``None`` when it can).

    Args:
        module: the module.
        query, key_padding_mask, need_weights, attn_mask, is_causal: the call's arguments.

    Example::

        unserved_reason(mha, x, None, True, None, False)   # "need_weights=True (...)"
    """
    if need_weights:
        return "nn.MultiheadAttention called with need_weights=True (its default; pass need_weights=False)"
    if key_padding_mask is not None:
        return "nn.MultiheadAttention called with a key_padding_mask"
    if attn_mask is not None and not is_causal:
        return "nn.MultiheadAttention called with an attn_mask and is_causal=False"
    if attn_mask is None and is_causal:
        return "nn.MultiheadAttention called with is_causal=True and no attn_mask (PyTorch requires the mask)"
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return "nn.MultiheadAttention with bias_k, bias_v or add_zero_attn"
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or query.is_nested:
        return "nn.MultiheadAttention called with unbatched or nested input"
    return None


def _served_forward(
    module: nn.MultiheadAttention,
    state: AttentionLayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
) -> torch.Tensor:
    # F.multi_head_attention_forward's steps for need_weights=False and no masks, in its order and layout,
    # so mode="full" reproduces it bit for bit.
    if module.batch_first:
        # Keep `query is key is value` where it holds: the packed projection then runs one matmul, as PyTorch's.
        if key is value:
            if query is key:
                query = key = value = query.transpose(1, 0)
            else:
                query, key = (x.transpose(1, 0) for x in (query, key))
                value = key
        else:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    tgt_len, bsz, embed_dim = query.shape
    heads, head_dim = module.num_heads, module.head_dim
    if module._qkv_same_embed_dim:
        q, k, v = F._in_projection_packed(query, key, value, module.in_proj_weight, module.in_proj_bias)
    else:
        b_q, b_k, b_v = (None, None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
        q, k, v = F._in_projection(
            query, key, value, module.q_proj_weight, module.k_proj_weight, module.v_proj_weight, b_q, b_k, b_v
        )
    q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1).view(bsz, heads, tgt_len, head_dim)
    k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
    src_len = k.size(1)
    k, v = k.view(bsz, heads, src_len, head_dim), v.view(bsz, heads, src_len, head_dim)
    dropout_p = module.dropout if module.training else 0.0
    out = state.scaled_dot_product_attention(q, k, v, None, dropout_p, is_causal)
    out = out.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)
    out = F.linear(out, module.out_proj.weight, module.out_proj.bias)
    out = out.view(tgt_len, bsz, out.size(1))
    return out.transpose(1, 0) if module.batch_first else out


#: Why a ``nn.TransformerEncoderLayer`` call made no call of its swapped ``self_attn``.
FAST_PATH_REASON = (
    "nn.TransformerEncoderLayer's inference fast path, which never calls self_attn "
    "(torch.backends.mha.set_fastpath_enabled(False) sends it through self_attn)"
)


def watch_encoder_layers(model: nn.Module) -> None:
    """Count the calls of ``nn.TransformerEncoderLayer`` that bypass their swapped ``self_attn``.

    In inference (``eval()`` without gradients) PyTorch's encoder layer can run a fused kernel with the attention's
    weights instead of calling ``self_attn``, which would leave the layer looking served. A pair of forward hooks on
    the encoder layer counts each call that made no call of ``self_attn`` as one not served, with
    :data:`FAST_PATH_REASON` (warned once). PyTorch (2.11 to 2.13) does not take that fast path for a layer with
    hooks, so in practice the hooks send inference through ``self_attn``, served like training; the count is there
    for a PyTorch that would. Installed once per encoder layer; calls under ``torch.compile`` are not watched.

    Args:
        model: the converted model.

    Example::

        model = convert_to_sage_attention(nn.TransformerEncoder(layer, 2))   # watched by the conversion
    """
    for module in model.modules():
        if not isinstance(module, nn.TransformerEncoderLayer) or getattr(module, "_sage_fast_path_watched", False):
            continue
        state = module.self_attn.__dict__.get(STATE_ATTRIBUTE)
        if state is None:
            continue
        before: list[int] = []

        def start(_module: nn.Module, _args: object, state: AttentionLayerState = state, before: list = before) -> None:
            if not torch.compiler.is_compiling():
                before.append(state.calls)

        def end(_module: nn.Module, _args: object, _out: object, state=state, before=before) -> None:  # noqa: ANN001
            if before and not torch.compiler.is_compiling() and state.calls == before.pop():
                state.count_unserved(FAST_PATH_REASON)

        module.register_forward_pre_hook(start)
        module.register_forward_hook(end)
        module._sage_fast_path_watched = True
