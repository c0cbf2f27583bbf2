"""benchmarks.controller.multi_gpu's comparison of ranks and runs (the runs themselves need two GPUs:
docs/controller.md)."""

from __future__ import annotations

import json

from benchmarks.controller import multi_gpu


def record(run: str, rank: int, decisions: list[str], tokens_per_s: float) -> dict:
    return {
        "run": run,
        "rank": rank,
        "decisions": decisions,
        "precisions": {"a": "full"},
        "rollbacks": 1,
        "params_finite": True,
        "tokens_per_s": tokens_per_s,
        "int8_fraction": 0.9,
        "peak_memory_gb": 1.0,
    }


def test_summary_flags_ranks_that_disagree_and_compares_speed_with_one_gpu(tmp_path) -> None:
    same = ["step 150: global rollback: step 150 -> last snapshot (loss is nan)"]
    records = [
        record("single", 0, same, 1000.0),
        record("ddp", 0, same, 1900.0),
        record("ddp", 1, same, 1900.0),
        record("fsdp", 0, same, 1700.0),
        record("fsdp", 1, [], 1700.0),
    ]
    for r in records:
        (tmp_path / f"{r['run']}-rank{r['rank']}.json").write_text(json.dumps(r))
    summary = multi_gpu.summarize(tmp_path, ["single", "ddp", "fsdp"])
    runs = summary["runs"]
    assert runs["ddp"]["decisions_identical"] and not runs["fsdp"]["decisions_identical"]
    assert runs["ddp"]["speedup_vs_one_gpu"] == 1.9 and "speedup_vs_one_gpu" not in runs["single"]
    text = multi_gpu.markdown(summary, "H200")
    assert "| ddp | 2 | True | [1, 1] | True | 1900 | 1.90x | 0.900 |" in text
    assert "| fsdp | 2 | False |" in text


def test_a_run_that_wrote_nothing_is_reported(tmp_path) -> None:
    summary = multi_gpu.summarize(tmp_path, ["fsdp"])
    assert "no rank wrote a record" in summary["runs"]["fsdp"]["error"]


def test_result_files_are_named_by_the_gpu_model() -> None:
    """The comparison's file name takes the GPU model, not the last word of its name ("HBM3" on an H100 80GB HBM3)."""
    assert multi_gpu.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert multi_gpu.device_slug("NVIDIA H200") == "h200"
