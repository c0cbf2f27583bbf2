"""A stand-in for autograd's ``ctx`` that records what an operator's ``setup_context`` asks of it (shared by
``test_triton_kernels.py`` and ``test_attn_qat.py``)."""

from __future__ import annotations


class RecordingCtx:
    """Records ``save_for_backward``, ``mark_non_differentiable`` (the number of tensors each) and
    ``set_materialize_grads`` (the value) as ``(name, value)`` pairs in :attr:`calls`.

    Example::

        ctx = RecordingCtx()
        ops._setup_context(ctx, inputs, outputs)
        assert ("materialize", False) in ctx.calls
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def save_for_backward(self, *tensors: object) -> None:
        self.calls.append(("save", len(tensors)))

    def mark_non_differentiable(self, *tensors: object) -> None:
        self.calls.append(("non-differentiable", len(tensors)))

    def set_materialize_grads(self, value: bool) -> None:
        self.calls.append(("materialize", value))
