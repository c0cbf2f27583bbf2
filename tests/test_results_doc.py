"""Issue #7's tooling end to end on the CPU: benchmarks/gpu_evidence.sh runs a tiny matrix through
``pretrain_compare --matrix evidence`` (the device's code path), and benchmarks.training.results_doc turns its files
into the results page: tables, figures, and every figure traced to its JSON and command."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks.training import results_doc
from benchmarks.training.evidence import (
    EVIDENCE_GROUPS,
    decision_records,
    difference,
    final_val,
    qk_pv_dv_share,
    rows_by_run,
    verdict,
)

REPO = Path(__file__).resolve().parent.parent

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
#: The matrix at toy size: sequences of 16, 4 and 2 per step, 256 tokens per training run (4 and 8 steps), thresholds
#: below any dS error so the controller acts.
TINY = [
    "--large-batch", "4", "--small-batch", "2", "--groups", "large-qknorm,small-qknorm,e2e-seq32",
    "--tokens-per-run", "256", "--warmup-steps", "0", "--evals", "2", "--val-sequences", "4", "--speed-steps", "2",
    "--set", "data.max_bytes=200000", "--set", "data.seq_len=16", "--set", "model.config.n_layers=1",
    "--set", "model.config.d_model=64", "--set", "adaptive_precision.init_args.config.ds_stats_every_n_steps=1",
    "--set", "adaptive_precision.init_args.config.ds_rel_err_high=0.0001",
    "--set", "adaptive_precision.init_args.config.ds_rel_err_low=0.00005",
]  # fmt: skip
ROW_FIELDS = {"run", "attention", "tokens_per_step", "qk_norm", "seed", "step", "tokens_seen", "train_loss"}


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """gpu_evidence.sh in the foreground on the tiny matrix; its $OUT unpacked as the device's would be."""
    root = tmp_path_factory.mktemp("evidence")
    env = {
        **os.environ,
        "OUT": str(root / "out"),
        "WORK": str(root / "work"),
        "SKIP_INSTALL": "1",
        "PYTHON": sys.executable,
        "CONFIG": "examples/configs/tiny.yaml",
        "CORPUS": "stdlib",
        "XDG_CACHE_HOME": str(root / "cache"),
        "GIT_COMMIT": "0123456789",
        "EXTRA_ARGS": " ".join(TINY),
    }
    done = subprocess.run(
        ["bash", "benchmarks/gpu_evidence.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = root / "results"
    results.mkdir()
    # As gpu_evidence.sh's header says to unpack them.
    unpack = ["tar", "-xzf", str(root / "out" / "evidence.tar.gz"), "-C", str(results), "--wildcards"]
    subprocess.run([*unpack, "training-*"], check=True)
    found = {path.stem.split("-evidence-")[1]: json.loads(path.read_text()) for path in results.glob("training-*.json")}
    return {"root": root, "stdout": done.stdout, "results": results, "groups": found}


def test_the_device_call_leaves_few_files_and_a_summary(evidence: dict[str, Any]) -> None:
    out = sorted(p.name for p in (evidence["root"] / "out").iterdir())
    assert out == ["evidence.tar.gz", "summary.md", "tensorboard.tar.gz"]  # the device returns at most 8 files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in out)
    assert (
        evidence["stdout"]
        .rstrip()
        .endswith(f"finished: exit status 0; results in {evidence['root']}/out/evidence.tar.gz")
    )
    assert "== training-cpu-" in evidence["stdout"] and "| sage-controller |" in evidence["stdout"]
    with tarfile.open(evidence["root"] / "out" / "evidence.tar.gz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert "evidence.log" in names and "status" in names and not any(n.endswith(".tokens") for n in names)


def test_every_training_run_of_the_matrix_sees_the_same_tokens(evidence: dict[str, Any]) -> None:
    groups = evidence["groups"]
    assert set(groups) == {"large-qknorm", "small-qknorm", "e2e-seq32"}
    for name in ("large-qknorm", "small-qknorm"):
        result = groups[name]
        assert result["kind"] == "training" and result["commit"] == "0123456789"
        assert result["command"].startswith("python -m benchmarks.training.pretrain_compare --matrix evidence")
        assert result["matrix"]["group"] == name and result["matrix"]["tokens_per_run"] == 256
        summaries = {s["run"]: s for s in result["summary"]}
        assert all(s["tokens_seen"] == 256 and not s.get("error") for s in summaries.values())
        assert summaries["full-seed1235"]["seed"] == 1235
        assert {s["seed"] for n, s in summaries.items() if n != "full-seed1235"} == {1234}
        assert summaries["full"]["controller"] is False and summaries["sage-fixed"]["int8_fraction"] is None
        for row in result["rows"]:
            assert ROW_FIELDS <= set(row) or "val_loss" in row
        # The same validation points, in tokens, in both groups: after 128 and 256 tokens.
        val_tokens = {r["tokens_seen"] for r in result["rows"] if "val_loss" in r}
        assert val_tokens == {128, 256}, name
    large = {s["run"]: s for s in groups["large-qknorm"]["summary"]}
    assert large["full"]["steps"] == 4 and {s["steps"] for s in groups["small-qknorm"]["summary"]} == {8}
    assert (
        "smooth_k" not in large["sage-fixed-no-smooth-k"]["precision"]
        and "smooth_k" in large["sage-fixed"]["precision"]
    )
    # Thresholds below any dS error: the controller steps dS up to bf16, and every decision keeps its record.
    log = groups["large-qknorm"]["decision_log"]["sage-controller"]
    assert log and {"step", "layer", "lever", "old", "new", "reason"} == set(log[0])
    assert log[0]["lever"] == "precision" and "ds_rel_err" in log[0]["reason"]
    assert large["sage-controller"]["int8_fraction"] < 1 and large["sage-controller"]["decisions"] == len(log)
    assert groups["large-qknorm"]["decision_log"]["sage-fixed"] == []


def test_the_matrix_keeps_the_model_of_the_first_full_precision_run(evidence: dict[str, Any]) -> None:
    work = evidence["root"] / "work"
    # The matrix saved large-qknorm/full's final model, and the config it trained with beside it.
    checkpoint = work / "checkpoints" / "evidence-large-qknorm-full.ckpt"
    assert checkpoint.is_file() and checkpoint.with_suffix(".yaml").is_file()
    config = checkpoint.with_suffix(".yaml").read_text()
    assert "batch_size: 4" in config and "qk_norm: true" in config and "attention: full" in config
    large = {s["run"]: s for s in evidence["groups"]["large-qknorm"]["summary"]}
    assert large["full"]["checkpoint"] == str(checkpoint)
    assert not any("checkpoint" in s for n, s in large.items() if n != "full")
    with tarfile.open(evidence["root"] / "out" / "evidence.tar.gz") as archive:
        names = set(archive.getnames())
    assert "checkpoints/evidence-large-qknorm-full.yaml" in names
    assert not any(name.endswith(".ckpt") for name in names)


def test_the_speed_group_records_a_backend_that_cannot_run(evidence: dict[str, Any]) -> None:
    speed = {s["run"]: s for s in evidence["groups"]["e2e-seq32"]["summary"]}
    assert speed["full-cudnn"]["error"].startswith("ValueError: sdpa=cudnn: PyTorch's SDPA has no cudnn kernel")
    assert speed["full-flash"]["sdpa_backend"] == "flash" and speed["full-flash"]["steps"] == 2
    assert speed["sage-fixed"]["tokens_per_step"] == 2 * 32
    assert evidence["groups"]["e2e-seq32"]["matrix"]["speed"] is True


@pytest.fixture(scope="module")
def page(evidence: dict[str, Any]) -> tuple[str, Path]:
    doc = evidence["root"] / "docs" / "results.md"
    text = results_doc.main(
        ["--results", str(evidence["results"]), "--doc", str(doc), "--images", str(doc.parent / "im")]
    )
    return text, doc


def test_the_page_has_the_tables_of_every_measured_group(page: tuple[str, Path], evidence: dict[str, Any]) -> None:
    text, _ = page
    # Section 1: no activations file among the matrix's results (the attribution is retired).
    assert "## 1. Error attribution with real activations\n\nNot measured yet: the attribution on real" in text
    large = evidence["groups"]["large-qknorm"]
    final = {r["run"]: r["val_loss"] for r in large["rows"] if r["step"] == 4 and "val_loss" in r}
    assert f"| full | full precision | 4 | 256 | {final['full']:.4f} |" in text
    delta = final["sage-fixed"] - final["full"]
    assert (
        "| sage-fixed | SageBwd fixed (INT8 dS, K-smoothing, no Q-smoothing) | 4 | 256 | "
        f"{final['sage-fixed']:.4f} | {delta:+.4f} |" in text
    )
    floor = abs(final["full-seed1235"] - final["full"])
    assert f"Noise floor: |full - full with the second seed| = {floor:.4f} at step 4" in text
    assert f"### large-no-qknorm: {EVIDENCE_GROUPS['large-no-qknorm']}\n\nNot measured yet." in text
    # The controller's record: each decision with its step, layer and reason.
    record = large["decision_log"]["sage-controller"][0]
    assert f"| {record['step']} | {record['layer']} | precision | {record['old']} | {record['new']} |" in text
    assert "| full-cudnn | | failed: ValueError: sdpa=cudnn" in text
    assert "**(i) QK-norm is needed for stability at large tokens per step.** Not measured yet." in text
    assert (
        "**(iii) Fewer tokens per step let SageBwd match full precision.** SageBwd fixed against full precision" in text
    )


def test_every_figure_and_table_names_its_json_and_command(page: tuple[str, Path], evidence: dict[str, Any]) -> None:
    text, doc = page
    for name, result in evidence["groups"].items():
        json_name = f"training-cpu-{result['date'].replace('-', '')}-evidence-{name}.json"
        assert f"[{json_name}](../results/{json_name}), made by `{result['command']}`" in text
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert (doc.parent / target).is_file(), target
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    if HAS_MATPLOTLIB:
        assert {Path(i).name for i in images} >= {
            "training-cpu-" + evidence["groups"]["large-qknorm"]["date"].replace("-", "") + "-evidence-large-qknorm.png"
        }
        for image in images:  # each figure is followed by where its data came from
            assert re.search(re.escape(image) + r"\)\n\nData: \[", text)
    else:
        assert not images and "Figure not drawn: matplotlib is not installed" in text


def test_the_committed_results_give_a_page_with_the_matrix_as_run(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "results.md"
    text = results_doc.main(
        ["--results", str(REPO / "benchmarks/results"), "--doc", str(doc), "--images", str(tmp_path / "im")]
    )
    # The combined file of benchmarks/noise_evidence.sh (4 H200s) is the matrix as run: no pending note.
    assert "**Pending" not in text and "The matrix as run: [training-h200-20261127-noise-evidence.json]" in text
    assert "| full | full precision | 0.8041 | 0.8165 | yes / yes |" in text
    assert "| 0.8254 | 0.8425 | no / no |" in text and "no gap at most 0.8227" in text
    assert "The controller ended without a gap in 1 of 2 seed(s) where SageBwd fixed of the same seed had one" in text
    assert "no threshold separates them" in text and "acted at noise_ratio_high 0.2, set by hand" in text
    for group in EVIDENCE_GROUPS:
        if not group.startswith("e2e-"):
            assert not re.search(rf"### {group}: [^\n]*\n\nNot measured yet\.", text), group
    # Groups outside the matrix's defaults (gpu_lanes.sh's runs joined by group), cuDNN's FP8 runs by their backend.
    gaps = json.loads((REPO / "benchmarks/results/training-h200-20261127-gap-groups.json").read_text())
    assert f"### large-qknorm-d128: {gaps['questions']['large-qknorm-d128']}" in text
    assert "| cudnn-fp8 | cuDNN's FP8 attention | 0.7296 | 0.7402 | yes / yes |" in text
    assert "| sage-fp8-ds | `sagebwd:int8=qk,pv,dv;fp8=ds;smooth_k` | 0.6469 | 0.6427 | yes / yes |" in text
    small = json.loads((REPO / "benchmarks/results/training-h200-20261121-small.json").read_text())
    sage = final_val(small, "sage")
    assert sage == (2000, pytest.approx(0.8135, abs=5e-5)) and f"| sage | 2000 | {sage[1]:.4f} |" in text
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert (doc.parent / target).is_file(), target


def _combined(tmp_path: Path) -> Path:
    """A small combined file as benchmarks/noise_evidence.sh writes it: two groups, rows and summary keyed by group."""
    finals = {  # group -> run -> (seed, final val loss)
        "large-qknorm": {"full": (1234, 0.80), "full-seed1235": (1235, 0.81), "sage-fixed": (1234, 0.85),
                         "sage-fixed-seed1235-observe": (1235, 0.84), "sage-controller": (1234, 0.815)},
        "small-qknorm": {"full": (1234, 0.70), "full-seed1235": (1235, 0.702), "sage-fixed": (1234, 0.705),
                         "sage-controller": (1234, 0.704)},
    }  # fmt: skip
    rows, summary = [], []
    for group, runs in finals.items():
        for run, (seed, loss) in runs.items():
            attention = "full" if run.startswith("full") else "sage"
            rows += [{"group": group, "run": run, "attention": attention, "step": step, "tokens_seen": 100 * step,
                      "train_loss": loss + 0.1, "val_loss": loss + (10 - step) / 100} for step in (5, 10)]  # fmt: skip
            readings = [[step, f"model.blocks.{i}.attn", 0.1 * (i + 1), 0.1] for step in (0, 5, 10) for i in (0, 1)]
            summary.append(
                {"group": group, "run": run, "attention": attention, "seed": seed, "precision": attention,
                 "controller": run.startswith("sage-controller") or run.endswith("-observe"), "max_steps": 10,
                 "tokens_per_step": 100, "qk_norm": True, "decisions": int(run == "sage-controller"),
                 "threshold": 0.2 if run == "sage-controller" else None, "int8_fraction": None,
                 "noise_readings": readings if run.endswith("-observe") else []}
            )  # fmt: skip
            if run == "sage-controller":
                summary[-1].update(
                    steps=10, final_precisions=dict.fromkeys(("model.blocks.0.attn", "model.blocks.1.attn"))
                )
    decision = "step 5: model.blocks.1.attn precision: sagebwd:int8=ds -> sagebwd:int8=qk (noise_ratio 0.3 > 0.2)"
    result = {"kind": "training", "device": "NVIDIA H200", "date": "2026-11-27", "commit": "abc", "rows": rows,
              "command": "bash benchmarks/noise_evidence.sh start", "summary": summary,
              "decisions": {"large-qknorm/sage-controller": [decision]}}  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "training-h200-20261127-noise-evidence.json").write_text(json.dumps(result))
    return tmp_path


def test_a_combined_file_renders_its_groups_and_final_losses(tmp_path: Path) -> None:
    results = _combined(tmp_path / "results")
    doc = tmp_path / "docs" / "results.md"
    text = results_doc.main(["--results", str(results), "--doc", str(doc), "--images", str(tmp_path / "im")])
    assert "**Pending" not in text and "The matrix as run: [training-h200-20261127-noise-evidence.json]" in text
    # Each group's table: the seeds side by side, and whether each run ends within the margin (mean 0.805 + 0.01).
    assert "### large-qknorm:" in text and "### small-qknorm:" in text
    assert "| full | full precision | 0.8000 | 0.8100 | yes / yes |" in text
    assert "| sage-fixed | `sage`; seed 1235: the controller observing only | 0.8500 | 0.8400 | no / no |" in text
    assert "| sage-controller | `sage`, controller at noise_ratio_high 0.2 | 0.8150 |  | yes |" in text
    assert "mean 0.8050, margin 0.0100" in text and "no gap at most 0.8150" in text
    assert "| full | full precision | 0.7000 | 0.7020 | yes / yes |" in text
    assert "### large-no-qknorm: " in text and "Not measured yet." in text
    # The controller's decisions, and whether it closed the gap where SageBwd fixed of its seed had one.
    assert "| 5 | model.blocks.1.attn | precision | sagebwd:int8=ds | sagebwd:int8=qk | noise_ratio 0.3 > 0.2 |" in text
    assert "The controller closed the gap in this seed." in text
    assert "1 of 1 seed(s)" in text and "Noise ratio of **sage-fixed-seed1235-observe**" in text
    # Where SageBwd fixed had no gap, whether the controller decided anything all the same.
    assert "beyond the margin: none. Controller decisions in 1 of 1 seed(s) with no gap." in text
    assert "at large tokens per step 0.8500 / 0.8400 (seeds 1234 / 1235), beyond the margin; at small 0.7050" in text
    if HAS_MATPLOTLIB:  # the decision as a picture, its colours named, then where its data came from
        image = "precision of sage-controller](../im/training-h200-20261127-noise-evidence-large-qknorm-sage-controller"
        assert "**sage-controller**, each layer's precision by step; green: `base`; lime: `sagebwd:int8=qk`." in text
        assert re.search(re.escape(image) + r"-precision\.png\)\n\nData: \[", text)
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert (doc.parent / target).is_file(), target


def test_the_noise_record_gives_the_gradient_noise_scale_where_the_readings_have_it() -> None:
    """Readings of 12beba4 on carry the noise scale (sequences) fifth; older ones, four entries, give no such line."""
    readings = [[step, f"model.blocks.{i}.attn", 0.1, 0.1, 10.0 * step + i] for step in (1, 5, 10) for i in (0, 1)]
    summary = [{"run": "sage-observe", "noise_readings": readings}]
    text = " ".join(results_doc.noise_record({"summary": summary}))
    # Over the last 80% of the run (steps after 2): 50, 51, 100, 101; their median 75.5.
    assert "Gradient noise scale, median over the last 80%: 75.5 sequences." in text
    older = [{"run": "sage-observe", "noise_readings": [r[:4] for r in readings]}]
    assert "Noise ratio of **sage-observe**" in " ".join(results_doc.noise_record({"summary": older}))
    assert "noise scale" not in " ".join(results_doc.noise_record({"summary": older}))


def test_groups_outside_the_matrix_take_their_question_from_their_file(tmp_path: Path) -> None:
    results = _combined(tmp_path / "results")
    result = json.loads((results / "training-h200-20261127-noise-evidence.json").read_text())
    for item in result["rows"] + result["summary"]:
        item["group"] = {"large-qknorm": "large-qknorm-seeds", "small-qknorm": "small-qknorm-rule"}[item["group"]]
    result["decisions"] = {}
    result["questions"] = {"large-qknorm-seeds": "four seeds: can they tell?", "small-qknorm-rule": "left alone?"}
    (results / "training-h200-20261128-tokens-rule.json").write_text(json.dumps(result))
    doc = tmp_path / "docs" / "results.md"
    text = results_doc.main(["--results", str(results), "--doc", str(doc), "--images", str(tmp_path / "im")])
    # After the matrix's groups, in the file's order, each under the question its file names.
    first, second = (
        text.index("### large-qknorm-seeds: four seeds: can they tell?"),
        text.index("### small-qknorm-rule: left alone?"),
    )
    assert text.index("### large-no-qknorm: ") < first < second < text.index("## 3. The controller's record")
    assert text.count("| full | full precision | 0.8000 | 0.8100 | yes / yes |") == 2


def test_the_page_in_docs_links_only_what_exists() -> None:
    doc = REPO / "docs" / "results.md"
    text = doc.read_text()
    assert text.startswith("# Evidence: SageBwd at small scale, and the controller (issue #7)")
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert (doc.parent / target).is_file(), target


def test_older_files_and_decisions_written_as_text_are_read() -> None:
    old = {
        "rows": [
            {"run": "small", "attention": "sage", "step": 10, "val_loss": 1.0},
            {"run": "small", "attention": "full", "step": 10, "val_loss": 0.9},
        ],
        "decisions": {
            "sage": ["step 500: model.blocks.2.attn precision: sagebwd:int8=qk -> full (probe dQ cos 0.8 < 0.9)"]
        },
    }
    assert set(rows_by_run(old)) == {"sage", "full"}
    assert difference(old, "sage", "full") == (10, pytest.approx(0.1))
    (record,) = decision_records(old, "sage")
    assert record == {
        "step": 500,
        "layer": "model.blocks.2.attn",
        "lever": "precision",
        "old": "sagebwd:int8=qk",
        "new": "full",
        "reason": "probe dQ cos 0.8 < 0.9",
    }
    assert verdict(0.001, 0.004) == "+0.0010, within the noise floor (0.0040)"
    assert verdict(-0.02, 0.004) == "-0.0200, 5.0x the noise floor (0.0040)"
    assert verdict(None, 0.004) == "not measured yet"


def test_issue_41s_share_counts_layer_steps_with_qk_pv_and_dv_low_bit_whatever_ds_runs() -> None:
    base, bf16_ds, fp8_ds = "sagebwd:int8=qk,pv,dv,ds;smooth_k", "sagebwd:int8=qk,pv,dv;smooth_k", "sagebwd:int8=pv,dv"
    layers = {"a": bf16_ds, "b": fp8_ds}
    log = [
        {"step": 0, "layer": "a", "lever": "precision", "old": base, "new": bf16_ds, "reason": ""},
        {
            "step": 30,
            "layer": "b",
            "lever": "precision",
            "old": base,
            "new": "sagebwd:int8=qk,pv,dv;fp8=ds",
            "reason": "",
        },
        {"step": 60, "layer": "b", "lever": "precision", "old": "", "new": fp8_ds, "reason": "QK to bf16"},
        {"step": 70, "layer": None, "lever": "tokens", "old": "", "new": "", "reason": ""},
    ]
    run = {"run": "c", "controller": True, "steps": 100, "precision": base, "final_precisions": layers}
    result = {"summary": [run], "decision_log": {"c": log}}
    assert qk_pv_dv_share(result, "c") == pytest.approx((100 + 60) / 200)  # b left at step 60, when QK left INT8
    result["decision_log"]["c"] = []
    assert qk_pv_dv_share(result, "c") == 1.0
    result["summary"] = [{**run, "precision": "attn_qat"}]
    assert qk_pv_dv_share(result, "c") is None  # no INT8 or FP8 QK, PV and dV to keep
    assert qk_pv_dv_share(result, "nobody") is None


def test_a_missing_results_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        results_doc.main(["--results", str(tmp_path / "nowhere")])
    assert "--results must be a folder of result JSON files; received" in capsys.readouterr().err
