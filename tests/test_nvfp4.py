"""NVFP4 fake quantization (kernels/nvfp4.py): grid, ties, saturation, zero and NaN blocks, ragged lengths,
the second-level scale at both extremes, and agreement with an independent formula (tests/qat_formula.py)."""

from __future__ import annotations

import pytest
import torch
from qat_formula import GRID, e2m1, e4m3, nvfp4, nvfp4_two_level
from sage_lightning.kernels.nvfp4 import (
    E2M1_VALUES,
    fake_quantize_nvfp4,
    nvfp4_quantize,
    nvfp4_tensor_scale,
    round_e2m1,
    round_e4m3,
)

NAN = float("nan")


def test_e2m1_grid_ties_and_saturation() -> None:
    assert E2M1_VALUES == GRID
    grid = torch.tensor(GRID)
    assert torch.equal(round_e2m1(grid), grid) and torch.equal(round_e2m1(-grid), -grid)
    # Every midpoint between neighbours goes to the even code: 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_e2m1(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    just = torch.tensor([0.2500001, 0.7499999, 4.9999, 5.0001])
    assert round_e2m1(just).tolist() == [0.5, 0.5, 4.0, 6.0]
    big = torch.tensor([6.5, 7.0, 100.0, float("inf"), -1e30])
    assert round_e2m1(big).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0]
    assert round_e2m1(torch.tensor([NAN])).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_e2m1_against_grid_search(dtype: torch.dtype) -> None:
    y = torch.randn(20000, generator=torch.Generator().manual_seed(0), dtype=dtype) * 4
    assert torch.equal(round_e2m1(y), e2m1(y))


def test_e4m3_against_torch_float8_including_every_tie() -> None:
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite value >= 0
    assert values[-1] == 448 and values[1] == 2.0**-9
    assert torch.equal(round_e4m3(values), values)
    midpoints = (values[1:] + values[:-1]) / 2  # ties: round to the even mantissa
    assert torch.equal(round_e4m3(midpoints), e4m3(midpoints))
    assert torch.equal(round_e4m3(-midpoints), e4m3(-midpoints))
    g = torch.Generator().manual_seed(1)
    random = torch.exp(torch.empty(20000).uniform_(-12, 6.2, generator=g))  # 6e-6 to 490: subnormals to saturation
    assert torch.equal(round_e4m3(random), e4m3(random))
    assert round_e4m3(torch.tensor([464.0, 465.0, 1e30, float("inf")])).tolist() == [448.0] * 4
    assert round_e4m3(torch.tensor([2.0**-10, 3 * 2.0**-10, 0.0])).tolist() == [0.0, 2.0**-8, 0.0]
    assert round_e4m3(torch.tensor([NAN])).isnan().all()


@pytest.mark.parametrize("length", [16, 40, 64, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_quantizer_against_the_independent_formula(length: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(length)
    x = (torch.randn(3, 5, length, generator=g) * torch.rand(3, 5, 1, generator=g) * 10).to(dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert torch.equal(fake_quantize_nvfp4(x), nvfp4(x.to(compute)))
    scale = nvfp4_tensor_scale(x, dims=(-2, -1))
    assert torch.equal(fake_quantize_nvfp4(x, scale), nvfp4_two_level(x.to(compute), (-2, -1)))
    assert fake_quantize_nvfp4(x).dtype == compute


def test_values_are_grid_times_e4m3_and_exact_in_16_bit_types() -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 3
    values, block_scales = nvfp4_quantize(x, nvfp4_tensor_scale(x, dims=(-1,)))
    assert block_scales.shape == (4, 4)
    assert torch.equal(e4m3(block_scales), block_scales) and (block_scales <= 448).all()
    assert (block_scales.amax(dim=-1) == 448).all()  # the second-level scale maps each row's max block to 448
    codes = values.reshape(4, 4, 16) / block_scales[..., None]
    assert torch.isin(codes.abs(), torch.tensor(GRID)).all()
    assert (codes.abs().amax(dim=-1) == 6).all()  # each block's max lands on 6 (scale rounding permitting)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(values.to(dtype).float(), values)


def test_representable_blocks_are_reproduced_exactly() -> None:
    grid = torch.tensor(GRID)
    x = torch.cat([grid, -grid]) * 0.75  # block max 4.5: block scale 0.75 is an E4M3 value
    assert torch.equal(fake_quantize_nvfp4(x), x)


def test_zero_blocks_and_ragged_lengths() -> None:
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(3))
    x[0, 16:32] = 0
    values, block_scales = nvfp4_quantize(x)
    assert block_scales.shape == (2, 3) and block_scales[0, 1] == 0
    assert (values[0, 16:32] == 0).all() and values.isfinite().all()
    padded = torch.nn.functional.pad(x, (0, 8))
    assert torch.equal(values, nvfp4_quantize(padded)[0][:, :40])  # a ragged block is a zero-padded one
    assert torch.equal(
        fake_quantize_nvfp4(torch.zeros(3, 16), nvfp4_tensor_scale(torch.zeros(3, 16), (-1,))), torch.zeros(3, 16)
    )


def test_nan_poisons_its_block_and_with_a_tensor_scale_its_tensor() -> None:
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(4))
    x[0, 20] = NAN
    single = fake_quantize_nvfp4(x)
    assert single[0, 16:32].isnan().all() and single[0, :16].isfinite().all() and single[1].isfinite().all()
    two_level = fake_quantize_nvfp4(x, nvfp4_tensor_scale(x, dims=(-1,)))
    assert two_level[0].isnan().all() and two_level[1].isfinite().all()
    x[1, 3] = float("inf")
    assert fake_quantize_nvfp4(x, nvfp4_tensor_scale(x, dims=(-1,)))[1].isnan().all()
    assert fake_quantize_nvfp4(x)[1, 3] == 2688  # single level: an infinity saturates, as the hardware's does


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e6])
def test_the_second_level_scale_keeps_tiny_and_huge_tensors(magnitude: float) -> None:
    """With the FP32 scale every magnitude quantizes alike; without it E4M3 flushes tiny blocks and clips huge ones."""
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5)) * magnitude
    two_level = fake_quantize_nvfp4(x, nvfp4_tensor_scale(x, dims=(-2, -1)))
    reference = fake_quantize_nvfp4(x / magnitude, nvfp4_tensor_scale(x / magnitude, dims=(-2, -1))) * magnitude
    assert torch.allclose(two_level, reference, rtol=1e-5, atol=0)
    error = ((two_level - x).norm() / x.norm()).item()
    assert 0.05 < error < 0.12  # FP4's error on normal data, whatever the magnitude
    single = fake_quantize_nvfp4(x)
    if magnitude == 1e-6:
        assert (single == 0).all()  # amax / 6 < 2**-10: every block scale underflows E4M3
    elif magnitude == 1e6:
        assert single.abs().max() == 2688 and ((single - x).norm() / x.norm()) > 0.99  # clipped to 6 * 448
    else:
        assert ((single - x).norm() / x.norm()).item() < 0.12
