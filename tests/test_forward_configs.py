"""``benchmarks/forward_configs.py`` (the forward kernels alone, one tile configuration at a time) on a machine
without a GPU: its command line parses and it refuses to run with a message that says why, before touching
CUDA. The timings themselves need a GPU (``benchmarks/results/speed-h100-20261123-forward-configs.md``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "forward_configs.py"


def test_help_lists_the_options() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True)
    for option in ("--tokens", "--seq", "--head-dim", "--out-dir"):
        assert option in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so_and_writes_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "no CUDA device is available" in done.stderr
    assert not list(tmp_path.iterdir())


def test_a_head_dim_the_hopper_forward_does_not_serve_is_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--head-dim", "96"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--head-dim" in done.stderr and "96" in done.stderr
