"""The Triton kernels compile for a Hopper GPU and use its 8-bit tensor-core instructions, checked without one.

``benchmarks/sm90_compile.py`` swaps Triton's CUDA driver for a stand-in (target sm_90, launches that do
nothing) and compiles every kernel and autotuning candidate of a forward and backward. Here it runs with the
installed Triton (CI: the current release); on the GPU image's Triton 3.6, see the script's docstring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "sm90_compile.py"

pytest.importorskip("triton.backends.nvidia.driver", reason="Triton's NVIDIA backend is not installed")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("sm90") / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(SCRIPT), "--head-dim", "64", "--seq", "256", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def test_every_entry_point_compiles_and_fits(compiled: dict) -> None:
    """Forward and backward, causal and not: no entry point failed, each hot kernel has a candidate that fits."""
    rows = compiled["rows"]
    assert not [row for row in rows if row["kernel"] == "(entry point)"]
    for kernel in ("_forward_kernel", "_dkdv_kernel", "_dq_kernel"):
        fitting = [row for row in rows if row["kernel"] == kernel and row["fits"] and not row["error"]]
        assert fitting, f"{kernel}: no autotuning candidate compiles within sm_90's shared memory"


def test_hot_loops_use_8bit_wgmma_not_mma_sync(compiled: dict) -> None:
    """QK^T, PV and the INT8 backward products run on Hopper's ``wgmma`` with s8 operands; no ``mma.sync``."""
    for row in compiled["rows"]:
        if row["kernel"] in ("_forward_kernel", "_dkdv_kernel", "_dq_kernel"):
            assert any(shape.endswith("s32.s8.s8") for shape in row["wgmma"]), (row["kernel"], row["wgmma"])
            assert row["mma_sync"] == 0, row


def test_bad_tile_argument_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiles", "128"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "--tiles takes BLOCK_MxBLOCK_N such as 128x64; received '128'" in done.stderr
