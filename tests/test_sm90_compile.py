"""The Triton kernels compile for a Hopper GPU and use its 8-bit tensor-core instructions, checked without one.

``benchmarks.kernels.sm90_compile`` swaps Triton's CUDA driver for a stand-in (target sm_90, launches that do
nothing) and compiles every kernel and autotuning candidate of a forward and backward, the portable ones and the
Hopper path's. It runs here under two Tritons: the installed one (CI: the current release, which users get), and
the one the GPU image has and the Hopper path is verified on (``VERIFIED_TRITON``, 3.6), in the Python that
``SAGE_SM90_TRITON_PYTHON`` names. ``.ci/run`` makes that Python (a venv with ``triton==3.6.0``); without the
variable those cases are skipped, and CI fails if it is not set.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = ["-m", "benchmarks.kernels.sm90_compile"]

pytest.importorskip("triton.backends.nvidia.driver", reason="Triton's NVIDIA backend is not installed")


#: The environment variable naming a Python whose Triton is the GPU image's (the one the Hopper path is verified on).
VERIFIED_PYTHON = "SAGE_SM90_TRITON_PYTHON"
#: The kernels of a forward and backward at the default precision, the Hopper path's among them.
HOT_KERNELS = ("_forward_kernel", "_hopper_forward_kernel", "_dkdv_kernel", "_dq_kernel")


def _python(which: str) -> str:
    if which == "installed":
        return sys.executable
    python = os.environ.get(VERIFIED_PYTHON)
    if not python:
        if os.environ.get("CI"):
            pytest.fail(f"{VERIFIED_PYTHON} is not set: CI compiles under the GPU image's Triton too (.ci/run)")
        pytest.skip(f"{VERIFIED_PYTHON} is not set (a Python with the GPU image's Triton, as .ci/run makes)")
    return python


@pytest.fixture(scope="module", params=["installed", "verified"])
def compiled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("sm90") / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [_python(request.param), *SCRIPT, "--head-dim", "64", "--seq", "256", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    if request.param == "verified":
        from sage_lightning.kernels.plan import VERIFIED_TRITON

        version = ".".join(result["triton"].split(".")[:2])
        assert version in VERIFIED_TRITON, f"{VERIFIED_PYTHON} has Triton {result['triton']}, not {VERIFIED_TRITON}"
    return result


def test_every_entry_point_compiles_and_fits(compiled: dict) -> None:
    """Forward and backward, causal and not: no entry point failed, each hot kernel has a candidate that fits."""
    rows = compiled["rows"]
    assert not [row for row in rows if row["kernel"] == "(entry point)"]
    for kernel in HOT_KERNELS:
        fitting = [row for row in rows if row["kernel"] == kernel and row["fits"] and not row["error"]]
        assert fitting, f"{kernel}: no autotuning candidate compiles within sm_90's shared memory"


def test_hot_loops_use_8bit_wgmma_not_mma_sync(compiled: dict) -> None:
    """QK^T, PV and the INT8 backward products run on Hopper's ``wgmma`` with s8 operands; no ``mma.sync``."""
    for row in compiled["rows"]:
        if row["kernel"] in HOT_KERNELS:
            assert any(shape.endswith("s32.s8.s8") for shape in row["wgmma"]), (row["kernel"], row["wgmma"])
            assert row["mma_sync"] == 0, row


def test_bad_tile_argument_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, *SCRIPT, "--tiles", "128"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and "--tiles takes BLOCK_MxBLOCK_N such as 128x64; received '128'" in done.stderr


GLUON_SCRIPT = ["-m", "benchmarks.kernels.gluon_dkdv_compile"]


@pytest.fixture(scope="module")
def gluon_compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The Gluon dK/dV kernel (the warp-specialised 64-key variant and, at D=64, the one-warpgroup-per-half ``wg``
    variant, as the backward launches them) compiled for sm_90 under the GPU image's Triton, the only one whose Gluon
    API they are written for (``GLUON_TRITON``)."""
    python = _python("verified")
    out = tmp_path_factory.mktemp("gluon-sm90") / "gluon.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [python, *GLUON_SCRIPT, "--head-dim", "64", "128", "--seq", "256", "--variant", "ws", "wg",
               "--no-portable", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def _dkdv_rows(gluon_compiled: dict) -> list[dict]:
    """The Gluon dK/dV kernel's rows: one kernel, its variant a constexpr (``WG``: one warpgroup per 64-key half)."""
    return [row for row in gluon_compiled["rows"] if row["kernel"] == "_gluon_dkdv_kernel"]


def test_the_gluon_dkdv_kernel_compiles_fits_and_does_not_spill(gluon_compiled: dict) -> None:
    """Every case (D 64 and 128, causal or not, with and without the dS statistics) compiles within sm_90's
    shared memory, keeps its registers (no spills: the loop the device measured), and runs its INT8 products on
    ``wgmma`` with s8 operands."""
    rows = [row for row in _dkdv_rows(gluon_compiled) if not row["constants"].get("WG")]
    assert len(rows) == 8, [row["case"] for row in rows]
    for row in rows:
        assert not row["error"] and row["fits"], (row["case"], (row["error"] or "")[:2000])
        assert row["spill_stores"] == 0, (row["case"], row["spill_stores"])
        assert any(shape.endswith("s32.s8.s8") for shape in row["wgmma"]), (row["case"], row["wgmma"])
        assert row["mma_sync"] == 0, row["case"]


#: Bytes the ``wg`` variant spilled per case in the build the device measured: none without the dS statistics and 12
#: with them, since delta is loaded after dP^T's wait (device run 35b, NOTES.md: before it 40 and 132, 52 and 112
#: causal, and the dK/dV kernel 1.05-1.11x slower). More means the consumers' registers grew past what was timed.
WG_SPILL_BYTES = {(False, False): 0, (False, True): 12, (True, False): 0, (True, True): 12}


def test_the_wg_dkdv_kernel_compiles_fits_and_spills_no_more_than_measured(gluon_compiled: dict) -> None:
    """The D=64 variant with one warpgroup per 64-key half: every case (causal or not, with and without the dS
    statistics) fits sm_90's shared memory, runs its INT8 products on s8 ``wgmma`` that ptxas does not serialize,
    and spills no more than the build the device measured."""
    rows = [row for row in _dkdv_rows(gluon_compiled) if row["constants"].get("WG")]
    assert len(rows) == 4, [row["case"] for row in rows]
    for row in rows:
        assert not row["error"] and row["fits"], (row["case"], (row["error"] or "")[:2000])
        assert row["constants"]["HEAD_DIM"] == 64, row["case"]
        key = (row["constants"]["CAUSAL"], row["constants"]["WITH_STATS"])
        assert row["spill_stores"] <= WG_SPILL_BYTES[key], (row["case"], row["spill_stores"])
        assert any(shape.endswith("s32.s8.s8") for shape in row["wgmma"]), (row["case"], row["wgmma"])
        assert row["mma_sync"] == 0 and not row["wgmma_serialized"], row["case"]


GLUON_DQ_SCRIPT = ["-m", "benchmarks.kernels.gluon_dq_compile"]
#: Bytes the D=64 ``wg`` dQ kernel spills per case (causal or not) in the build the device measured (device run 11,
#: NOTES.md): none since the producer warpgroup transposes K'^ (the consumers' own transposition spilled 4 bytes
#: causal in device run 10's build).
DQ_WG_SPILL_BYTES = {False: 0, True: 0}


def test_the_gluon_dq_kernels_compile_fit_and_do_not_spill(tmp_path: Path) -> None:
    """The Gluon dQ kernels the backward launches (the warp-specialised variant, dS codes from registers, and at
    D=64 the one-warpgroup-per-block ``wg`` variant) compiled for sm_90 under the GPU image's Triton: every case (D 64
    and 128, causal or not) fits sm_90's shared memory, keeps its registers in the hot loop (and spills no more than
    the build the device measured), runs its INT8 products on s8 ``wgmma`` and ptxas does not serialize them."""
    python = _python("verified")
    out = tmp_path / "gluon-dq.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [python, *GLUON_DQ_SCRIPT, "--head-dim", "64", "128", "--seq", "256", "--variant", "ws", "wg",
               "--no-portable", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = json.loads(out.read_text())["rows"]
    # One kernel, its variant a constexpr (WG: one warpgroup per 128-query block).
    dq_rows = [row for row in rows if row["kernel"] == "_gluon_dq_kernel"]
    counts = collections.Counter(bool(row["constants"].get("WG")) for row in dq_rows)
    assert counts == {False: 4, True: 2}, [(row["kernel"], row["case"]) for row in rows]
    for row in dq_rows:
        assert not row["error"] and row["fits"], (row["case"], (row["error"] or "")[:2000])
        allowed = DQ_WG_SPILL_BYTES[row["constants"]["CAUSAL"]] if row["constants"].get("WG") else 0
        assert row["spill_stores"] <= allowed, (row["case"], row["spill_stores"])
        assert not {"LDL", "STL"} & set(row["loop_opcodes"]), (row["case"], "local memory in the hot loop")
        assert any(shape.endswith("s32.s8.s8") for shape in row["wgmma"]), (row["case"], row["wgmma"])
        assert row["mma_sync"] == 0 and not row["wgmma_serialized"], row["case"]


FORMAT_SCRIPT = ["-m", "tests.format_compile"]


@pytest.mark.parametrize("which", ["installed", "verified"])
def test_every_product_format_compiles(which: str, tmp_path: Path) -> None:
    """A forward and backward with every product in its other formats (FP8 or bf16 dS, FP8 Q K, P V, dV and dP,
    Q-smoothing: :data:`tests.format_compile.CHANGES`) compiles for sm_90 on the portable and the Hopper path, and under
    the GPU image's Triton the Gluon dQ and dK/dV kernels with an FP8 and a bf16 dS: the default precision's compile
    (above) does not reach them, nor does the interpreter see a ``tl`` function that does not compile (device run 46's
    check found one on the GPU)."""
    out = tmp_path / "formats.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [_python(which), *FORMAT_SCRIPT, "--out", str(out), *(["--gluon"] if which == "verified" else [])]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = json.loads(out.read_text())["rows"]
    compiled = {row["case"] for row in rows if not row["error"]}
    for path in ("portable", "hopper"):  # each of the two precisions on each path
        assert len([case for case in compiled if case.startswith(f"{path} D=64 {{")]) == 2, sorted(compiled)
    if which == "verified":
        gluon = {row["case"] for row in rows if row["kernel"] in ("_gluon_dq_kernel", "_gluon_dkdv_kernel")}
        assert len(gluon) == 8, sorted(gluon)


GLUON_FWD_SCRIPT = ["-m", "tests.gluon_fwd_compile"]


def test_the_gluon_forward_compiles_fits_and_does_not_spill(tmp_path: Path) -> None:
    """The warp-specialised Gluon forward with FP8 P.V (``gluon_forward.py``, P's codes through shared memory; two
    consumer warpgroups taking turns, three taking turns, three issuing freely: the defaults at D=64 and D=128)
    compiled for sm_90 under the GPU image's Triton: every case it serves (D 64 and 128, causal or not, INT8 or FP8
    Q K^T) fits sm_90's shared memory, spills nothing, runs P.V on e4m3 ``wgmma`` with fp32 accumulation and Q K^T on
    the format's, and ptxas does not serialize them."""
    python = _python("verified")
    out = tmp_path / "gluon-fwd.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [python, *GLUON_FWD_SCRIPT, "--head-dim", "64", "128", "--seq", "256", "--variant", "pp-smem",
               "3wg-pp-smem", "3wg-free-smem", "--no-portable", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [row for row in json.loads(out.read_text())["rows"] if row["kernel"] == "_gluon_forward_kernel"]
    assert len(rows) == 24, [row["case"] for row in rows]
    for row in rows:
        assert not row["error"] and row["fits"], (row["case"], (row["error"] or "")[:2000])
        assert row["spill_stores"] == 0 and row["local_memory_ops"] == 0, row["case"]
        qk = "s32.s8.s8" if row["constants"]["QK_INT8"] else "f32.e4m3.e4m3"
        assert all(shape.endswith(("f32.e4m3.e4m3", qk)) for shape in row["wgmma"]), (row["case"], row["wgmma"])
        assert any(shape.endswith(qk) for shape in row["wgmma"]), (row["case"], row["wgmma"])
        assert row["mma_sync"] == 0 and not row["wgmma_serialized"], row["case"]


def test_the_row_block_kernels_take_rows_warps_and_do_not_spill(tmp_path: Path) -> None:
    """The forward's quantization of Q, K and V (``_quantize_rows_kernel``) and the backward's preprocess launch
    (``_backward_preprocess_kernel``: delta and dO's codes) compiled for sm_90 under the GPU image's Triton at D 64
    and 128: no spills, and the warps :func:`~sage_lightning.kernels.quant.rows_warps` gives. With 4 warps Q's
    128 x 128 tile spilled 168 bytes; the preprocess ran 1.42-1.57x faster at D=128 with these warps than with 4 on an
    H200 (device run 36, delta and the codes bit for bit)."""
    from sage_lightning.kernels.quant import rows_warps

    python = _python("verified")
    out = tmp_path / "quantize.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [python, *SCRIPT, "--head-dim", "64", "128", "--path", "hopper", "--seq", "256", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = json.loads(out.read_text())["rows"]
    for kernel, block_name in (("_quantize_rows_kernel", "BLOCK"), ("_backward_preprocess_kernel", "BLOCK_M")):
        found = [row for row in rows if row["kernel"] == kernel]
        assert {row["constants"]["D_PAD"] for row in found} == {64, 128}, (kernel, [row["case"] for row in found])
        for row in found:
            block, d_pad = row["constants"][block_name], row["constants"]["D_PAD"]
            assert row["num_warps"] == rows_warps(block, d_pad), (kernel, row["case"], row["num_warps"])
            assert row["spill_stores"] == 0 and row["local_memory_ops"] == 0, (kernel, row["case"], row["spill_stores"])
