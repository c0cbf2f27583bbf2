"""The accuracy harness (benchmarks.kernels.accuracy) at a tiny size: file format, row schema, sane metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.kernels import accuracy

ROW_KEYS = {
    "path",
    "setting",
    "label",
    "inputs",
    "batch",
    "heads",
    "kv_heads",
    "seq",
    "head_dim",
    "causal",
    "smooth_k",
    "tensor",
    "cos",
    "rel_l2",
}
# seq 96 is not a multiple of the 128-query or 64-key tile; the causal run also has GQA.
CASES = {
    "plain": ["--seq", "96", "--head-dim", "32"],
    "causal-gqa": ["--seq", "96", "--head-dim", "32", "--heads", "4", "--kv-heads", "2", "--causal"],
}


@pytest.fixture(scope="module", params=list(CASES))
def result(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, list]:
    """The harness run in-process on one case; returns (returned dict, JSON path, argv)."""
    out = tmp_path_factory.mktemp(request.param) / "acc.json"
    argv = [*CASES[request.param], "--out", str(out)]
    return accuracy.main(argv), out, argv


def test_header_and_files(result: tuple[dict, Path, list]) -> None:
    returned, out, argv = result
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    assert data["kind"] == "accuracy" and data["device"] == "cpu"
    assert len(data["date"]) == 10 and data["date"][4] == "-" and data["commit"]
    assert data["command"].startswith("python -m benchmarks.kernels.accuracy") and argv[-1] in data["command"]
    assert "torch" in data["versions"]
    assert out.with_suffix(".md").read_text().count("| bf16 |") == 2 * 2 * len(accuracy.input_kinds())


def test_row_schema(result: tuple[dict, Path, list]) -> None:
    rows, argv = result[0]["rows"], result[2]
    n_settings = len(accuracy.settings(True))
    assert len(rows) == len(accuracy.input_kinds()) * 2 * n_settings * len(accuracy.TENSORS)
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["path"] == "reference" and row["tensor"] in accuracy.TENSORS
        assert row["setting"].startswith("sagebwd:int8=") and row["seq"] == 96 and row["head_dim"] == 32
        assert row["causal"] == ("--causal" in argv) and row["smooth_k"] == ("smooth_k" in row["setting"])
    assert len({(r["setting"], r["label"]) for r in rows}) == 2 * n_settings  # short names are distinct


def test_bf16_baseline_and_cos_bounds(result: tuple[dict, Path, list]) -> None:
    rows = result[0]["rows"]
    for row in rows:
        assert row["cos"] is None or row["cos"] <= 1.0
        assert row["rel_l2"] is None or row["rel_l2"] >= 0.0
        if row["label"] == "bf16":
            assert row["cos"] is not None and math.isfinite(row["cos"])
            if row["tensor"] == "O":
                assert row["cos"] > 0.999, row


def test_every_cos_finite(result: tuple[dict, Path, list]) -> None:
    bad = {(r["inputs"], r["label"], r["smooth_k"]) for r in result[0]["rows"] if r["cos"] is None}
    assert not bad, sorted(bad)


def test_triton_path_rows(tmp_path: Path) -> None:
    """``--path triton`` measures the kernels' outputs (Triton interpreter on a CPU) and judges the bar."""
    out = tmp_path / "acc-triton.json"
    result = accuracy.main(
        [
            "--seq",
            "80",
            "--head-dim",
            "16",
            "--causal",
            "--path",
            "triton",
            "--inputs",
            "normal sigma=1",
            "--out",
            str(out),
        ]
    )
    rows = result["rows"]
    assert {row["path"] for row in rows} == {"triton"}
    assert {row["tensor"] for row in rows} == set(accuracy.OUTPUT_TENSORS)
    default = {row["tensor"]: row for row in rows if row["label"] == "sagebwd" and row["smooth_k"]}
    assert 0.99 < default["dQ"]["cos"] < 1.0  # INT8 error is there, and small
    assert "bar (O, dV >= 0.999" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_attn_qat_mode(tmp_path: Path, path: str) -> None:
    """``--mode attn_qat``: simulated NVFP4 beside bf16 and SageBwd, against float64 and against its own gradient."""
    out = tmp_path / "acc-qat.json"
    argv = ["--seq", "80", "--head-dim", "16", "--mode", "attn_qat", "--inputs", "normal sigma=1", "--path", path]
    rows = accuracy.main([*argv, "--out", str(out)])["rows"]
    labels = {row["label"] for row in rows}
    assert labels == {"bf16", "sagebwd", "attn_qat", "attn_qat dropin"}
    assert {row["setting"] for row in rows if row["label"].startswith("attn_qat")} == {"attn_qat", "attn_qat:dropin"}
    assert all(set(row) == ROW_KEYS | {"against"} and row["path"] == path for row in rows)
    by = {(row["label"], row["against"], row["tensor"]): row for row in rows}
    assert {against for _, against, _ in by} == {"float64", "fp4_float64"}
    assert not any(label in ("bf16", "sagebwd") and against == "fp4_float64" for label, against, _ in by)
    assert 0.95 < by[("attn_qat", "float64", "O")]["cos"] < 0.995  # FP4's error, larger than INT8's
    assert by[("sagebwd", "float64", "O")]["cos"] > by[("attn_qat", "float64", "O")]["cos"]
    # The matched backward is the gradient of the FP4 forward; the drop-in one is not.
    for tensor in ("dQ", "dK", "dV"):
        assert by[("attn_qat", "fp4_float64", tensor)]["cos"] > 0.999
        assert by[("attn_qat dropin", "fp4_float64", tensor)]["cos"] < 0.995
    text = out.with_suffix(".md").read_text()
    assert text.startswith(f"# Accuracy: Attn-QAT (simulated NVFP4) ({path}) vs float64")
    assert "### cos: normal sigma=1, against fp4_float64" in text and "## Summary (simulated NVFP4)" in text


def test_formats_settings() -> None:
    """``--mode formats``: the INT8 settings of the default mode, then each product alone in FP8 and the mixes."""
    for smooth_k in (True, False):
        int8 = accuracy.settings(smooth_k)
        pairs = accuracy.settings(smooth_k, "formats")
        labels = [label for label, _ in pairs]
        assert pairs[: len(int8)] == int8 and len(set(labels)) == len(labels)
        assert len({precision.short_name for _, precision in pairs}) == len(pairs)  # each label its own numerics
        assert labels[len(int8) :] == list(accuracy.FP8_LABELS)
        by_label = dict(pairs)
        for product in accuracy.PRODUCTS:
            alone = by_label[f"only {product} fp8"]
            assert alone.fp8_products == (product,) and alone.int8_products == ()
        default = accuracy.AttentionPrecision(smooth_k=smooth_k)
        assert by_label["default, pv fp8"] == default.replace(pv="fp8")
        assert by_label["default, ds fp8"] == default.replace(ds="fp8")
        assert by_label["default, pv+ds fp8"] == default.replace(pv="fp8", ds="fp8")
        assert by_label["fp8 fwd, int8 bwd"] == default.replace(qk="fp8", pv="fp8")
        assert by_label["all fp8"] == accuracy.AttentionPrecision.all_fp8(smooth_k=smooth_k)
        assert all(precision.smooth_k == smooth_k for _, precision in pairs)
    # The default mode (and attribution.py, which takes it) has no FP8 setting.
    assert not any(precision.fp8_products for _, precision in accuracy.settings(True))
    with pytest.raises(ValueError, match="mode must be one of"):
        accuracy.settings(True, "fp8")


def test_formats_mode_rows_and_tables(tmp_path: Path) -> None:
    out = tmp_path / "acc-formats.json"
    argv = ["--seq", "96", "--head-dim", "32", "--causal", "--mode", "formats", "--inputs", "normal sigma=1"]
    rows = accuracy.main([*argv, "--out", str(out)])["rows"]
    n_settings = len(accuracy.settings(True, "formats"))
    assert len(rows) == 2 * n_settings * len(accuracy.TENSORS)
    assert all(set(row) == ROW_KEYS and row["cos"] is not None and row["rel_l2"] is not None for row in rows)
    assert {row["label"] for row in rows} == {label for label, _ in accuracy.settings(True, "formats")}
    assert len({(r["setting"], r["smooth_k"]) for r in rows}) == 2 * n_settings
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# Accuracy: SageBwd, INT8 and FP8 products (reference) vs float64")
    assert "## Summary (setting sagebwd, smooth_k=True)" in text  # the INT8 summary, as in the default mode
    assert "## FP8 (e4m3) against INT8, rel_l2 against float64 (smooth_k=True)" in text
    assert "FP8 / INT8 rel_l2, each product alone: qk (P) " in text and ", ds (dS) " in text
    for label in accuracy.FP8_LABELS:
        # cos and rel_l2 tables for smooth_k True and False, and the summary's table
        assert text.count(f"| {label} |") == 5, label


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_ds_beats_int8_ds_on_normal_inputs(causal: bool) -> None:
    """dS alone in FP8 (e4m3, per-tile scale) is more accurate than in INT8 on N(0, 1) inputs: the rounding of a
    dS tile's many small entries is relative in e4m3, absolute in INT8. Over seeds 0-19 at this size the ratio
    of rel_l2 (FP8 / INT8) was at most 0.91 for dS, dQ and dK, causal or not; seed 0 is what runs here.

    (It does not hold for wider inputs: at N(0, 16) and with outlier channels FP8's dS error was the larger.)
    """
    argv = ["--seq", "128", "--head-dim", "32", *(["--causal"] if causal else [])]
    inputs = accuracy.make_inputs("normal sigma=1", accuracy.parse_args(argv))
    ref = accuracy.exact(inputs, causal)
    by_label = dict(accuracy.settings(True, "formats"))
    int8 = accuracy.measure(inputs, ref, by_label["only ds"], causal)
    fp8 = accuracy.measure(inputs, ref, by_label["only ds fp8"], causal)
    for tensor in ("dS", "dQ", "dK"):
        assert fp8[tensor][1] < 0.95 * int8[tensor][1], (tensor, fp8[tensor], int8[tensor])
