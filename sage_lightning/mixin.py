"""``SageAttentionMixin``: a LightningModule whose attention runs as SageBwd."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from sage_lightning.console import attention_summary
from sage_lightning.kernels import AttentionPrecision
from sage_lightning.layer import attention_layers, check_precision
from sage_lightning.layer_checkpoint import CHECKPOINT_KEY, load_layers, save_layers
from sage_lightning.swap import NoAttentionLayerError, convert_to_sage_attention, is_attention_module

# Where Lightning's own no-op ``configure_model`` lives; a mixin listed after it would never run.
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning")


class SageAttentionMixin:
    """Swap a LightningModule's attention to SageBwd in ``configure_model``.

    List it before ``LightningModule`` in the bases. Lightning calls ``configure_model`` once per
    fit/validate/test/predict, after ``__init__`` and before the optimizers are built; the mixin first calls
    ``super().configure_model()`` (cooperative, so your own ``configure_model`` can build the model first and
    then call ``super().configure_model()``) and then runs
    :func:`~sage_lightning.convert_to_sage_attention` on the whole module. Converting is idempotent, so the
    repeated calls change nothing, and it keeps every Parameter, so checkpoints and optimizers are unaffected.

    Two knobs, set on the class or on the instance in ``__init__``:

    * ``sage_precision``: the starting :class:`~sage_lightning.AttentionPrecision` of every layer
      (``None``: SageBwd defaults);
    * ``sage_attention_filter(module, fqn) -> bool``: a method choosing the modules to swap; the default
      picks the innermost modules whose class name contains "Attention" or "Attn".

    The swapped layers are then ``sage_lightning.attention_layers(self)``; ``AdaptivePrecision`` reads and
    steers them. Their precisions are saved in checkpoints (``on_save_checkpoint``, under ``"sage_attention"``) and
    restored on load (``on_load_checkpoint``), so a resume keeps the controller's escalations even without the
    callback; if you override these hooks, call ``super()``.

    Raises:
        TypeError: at class creation, when the mixin comes after ``LightningModule`` in the bases (Lightning's
            ``configure_model`` would hide it); in ``configure_model``, when ``sage_precision`` is not an
            ``AttentionPrecision`` or the filter returns a non-bool.
        ValueError: in ``configure_model``, when no attention layer is found; in ``on_load_checkpoint``, when the
            checkpoint's attention layers are not the model's.

    Example::

        import lightning as L
        from sage_lightning import AttentionPrecision, SageAttentionMixin

        class GPTModule(SageAttentionMixin, L.LightningModule):
            sage_precision = AttentionPrecision(ds="bf16")     # optional: start with dS in bf16

            def __init__(self):
                super().__init__()
                self.model = GPT()                              # attention modules call SDPA

            def sage_attention_filter(self, module, fqn):       # optional: leave the first block alone
                return super().sage_attention_filter(module, fqn) and not fqn.startswith("model.blocks.0.")
    """

    #: Starting precision of the swapped layers; ``None`` for SageBwd defaults.
    sage_precision: AttentionPrecision | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for klass in cls.__mro__:
            if klass is SageAttentionMixin:
                return
            if "configure_model" in vars(klass) and klass.__module__.split(".")[0] in _LIGHTNING_PACKAGES:
                bases = ", ".join(base.__name__ for base in cls.__bases__)
                raise TypeError(
                    f"SageAttentionMixin: list it before LightningModule in the bases of {cls.__name__}, as in "
                    f"class {cls.__name__}(SageAttentionMixin, LightningModule); received bases ({bases}), where "
                    f"{klass.__qualname__}.configure_model would hide the mixin's."
                )

    def sage_attention_filter(self, module: nn.Module, fqn: str) -> bool:
        """Whether to swap ``module`` (at path ``fqn`` in this LightningModule). Override to choose.

        Args:
            module: a candidate module.
            fqn: its path, e.g. ``"model.blocks.3.attn"``.

        Returns:
            The default: :func:`~sage_lightning.swap.is_attention_module` (innermost modules whose class name
            contains "Attention" or "Attn").
        """
        return is_attention_module(module, fqn)

    def configure_model(self) -> None:
        """Lightning's hook: the parent's ``configure_model``, then the attention swap (idempotent).

        Raises:
            TypeError: ``sage_precision`` is not an ``AttentionPrecision`` or ``None``.
            ValueError: no attention layer was found.
        """
        parent = getattr(super(), "configure_model", None)
        if parent is not None:
            parent()
        if not isinstance(self, nn.Module):
            raise TypeError(
                "SageAttentionMixin: must be mixed into a LightningModule, as in "
                f"class MyModel(SageAttentionMixin, LightningModule); received {type(self).__name__}, which is not "
                "a torch.nn.Module."
            )
        caller = "SageAttentionMixin.configure_model"
        if self.sage_precision is not None:
            check_precision(self.sage_precision, f"{caller}: sage_precision")

        def chosen(module: nn.Module, fqn: str) -> bool:
            keep = self.sage_attention_filter(module, fqn)
            if not isinstance(keep, bool):
                raise TypeError(
                    f"{caller}: sage_attention_filter must return True or False; received {keep!r} for module "
                    f"{fqn or type(self).__name__!r} ({type(module).__name__})."
                )
            return keep

        try:
            convert_to_sage_attention(self, filter_fn=chosen, precision=self.sage_precision)
        except NoAttentionLayerError as error:
            raise NoAttentionLayerError(
                f"{caller}: sage_attention_filter found no attention layer in {type(self).__name__}. The default "
                "picks the innermost modules whose class name contains 'Attention' or 'Attn'; override "
                "sage_attention_filter(module, fqn) to return True for the modules that call "
                "torch.nn.functional.scaled_dot_product_attention. If you build the model in your own "
                "configure_model, build it first and call super().configure_model() after."
            ) from error

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Lightning's hook: after the first training batch, warn once for each swapped layer that made no call.

        A layer can be swapped and never reach ``scaled_dot_product_attention`` (attention computed by hand, a
        module that is never called): its precision and signals would then mean nothing. Each such layer gets one
        :class:`~sage_lightning.layer.SilentAttentionWarning`. If you override this hook, call
        ``super().on_train_batch_end(outputs, batch, batch_idx)``.
        """
        parent = getattr(super(), "on_train_batch_end", None)
        if parent is not None:
            parent(outputs, batch, batch_idx)
        if getattr(self, "_sage_checked_calls", False):
            return
        self._sage_checked_calls = True
        for layer in attention_layers(self).values():
            if layer.calls == 0:
                layer.warn_if_silent("it made no attention call in the first training batch")

    def on_train_end(self) -> None:
        """Lightning's hook: the parent's, then, when the Trainer has no ``AdaptivePrecision`` (which prints its own),
        one line on what ran: the layers served by SageBwd and the calls sent to SDPA, with why
        (:func:`~sage_lightning.attention_summary`). If you override this hook, call ``super().on_train_end()``.
        """
        parent = getattr(super(), "on_train_end", None)
        if parent is not None:
            parent()
        from sage_lightning.callback import AdaptivePrecision  # the callback imports this module

        trainer = getattr(self, "_trainer", None)
        if trainer is not None and not any(isinstance(cb, AdaptivePrecision) for cb in trainer.callbacks):
            rank_zero_info(attention_summary(self))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning's hook: the parent's, then every attention layer's precision into the checkpoint."""
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        checkpoint[CHECKPOINT_KEY] = save_layers(self, self.sage_precision)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning's hook: the parent's, then every attention layer back at the checkpoint's precision (a warning
        when ``sage_precision`` differs from the one the checkpoint was trained from).

        Raises:
            ValueError: the checkpoint's attention layers are not the model's.
        """
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        if CHECKPOINT_KEY in checkpoint:  # absent from checkpoints written before the mixin saved it
            load_layers(
                self, checkpoint[CHECKPOINT_KEY], self.sage_precision, owner=f"{type(self).__name__}.on_load_checkpoint"
            )
