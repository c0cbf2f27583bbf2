"""A NaN or an infinity in one row of q, k or v stays where SDPA keeps it; a huge row of q leaves the other query
blocks alone.

What "confined" means, precisely (kernels/quant.py's module docstring has the mechanism): the quantizers of Q, K and V
read a NaN or infinity as 0, so every scale, mean and code is the one of the same inputs with that value zeroed;
the forward then makes NaN exactly the query rows that SDPA makes non-finite through the value: the bad query row
itself, or for a bad key or value row every query row that attends it (all of them, or with ``is_causal`` the rows
from it on). So each other row equals, bit for bit, the run with the bad value replaced by 0, and the poisoned rows
are NaN. That is stricter than SDPA in two places, both on the side of a NaN the controller sees: an infinity in a
key row whose score a query takes as -inf (SDPA drops the key for that query, we make the row NaN), and nothing
else. (SDPA's CPU math path also spreads a NaN in v to the causal rows before it, through ``0 * NaN``; we do not.)

The backward, not confined and by design: a poisoned row's logsumexp is NaN, so its P and dS are; dS is quantized
per 128 x 64 tile, and that tile's scale carries the NaN (an int8 code cannot), so dQ is NaN in the row blocks that
hold a poisoned row and dK, dV in the key tiles those rows attend. SDPA's own dK and dV are NaN in every key a
poisoned row attends, so a training step sees a NaN gradient either way; the dQ of the other row blocks equals the
zeroed run's. (tested on every path below)

Paths: the reference, the portable Triton kernels and the Hopper forward (``SAGE_LIGHTNING_HOPPER=force``); on a
CPU-only machine the kernels run in Triton's interpreter (conftest.py), on a GPU on CUDA:

    .venv/bin/python -m pytest -q tests/test_bad_values.py

runs every case on the GPU the machine has (the Hopper cases on an sm_90 GPU only).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from sage_lightning.kernels import AttentionPrecision, ops, plan
from sage_lightning.kernels.ops import sage_attention_triton
from sage_lightning.kernels.quant import NO_BAD_KEY, finite_mean, quantize_channels_fp8, quantize_rows
from sage_lightning.kernels.reference import confine, sage_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
HAS_KERNELS = INTERPRETED or DEVICE == "cuda"

# One q head group of 2 over one kv head (GQA), 160 queries and keys: two query blocks of 128 (one ragged), three
# key tiles of 64 (one ragged). Head dim 64 and keys a multiple of 16, which the Hopper forward serves.
Q_SHAPE, K_SHAPE = (1, 2, 160, 64), (1, 1, 160, 64)
BAD_QUERY = 70  # in query block 0, with 127 good rows around it
BAD_KEY = 100  # in key tile 1 (keys 64-127): with is_causal, queries 64-99 attend keys of its tile before it
LATE_KEY = 140  # with is_causal, only query block 1 attends it: query block 0's gradients stay finite


def _backend(name: str, monkeypatch: pytest.MonkeyPatch):
    """The attention function of one path, or a skip where it cannot run here."""
    if name == "reference":
        return sage_attention_reference
    if not HAS_KERNELS:
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    if name == "hopper":
        if not (INTERPRETED or ON_HOPPER):
            pytest.skip("the Hopper forward needs an sm_90 GPU or TRITON_INTERPRET=1")
        monkeypatch.setenv(plan.HOPPER_ENV, "force")
        plan.refresh_settings()
    else:
        monkeypatch.setenv(plan.HOPPER_ENV, "off")
        plan.refresh_settings()
    calls = []
    original = ops.hopper_forward
    monkeypatch.setattr(ops, "hopper_forward", lambda *a, **kw: calls.append(1) or original(*a, **kw))

    def attention(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        result = sage_attention_triton(*args, **kwargs)
        assert bool(calls) == (name == "hopper"), "the call did not take the path under test"
        return result

    return attention


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": Q_SHAPE, "k": K_SHAPE, "v": K_SHAPE, "do": Q_SHAPE}
    return {name: torch.randn(shape, generator=gen).to(DEVICE, torch.bfloat16) for name, shape in shapes.items()}


def _with(tensors: dict[str, torch.Tensor], where: str, row: int, value: float) -> dict[str, torch.Tensor]:
    """The inputs with element 5 of ``row`` of ``where`` set to ``value`` (in every head of that tensor)."""
    changed = dict(tensors)
    changed[where] = tensors[where].clone()
    changed[where][:, :, row, 5] = value
    return changed


def _poisoned(where: str, row: int, causal: bool) -> torch.Tensor:
    """``[N]``: the query rows SDPA makes non-finite for a NaN in ``row`` of ``where`` (every q head of the group)."""
    queries = torch.arange(Q_SHAPE[2], device=DEVICE)
    if where == "q":
        return queries == row
    return queries >= row if causal else torch.ones_like(queries, dtype=torch.bool)


def _run(fn, tensors: dict[str, torch.Tensor], causal: bool, precision: AttentionPrecision | None = None):
    q, k, v = (tensors[name].clone().requires_grad_() for name in "qkv")
    out, _ = fn(q, k, v, is_causal=causal, precision=precision)
    return out, (q, k, v)


CASES = [
    pytest.param(where, value, causal, id=f"{where}-{value}-{'causal' if causal else 'full'}")
    for where in ("q", "k", "v")
    for value in (math.nan, math.inf, -math.inf)
    for causal in (False, True)
]


@pytest.mark.parametrize("where, value, causal", CASES)
def test_a_bad_row_poisons_only_the_rows_sdpa_does_on_the_reference(where, value, causal, monkeypatch):
    _check_forward("reference", where, value, causal, monkeypatch)


@pytest.mark.parametrize("backend", ["triton", "hopper"])
@pytest.mark.parametrize("where, value, causal", CASES)
def test_a_bad_row_poisons_only_the_rows_sdpa_does_on_the_kernels(backend, where, value, causal, monkeypatch):
    _check_forward(backend, where, value, causal, monkeypatch)


def _check_forward(backend: str, where: str, value: float, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    fn = _backend(backend, monkeypatch)
    row = BAD_QUERY if where == "q" else BAD_KEY
    clean = _inputs()
    bad = _with(clean, where, row, value)
    out, _ = _run(fn, bad, causal)
    zeroed, _ = _run(fn, _with(clean, where, row, 0.0), causal)
    poisoned = _poisoned(where, row, causal)
    for head in range(Q_SHAPE[1]):
        assert out[0, head, poisoned].isnan().all(), "a row SDPA makes non-finite must be NaN"
        # Every other row: the same bits as the run with the bad value zeroed (the same codes, scales and means).
        assert torch.equal(out[0, head, ~poisoned], zeroed[0, head, ~poisoned])
    # SDPA's non-finite rows are among ours (its CPU math path spreads a NaN of v to earlier causal rows by 0 * NaN).
    # On the CPU: CUDA's math path adds the causal mask to the scores, and NaN + -inf spreads a bad key to every row.
    sdpa = F.scaled_dot_product_attention(
        *(bad[name].double().cpu() for name in "qkv"), is_causal=causal, enable_gqa=True
    )
    sdpa_bad = ~sdpa.isfinite().all(dim=-1)
    if not (where == "v" and causal):
        assert not (sdpa_bad & ~out.cpu().isnan().all(dim=-1)).any()


@pytest.mark.parametrize("backend", ["reference", "triton", "hopper"])
@pytest.mark.parametrize(
    "where, row, causal", [("q", BAD_QUERY, False), ("k", LATE_KEY, True), ("v", LATE_KEY, True)], ids=["q", "k", "v"]
)
def test_the_gradients_of_the_other_row_blocks_are_the_zeroed_runs(backend, where, row, causal, monkeypatch):
    """The backward keeps the NaN in dQ's row blocks of the poisoned rows and dK, dV's key tiles they attend (module
    docstring); dQ of the other row blocks is the zeroed run's, and the gradients are not all finite."""
    fn = _backend(backend, monkeypatch)
    clean = _inputs(seed=1)
    grads = []
    for tensors in (_with(clean, where, row, math.nan), _with(clean, where, row, 0.0)):
        out, leaves = _run(fn, tensors, causal)
        grads.append(torch.autograd.grad(out, leaves, clean["do"]))
    (dq, dk, dv), (dq0, _, _) = grads
    assert not (dk.isfinite().all() and dv.isfinite().all())  # the NaN reaches the weights' gradients
    poisoned = _poisoned(where, row, causal)
    block_poisoned = torch.zeros_like(poisoned).reshape(-1)
    for start in range(0, Q_SHAPE[2], 128):
        block_poisoned[start : start + 128] = poisoned[start : start + 128].any()
    assert block_poisoned.any() and not block_poisoned.all()
    assert dq[:, :, block_poisoned].isnan().any()
    torch.testing.assert_close(dq[:, :, ~block_poisoned], dq0[:, :, ~block_poisoned], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_huge_query_row_leaves_the_other_query_blocks_alone(backend, monkeypatch):
    fn = _backend(backend, monkeypatch)
    clean = _inputs(seed=3)
    out, _ = _run(fn, _with(clean, "q", BAD_QUERY, 1e30), causal=True)
    reference, _ = _run(fn, clean, causal=True)
    assert out.isfinite().all()
    assert torch.equal(out[:, :, 128:], reference[:, :, 128:])  # query block 1: its own scale, the same bits


def test_clean_inputs_quantize_as_before():
    """Confinement changes nothing on finite inputs: the same codes, scales and means."""
    x = torch.randn(2, 3, 150, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    confined, bad = confine(x.float())
    assert torch.equal(confined, x.float()) and not bad.any()
    if HAS_KERNELS:
        for kwargs in ({"fmt": "int8"}, {"fmt": "int8", "block_mean": True}, {"fmt": "fp8"}):
            plain = quantize_rows(x, 64, **kwargs)
            first_bad = torch.full((6,), NO_BAD_KEY, dtype=torch.int32, device=DEVICE)
            kept = quantize_rows(x, 64, **kwargs, confine=True, first_bad=first_bad)
            for a, b in zip(plain, kept, strict=True):
                assert (a is None and b is None) or torch.equal(a.float(), b.float())
            assert (first_bad == NO_BAD_KEY).all()
        assert torch.equal(quantize_channels_fp8(x)[1], quantize_channels_fp8(x, confine=True)[1])
        torch.testing.assert_close(finite_mean(x), x.float().mean(dim=2), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_KERNELS, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
def test_the_confined_quantizer_reports_its_bad_rows():
    x = torch.randn(1, 2, 150, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x[0, 0, 70, 3], x[0, 1, 140, 0], x[0, 1, 20, 1] = math.nan, -math.inf, 1e30
    poison = torch.empty(1, 2, 150, device=DEVICE)
    first_bad = torch.full((2,), NO_BAD_KEY, dtype=torch.int32, device=DEVICE)
    codes, scale, _ = quantize_rows(x, 64, fmt="int8", confine=True, row_poison=poison, first_bad=first_bad)
    assert poison.isnan().nonzero().tolist() == [[0, 0, 70], [0, 1, 140]]
    assert first_bad.tolist() == [70, 140]
    assert scale.isfinite().all()
    torch.testing.assert_close(scale[0, 1, 0].item(), 1e30 / 127, rtol=1e-6, atol=0)  # a huge value is kept
    assert codes[0, 0, 70, 3] == 0 and codes[0, 1, 140, 0] == 0
    zeroed = x.clone()
    zeroed[0, 0, 70, 3] = zeroed[0, 1, 140, 0] = 0
    assert torch.equal(scale[0, 0], quantize_rows(zeroed, 64, fmt="int8")[1][0, 0])


PRECISIONS = [
    pytest.param(AttentionPrecision.all_fp8(), id="fp8"),
    pytest.param(AttentionPrecision(smooth_q=True, smooth_k=False), id="smooth-q-only"),
    pytest.param(AttentionPrecision(qk="bf16", pv="bf16"), id="qk-pv-bf16"),
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("where, causal", [("q", False), ("k", True), ("v", True)])
def test_every_format_and_smoothing_confines_a_nan(backend, precision, where, causal, monkeypatch):
    """FP8 (V per channel over all keys), Q-smoothing's block means, 16-bit products (V unquantized: its NaN reaches
    the rows that attend it through P V itself, and may reach earlier rows whose tiles hold the key by ``0 * NaN``, as
    SDPA's math path's does)."""
    fn = _backend(backend, monkeypatch)
    row = BAD_QUERY if where == "q" else BAD_KEY
    clean = _inputs(seed=4)
    out, _ = _run(fn, _with(clean, where, row, math.nan), causal, precision)
    zeroed, _ = _run(fn, _with(clean, where, row, 0.0), causal, precision)
    poisoned = _poisoned(where, row, causal)
    # Non-finite, every channel (the poison) or, with V unquantized, the channel of the NaN (as SDPA's).
    assert out[:, :, poisoned].isnan().any(dim=-1).all()
    same = out[:, :, ~poisoned] == zeroed[:, :, ~poisoned]
    if where == "v" and precision.pv == "bf16":
        # 0 * NaN in a tile product that holds the key may spread it to earlier rows (as SDPA's math path's does)
        same = same | out[:, :, ~poisoned].isnan()
    assert same.all()
