"""``benchmarks/step_profile.py`` (the GPU's busy share of a training step) on the CPU: it trains the tiny config
through its profiled window and writes one row per run; bad window sizes are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "step_profile.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import step_profile  # noqa: E402


def test_it_profiles_each_run_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    runs = ["--runs", "sage:controller=off", "full:controller=off"]
    window = ["--start", "1", "--steps", "2", "--set", "data.seq_len=64"]
    command = [sys.executable, str(SCRIPT), "--config", "examples/configs/tiny.yaml", *runs, *window, "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kind"] == "overhead" and "--steps 2" in result["command"]
    assert [row["what"] for row in result["rows"]] == ["sage-fixed", "full"]
    for row in result["rows"]:
        assert row["steps"] == 2 and row["step_ms"] > 0 and row["device_ms"] > 0 and row["top_kernels_ms"]
    assert "| sage-fixed |" in done.stdout


def test_an_empty_window_is_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "0"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--start and --steps must be at least 1; received 15 and 0" in done.stderr


@pytest.mark.parametrize(
    ("kernel", "counted"),
    [
        ("_gluon_dkdv_wg_kernel", True),  # missed by the first step profile of 2026-11-24 (a "_dkdv_kernel" match)
        ("_gluon_dkdv_kernel", True),
        ("_dkdv_kernel", True),
        ("_gluon_dq_kernel", True),
        ("_gluon_dq_wg_kernel", True),  # missed by the step profile at 8cc3688 (a "_dq_kernel" match)
        ("_hopper_forward_kernel", True),
        ("_quantize_rows_kernel", True),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", True),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", True),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", False),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", False),
    ],
)
def test_every_attention_kernel_is_counted_and_nothing_else(kernel: str, counted: bool) -> None:
    assert step_profile.is_attention(kernel) is counted
