"""Boolean attention masks the kernel computes itself: the top-left causal mask, and the mask that keeps all.

litgpt's KV-cache prefill passes the top-left causal mask as a boolean tensor, each decode step an all-true one;
models that keep a causal mask buffer pass slices of it. Such a call is served by the kernel
(``is_causal=True``, or no mask). Reading a mask's values needs its contents on the host (one sync), so the
answer is remembered per mask: by the tensor that owns its memory (held weakly, so freed memory is never
mistaken for the same mask), the view's offset, shape and strides, and the memory's version counter (bumped by
every in-place write). A mask kept and sliced each step costs one sync in its lifetime; a mask built afresh each
forward costs one sync per forward, shared by every layer that receives it.
"""

from __future__ import annotations

import weakref

import torch

#: What a recognised mask is served as.
CAUSAL = "causal"
ALL_TRUE = "all"

# id(owner) -> (weak reference to owner, {view and version key: answer}).
_SEEN: dict[int, tuple[weakref.ref, dict[tuple, str | None]]] = {}
_MAX_VIEWS_PER_OWNER = 64


def kernel_mask(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> str | None:
    """Whether a boolean ``attn_mask`` is one the kernel computes: :data:`CAUSAL`, :data:`ALL_TRUE` or ``None``.

    Args:
        mask: SDPA's ``attn_mask`` (``True`` = attend), any shape that broadcasts to ``shape``.
        shape: the scores' shape ``(batch, q_heads, seq_q, seq_k)``.

    Returns:
        :data:`CAUSAL` when every broadcast slice equals the top-left lower triangle of ``seq_q x seq_k`` (SDPA's
        ``is_causal=True``; the kernel's causal mask), :data:`ALL_TRUE` when it is all true, ``None`` otherwise
        (a float mask, a padding or sliding-window mask, a shape that does not broadcast).

    Example::

        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        assert kernel_mask(causal, (2, 4, 8, 8)) == CAUSAL
        assert kernel_mask(causal[:1], (2, 4, 1, 8)) is None   # a decode row over 8 keys: one allowed
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.is_sparse or mask.is_nested:
        return None
    try:
        if torch.broadcast_shapes(mask.shape, shape) != torch.Size(shape):
            return None
    except RuntimeError:
        return None
    if mask.numel() == 0:
        return None
    owner = mask if mask._base is None else mask._base
    if mask.is_inference():  # inference tensors have no version counter: nothing can be remembered safely
        return _classify(mask, shape)
    key = (mask.storage_offset(), tuple(mask.shape), mask.stride(), owner._version, shape[2], shape[3])
    ident = id(owner)
    entry = _SEEN.get(ident)
    if entry is None or entry[0]() is not owner:
        entry = (weakref.ref(owner, lambda ref: _forget(ident, ref)), {})
        _SEEN[ident] = entry
    answers = entry[1]
    if key not in answers:
        if len(answers) >= _MAX_VIEWS_PER_OWNER:
            answers.clear()
        answers[key] = _classify(mask, shape)
    return answers[key]


def _classify(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> str | None:
    seq_q, seq_k = shape[2], shape[3]
    causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).tril()
    with torch.no_grad():
        # One host sync for both answers.
        all_true, is_causal = torch.stack([mask.all(), (mask == causal).all()]).tolist()
    if all_true:
        return ALL_TRUE
    return CAUSAL if is_causal else None


def _forget(ident: int, ref: weakref.ref) -> None:
    entry = _SEEN.get(ident)
    if entry is not None and entry[0] is ref:
        del _SEEN[ident]
