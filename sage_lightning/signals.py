"""One optimizer step's signals as one float64 vector: a named layout, packed on the device, summed across ranks
with one all-reduce, unpacked into the policy's :class:`~sage_lightning.policy.StepSignals`.

Raw sums travel, divisions happen after the reduction: the loss sum and the micro-batch count, the dS error and
norm sums, flags (any rank's counts), probe metrics summed with the count of ranks that probed.

Most steps measure nothing optional: in one process such a step packs only what the device holds (the loss sum,
the squared gradient norm and the layers' non-finite flags; :meth:`SignalLayout.pack_short`, a stack and a
concatenation) and keeps its host numbers (micro-batches, tokens) on the host; :meth:`StepRecord.host_values` widens
it to the full layout. The per-step host time is the controller's cost on a host-bound step (``docs/controller.md``,
Overhead).

Without the check before each step, the reduced vector goes to the host on its own: :meth:`StepRecord.start_copy`
copies it into pinned host memory without waiting and records a CUDA event after the copy; the controller reads it
:data:`VERDICT_LAG` optimizer steps later, when the event has (almost always) completed, so the read waits for
nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from sage_lightning.kernels import AttentionPrecision
from sage_lightning.noise import NOISE_FIELDS, noise_ratio, noise_scale
from sage_lightning.policy import PROBE_TENSORS, LayerSignals, SignalRequest

#: The head of the vector: the step's global numbers.
HEAD_FIELDS: tuple[str, ...] = ("loss_sum", "micro_batches", "tokens", "grad_norm2", "ranks_with_grads")
#: The noise measurement's rows: at the layer's base precision and at the one it ran in
#: (:meth:`~sage_lightning.layer.AttentionLayerState.take_noise`).
NOISE_ROWS: tuple[str, ...] = ("base", "ran")
#: Per layer, in module order: the dS sums, whether they were measured, the forward's health, whether the layer
#: was probed, the probe, the noise measurement's sums (:mod:`sage_lightning.noise`) with the sequences and ranks
#: it saw, and the ranks on which the layer returned a non-finite output from finite inputs.
LAYER_FIELDS: tuple[str, ...] = (
    "ds_err2",
    "ds_norm2",
    "ranks_with_ds",
    "qk_rel_q",
    "qk_rows_q",
    "qk_rel_k",
    "qk_rows_k",
    "ranks_with_probe",
    *(f"{tensor}_{metric}" for tensor in PROBE_TENSORS for metric in ("cos", "rel_l2")),
    *(f"noise_{row}_{name}" for row in NOISE_ROWS for name in NOISE_FIELDS),
    "noise_sequences",
    "ranks_with_noise",
    "nonfinite",
)
#: The fields a vector of the previous layout (without the noise measurement) lacks, read as zeros.
_NOISE_BLOCK = len(NOISE_ROWS) * len(NOISE_FIELDS) + 2
#: A layer's values in that layout (a checkpoint's pending verdict may hold it; :meth:`SignalLayout.unpack` reads it).
PREVIOUS_LAYER_WIDTH = len(LAYER_FIELDS) - _NOISE_BLOCK
#: A layer's values in the layout between (noise rows without ``mean2``, the last of :data:`NOISE_FIELDS`), and
#: where its noise rows start.
NO_SCALE_LAYER_WIDTH = len(LAYER_FIELDS) - len(NOISE_ROWS)
_NOISE_START = LAYER_FIELDS.index(f"noise_{NOISE_ROWS[0]}_{NOISE_FIELDS[0]}")
#: Offsets in a layer's row of the counts that say something optional was measured there, and of its flag.
_MEASURED = tuple(
    LAYER_FIELDS.index(name)
    for name in ("ranks_with_ds", "qk_rows_q", "qk_rows_k", "ranks_with_probe", "ranks_with_noise")
)
_NONFINITE = LAYER_FIELDS.index("nonfinite")
#: A layer with nothing measured, shared (frozen), flagged or not.
_QUIET, _FLAGGED = LayerSignals(), LayerSignals(nonfinite=True)
#: How many optimizer steps after its own a step's signals are read without the check before each step: the signals
#: of step ``t`` decide at step ``t + VERDICT_LAG``, on every rank and every device (``docs/controller.md``, Overhead).
VERDICT_LAG = 2


def squared_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gradients' squared L2 norm as a float32 scalar on their device, without a host sync: one multi-tensor
    norm (in float32 whatever the gradients' dtype), a stack and a dot product, so the host's cost does not grow
    with per-tensor operators. Gradients that are not plain tensors on one device (DTensor shards, a model split
    over devices) take :func:`torch.nn.utils.get_total_norm`, on the first gradient's device.

    A non-finite gradient gives a non-finite result (so does a norm past float32's range, about 1.8e19).

    Args:
        grads: the gradients, at least one.

    Example::

        squared_grad_norm([torch.ones(3), torch.ones(1)])   # tensor(4.)
    """
    if all(type(grad) is torch.Tensor for grad in grads):
        norms = torch._foreach_norm(list(grads), 2.0, dtype=torch.float32)
        try:
            stacked = torch.stack(norms)
        except RuntimeError:  # gradients on several devices
            pass
        else:
            return torch.dot(stacked, stacked)
    total = torch.nn.utils.get_total_norm(list(grads))
    return total.to(device=grads[0].device, dtype=torch.float32).square()


@dataclasses.dataclass(frozen=True)
class SignalLayout:
    """Where each number of the packed vector lives, for a model's attention layers.

    Args:
        layers: the layer names, in module order.

    Example::

        layout = SignalLayout(("blocks.0.attn", "blocks.1.attn"))
        layout.size   # 5 + 2 * 25
    """

    layers: tuple[str, ...]

    @property
    def size(self) -> int:
        """The vector's length."""
        return len(HEAD_FIELDS) + len(self.layers) * len(LAYER_FIELDS)

    def pack(
        self,
        device: torch.device,
        *,
        loss_sum: torch.Tensor | None,
        micro_batches: int,
        tokens: int,
        grad_norm2: torch.Tensor | None,
        ds_sums: Sequence[torch.Tensor | None] | None,
        qk_sums: Sequence[torch.Tensor | None] | None,
        probes: Sequence[Mapping[str, Mapping[str, float]] | None] | None,
        nonfinite: torch.Tensor | None = None,
        noise: Sequence[tuple[torch.Tensor, int] | None] | None = None,
    ) -> torch.Tensor:
        """The step's raw signals in one float64 vector on ``device``, without a host sync (a probe step's metrics,
        host numbers already, are copied to the device).

        Args:
            loss_sum: the sum of the step's micro-batch losses as ``training_step`` returned them (a device
                scalar), ``None`` when none returned a loss.
            micro_batches: the micro-batches that returned a loss.
            tokens: the step's tokens on this rank.
            grad_norm2: the squared norm of the gradients about to be applied (:func:`squared_grad_norm`), ``None``
                when there are none.
            ds_sums: per layer, ``[err2, norm2]`` on the device (``None`` where nothing was measured); ``None`` when
                the dS statistics were not asked for.
            qk_sums: per layer, the forward health's four sums on the device
                (:func:`~sage_lightning.forward_health.qk_quant_error`); as ``ds_sums``.
            probes: per layer, the probe's metrics (``None`` where nothing was captured); ``None`` when not probed.
            nonfinite: per layer, whether it returned a non-finite output from finite inputs during the step, on the
                device (:func:`~sage_lightning.layer.take_nonfinite_flags`); ``None``: none did.
            noise: per layer, the noise measurement's ``(sums, sequences)``
                (:meth:`~sage_lightning.layer.AttentionLayerState.take_noise`; ``None`` where nothing was
                captured); ``None`` when not asked for.

        Example::

            layout = SignalLayout(("attn",))
            packed = layout.pack(torch.device("cpu"), loss_sum=torch.tensor(2.0), micro_batches=1, tokens=64,
                                 grad_norm2=torch.tensor(3.0), ds_sums=None, qk_sums=None, probes=None)
            layout.unpack(packed.tolist())[0]["loss"]   # 2.0
        """
        zero = torch.zeros((), device=device, dtype=torch.float64)
        loss = zero if loss_sum is None else loss_sum.to(device=device, dtype=torch.float64)
        has_grads = grad_norm2 is not None
        norm2 = grad_norm2.to(device, torch.float64) if has_grads else zero
        head = torch.stack([loss, zero + micro_batches, zero + tokens, norm2, zero + (1.0 if has_grads else 0.0)])
        count = len(self.layers)
        if ds_sums is not None:
            none = torch.zeros(2, dtype=torch.float32, device=device)
            sums = torch.stack([none if s is None else s.to(device) for s in ds_sums]).to(torch.float64)
            has_ds = (sums != 0).any(dim=1, keepdim=True).to(torch.float64)
        else:
            sums = torch.zeros(count, 2, dtype=torch.float64, device=device)
            has_ds = torch.zeros(count, 1, dtype=torch.float64, device=device)
        none4 = torch.zeros(4, dtype=torch.float64, device=device)
        qk = torch.stack([none4 if s is None else s.to(device, torch.float64) for s in (qk_sums or [None] * count)])
        if probes is not None:
            # The probe's metrics are host numbers (the probe itself waited for the device): one copy.
            rows = []
            for probe in probes:
                row = [float(probe is not None)]
                for tensor in PROBE_TENSORS:
                    metrics = probe.get(tensor, {}) if probe is not None else {}
                    row += [float(metrics.get("cos", 0.0)), float(metrics.get("rel_l2", 0.0))]
                rows.append(row)
            rest = torch.tensor(rows, dtype=torch.float64, device=device)
        else:
            rest = torch.zeros(count, 1 + 2 * len(PROBE_TENSORS), dtype=torch.float64, device=device)
        if noise is None:
            noise_block = torch.zeros(count, _NOISE_BLOCK, dtype=torch.float64, device=device)
        else:
            none6 = torch.zeros(len(NOISE_ROWS) * len(NOISE_FIELDS), dtype=torch.float64, device=device)
            sums6 = torch.stack([none6 if t is None else t[0].to(device, torch.float64).flatten() for t in noise])
            # The sequences and the rank count are host numbers: one copy for every layer.
            tails = [[0.0, 0.0] if t is None else [float(t[1]), 1.0] for t in noise]
            noise_block = torch.cat([sums6, torch.tensor(tails, dtype=torch.float64, device=device)], dim=1)
        if nonfinite is None:
            flags = torch.zeros(count, 1, dtype=torch.float64, device=device)
        else:
            flags = nonfinite.to(device=device, dtype=torch.float64).reshape(count, 1)
        return torch.cat([head, torch.cat([sums, has_ds, qk, rest, noise_block, flags], dim=1).flatten()])

    def pack_short(
        self, loss_sum: torch.Tensor | None, grad_norm2: torch.Tensor | None, nonfinite: torch.Tensor
    ) -> torch.Tensor:
        """A step that measured nothing optional, in one process: only what the device holds, as one float32
        vector ``[loss_sum, grad_norm2, nonfinite...]`` (a stack and a concatenation); the host numbers stay with
        the :class:`StepRecord` and :func:`widen` puts both in the full layout.

        Args:
            loss_sum: as :meth:`pack`'s, a float32 device scalar, or ``None``.
            grad_norm2: the squared gradient norm on the flags' device, or ``None`` (:func:`widen` reads it only
                where there were gradients).
            nonfinite: per layer, the non-finite flags (:func:`~sage_lightning.layer.take_nonfinite_flags`).

        Example::

            layout = SignalLayout(("attn",))
            short = layout.pack_short(torch.tensor(2.0), torch.tensor(9.0), torch.tensor([False]))
            layout.unpack(widen(short.tolist(), micro_batches=1, tokens=64, has_grads=True))[0]["grad_norm"]   # 3.0
        """
        loss = None if loss_sum is None else loss_sum.to(nonfinite.device, torch.float32)
        if loss is None or grad_norm2 is None:
            zero = torch.zeros((), dtype=torch.float32, device=nonfinite.device)
            loss, grad_norm2 = (zero if loss is None else loss), (zero if grad_norm2 is None else grad_norm2)
        return torch.cat([torch.stack([loss, grad_norm2]), nonfinite])

    def unpack(
        self, total: Sequence[float], *, sharded_grads: bool = False
    ) -> tuple[dict[str, float], dict[str, LayerSignals]]:
        """The reduced vector as ``(head, layers)``: the head's fields by name (``loss`` and ``grad_norm`` divided
        out, ``None`` where nothing was measured), and each layer's :class:`LayerSignals`.

        ``nonfinite`` is set where any rank flagged the layer; the controller keeps it only on a step whose loss or
        gradient norm is non-finite (where it tells where the divergence started).

        Args:
            total: the reduced vector, on the host.
            sharded_grads: each rank holds a shard of the gradients (FSDP): the squared norms add up across
                ranks. Otherwise (DDP) every rank holds the same all-reduced gradients and their mean is the norm.
        """
        total = self._current_layout(total)
        head = dict(zip(HEAD_FIELDS, total[: len(HEAD_FIELDS)], strict=True))
        layers: dict[str, LayerSignals] = {}
        for i, name in enumerate(self.layers):
            start = len(HEAD_FIELDS) + i * len(LAYER_FIELDS)
            if not any(total[start + offset] for offset in _MEASURED):  # the usual step: nothing optional measured
                layers[name] = _FLAGGED if total[start + _NONFINITE] > 0 else _QUIET
                continue
            row = dict(zip(LAYER_FIELDS, total[start : start + len(LAYER_FIELDS)], strict=True))
            ds_rel_err = None
            if row["ranks_with_ds"] > 0:
                err2, norm2 = row["ds_err2"], row["ds_norm2"]
                ds_rel_err = math.sqrt(err2 / norm2) if norm2 > 0 else (0.0 if err2 == 0 else math.nan)
                if not (math.isfinite(err2) and math.isfinite(norm2)):
                    ds_rel_err = math.nan
            probe = None
            if (ranks := row["ranks_with_probe"]) > 0:
                probe = {
                    tensor: {metric: row[f"{tensor}_{metric}"] / ranks for metric in ("cos", "rel_l2")}
                    for tensor in PROBE_TENSORS
                }
            qk_rel_err = None
            if row["qk_rows_q"] > 0 and row["qk_rows_k"] > 0:
                qk_rel_err = math.sqrt(row["qk_rel_q"] / row["qk_rows_q"] + row["qk_rel_k"] / row["qk_rows_k"])
            ratios: dict[str, float | None] = dict.fromkeys(NOISE_ROWS)
            scale = scale_ratio = None
            if (ranks := row["ranks_with_noise"]) > 0:
                # The step's sequences: the measured micro-batches' mean, times every rank's micro-batches.
                per_step = row["noise_sequences"] / ranks * max(head["micro_batches"], 1.0)
                for which in NOISE_ROWS:
                    bias2, err_var, grad_var, _ = (row[f"noise_{which}_{field}"] / ranks for field in NOISE_FIELDS)
                    ratios[which] = noise_ratio(bias2, err_var, grad_var, sequences_per_step=per_step)
                scale = noise_scale(row["noise_base_grad_var"] / ranks, row["noise_base_mean2"] / ranks)
                scale_ratio = per_step / scale if scale is not None else None
            layers[name] = LayerSignals(
                ds_rel_err=ds_rel_err,
                probe=probe,
                qk_rel_err=qk_rel_err,
                nonfinite=row["nonfinite"] > 0,
                noise_ratio=ratios["base"],
                noise_ratio_ran=ratios["ran"],
                noise_scale=scale,
                noise_scale_ratio=scale_ratio,
            )
        micro_batches, ranks_with_grads = head["micro_batches"], head["ranks_with_grads"]
        # DDP all-reduces gradients before on_before_optimizer_step, so every rank holds the same norm: the mean
        # over the ranks that had gradients is that norm (and a NaN on any rank stays NaN). FSDP's shards add up.
        head["loss"] = head["loss_sum"] / micro_batches if micro_batches > 0 else None
        ranks = 1.0 if sharded_grads else ranks_with_grads
        head["grad_norm"] = math.sqrt(head["grad_norm2"] / ranks) if ranks_with_grads > 0 else None
        return head, layers

    def _current_layout(self, total: Sequence[float]) -> Sequence[float]:
        """``total`` in this layout: a vector of an earlier one (a checkpoint's pending verdict) as this one reads
        it. Without the noise fields (from before the measurement existed) they are zeros (nothing measured); with
        noise rows of three sums (before ``mean2``) each row gains a zero ``mean2`` (no noise scale)."""
        if len(total) == self.size:
            return total
        head = len(HEAD_FIELDS)
        widths = [w for w in (PREVIOUS_LAYER_WIDTH, NO_SCALE_LAYER_WIDTH) if len(total) == head + len(self.layers) * w]
        if not widths:
            raise ValueError(f"SignalLayout.unpack: expected {self.size} values for {self.layers}; got {len(total)}.")
        width, values = widths[0], list(total[:head])
        for i in range(len(self.layers)):
            row = list(total[head + i * width : head + (i + 1) * width])
            if width == PREVIOUS_LAYER_WIDTH:
                values += row[:-1] + [0.0] * _NOISE_BLOCK + row[-1:]
                continue
            old = len(NOISE_FIELDS) - 1
            sums = row[_NOISE_START : _NOISE_START + len(NOISE_ROWS) * old]
            rows = [sums[r * old : (r + 1) * old] + [0.0] for r in range(len(NOISE_ROWS))]
            values += row[:_NOISE_START] + [x for r in rows for x in r] + row[_NOISE_START + len(sums) :]
        return values


def reduce(trainer: pl.Trainer, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed across ranks (one all-reduce; the identity on one process)."""
    return trainer.strategy.reduce(values, reduce_op="sum")


def widen(short: Sequence[float], *, micro_batches: int, tokens: int, has_grads: bool) -> list[float]:
    """A :meth:`SignalLayout.pack_short` vector, read on the host, in the full layout (what
    :meth:`SignalLayout.unpack` reads and a checkpoint keeps): the host numbers in the head, zeros for what was not
    measured, each layer's flag at its place.

    Args:
        short: ``[loss_sum, grad_norm2, nonfinite...]`` as host numbers.
        micro_batches: the micro-batches that returned a loss.
        tokens: the step's tokens.
        has_grads: whether the step had gradients.

    Example::

        widen([2.0, 9.0, 0.0], micro_batches=1, tokens=64, has_grads=True)[:5]   # [2.0, 1.0, 64.0, 9.0, 1.0]
    """
    loss_sum, grad_norm2, *flags = short
    values = [loss_sum, float(micro_batches), float(tokens), grad_norm2 if has_grads else 0.0, float(has_grads)]
    quiet = [0.0] * (len(LAYER_FIELDS) - 1)
    for flag in flags:
        values += quiet
        values.append(flag)
    return values


class HostCopies:
    """Pinned host buffers and CUDA events for the signals' copies to the host, reused from step to step: a step
    takes one pair, its record gives it back once read (a fresh pinned allocation and event per step cost the host
    more than the copy).

    Example::

        copies = HostCopies()
        record.start_copy(copies)     # takes a buffer and an event
        record.host_values()          # reads, then gives them back
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer of ``like``'s size and dtype, and an event."""
        free = self._free.get((like.numel(), like.dtype))
        if free:
            return free.pop()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True), torch.cuda.Event()

    def give_back(self, buffer: torch.Tensor, event: torch.cuda.Event) -> None:
        """Return a pair whose copy has been read."""
        self._free.setdefault((buffer.numel(), buffer.dtype), []).append((buffer, event))


@dataclasses.dataclass
class StepRecord:
    """One optimizer step's reduced signals on their way to the host, with what its verdict needs: among it each
    layer's precision during the step (``precisions``, in module order), since a verdict that lands after a decision
    changed a layer's precision must not read that layer's measurements as the new precision's.

    ``short_head`` (micro-batches, tokens, whether there were gradients) marks a :meth:`SignalLayout.pack_short`
    vector, widened to the full layout when read.

    Example::

        record = StepRecord(step=7, packed=packed, request=SignalRequest(False, False), grad_scaler=False, ran_int8=2)
        record.start_copy()         # device -> pinned host memory, no wait
        ...                         # VERDICT_LAG steps later
        if record.ready():          # the copy is done: reading it waits for nothing
            values = record.host_values()
    """

    step: int
    packed: torch.Tensor
    request: SignalRequest
    grad_scaler: bool
    ran_int8: int
    skipped_on_device: bool = False
    precisions: tuple[AttentionPrecision, ...] = ()
    short_head: tuple[int, int, bool] | None = None
    _copied: torch.cuda.Event | None = None
    _copies: HostCopies | None = None
    _values: list[float] | None = None

    def start_copy(self, copies: HostCopies | None = None) -> None:
        """Copy the signals into pinned host memory without waiting, and record a CUDA event after the copy (the
        buffer and the event from ``copies`` when given, returned there once read). On the CPU the vector is on
        the host already: nothing to copy, :meth:`ready` at once."""
        if self.packed.is_cuda:
            copies = HostCopies() if copies is None else copies
            host, self._copied = copies.take(self.packed)
            host.copy_(self.packed, non_blocking=True)
            self.packed = host
            self._copied.record()
            self._copies = copies

    def ready(self) -> bool:
        """Whether :meth:`host_values` would return without waiting (the copy's event has completed; asks the
        driver, never blocks)."""
        return self._copied is None or self._copied.query()

    def host_values(self) -> list[float]:
        """The reduced vector on the host, in the full layout; waits for its copy only if it is not :meth:`ready`."""
        if self._values is None:
            if self._copied is not None:
                self._copied.synchronize()  # returns at once where the copy is done
            values = self.packed.tolist()
            if self._copies is not None:
                self._copies.give_back(self.packed, self._copied)
            self._copied = self._copies = None
            if self.short_head is not None:
                micro_batches, tokens, has_grads = self.short_head
                values = widen(values, micro_batches=micro_batches, tokens=tokens, has_grads=has_grads)
            self._values = values
        return self._values

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of a step whose verdict is pending (waits for its signals)."""
        return {
            "step": self.step,
            "values": self.host_values(),
            "request": dataclasses.asdict(self.request),
            "grad_scaler": self.grad_scaler,
            "ran_int8": self.ran_int8,
            "skipped_on_device": self.skipped_on_device,
            "precisions": [dataclasses.asdict(precision) for precision in self.precisions],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> StepRecord | None:
        """The record :meth:`state` kept, or ``None``."""
        if state is None:
            return None
        return cls(
            step=state["step"],
            packed=torch.tensor(state["values"], dtype=torch.float64),
            request=SignalRequest(**state["request"]),
            grad_scaler=state["grad_scaler"],
            ran_int8=state["ran_int8"],
            skipped_on_device=state["skipped_on_device"],
            precisions=tuple(AttentionPrecision(**fields) for fields in state["precisions"]),
        )


def count_tokens(batch: Any) -> int:
    """The default ``tokens_fn``: elements of the batch's token-id tensor.

    A tensor counts as itself; a mapping by ``"input_ids"`` or else its first tensor value; a list or tuple by
    its first tensor.

    Raises:
        ValueError: no tensor found; pass ``AdaptivePrecision(tokens_fn=...)``.

    Example::

        count_tokens({"input_ids": torch.zeros(8, 1024, dtype=torch.long)})   # 8192
    """
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"].numel()
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = []
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.numel()
    raise ValueError(
        f"AdaptivePrecision: cannot count the tokens of a batch of type {type(batch).__name__}; pass "
        "AdaptivePrecision(tokens_fn=lambda batch: ...) returning the tokens of one micro-batch."
    )
