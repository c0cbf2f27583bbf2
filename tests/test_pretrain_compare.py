"""benchmarks.training.pretrain_compare at tiny sizes on the CPU: both runs, the result file, the summary."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.training import evidence, matrix, pretrain_compare, runs, specs
from examples.pretrain import LlamaPretraining

REPO = Path(__file__).resolve().parent.parent

#: The row fields every training result carries (shared/RESULTS.md).
ROW_FIELDS = {"run", "attention", "tokens_per_step", "qk_norm", "seed", "step", "tokens_seen", "train_loss"}


def _tiny_run(tmp_path: Path, *args: str) -> list[str]:
    """``pretrain_compare.py`` arguments for a short CPU run of the tiny config (two layers, 300 KB of text, writing
    into ``tmp_path``) whose controller measures dS on every step against thresholds below any error, then
    ``args``."""
    settings = (
        "data.max_bytes=300000",
        "model.config.n_layers=2",
        "adaptive_precision.init_args.config.ds_stats_every_n_steps=1",
        "adaptive_precision.init_args.config.ds_rel_err_high=0.0001",
        "adaptive_precision.init_args.config.ds_rel_err_low=0.00005",
    )
    sets = [item for setting in settings for item in ("--set", setting)]
    return ["--config", str(REPO / "examples/configs/tiny.yaml"), "--out-dir", str(tmp_path), *sets, *args]


def test_sage_against_full_writes_the_training_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = pretrain_compare.main(
        _tiny_run(tmp_path, "--max-steps", "6", "--tag", "tiny", "--set", "trainer.log_every_n_steps=2")
        + ["--set", "trainer.val_check_interval=3", "--save-checkpoint", "full"]
    )
    (written,) = tmp_path.glob("training-cpu-*-tiny.json")
    assert json.loads(written.read_text()) == json.loads(json.dumps(result))
    assert result["kind"] == "training" and result["device"] == "cpu"
    assert {"date", "commit", "command", "versions"} <= set(result)
    rows = result["rows"]
    assert {row["attention"] for row in rows} == {"sage", "full"}
    for attention in ("sage", "full"):
        steps = [row for row in rows if row["attention"] == attention]
        assert [row["step"] for row in steps] == [2, 3, 4, 6]
        for row in steps:
            assert row["tokens_per_step"] == 16 * 128 and row["seed"] == 1234 and row["qk_norm"] is False
        trained = [row for row in steps if "train_loss" in row]
        assert all(ROW_FIELDS <= set(row) and row["tokens_per_s"] > 0 for row in trained)
        assert [row["tokens_seen"] for row in trained] == [2 * 2048, 4 * 2048, 6 * 2048]
        assert [row["step"] for row in steps if "val_loss" in row] == [3, 6]
    # Same seed, data and schedule: the first window's losses agree closely; the runs differ only in attention.
    first = {row["attention"]: row["train_loss"] for row in rows if row["step"] == 2}
    assert first["sage"] == pytest.approx(first["full"], rel=0.02)
    summary = {s["attention"]: s for s in result["summary"]}
    assert summary["sage"]["steps"] == summary["full"]["steps"] == 6
    # Thresholds below any dS error: the sage run's controller acts, the full run has nothing to raise.
    assert result["decisions"]["sage"] and result["decisions"]["full"] == []
    markdown = written.with_suffix(".md").read_text()
    assert "Speed, sage / full:" in markdown and "| sage | 6 |" in markdown
    assert written.with_suffix(".png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert (tmp_path / "tensorboard" / "tiny-sage" / "version_0").is_dir()
    # --save-checkpoint full: that run's final model and the config it trained with.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["tiny-full.ckpt", "tiny-full.yaml"]
    assert summary["full"]["checkpoint"] == str(tmp_path / "checkpoints" / "tiny-full.ckpt")
    assert "checkpoint" not in summary["sage"]
    config = specs.load_config(tmp_path / "checkpoints" / "tiny-full.yaml", [])
    assert config["model"]["attention"] == "full" and config["trainer"]["max_steps"] == 6
    assert config["model"]["config"]["n_layers"] == 2 and config["data"]["max_bytes"] == 300000
    checkpoint = torch.load(tmp_path / "checkpoints" / "tiny-full.ckpt", map_location="cpu", weights_only=False)
    module = LlamaPretraining.load_from_checkpoint(
        tmp_path / "checkpoints" / "tiny-full.ckpt", map_location="cpu", weights_only=False
    )
    assert checkpoint["global_step"] == 6 and module.attention == "full" and module.config.n_layers == 2


def test_set_changes_one_entry_and_names_a_bad_one(tmp_path: Path) -> None:
    config = specs.load_config(
        REPO / "examples/configs/small.yaml", ["data.seq_len=1024", "model.config.qk_norm=false"]
    )
    assert config["data"]["seq_len"] == 1024 and config["model"]["config"]["qk_norm"] is False
    with pytest.raises(ValueError, match="--set takes SECTION.KEY=VALUE"):
        specs.load_config(REPO / "examples/configs/small.yaml", ["data.seq_len"])


def test_the_controller_is_built_from_the_config() -> None:
    controller = runs.build_controller(
        {
            "class_path": "sage_lightning.AdaptivePrecision",
            "init_args": {
                "snapshot_every_n_steps": 7,
                "config": {"ds_rel_err_high": 0.3, "ladder": [{"name": "ds", "changes": {"ds": "bf16"}}]},
            },
        }
    )
    assert controller.snapshot_every_n_steps == 7 and controller.config.ds_rel_err_high == 0.3
    assert [rung.name for rung in controller.config.ladder] == ["ds"]
    assert runs.build_controller(None) is None


def test_runs_name_what_sets_them_apart_and_refuse_bad_entries() -> None:
    spec = specs.parse_run("sage:controller=off,smooth_k=off")
    assert spec == specs.RunSpec(name="sage-fixed-no-smooth-k", attention="sage", controller=False, smooth_k=False)
    assert specs.parse_run("full:seed=7,sdpa=cudnn").name == "full-seed7-cudnn"
    assert specs.parse_run("sage:controller=on,name=adaptive").name == "adaptive"
    args = pretrain_compare.parse_args(["--runs", "full", "full", "sage:controller=off"])
    assert [s.name for s in specs.run_specs(args)] == ["full", "full-2", "sage-fixed"]
    for text, named in (
        ("fast", "the attention must be one of"),
        ("sage:smoothk=off", "KEY one of name, controller"),
        ("sage:controller=maybe", "controller must be on or off; received 'maybe'"),
        ("full:smooth_k=off", "smooth_k and smooth_q are SageBwd's"),
        ("full:sdpa=fast", "sdpa must be one of default, cudnn"),
        ("sage:seed=x", "seed must be an integer; received 'x'"),
        ("sage:name=a b", "name must be letters"),
    ):
        with pytest.raises(ValueError, match=named):
            specs.parse_run(text)


def test_fp8_runs_parse_like_sage_and_bad_names_say_what_works() -> None:
    assert specs.parse_run("sage_fp8_pv:controller=off") == specs.RunSpec(
        name="sage_fp8_pv-fixed", attention="sage_fp8_pv", controller=False
    )
    # The sage_fp8* settings are SageBwd: its smoothing switches apply to them.
    spec = specs.parse_run("sage_fp8:smooth_k=off,smooth_q=on")
    assert (spec.name, spec.smooth_k, spec.smooth_q) == ("sage_fp8-no-smooth-k-smooth-q", False, True)
    args = pretrain_compare.parse_args(["--attention", "sage_fp8_ds", "sage_fp8_pv_ds", "full"])
    assert [s.attention for s in specs.run_specs(args)] == ["sage_fp8_ds", "sage_fp8_pv_ds", "full"]
    with pytest.raises(
        ValueError,
        match=r"--runs 'sage_fp4:controller=off': the attention must be one of sage, "
        r"sage_fp8_pv, sage_fp8_ds, sage_fp8_pv_ds, sage_fp8, .*full; received 'sage_fp4'",
    ):
        specs.parse_run("sage_fp4:controller=off")
    with pytest.raises(ValueError, match=r"--attention must be among sage, sage_fp8_pv, .*; received 'fp8'"):
        specs.run_specs(pretrain_compare.parse_args(["--attention", "sage", "fp8"]))
    with pytest.raises(ValueError, match="give them to sage, .*, sage_fp8, sage_bf16_ds runs"):
        specs.parse_run("attn_qat:smooth_q=on")


def test_an_fp8_run_trains_and_records_its_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = pretrain_compare.main(
        _tiny_run(tmp_path, "--runs", "sage_fp8_pv_ds:controller=on", "--max-steps", "3", "--tag", "fp8")
        + ["--set", "trainer.log_every_n_steps=1", "--set", "trainer.limit_val_batches=0"]
    )
    (summary,) = result["summary"]
    assert summary["run"] == "sage_fp8_pv_ds-controller" and summary["attention"] == "sage_fp8_pv_ds"
    assert not summary.get("error") and summary["steps"] == 3 and summary["fallback_calls"] == 0
    assert summary["precision"] == "sagebwd:int8=qk,dv;fp8=pv,ds;smooth_k"
    assert all(math.isfinite(row["train_loss"]) for row in result["rows"] if "train_loss" in row)
    # The controller raised the FP8 dS to bf16 (a threshold below any error), pv stayed FP8: off the fast path.
    assert set(summary["final_precisions"].values()) == {"sagebwd:int8=qk,dv;fp8=pv;smooth_k"}
    assert summary["int8_fraction"] < 1


def test_profile_steps_put_each_runs_kernels_and_step_time_in_its_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--profile-steps 2``: steps 10 and 11 of each run profiled (on CPU the operators stand for the kernels); the
    summary's ``profile`` has the time per step of what ran, its total and the wall time of a step."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = pretrain_compare.main(
        _tiny_run(tmp_path, "--runs", "full", "sage:controller=off", "--max-steps", "12", "--profile-steps", "2")
        + ["--tag", "profiled", "--set", "trainer.limit_val_batches=0", "--warmup-steps", "0"]
    )
    for summary in result["summary"]:
        profile = summary["profile"]
        assert profile["steps"] == 2 and 0 < profile["device_ms_total"] < profile["wall_ms_per_step"] * 4
        assert profile["device_ms"] and all(ms > 0 for ms in profile["device_ms"].values())
    names = {s["run"]: " ".join(s["profile"]["device_ms"]) for s in result["summary"]}
    assert "scaled_dot_product" in names["full"] and "scaled_dot_product" not in names["sage-fixed"]
    (copied,) = pretrain_compare.main(
        _tiny_run(tmp_path, "--runs", "sage:controller=off", "--max-steps", "11", "--profile-steps", "1")
        + ["--profile-copies", "--tag", "copies", "--set", "trainer.limit_val_batches=0", "--warmup-steps", "0"]
    )["summary"]
    copies = copied["profile"]["copies"]  # on CPU no GPU time: the calls, their shapes and where they come from
    assert copies and all(c["calls"] > 0 and c["shapes"] and c["device_ms"] == 0 for c in copies)
    assert any(frame for c in copies for frame in c["stack"])
    (unprofiled,) = pretrain_compare.main(_tiny_run(tmp_path, "--runs", "full", "--max-steps", "1", "--tag", "plain")
                                          + ["--set", "trainer.limit_val_batches=0"])["summary"]  # fmt: skip
    assert unprofiled["profile"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile-steps", "-1"], "--profile-steps must be an integer >= 0; received -1"),
        (["--profile-copies"], "--profile-copies profiles the steps of --profile-steps; received it without"),
        (
            ["--sdpa-backend", "fast"],
            "--sdpa-backend must be one of default, cudnn, flash, efficient, math, cudnn_fp8; received",
        ),
        (["--attention", "sage", "--runs", "full"], "give --attention or --runs, not both"),
        (["--matrix", "all", "--tokens-per-run", "1"], "--matrix must be one of evidence; received 'all'"),
        (["--matrix", "evidence"], "--matrix needs --budget-minutes"),
        (["--matrix", "evidence", "--tokens-per-run", "1", "--max-steps", "5"], "--matrix plans its own runs"),
        (["--matrix", "evidence", "--budget-minutes", "0"], "--budget-minutes must be a positive number"),
        (["--matrix", "evidence", "--tokens-per-run", "8", "--large-batch", "6", "--small-batch", "4"], "multiple"),
        (["--groups", "large-qknorm"], "--groups selects groups of --matrix"),
        (["--evals", "0"], "--evals must be an integer >= 1; received 0"),
        (
            ["--matrix", "evidence", "--tokens-per-run", "1", "--save-checkpoint", "full"],
            "--save-checkpoint must be GROUP/RUN under --matrix",
        ),
        (["--save-checkpoint", "large-qknorm/full"], "--save-checkpoint must be a run's name without --matrix"),
    ],
)
def test_bad_arguments_are_refused_with_what_works(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        pretrain_compare.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--attention", "sage", "full", "--save-checkpoint", "ful"], "must name one of the runs, sage, full; "),
        (
            ["--matrix", "evidence", "--tokens-per-run", "1", "--save-checkpoint", "large-qknorm/sage"],
            "must name a run of the matrix as GROUP/RUN, e.g. large-qknorm/full; received 'large-qknorm/sage'",
        ),
    ],
)
def test_a_checkpoint_of_a_run_that_is_not_there_is_refused_before_training(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit, match=message):
        pretrain_compare.main([*argv, "--config", str(REPO / "examples/configs/tiny.yaml"), "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_a_forced_sdpa_backend_that_cannot_run_the_model_is_refused_before_training() -> None:
    import torch

    from examples.llama import LlamaConfig

    config = LlamaConfig(vocab_size=256, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=32)
    runs.check_sdpa_backend("math", config, 32, "cpu", torch.float32)
    runs.check_sdpa_backend("default", config, 32, "cpu", torch.float32)
    with pytest.raises(ValueError, match="sdpa=cudnn: PyTorch's SDPA has no cudnn kernel .*4 query and 2 key/value"):
        runs.check_sdpa_backend("cudnn", config, 32, "cpu", torch.float32)


def test_the_plan_gives_every_run_the_same_tokens_within_the_time() -> None:
    tokens, steps = matrix.plan_steps(100.0, [("large", 1000, [1e4, 1e4]), ("small", 250, [5e3])], multiple=10)
    assert (tokens, steps) == (250_000, {"large": 250, "small": 1000})
    # Rounded down to whole multiples of the validations: never over the time.
    tokens, steps = matrix.plan_steps(99.0, [("large", 1000, [1e4, 1e4]), ("small", 250, [5e3])], 10)
    assert steps == {"large": 240, "small": 960} and tokens == 240_000
    with pytest.raises(ValueError, match="too little for 10 steps of 1000 tokens in each of the 3 runs"):
        matrix.plan_steps(1.0, [("large", 1000, [1e4, 1e4]), ("small", 250, [5e3])], 10)
    with pytest.raises(ValueError, match="do not divide"):
        matrix.plan_steps(100.0, [("large", 1000, [1e4]), ("small", 300, [1e4])], 10)


def test_the_matrix_plan_subtracts_the_speed_group_and_each_run_s_overhead() -> None:
    import argparse
    import time
    from types import SimpleNamespace

    groups = matrix.evidence_groups(1, 4, 1, 100)
    datas = {
        "large-qknorm": SimpleNamespace(batch_size=4, seq_len=100),
        "small-qknorm": SimpleNamespace(batch_size=1, seq_len=100),
        "large-no-qknorm": SimpleNamespace(batch_size=4, seq_len=100),
        "e2e-seq200": SimpleNamespace(batch_size=1, seq_len=200),
    }
    speeds = {(g.name, r.name): 1000.0 for g in groups for r in g.runs}
    speeds[("e2e-seq200", "full-cudnn")] = None  # its warm-up failed: planned at the slowest measured speed
    args = argparse.Namespace(budget_minutes=10.0, tokens_per_run=None, speed_steps=10, evals=10, val_sequences=4)
    steps, tokens, plan = matrix.plan_matrix(
        args, groups, datas, speeds, overheads=[4.0, 6.0], deadline=time.perf_counter() + 600
    )
    # 600 s - 3 speed runs (2000 tokens at 1000/s + 5 s) - 12 runs x 5 s - validation (12 x 4000 / 3000 s),
    # x 0.85, shared by 12 runs at 1000 tokens/s: about 35,000 tokens each, in whole tens of large steps.
    assert steps["e2e-seq200"] == 10 and steps["large-qknorm"] == steps["large-no-qknorm"] == 80
    assert steps["small-qknorm"] == 4 * 80 and tokens == 80 * 400
    assert plan["run_seconds"]["large-qknorm/full"] == 80 * 400 / 1000 + 5
    assert "e2e-seq200/full-cudnn" not in plan["run_seconds"]


def test_the_matrix_groups_match_the_results_page() -> None:

    groups = matrix.evidence_groups(1234, 64, 8, 2048)
    assert [g.name for g in groups] == list(evidence.EVIDENCE_GROUPS)
    assert [r.name for r in groups[0].runs] == [
        "full",
        "sage-fixed",
        "sage-controller",
        "full-seed1235",
        "sage-fixed-no-smooth-k",
    ]
    for group in groups:
        found = evidence.roles({"runs": [dataclasses.asdict(r) for r in group.runs]})
        assert sorted(found.values()) == sorted(r.name for r in group.runs)


def test_warm_up_times_its_last_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = specs.load_config(
        REPO / "examples/configs/tiny.yaml",
        ["data.max_bytes=100000", "data.seq_len=16", "data.batch_size=2", "model.config.n_layers=1"],
    )
    data = pretrain_compare.TextDataModule(**config["data"])
    data.prepare_data()
    spec = specs.parse_run("sage:controller=on")
    speed = runs.warm_up(config, spec, steps=1, data=data, timed_steps=2)
    assert speed is not None and speed > 0
    assert runs.warm_up(config, spec, steps=1, data=data) is None
