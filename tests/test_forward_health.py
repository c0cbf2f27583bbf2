"""The forward's quantization health (qk_rel_err): blind to the scale of healthy inputs, sharp on an outlier that
spoils its block's INT8 scale (issue 16, case 6), measured by the layer on the steps that measure dS, and acted on by
the controller in a real Trainer run."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from sage_lightning.kernels.reference import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, quantize_int8
from tiny_lightning import TinyLM, token_loader, trainer_kwargs
from torch.utils._python_dispatch import TorchDispatchMode

from sage_lightning import AdaptivePrecision, PolicyConfig, attention_layers
from sage_lightning.forward_health import qk_quant_error, qk_rel_err


def inputs(scale: float = 1.0, outlier: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q, k = (scale * torch.randn(1, 2, 1024, 64, generator=generator) for _ in range(2))
    if outlier is not None:
        q[0, 0, 5, 3] = outlier
    return q.bfloat16(), k.bfloat16()


@pytest.mark.parametrize("scale", [1.0, 4.0, 10.0])
def test_healthy_inputs_read_the_same_whatever_their_scale(scale: float) -> None:
    q, k = inputs(scale)
    assert qk_rel_err(qk_quant_error(q, k, smooth_q=False, smooth_k=True).tolist()) == pytest.approx(0.0127, abs=2e-3)


@pytest.mark.parametrize(("outlier", "low", "high"), [(100.0, 0.05, 0.07), (300.0, 0.15, 0.19), (1000.0, 0.22, 0.28)])
def test_one_outlier_in_q_reads_well_above_the_threshold(outlier: float, low: float, high: float) -> None:
    # The inputs (1024 rows, one of 16 blocks of 128 ruined): 0.059, 0.17, 0.25 against 0.013 healthy, where
    # the probe's O cosine reads 0.995, 0.962, 0.919 (docs/controller.md).
    q, k = inputs(outlier=outlier)
    assert low < qk_rel_err(qk_quant_error(q, k, smooth_q=False, smooth_k=True).tolist()) < high


class QueryOutlier(Callback):
    """Set one query entry of the first attention layer to 300 (the rest of q is O(1))."""

    def on_train_start(self, trainer, pl_module) -> None:
        def hook(module, args, output):
            output = output.clone()
            output[0, 3, 0] = 300.0  # batch 0, token 3, the first channel of q
            return output

        pl_module.blocks[0].attn.qkv.register_forward_hook(hook)


def test_an_outlier_in_q_moves_its_layer_to_qk_bf16(tmp_path) -> None:
    torch.manual_seed(0)
    # The probe at step 0 would see the outlier too (O cosine 0.989): loosened here so qk_rel_err alone decides.
    lenient_probe = dict(probe_o_cos_min=0.5, probe_grad_cos_min=0.5, probe_catastrophic_cos=0.1)
    config = PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=1000, **lenient_probe)
    controller = AdaptivePrecision(config, verbose=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3), callbacks=[controller, QueryOutlier()])
    model = TinyLM()
    trainer.fit(model, token_loader(3))

    (decision,) = controller.history
    assert (decision.step, decision.layer) == (1, "blocks.0.attn") and "qk_rel_err" in decision.reason
    assert attention_layers(model)["blocks.0.attn"].precision.qk == "bf16"
    assert attention_layers(model)["blocks.1.attn"].precision.qk == "int8"


def one_element_at_a_time(q: torch.Tensor, k: torch.Tensor, *, smooth_q: bool, smooth_k: bool) -> torch.Tensor:
    """The first implementation (one batch element at a time, through the kernels' own ``quantize_int8``): what the
    batched one must equal."""

    def rows(x: torch.Tensor, block: int, smooth: bool) -> torch.Tensor:
        total = torch.zeros(2, dtype=torch.float64)
        for element in x.detach():
            heads, n, dim = element.shape
            padded = -(-n // block) * block
            blocks = torch.nn.functional.pad(element.float(), (0, 0, 0, padded - n)).reshape(heads, -1, block, dim)
            if smooth:
                valid = (torch.arange(padded) < n).reshape(padded // block, block, 1).float()
                mean = blocks.sum(dim=2, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp_min(1)
                blocks = (blocks - mean) * valid
            codes, scale = quantize_int8(blocks, (-2, -1))
            err = (blocks - codes * scale).square().sum(dim=-1)
            norm = blocks.square().sum(dim=-1)
            counted = norm > 0
            rel = torch.where(counted, err / norm.where(counted, torch.ones_like(norm)), torch.zeros_like(norm))
            total += torch.stack([rel.sum().double(), counted.sum().double()])
        return total

    keys = k.detach().float()
    if smooth_k:
        keys = keys - keys.mean(dim=2, keepdim=True)
    return torch.cat([rows(q, DEFAULT_BLOCK_M, smooth_q), rows(keys, DEFAULT_BLOCK_N, False)])


def attention_inputs(batch: int, q_heads: int, k_heads: int, n: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(batch, q_heads, n, 64, generator=generator)
    k = torch.randn(batch, k_heads, n, 64, generator=generator) + 2  # a mean over tokens for smooth_k to remove
    q[0, 0, min(5, n - 1), 3] = 300.0  # an outlier that spoils its block's scale
    q[-1, -1, n // 2] = 0.0  # an all-zero row: not counted
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 63, 64, 200, 256, 300])  # ragged: not a multiple of 128 (Q) or 64 (K) blocks
@pytest.mark.parametrize(("q_heads", "k_heads"), [(4, 4), (8, 2)])  # MHA and GQA
@pytest.mark.parametrize(("smooth_q", "smooth_k"), [(False, True), (True, False), (True, True), (False, False)])
def test_the_batched_measurement_equals_one_element_at_a_time(dtype, n, q_heads, k_heads, smooth_q, smooth_k) -> None:
    # The mask plays no part: Q' and K' are quantized whole, causal or not.
    q, k = attention_inputs(3, q_heads, k_heads, n, dtype)
    expected = one_element_at_a_time(q, k, smooth_q=smooth_q, smooth_k=smooth_k)
    torch.testing.assert_close(qk_quant_error(q, k, smooth_q=smooth_q, smooth_k=smooth_k), expected, rtol=1e-5, atol=0)


def test_non_finite_inputs_read_as_one_element_at_a_time_did() -> None:
    # A NaN row is not counted; a NaN spread by the block mean (smooth_q) or an infinity makes the sum NaN.
    q, k = attention_inputs(2, 2, 2, 200, torch.float32)
    q[0, 1, 3, 3], k[1, 0, 150, 2] = float("nan"), float("inf")
    for smooth in (False, True):
        expected = one_element_at_a_time(q, k, smooth_q=smooth, smooth_k=smooth)
        got = qk_quant_error(q, k, smooth_q=smooth, smooth_k=smooth)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0, equal_nan=True)


def test_the_inputs_are_left_alone() -> None:
    q, k = attention_inputs(2, 4, 2, 300, torch.float32)  # float32: no copy of its own before the arithmetic
    q_before, k_before = q.clone(), k.clone()
    for smooth in (False, True):
        qk_quant_error(q, k, smooth_q=smooth, smooth_k=smooth)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


class CountOps(TorchDispatchMode):
    """Every ATen operation dispatched while active, and the host reads of a device value among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n", [256, 300])
@pytest.mark.parametrize("smooth_q", [False, True])
def test_the_measurement_costs_a_fixed_number_of_operations_whatever_the_batch_and_heads(n: int, smooth_q) -> None:
    """Measured on the GPU (issue 16, item 7): one element at a time it took ~60 operations per batch element and
    layer (1912 per measured step of 8 layers at batch 4), 23-28 ms of a step; batched it is a fixed few dozen."""
    counts = set()
    for batch, q_heads, k_heads in [(1, 2, 2), (4, 16, 16), (16, 16, 4), (32, 8, 1)]:
        q, k = attention_inputs(batch, q_heads, k_heads, n, torch.bfloat16)
        counter = CountOps()
        with counter:
            qk_quant_error(q, k, smooth_q=smooth_q, smooth_k=True)
        assert counter.host_reads == 0
        counts.add(counter.ops)
    assert len(counts) == 1 and counts.pop() <= 64
