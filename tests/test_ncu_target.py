"""``benchmarks/ncu_target.py`` and ``benchmarks/ncu_kernels.sh`` (Nsight Compute on one forward and backward) on
a machine without a GPU: the shell script parses, the target refuses bad sizes by name and, without CUDA, says why
before touching it. The profile itself needs a GPU with readable counters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "benchmarks" / "ncu_target.py"


def test_the_shell_driver_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "ncu_kernels.sh")], check=True)


def test_sizes_that_do_not_divide_are_refused() -> None:
    done = subprocess.run([sys.executable, str(TARGET), "--seq", "3000"], capture_output=True, text=True)
    assert done.returncode == 2 and "--tokens must be a multiple of --seq; received 16384 and 3000" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so() -> None:
    done = subprocess.run([sys.executable, str(TARGET)], capture_output=True, text=True)
    assert done.returncode == 1 and "no CUDA device is available" in done.stderr
