"""benchmarks/pretrain_compare.py at tiny sizes on the CPU: both runs, the result file, the summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import pretrain_compare  # noqa: E402  (benchmarks/ is a folder of scripts)

#: The row fields every training result carries (shared/RESULTS.md).
ROW_FIELDS = {"run", "attention", "tokens_per_step", "qk_norm", "seed", "step", "tokens_seen", "train_loss"}


def test_sage_against_full_writes_the_training_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = pretrain_compare.main(
        [
            "--config",
            str(REPO / "examples/configs/tiny.yaml"),
            "--max-steps",
            "6",
            "--tag",
            "tiny",
            "--out-dir",
            str(tmp_path),
            "--set",
            "data.max_bytes=300000",
            "--set",
            "model.config.n_layers=2",
            "--set",
            "trainer.log_every_n_steps=2",
            "--set",
            "trainer.val_check_interval=3",
            "--set",
            "adaptive_precision.init_args.config.ds_stats_every_n_steps=1",
            "--set",
            "adaptive_precision.init_args.config.ds_rel_err_high=0.0001",
            "--set",
            "adaptive_precision.init_args.config.ds_rel_err_low=0.00005",
        ]
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


def test_set_changes_one_entry_and_names_a_bad_one(tmp_path: Path) -> None:
    config = pretrain_compare.load_config(
        REPO / "examples/configs/small.yaml", ["data.seq_len=1024", "model.config.qk_norm=false"]
    )
    assert config["data"]["seq_len"] == 1024 and config["model"]["config"]["qk_norm"] is False
    with pytest.raises(ValueError, match="--set takes SECTION.KEY=VALUE"):
        pretrain_compare.load_config(REPO / "examples/configs/small.yaml", ["data.seq_len"])


def test_the_controller_is_built_from_the_config() -> None:
    controller = pretrain_compare.build_controller(
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
    assert pretrain_compare.build_controller(None) is None
