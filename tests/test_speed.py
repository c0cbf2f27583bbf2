"""benchmarks.kernels.speed without a GPU: its command line, the FP8 implementations' precisions and calls, and the
table built from synthetic rows (the timings themselves need CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sage_lightning.kernels import AttentionPrecision

from benchmarks.kernels import speed
from benchmarks.training import readme_perf

REPO = Path(__file__).resolve().parent.parent
HOPPER = speed.HOPPER_ENV


SHAPE = {"batch": 4, "heads": 16, "kv_heads": 16, "seq": 4096, "head_dim": 128, "causal": False}


def _rows(ms: dict[str, float], **shape: object) -> list[dict]:
    """Rows of one shape, every pass, for each implementation of ``ms`` (its time; TFLOPS ``100 / ms``)."""
    shape = {**SHAPE, **shape}
    return [
        {"impl": impl, "pass": which, **shape, "ms": t, "tflops": 100.0 / t,
         "peak_mem_mb": 400.0 + 10 * t if which == "fwd+bwd" else None}
        for impl, t in ms.items()
        for which in speed.PASSES
    ]  # fmt: skip


def test_help_and_fp8_impls_on_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.kernels.speed", "--help"], capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for impl in ("sage_fp8_pv", "sage_fp8_ds", "sage_fp8_pv_ds", "sage_fp8"):
        assert impl in done.stdout
        assert speed.parse_args(["--impl", "sage", "--impl", impl]).impl == ["sage", impl]
    assert speed.parse_args([]).impl is None  # the default: sage and the SDPA backends, as before


def test_fp8_impls_run_the_precisions_they_name() -> None:
    assert set(speed.FP8_IMPLS) <= set(speed.SAGE_IMPLS) and set(speed.PRECISIONS) == set(speed.SAGE_IMPLS)
    default = AttentionPrecision()
    assert speed.FP8_IMPLS == {
        "sage_fp8_pv": default.replace(pv="fp8"),
        "sage_fp8_ds": default.replace(ds="fp8"),
        "sage_bf16_ds": default.replace(ds="bf16"),
        "sage_fp8_pv_ds": default.replace(pv="fp8", ds="fp8"),
        "sage_fp8": AttentionPrecision.all_fp8(),
    }
    names = [precision.short_name for precision in speed.FP8_IMPLS.values()]
    assert len(set(names)) == len(names) and all("fp8=" in name or "ds" not in name for name in names)


def test_fp8_impl_calls_sage_attention_triton_with_its_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        calls.append(kwargs)
        return q, None

    monkeypatch.setattr(speed, "sage_attention_triton", fake)
    q = torch.zeros(1, 1, 4, 8)
    for impl, precision in speed.FP8_IMPLS.items():
        assert speed._attention(impl, block_m=64)(q, q, q, True) is q
        assert calls[-1] == {"is_causal": True, "precision": precision, "with_lse": False, "block_m": 64}
    speed._attention("sage")(q, q, q, False)
    assert "precision" not in calls[-1]  # sage keeps the default precision, as before


def test_table_has_fp8_rows_with_ratios_to_flash_cudnn_and_sage() -> None:
    rows = _rows({"sage": 1.0, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0, "sage_fp8_pv": 0.5, "sage_fp8": 4.0})
    text = speed.table(rows)
    # The INT8 table as before: cuDNN 2 ms, flash 3 ms, SageBwd 1 ms.
    assert "| 128 | 4096 | no | fwd+bwd | 100 | 33 | 50 | 3.00 | 2.00 | 410 / 430 / 420 |" in text
    assert "FP8 mixes (sage_fp8_pv: `sagebwd:int8=qk,dv,ds;fp8=pv;smooth_k`; sage_fp8: " in text
    # sage_fp8_pv at 0.5 ms: 6x flash, 4x cuDNN, 2x sage; sage_fp8 at 4 ms: 0.75x flash, 0.5x cuDNN, 0.25x sage.
    assert "| 128 | 4096 | no | fwd+bwd | sage_fp8_pv | 200 | 6.00 | 4.00 | 2.00 | 405 |" in text
    assert "| 128 | 4096 | no | fwd | sage_fp8 | 25 | 0.75 | 0.50 | 0.25 | - |" in text
    assert "sage_fp8_ds" not in text  # not timed: no rows, no legend


def test_table_handles_implementations_absent_from_a_run() -> None:
    # No sage, no flash; an FP8 impl timed at one shape only (say, refused at the other).
    rows = _rows({"sdpa_cudnn": 2.0, "sage_fp8_ds": 1.0}) + _rows({"sdpa_cudnn": 1.0}, seq=1024, batch=16)
    text = speed.table(rows)
    assert "sage TFLOPS" not in text  # the INT8 table needs sage's rows
    assert "| 128 | 4096 | no | fwd+bwd | sage_fp8_ds | 100 | - | 2.00 | - | 410 |" in text
    assert "| 1024 |" not in text
    assert "FP8 mixes" not in speed.table(_rows({"sage": 1.0, "sdpa_cudnn": 2.0}))
    assert speed.table([]) == ""


def test_readme_keeps_to_the_int8_sage_rows(tmp_path: Path) -> None:
    """FP8 rows in a speed result change neither which file the README takes nor its table."""
    plain = [*(_rows({"sage": 1.0, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0}, head_dim=d) for d in (64, 128))]
    plain = plain[0] + plain[1]
    header = {"kind": "speed", "device": "NVIDIA H100", "date": "2026-11-27", "commit": "0" * 40, "command": "x"}
    with_fp8 = {**header, "rows": plain + _rows({"sage_fp8_pv": 0.5, "sage_fp8": 0.25})}
    assert readme_perf.is_speed_run(with_fp8)
    # A run of one head dim (a kernel's check, device run 25's D=64 one) is not the table's source.
    assert not readme_perf.is_speed_run({**header, "rows": [r for r in plain if r["head_dim"] == 64]})
    path = tmp_path / "speed-h100-20261127.json"
    assert readme_perf.speed_table(path, with_fp8) == readme_perf.speed_table(path, {**header, "rows": plain})
    assert not readme_perf.is_speed_run({**header, "rows": _rows({"sage_fp8": 1.0, "sdpa_cudnn": 2.0})})


def test_cudnn_fp8_is_an_impl_with_rows_beside_sages_and_refuses_what_cudnn_cannot_run() -> None:
    assert speed.parse_args(["--impl", "sage", "--impl", "sdpa_cudnn_fp8"]).impl == ["sage", speed.CUDNN_FP8]
    rows = _rows({"sage": 1.0, "sdpa_cudnn": 2.0, "sdpa_cudnn_fp8": 1.5, "sage_bf16_ds": 1.0})
    text = speed.table(rows)
    assert "sage_bf16_ds: `sagebwd:int8=qk,pv,dv;smooth_k`; sdpa_cudnn_fp8: cuDNN's FP8):" in text
    assert "| 128 | 4096 | no | fwd+bwd | sdpa_cudnn_fp8 | 67 | - | 1.33 | 0.67 | 415 |" in text
    q = torch.zeros(1, 1, 4, 128)
    with pytest.raises(ValueError, match="CUDA tensors"):  # main() reports it and goes on to the next shape
        speed._attention(speed.CUDNN_FP8)(q, q, q, False)


@pytest.mark.parametrize("before", [None, "force"])
def test_sage_portable_turns_the_hopper_kernels_off_for_its_call_only(monkeypatch: pytest.MonkeyPatch, before) -> None:
    seen = []
    monkeypatch.setattr(speed, "sage_attention_triton", lambda q, *a, **k: (seen.append(os.environ[HOPPER]), (q,))[1])
    if before is None:
        monkeypatch.delenv(HOPPER, raising=False)
    else:
        monkeypatch.setenv(HOPPER, before)
    q = torch.zeros(1, 1, 4, 8)
    assert speed._attention("sage_portable")(q, q, q, True) is q
    assert seen == ["off"] and os.environ.get(HOPPER) == before


def test_heads_on_the_command_line_time_the_training_shape_with_fewer_key_value_heads() -> None:
    """``--heads 10 5``: the example's grouped heads (examples/configs/small.yaml); SDPA gets ``enable_gqa`` as
    examples/llama.py passes it, so its rows time what a full-precision step runs."""
    assert speed.parse_args(["--heads", "10", "5"]).heads == [10, 5]
    assert speed.parse_args([]).heads is None  # the default: 2048 / D query and key/value heads
    with pytest.raises(SystemExit):
        speed.parse_args(["--heads", "10"])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 32, 16, generator=gen)
    k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(speed._attention("sdpa_flash")(q, k, v, True), want)
