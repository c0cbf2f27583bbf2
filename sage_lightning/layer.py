"""One swapped attention layer: its name, its precision, its signals, and the per-call routing.

:func:`~sage_lightning.convert_to_sage_attention` gives every attention layer it swaps an
:class:`AttentionLayerState`, kept on the module as ``module.sage_attention_state``. Each
``scaled_dot_product_attention`` call made inside that module lands in
:meth:`AttentionLayerState.scaled_dot_product_attention`, which serves it with SageBwd at the layer's current
precision or, when the kernel cannot serve it, sends it to PyTorch's SDPA (counted and warned once per reason).
The controller (``AdaptivePrecision``) reads the signals through the ``take_*`` methods and turns the levers by
assigning :attr:`AttentionLayerState.precision`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from sage_lightning.forward_health import qk_quant_error
from sage_lightning.interception import bind_sdpa_arguments
from sage_lightning.kernels import AttentionPrecision, UnsupportedAttention, sage_attention
from sage_lightning.kernels.interface import MAX_TRITON_HEAD_DIM
from sage_lightning.kernels.reference import exact_attention
from sage_lightning.ledger import FALLBACK_PREFIX, FORWARD_END, FORWARD_START, SERVED, record, register
from sage_lightning.masks import CAUSAL, kernel_mask
from sage_lightning.noise import noise_sums

#: The attribute of a swapped module that holds its :class:`AttentionLayerState`.
STATE_ATTRIBUTE = "sage_attention_state"

# Probe metrics are computed per output, in this order.
_PROBED_OUTPUTS = ("O", "dQ", "dK", "dV")


class AttentionFallbackWarning(UserWarning):
    """An attention call went to PyTorch's SDPA instead of SageBwd (warned once per layer and reason).

    Example::

        import warnings
        from sage_lightning.layer import AttentionFallbackWarning

        warnings.filterwarnings("ignore", category=AttentionFallbackWarning)  # counted all the same
    """


class SilentAttentionWarning(UserWarning):
    """A swapped attention layer made no attention call: nothing in it runs SageBwd (warned once per layer).

    Example::

        import warnings
        from sage_lightning.layer import SilentAttentionWarning

        warnings.filterwarnings("error", category=SilentAttentionWarning)  # make it fatal in CI
    """


class ReferenceAttentionWarning(UserWarning):
    """A layer's head dim is larger than the Triton kernels take (:data:`MAX_TRITON_HEAD_DIM`, 128): its calls run
    SageBwd's PyTorch reference, on a GPU too: the same numerics, but slow and with the whole score matrix in
    memory (warned once per layer).

    Example::

        import warnings
        from sage_lightning.layer import ReferenceAttentionWarning

        warnings.filterwarnings("error", category=ReferenceAttentionWarning)  # refuse the slow path in CI
    """


@dataclasses.dataclass
class KeptCall:
    """One served call's inputs and output, kept while :attr:`AttentionLayerState.keep_calls` is on.

    Attributes:
        q, k, v: the inputs as the kernel got them (detached, not copied).
        out: the output, still in the autograd graph (so a caller can take the loss's gradient of it).
        is_causal: as served (a recognised causal mask reads ``True``).
        scale: the call's ``scale`` (``None``: ``1/sqrt(head_dim)``).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    is_causal: bool
    scale: float | None


@dataclasses.dataclass
class _ProbeCapture:
    """The inputs of one served call (its first sequences, or all) and, once its backward ran, the gradient that
    reached its output; ``sequences`` is the call's whole batch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    is_causal: bool
    scale: float | None
    precision: AttentionPrecision
    sequences: int
    grad_out: torch.Tensor | None = None


def _capture(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    bound: dict[str, Any],
    precision: AttentionPrecision,
    keep: int | None = None,
) -> _ProbeCapture:
    """Copies of a served call's first ``keep`` sequences (all where ``None``) and, through a hook on ``out``, of
    their share of the gradient that reaches it. Copies, not views: the caller may write into its q/k/v (a KV cache)
    after the call."""
    part = slice(None) if keep is None else slice(0, keep)
    capture = _ProbeCapture(
        q=q[part].detach().clone(),
        k=k[part].detach().clone(),
        v=v[part].detach().clone(),
        is_causal=bound["is_causal"],
        scale=None if bound["scale"] is None else float(bound["scale"]),
        precision=precision,
        sequences=q.shape[0],
    )

    def keep_grad_out(grad: torch.Tensor) -> None:
        capture.grad_out = grad[part].detach().clone()

    out.register_hook(keep_grad_out)
    return capture


class AttentionLayerState:
    """One swapped attention layer: its name, its precision, its signals. Kernels read it per call.

    Built by :func:`~sage_lightning.convert_to_sage_attention` (one per layer, reachable as
    ``module.sage_attention_state`` and through :func:`attention_layers`); there is rarely a reason to build one
    yourself.

    Signals cost nothing unless asked for: the dS error statistics are gathered only while
    :attr:`collect_stats` is on, the probe captures one call only after :meth:`arm_probe`, and the non-finite
    check is a few reductions per call into a device flag, read (one host sync) by :meth:`take_nonfinite`, taken
    on the device by :func:`take_nonfinite_flags` (what the controller does, every step) or dropped unread by
    :meth:`clear_nonfinite`.

    Args:
        name: the layer's module path, e.g. ``"blocks.3.attn"`` (the root module is named by its class).
        precision: how the layer runs; ``AttentionPrecision()`` (SageBwd defaults) when ``None``.
        collect_stats: start with the dS statistics on.

    Attributes:
        name: as above.
        precision: the layer's current :class:`~sage_lightning.kernels.AttentionPrecision`. Assign a new value
            to change it; the next call uses it (no reallocation).
        collect_stats: ``False``: ``sage_attention`` gets ``stats=None`` (free). ``True``: each backward adds
            into :attr:`stats`.
        stats: float32 ``(2,)`` = ``[sum (dS - deq(psi(dS)))^2, sum dS^2]``, created on the first call that
            collects, on that call's device; ``None`` before.
        forward_stats: float64 ``(4,)``, the forward's quantization health summed over the calls that collect
            (:func:`~sage_lightning.forward_health.qk_quant_error`); ``None`` before.
        calls: attention calls seen (served and sent to SDPA); a host-side counter.
        fallback_calls: calls sent to SDPA because the kernel cannot serve them.
        fallback_reasons: reason -> number of calls sent to SDPA for it.
        keep_calls: ``True``: every served call appends a :class:`KeptCall` (its inputs and output) to
            :attr:`kept_calls`, e.g. to capture a model's attention inputs at ``mode="full"`` (the accuracy
            harness does); the caller clears the list.
        kept_calls: as above.

    The counters are host-side and exact under ``torch.compile`` (``fullgraph=True`` included): they are
    updated outside the traced region (:mod:`sage_lightning.ledger`).

    Raises:
        TypeError: ``name`` not a string, ``precision`` not an ``AttentionPrecision``, ``collect_stats`` not a
            bool.

    Example::

        from sage_lightning import attention_layers, convert_to_sage_attention

        convert_to_sage_attention(model)
        layer = attention_layers(model)["blocks.0.attn"]
        layer.precision = layer.precision.replace(ds="bf16")  # the next call runs dS in bf16
        layer.collect_stats = True                            # the next backwards measure dS's INT8 error
    """

    def __init__(self, name: str, precision: AttentionPrecision | None = None, *, collect_stats: bool = False):
        if not isinstance(name, str) or not name:
            raise TypeError(f"AttentionLayerState: name must be a non-empty module path; received {name!r}.")
        self.name = name
        self.precision = AttentionPrecision() if precision is None else precision
        self.collect_stats = collect_stats
        self.stats: torch.Tensor | None = None
        self.forward_stats: torch.Tensor | None = None
        self.calls = 0
        self.fallback_calls = 0
        self.fallback_reasons: dict[str, int] = {}
        self._warned: set[str] = set()
        # True once a call handed the buffer to the kernel since the last take (host side, no sync).
        self._stats_given = False
        self._probe_armed = False
        self._capture: _ProbeCapture | None = None
        # Sequences to capture for the noise measurement (0: not armed), and the capture.
        self._noise_armed = 0
        self._noise_capture: _ProbeCapture | None = None
        # Born on the CPU so a compiled first call finds it and no recompile follows; a call on another device
        # moves it there once (one recompile under torch.compile).
        self._nonfinite: torch.Tensor = torch.zeros((), dtype=torch.bool)
        self.keep_calls = False
        self.kept_calls: list[KeptCall] = []
        self._calls_at_forward = 0
        self._warned_silent = False
        self._warned_reference = False
        self.ledger_key = register(self)

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "ledger_key"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (deepcopy, pickle) is a layer of its own: its compiled calls must find it, not the original.
        self.__dict__.update(state)
        self.__dict__.setdefault("_warned_reference", False)  # a state pickled before the warning existed
        self.__dict__.setdefault("_noise_armed", 0)  # ... or before the noise measurement
        self.__dict__.setdefault("_noise_capture", None)
        self.ledger_key = register(self)

    # ----------------------------------------------------------------------------------------------- levers

    @property
    def precision(self) -> AttentionPrecision:
        """The layer's current precision; assigning validates the type, so a bad value fails where it is set."""
        return self._precision

    @precision.setter
    def precision(self, value: AttentionPrecision) -> None:
        check_precision(value, f"AttentionLayerState({self.name!r}): precision")
        self._precision = value

    @property
    def collect_stats(self) -> bool:
        """Whether backwards add the dS quantization error into :attr:`stats`."""
        return self._collect_stats

    @collect_stats.setter
    def collect_stats(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"AttentionLayerState({self.name!r}): collect_stats must be True or False; received {value!r}."
            )
        self._collect_stats = value

    # ------------------------------------------------------------------------------------------- the call

    def scaled_dot_product_attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """This layer's ``torch.nn.functional.scaled_dot_product_attention``: SageBwd where it can serve the call.

        Takes SDPA's arguments as SDPA does. The kernel serves a call with ``dropout_p == 0``, inputs that
        :func:`~sage_lightning.kernels.check_inputs` accepts, and no ``attn_mask``, or a boolean one that equals
        the top-left causal mask or keeps every key (:func:`sage_lightning.masks.kernel_mask`; served as
        ``is_causal=True`` or without a mask). Any other call (another mask, dropout, a head dim or dtype the
        kernel refuses, a sparse or non-finite-scale call, query and key head counts that differ without
        ``enable_gqa``, arguments SDPA itself would reject) runs SDPA unchanged, so its result, or its error, is
        SDPA's own. Such calls are counted in :attr:`fallback_calls` and :attr:`fallback_reasons` and warned
        once per reason (:class:`AttentionFallbackWarning`). Counters and warnings stay exact under
        ``torch.compile`` (:mod:`sage_lightning.ledger`).

        Returns:
            The attention output, as SDPA's.

        Example::

            out = layer.scaled_dot_product_attention(q, k, v, is_causal=True)
        """
        bound, reason = self._route(args, kwargs)
        if reason is None:
            q, k, v = bound["query"], bound["key"], bound["value"]
            stats = self._stats_buffer(q.device) if self.collect_stats else None
            try:  # the kernel validates its inputs once, here; what it refuses goes to SDPA
                out = sage_attention(
                    q, k, v, is_causal=bound["is_causal"], scale=bound["scale"], precision=self.precision, stats=stats
                )
            except UnsupportedAttention as error:
                reason = error.reason
        if reason is not None:
            return self._fallback(reason, bound, args, kwargs)
        record(self, self.ledger_key, SERVED)
        if MAX_TRITON_HEAD_DIM and q.shape[-1] > MAX_TRITON_HEAD_DIM and not self._warned_reference:
            self._warn_reference(q.shape[-1])
        self._stats_given = self._stats_given or stats is not None
        if stats is not None and self.precision.mode == "sagebwd":
            health = qk_quant_error(q, k, smooth_q=self.precision.smooth_q, smooth_k=self.precision.smooth_k)
            self.forward_stats = health if self.forward_stats is None else self.forward_stats + health
        self._record_finiteness(q, k, v, out)
        if self._probe_armed and torch.is_grad_enabled() and out.requires_grad:
            self._capture, self._probe_armed = _capture(q, k, v, out, bound, self.precision), False
        if self._noise_armed and q.dim() == 4 and q.shape[0] >= 2 and torch.is_grad_enabled() and out.requires_grad:
            self._noise_capture = _capture(q, k, v, out, bound, self.precision, keep=self._noise_armed)
            self._noise_armed = 0
        if self.keep_calls:
            kept = KeptCall(q.detach(), k.detach(), v.detach(), out, bound["is_causal"], bound["scale"])
            self.kept_calls.append(kept)
        return out

    def count_unserved(self, reason: str) -> None:
        """Count one attention call this layer saw but could not route (it ran unchanged), warned once per reason.

        For code that computes attention without an SDPA call the layer could serve (the interceptor's
        ``multi_head_attention_forward``, the ``nn.MultiheadAttention`` adapter): the call is still counted, so a
        layer never looks served when it is not.

        Args:
            reason: why the call was not served, as it appears in :attr:`fallback_reasons`.

        Example::

            layer.count_unserved("need_weights=True (the kernel returns no attention weights)")
        """
        record(self, self.ledger_key, FALLBACK_PREFIX + reason)

    def _route(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], str | None]:
        """SDPA's arguments by name (a recognised mask already turned into ``is_causal``), and why the kernel
        cannot serve them (``None`` when it may; the kernel's own validation has the last word)."""
        bound, problem = bind_sdpa_arguments(args, kwargs)
        if problem is not None:
            return bound, problem
        dropout = bound["dropout_p"]
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or dropout != 0:
            return bound, "dropout_p > 0 (SageBwd has no attention dropout; set it to 0 to train on the kernel)"
        q, k, v = bound["query"], bound["key"], bound["value"]
        for tensor in (q, k, v):
            if not isinstance(tensor, torch.Tensor):
                continue  # the kernel names it
            # Subclasses (DTensor, nested tensors, ...) carry their own dispatch; SDPA knows them, we do not.
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                return bound, f"tensor subclass {type(tensor).__name__}"
            if tensor.is_nested:
                return bound, "nested tensor inputs"
            if tensor.layout != torch.strided:
                return bound, f"{tensor.layout} inputs (the kernel takes dense tensors)"
        scale = bound["scale"]
        if isinstance(scale, (int, float)) and not isinstance(scale, bool) and not math.isfinite(scale):
            return bound, f"scale={scale!r} (not finite; the kernel takes a positive finite scale)"
        if bound["attn_mask"] is not None:
            kind, why = self._mask_kind(bound)
            if kind is None:
                return bound, why
            bound = {**bound, "attn_mask": None, "is_causal": kind == CAUSAL}
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4:
            if q.shape[1] != k.shape[1] and bound["enable_gqa"] is not True:
                # SDPA raises here (or broadcasts a single kv head): whatever it does, it stays SDPA's behaviour.
                return bound, "query and key head counts differ without enable_gqa=True"
        return bound, None

    @staticmethod
    def _mask_kind(bound: dict[str, Any]) -> tuple[str | None, str]:
        """What a given ``attn_mask`` is served as (:data:`~sage_lightning.masks.CAUSAL` or ``ALL_TRUE``), or
        ``None`` and the fallback reason."""
        q, k = bound["query"], bound["key"]
        if bound["is_causal"] is not False:
            return None, "attn_mask given with is_causal=True (SDPA's to accept or refuse)"
        if torch.compiler.is_compiling():
            # Reading the mask's values would break the graph; the compiled call falls back.
            return None, "attn_mask under torch.compile (recognising a causal mask needs its values on the host)"
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4:
            kind = kernel_mask(bound["attn_mask"], (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
            if kind is not None:
                return kind, ""
        return None, (
            "attn_mask given that is not a boolean top-left causal or all-true mask (SageBwd masks only through "
            "is_causal)"
        )

    def _fallback(self, reason: str, bound: dict[str, Any], args: tuple, kwargs: dict) -> torch.Tensor:
        record(self, self.ledger_key, FALLBACK_PREFIX + reason)
        # The call exactly as it came: SDPA's result, or SDPA's error, is the caller's.
        out = F.scaled_dot_product_attention(*args, **kwargs)
        q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
        if all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in (q, k, v, out)):
            self._record_finiteness(q, k, v, out)
        return out

    # ------------------------------------------------------------------------------------- host bookkeeping

    def handle_event(self, event: str) -> None:
        """Update the counters for one event of :mod:`sage_lightning.ledger` (called eagerly, or by its op).

        Args:
            event: ``"served"``, ``"fallback:<reason>"``, ``"forward_start"`` or ``"forward_end"`` (a training
                forward of the swapped module: warned once when it made no attention call).
        """
        if event == SERVED:
            self.calls += 1
        elif event.startswith(FALLBACK_PREFIX):
            reason = event.removeprefix(FALLBACK_PREFIX)
            self.calls += 1
            self.fallback_calls += 1
            self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
            if reason not in self._warned:
                self._warned.add(reason)
                rank_zero_warn(
                    f"Attention layer {self.name!r}: a call runs torch.nn.functional.scaled_dot_product_attention "
                    f"in full precision instead of SageBwd: {reason}. Warned once per layer and reason; every such "
                    f"call is counted in attention_layers(model)[{self.name!r}].fallback_calls.",
                    category=AttentionFallbackWarning,
                    stacklevel=9,
                )
        elif event == FORWARD_START:
            self._calls_at_forward = self.calls
        elif event == FORWARD_END:
            if self.calls == self._calls_at_forward:
                # Six frames up from here (record, the wrapper, Module.__call__'s two) is the code calling the module.
                self.warn_if_silent("its forward ran in training and made no attention call", stacklevel=6)

    def warn_if_silent(self, when: str, *, stacklevel: int = 1) -> bool:
        """Warn once (:class:`SilentAttentionWarning`) that this layer is swapped but makes no attention call.

        Args:
            when: what was seen, for the message (e.g. ``"no call in the first training step"``).
            stacklevel: as ``warnings.warn``'s, counted from the caller of this method (1: the caller's line).

        Returns:
            Whether it warned now (``False`` when it had warned before).

        Example::

            if layer.calls == 0:
                layer.warn_if_silent("no call in the first training step")
        """
        if self._warned_silent:
            return False
        self._warned_silent = True
        rank_zero_warn(
            f"Attention layer {self.name!r} is swapped to SageBwd but {when}: nothing in it reaches "
            "torch.nn.functional.scaled_dot_product_attention (attention computed by hand, e.g. with logit "
            "softcapping, or a module that is never called). Its precision and signals have no effect. Leave it "
            "out with filter_fn, or compute its attention with scaled_dot_product_attention.",
            category=SilentAttentionWarning,
            stacklevel=4 + stacklevel,  # rank_zero_warn's own frames, then ours
        )
        return True

    def _warn_reference(self, head_dim: int) -> None:
        self._warned_reference = True
        rank_zero_warn(
            f"Attention layer {self.name!r}: head_dim {head_dim} is larger than the Triton kernels take "
            f"(up to {MAX_TRITON_HEAD_DIM}), so its calls run SageBwd's PyTorch reference, on a GPU too: the same INT8 "
            "numerics, but slow and holding the whole score matrix in memory. Use heads of at most "
            f"{MAX_TRITON_HEAD_DIM}, or leave this layer out of the swap (filter_fn, sage_attention_filter) so it runs "
            "PyTorch's SDPA. Warned once per layer.",
            category=ReferenceAttentionWarning,
            stacklevel=5,
        )

    def _stats_buffer(self, device: torch.device) -> torch.Tensor:
        if self.stats is None:
            self.stats = torch.zeros(2, dtype=torch.float32, device=device)
        elif self.stats.device != device:
            # The module moved (e.g. to the GPU after the first CPU call); the sums so far move with it.
            self.stats = self.stats.to(device)
        return self.stats

    def _record_finiteness(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        # A non-finite output from finite inputs marks the layer where a divergence starts; downstream layers
        # then see non-finite inputs and stay unflagged. Device ops only: no sync per call. A tensor is finite
        # when its largest magnitude is (the infinity norm propagates NaN); one multi-tensor reduction for the
        # four costs the host a third of what fourteen isfinite/all ops did (benchmarks/host_breakdown.py).
        if out.numel() == 0:
            return  # nothing to be non-finite
        tensors = [t for t in (q, k, v) if t.numel()] + [out]
        with torch.no_grad():
            finite = torch.stack(torch._foreach_norm(tensors, ord=math.inf)).isfinite()
            started_here = finite[:-1].all() & finite[-1].logical_not()
            if self._nonfinite.device != started_here.device:
                self._nonfinite = started_here.logical_or(self._nonfinite.to(started_here.device))
            else:
                self._nonfinite.logical_or_(started_here)

    # --------------------------------------------------------------------------------------------- signals

    def take_ds_stats(self) -> tuple[float, float] | None:
        """The dS statistics summed since the last take, then zeroes them.

        Raw sums, so they can be all-reduced across ranks before dividing:
        ``ds_rel_err = sqrt(err2 / norm2)``. One host sync.

        Returns:
            ``(err2, norm2)``: the sum of squared INT8 quantization error of dS and the sum of dS squared, or
            ``None`` when nothing was added since the last take (statistics off, no backward yet, or a layer in
            ``"full"`` mode, whose kernel leaves the buffer alone).

        Example::

            layer.collect_stats = True
            loss.backward()
            err2, norm2 = layer.take_ds_stats()
            print("dS relative error", (err2 / norm2) ** 0.5)
        """
        sums = self.take_ds_stats_on_device()
        if sums is None:
            return None
        err2, norm2 = sums.tolist()
        if err2 == 0.0 and norm2 == 0.0:
            return None
        return err2, norm2

    def take_ds_stats_on_device(self) -> torch.Tensor | None:
        """The dS statistics summed since the last take, as a tensor ``[err2, norm2]`` on their device, then
        zeroes them, without waiting for the device (the sums of :meth:`take_ds_stats`, not yet on the host).

        Returns:
            A fresh float32 tensor of 2 elements, or ``None`` when no served call was asked for statistics since
            the last take. Both sums are zero where the kernel added nothing (a layer in ``"full"`` mode).

        Example::

            layer.collect_stats = True
            loss.backward()
            sums = layer.take_ds_stats_on_device()      # no host sync
            err2, norm2 = sums.tolist()                 # one, later
        """
        if self.stats is None or not self._stats_given:
            return None
        sums = self.stats.clone()
        self.stats.zero_()
        self._stats_given = False
        return sums

    def take_forward_stats_on_device(self) -> torch.Tensor | None:
        """The forward's quantization health summed since the last take (four float64 sums on their device, see
        :func:`~sage_lightning.forward_health.qk_quant_error`), then clears them; ``None`` when nothing was
        measured. No host sync.

        Example::

            layer.collect_stats = True
            model(batch)
            sums = layer.take_forward_stats_on_device()
        """
        sums, self.forward_stats = self.forward_stats, None
        return sums

    def arm_probe(self) -> None:
        """Capture the next served call made with grad enabled, for :meth:`take_probe`.

        The capture keeps detached copies of q, k, v (plus ``is_causal``, ``scale`` and the precision in use)
        and, through a hook on the output, the gradient that reaches it in the backward. Training is untouched.
        A call sent to SDPA is not captured (it has no low-precision error to measure); the probe stays armed.

        Example::

            layer.arm_probe()
            model(batch).loss.backward()
            print(layer.take_probe()["dQ"])
        """
        self._probe_armed = True
        self._capture = None

    def take_probe(self) -> dict[str, dict[str, float]] | None:
        """The captured call at the precision it ran in against full-precision attention, then clears the capture.

        Both sides see the captured q, k, v and output gradient: this layer's kernel (``sage_attention`` at the
        captured precision) and float64 attention (:func:`~sage_lightning.kernels.reference.exact_attention`),
        the latter one (batch, kv head) at a time so memory stays that of one head's score matrix. Metrics are
        over the flattened tensors: ``cos`` the cosine similarity, ``rel_l2`` ``||a - b|| / ||b||`` with ``b``
        the full-precision tensor.

        Returns:
            ``{"O": {"cos": .., "rel_l2": ..}, "dQ": {...}, "dK": {...}, "dV": {...}}``, or ``None`` when nothing
            was captured (probe not armed, no served call, or no backward through the captured call yet).

        Example::

            layer.arm_probe()
            loss.backward()
            probe = layer.take_probe()
            print(probe["dK"]["cos"], probe["dK"]["rel_l2"])
        """
        capture, self._capture = self._capture, None
        self._probe_armed = False
        if capture is None or capture.grad_out is None:
            return None
        return compare_with_full_precision(
            capture.q,
            capture.k,
            capture.v,
            capture.grad_out,
            is_causal=capture.is_causal,
            scale=capture.scale,
            precision=capture.precision,
        )

    def arm_noise(self, sequences: int = 16) -> None:
        """Capture up to ``sequences`` sequences of the next served call made with grad enabled (and at least two
        sequences), for :meth:`take_noise`: detached copies of their q, k, v and, through a hook on the output, of
        the gradient that reaches them. Training is untouched.

        Args:
            sequences: the most sequences kept (memory: four copies of that many sequences' q).

        Example::

            layer.arm_noise(8)
            model(batch).loss.backward()
            sums, sequences = layer.take_noise(AttentionPrecision())
        """
        if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 2:
            raise ValueError(
                f"AttentionLayerState({self.name!r}).arm_noise: sequences must be an int >= 2 (the noise is the "
                f"spread between sequences); received {sequences!r}."
            )
        self._noise_armed = sequences
        self._noise_capture = None

    def take_noise(self, base: AttentionPrecision) -> tuple[torch.Tensor, int] | None:
        """The captured call's error against gradient noise (:func:`sage_lightning.noise.noise_sums`) at ``base``
        and at the precision it ran in, then clears the capture.

        Args:
            base: the precision the controller would step back down to (the layer's starting precision).

        Returns:
            ``(sums, sequences)``: a float64 ``[2, 4]`` device tensor, rows ``base`` and the precision that ran
            (the same row twice where they are equal), and the sequences of the captured call (its micro-batch; the
            sums are over the first ``arm_noise(sequences)`` of them); ``None`` where nothing was
            captured (not armed, no served call of two or more sequences, or no backward through it yet) or the
            layer runs in full precision (no low-bit error to measure).

        Example::

            layer.arm_noise()
            loss.backward()
            taken = layer.take_noise(AttentionPrecision())
        """
        capture, self._noise_capture = self._noise_capture, None
        self._noise_armed = 0
        if capture is None or capture.grad_out is None or capture.precision.mode == "full":
            return None
        ran = capture.precision
        precisions = [base] if base == ran else [base, ran]
        sums = noise_sums(
            capture.q,
            capture.k,
            capture.v,
            capture.grad_out,
            precisions,
            is_causal=capture.is_causal,
            scale=capture.scale,
        )
        if len(precisions) == 1:
            sums = sums.expand(2, -1)
        return sums, capture.sequences

    def take_nonfinite(self) -> bool:
        """Whether a call since the last take returned a non-finite output from finite q, k, v. One host sync.

        Returns:
            ``True`` when this layer is where a divergence started since the last take.

        Example::

            if layer.take_nonfinite():
                layer.precision = layer.precision.replace(ds="bf16")
        """
        flag = bool(self._nonfinite.item())
        self._nonfinite.zero_()
        return flag

    def clear_nonfinite(self) -> None:
        """Forget the flag :meth:`take_nonfinite` would read, without reading it (no host sync).

        Example::

            layer.clear_nonfinite()   # a stale flag would otherwise pin a later divergence on this layer
        """
        self._nonfinite.zero_()

    # ---------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The precision (as a plain dict) and the counters; not the statistics buffer.

        Returns:
            ``{"precision": {...}, "calls": int, "fallback_calls": int, "fallback_reasons": {reason: int}}``.
        """
        return {
            "precision": dataclasses.asdict(self.precision),
            "calls": self.calls,
            "fallback_calls": self.fallback_calls,
            "fallback_reasons": dict(self.fallback_reasons),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            TypeError, ValueError: ``state`` is not such a dict, or holds a precision that does not validate.

        Example::

            saved = layer.state_dict()
            layer.load_state_dict(saved)
        """
        if not isinstance(state, dict) or not isinstance(state.get("precision"), dict):
            raise TypeError(
                f"AttentionLayerState({self.name!r}).load_state_dict: state must be a dict from state_dict() with "
                f"a 'precision' dict; received {type(state).__name__}"
                + (f" with keys {sorted(state)}" if isinstance(state, dict) else "")
                + "."
            )
        known = {field.name for field in dataclasses.fields(AttentionPrecision)}
        unknown = sorted(set(state["precision"]) - known)
        if unknown:
            raise ValueError(
                f"AttentionLayerState({self.name!r}).load_state_dict: precision has fields {unknown} that "
                f"AttentionPrecision does not know (it takes {sorted(known)})."
            )
        self.precision = AttentionPrecision(**state["precision"])
        self.calls = int(state.get("calls", 0))
        self.fallback_calls = int(state.get("fallback_calls", 0))
        self.fallback_reasons = {str(k): int(n) for k, n in state.get("fallback_reasons", {}).items()}

    def __repr__(self) -> str:
        return (
            f"AttentionLayerState(name={self.name!r}, precision={self.precision.short_name!r}, "
            f"collect_stats={self.collect_stats}, calls={self.calls}, fallback_calls={self.fallback_calls})"
        )


def check_precision(precision: object, argument: str) -> None:
    """Refuse anything but an ``AttentionPrecision`` where it is set, naming where (its fields are checked when it is
    made: ``AttentionPrecision`` refuses a field that is not a ``str`` or ``bool``).

    Args:
        precision: the value given.
        argument: how the caller names it in the message, e.g. ``"convert_to_sage_attention: precision"``.

    Raises:
        TypeError: not an ``AttentionPrecision``.

    Example::

        check_precision(AttentionPrecision(ds="bf16"), "precision")   # returns None
    """
    if not isinstance(precision, AttentionPrecision):
        raise TypeError(f"{argument} must be a sage_lightning.AttentionPrecision; received {type(precision).__name__}.")


def attention_layers(module: torch.nn.Module) -> dict[str, AttentionLayerState]:
    """Every swapped attention layer under ``module`` (itself included), by name, in module order.

    Args:
        module: a model (or part of one) after :func:`~sage_lightning.convert_to_sage_attention`.

    Returns:
        ``{name: AttentionLayerState}``; ``{}`` when nothing under ``module`` was swapped.

    Example::

        for name, layer in attention_layers(model).items():
            print(name, layer.precision.short_name, layer.calls, layer.fallback_calls)
    """
    layers: dict[str, AttentionLayerState] = {}
    for submodule in module.modules():
        state = submodule.__dict__.get(STATE_ATTRIBUTE)
        if isinstance(state, AttentionLayerState):
            layers[state.name] = state
    return layers


def take_nonfinite_flags(layers: Sequence[AttentionLayerState], device: torch.device) -> torch.Tensor:
    """Every layer's non-finite flag (:meth:`AttentionLayerState.take_nonfinite`'s) as one bool tensor on
    ``device``, in the given order, then clears them; no host sync (a stack and a zeroing, whatever the number of
    layers). A flag still on another device (a layer not called yet) moves to ``device`` first, once.

    Args:
        layers: the layers, in the order the flags are wanted.
        device: where the flags are read (the training device).

    Returns:
        A bool tensor of ``len(layers)`` elements on ``device``; empty when there are no layers.

    Example::

        flags = take_nonfinite_flags(list(attention_layers(model).values()), torch.device("cuda"))
        packed = torch.cat([packed, flags.double()])        # read later, with the step's other signals
    """
    if not layers:
        return torch.zeros(0, dtype=torch.bool, device=device)
    for layer in layers:
        if layer._nonfinite.device != device:
            layer._nonfinite = layer._nonfinite.to(device)
    held = [layer._nonfinite for layer in layers]
    flags = torch.stack(held)
    # In place: a compiled call holds on to each layer's flag tensor.
    torch._foreach_zero_(held)
    return flags


def compare_with_full_precision(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    precision: AttentionPrecision | None = None,
) -> dict[str, dict[str, float]]:
    """O, dQ, dK, dV of ``sage_attention`` at ``precision`` against float64 attention on the same inputs.

    The low-precision side is one ``sage_attention`` call (as in training); the float64 side runs one
    (batch, kv head) at a time, which keeps its memory to one head group's score matrices and changes nothing
    in its result. Sums are accumulated in float64 on the inputs' device and read once.

    Args:
        q, k, v: SDPA layout, as ``sage_attention`` takes them (detached; gradients are taken internally).
        grad_out: the gradient of the output, shaped like ``q``.
        is_causal, scale: as ``sage_attention``.
        precision: the low-precision side's setting; SageBwd defaults when ``None``.

    Returns:
        ``{"O": {"cos": .., "rel_l2": ..}, "dQ": {...}, "dK": {...}, "dV": {...}}``, ``rel_l2`` relative to the
        float64 tensor. Two all-zero tensors have ``cos == 1`` and ``rel_l2 == 0``.

    Example::

        import torch
        from sage_lightning.layer import compare_with_full_precision

        q, k, v, do = (torch.randn(1, 2, 64, 32) for _ in range(4))
        print(compare_with_full_precision(q, k, v, do, is_causal=True)["dQ"])
    """
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = sage_attention(*leaves, is_causal=is_causal, scale=scale, precision=precision)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    low = {"O": out.detach(), "dQ": grads[0], "dK": grads[1], "dV": grads[2]}

    # Per output: [sum a*b, sum a*a, sum b*b, sum (a-b)^2], a the low-precision tensor, b the float64 one.
    sums = torch.zeros(len(_PROBED_OUTPUTS), 4, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(k.shape[1]):
            heads = slice(h * group, (h + 1) * group)
            ref = exact_attention(
                q[b : b + 1, heads],
                k[b : b + 1, h : h + 1],
                v[b : b + 1, h : h + 1],
                grad_out[b : b + 1, heads],
                is_causal=is_causal,
                scale=scale,
            )
            pieces = {
                "O": low["O"][b : b + 1, heads],
                "dQ": low["dQ"][b : b + 1, heads],
                "dK": low["dK"][b : b + 1, h : h + 1],
                "dV": low["dV"][b : b + 1, h : h + 1],
            }
            for row, name in enumerate(_PROBED_OUTPUTS):
                a, r = pieces[name].to(torch.float64), ref[name]
                sums[row] += torch.stack([(a * r).sum(), (a * a).sum(), (r * r).sum(), (a - r).square().sum()])
    result = {}
    for name, (dot, norm_a2, norm_b2, diff2) in zip(_PROBED_OUTPUTS, sums.tolist(), strict=True):
        result[name] = {"cos": _cosine(dot, norm_a2, norm_b2), "rel_l2": _relative_l2(diff2, norm_b2)}
    return result


def _cosine(dot: float, norm_a2: float, norm_b2: float) -> float:
    if norm_a2 == 0.0 and norm_b2 == 0.0:
        return 1.0
    if norm_a2 == 0.0 or norm_b2 == 0.0:
        return 0.0
    return dot / math.sqrt(norm_a2 * norm_b2)


def _relative_l2(diff2: float, norm_b2: float) -> float:
    if norm_b2 == 0.0:
        return 0.0 if diff2 == 0.0 else math.inf
    return math.sqrt(diff2 / norm_b2)
