"""The quiet step's short signal vector, the one-pass gradient norm and the reused host buffers: the controller's
per-step cost was cut with these (docs/controller.md, Overhead); the numbers must not change with them."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sage_lightning.policy import SignalRequest
from sage_lightning.signals import (
    HEAD_FIELDS,
    LAYER_FIELDS,
    HostCopies,
    SignalLayout,
    StepRecord,
    squared_grad_norm,
    widen,
)
from sage_lightning.snapshots import Snapshots, copy_to_host

LAYERS = ("blocks.0.attn", "blocks.1.attn", "blocks.2.attn")


@pytest.mark.parametrize("seed", range(6))
def test_squared_grad_norm_equals_the_total_norm_squared(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(random.Random(seed * 7 + i).randint(1, 40), 3) for i in range(1 + seed * 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    grads = [
        (torch.randn(shape, generator=generator) * 10 ** (seed % 3)).to(dtypes[i % len(dtypes)])
        for i, shape in enumerate(shapes)
    ]
    expected = sum(float(g.double().square().sum()) for g in grads)
    got = squared_grad_norm(grads)
    assert got.dtype == torch.float32 and got.shape == ()
    assert float(got) == pytest.approx(expected, rel=1e-5)
    reference = float(torch.nn.utils.get_total_norm([g.float() for g in grads])) ** 2
    assert float(got) == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_squared_grad_norm_of_a_non_finite_gradient_is_non_finite(bad: float) -> None:
    grads = [torch.ones(5), torch.tensor([1.0, bad])]
    assert not math.isfinite(float(squared_grad_norm(grads)))


def _random_step(rng: random.Random) -> dict:
    flags = torch.tensor([rng.random() < 0.3 for _ in LAYERS])
    return {
        "loss_sum": torch.tensor(rng.uniform(0.1, 9.0)),
        "micro_batches": rng.randint(1, 8),
        "tokens": rng.randint(1, 10**6),
        "grad_norm2": None if rng.random() < 0.2 else torch.tensor(rng.uniform(0.0, 50.0)),
        "nonfinite": flags,
    }


@pytest.mark.parametrize("seed", range(8))
def test_the_short_vector_reads_as_the_full_one(seed: int) -> None:
    layout = SignalLayout(LAYERS)
    step = _random_step(random.Random(seed))
    full = layout.pack(
        torch.device("cpu"),
        loss_sum=step["loss_sum"],
        micro_batches=step["micro_batches"],
        tokens=step["tokens"],
        grad_norm2=step["grad_norm2"],
        ds_sums=None,
        qk_sums=None,
        probes=None,
        nonfinite=step["nonfinite"],
    ).tolist()
    short = layout.pack_short(step["loss_sum"], step["grad_norm2"], step["nonfinite"])
    assert short.dtype == torch.float32 and short.numel() == 2 + len(LAYERS)
    has_grads = step["grad_norm2"] is not None
    wide = widen(short.tolist(), micro_batches=step["micro_batches"], tokens=step["tokens"], has_grads=has_grads)
    assert len(wide) == layout.size
    assert wide == pytest.approx(full, rel=1e-6)
    head_full, layers_full = layout.unpack(full)
    head_short, layers_short = layout.unpack(wide)
    assert layers_short == layers_full
    for field in ("loss", "grad_norm", "tokens", "micro_batches"):
        if head_full[field] is None:
            assert head_short[field] is None
        else:
            assert head_short[field] == pytest.approx(head_full[field], rel=1e-6)


def test_unpack_reads_measured_and_quiet_layers_alike() -> None:
    """A row with something measured takes the full reading; a quiet one the shared reading; flags in both."""
    layout = SignalLayout(LAYERS)
    ds = [torch.tensor([0.04, 1.0]), None, torch.tensor([0.0, 0.0])]
    values = layout.pack(
        torch.device("cpu"),
        loss_sum=torch.tensor(2.0),
        micro_batches=1,
        tokens=8,
        grad_norm2=torch.tensor(4.0),
        ds_sums=ds,
        qk_sums=None,
        probes=None,
        nonfinite=torch.tensor([False, True, True]),
    ).tolist()
    _, layers = layout.unpack(values)
    assert layers["blocks.0.attn"].ds_rel_err == pytest.approx(0.2)
    assert layers["blocks.1.attn"].ds_rel_err is None and layers["blocks.1.attn"].nonfinite
    assert layers["blocks.2.attn"].ds_rel_err is None and layers["blocks.2.attn"].nonfinite


def test_a_short_record_is_widened_once_and_checkpointed_in_the_full_layout() -> None:
    layout = SignalLayout(LAYERS)
    short = layout.pack_short(torch.tensor(3.0), torch.tensor(16.0), torch.tensor([False, True, False]))
    request = SignalRequest(False, False)
    record = StepRecord(step=4, packed=short, request=request, grad_scaler=False, ran_int8=3, short_head=(2, 64, True))
    record.start_copy(HostCopies())  # on the CPU: nothing to copy
    assert record.ready()
    values = record.host_values()
    assert values is record.host_values()
    assert values[HEAD_FIELDS.index("tokens")] == 64 and values[HEAD_FIELDS.index("grad_norm2")] == 16.0
    state = record.state()
    assert len(state["values"]) == layout.size
    restored = StepRecord.from_state(state)
    assert restored.host_values() == values
    flag = len(HEAD_FIELDS) + len(LAYER_FIELDS) + LAYER_FIELDS.index("nonfinite")
    assert values[flag] == 1.0


def test_host_copies_hands_back_what_was_returned() -> None:
    copies = HostCopies()
    buffer, event = torch.empty(5), object()
    copies.give_back(buffer, event)
    taken, taken_event = copies.take(torch.zeros(5))
    assert taken is buffer and taken_event is event


def test_copies_to_host_take_pool_buffers_only_for_device_tensors() -> None:
    pool = {(torch.Size([3]), torch.float32): [torch.full((3,), -1.0)]}
    saved = copy_to_host({"w": torch.ones(3)}, None, pool)
    assert torch.equal(saved["w"], torch.ones(3))
    assert len(pool[(torch.Size([3]), torch.float32)]) == 1  # a CPU tensor needs no pinned buffer


def test_snapshot_reservation_is_a_no_op_off_cuda() -> None:
    class _Strategy:
        root_device = torch.device("cpu")

    class _Trainer:
        strategy = _Strategy()
        optimizers: list = []

    snapshots = Snapshots()
    snapshots.reserve(_Trainer())
    assert not snapshots.reserved
