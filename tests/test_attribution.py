"""benchmarks.training.attribution at a tiny size on the CPU: a real checkpoint, the capture, the result file,
the errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.kernels import accuracy
from benchmarks.training import attribution, attribution_report, specs
from examples.corpus import TextDataModule

REPO = Path(__file__).resolve().parent.parent


TINY = REPO / "examples" / "configs" / "tiny.yaml"
SEQ = 64  # the training windows; the model's max_seq_len
LAYERS = 2
ROW_KEYS = {
    "path",
    "setting",
    "label",
    "inputs",
    "layer",
    "layer_name",
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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attribution")


@pytest.fixture(scope="module")
def changes(workdir: Path) -> list[str]:
    """tiny.yaml made smaller: 2 layers, windows of 64, 300 KB of the built-in corpus, a private token cache."""
    return [
        f"model.config.n_layers={LAYERS}",
        f"data.seq_len={SEQ}",
        "data.max_bytes=300000",
        f"data.cache_dir={workdir / 'cache'}",
    ]


@pytest.fixture(scope="module")
def overrides(changes: list[str]) -> list[str]:
    """The harness's arguments for :func:`changes`."""
    return ["--config", str(TINY)] + [arg for change in changes for arg in ("--set", change)]


@pytest.fixture(scope="module")
def checkpoint(workdir: Path) -> Path:
    """``last.ckpt`` of a 3-step run of ``examples.pretrain`` (tiny.yaml's ModelCheckpoint), SageBwd attention."""
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["pretrain.py"])  # pytest's own arguments are not the CLI's
        main(
            [
                "fit",
                "--config",
                str(TINY),
                "--trainer.max_steps=3",
                "--trainer.val_check_interval=3",
                "--trainer.limit_val_batches=1",
                "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false",
                f"--trainer.default_root_dir={workdir / 'runs'}",
                "--data.max_bytes=300000",
                f"--data.seq_len={SEQ}",
                f"--data.cache_dir={workdir / 'cache'}",
                f"--model.config.n_layers={LAYERS}",
                "--adaptive_precision=null",
            ]
        )
    path = workdir / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert path.is_file()
    return path


@pytest.fixture(scope="module")
def from_checkpoint(workdir: Path, overrides: list[str], checkpoint: Path) -> tuple[dict, Path]:
    """The harness on the checkpoint: every layer, two held-out batches of one window."""
    out = workdir / "from-checkpoint" / "acc.json"
    return attribution.main([*overrides, "--checkpoint", str(checkpoint), "--batches", "2", "--out", str(out)]), out


@pytest.fixture(scope="module")
def from_training(workdir: Path, overrides: list[str]) -> tuple[dict, Path]:
    """The harness training its own model 3 steps: layer 1 only, one batch of two windows of 32 tokens."""
    out = workdir / "from-training" / "acc.json"
    argv = [*overrides, "--train-steps", "3", "--layers", "1", "--batch-size", "2", "--seq", "32", "--out", str(out)]
    return attribution.main(argv), out


@pytest.fixture(params=["checkpoint", "training"])
def result(request: pytest.FixtureRequest) -> tuple[dict, Path]:
    return request.getfixturevalue(f"from_{request.param}")


def test_header_and_files(result: tuple[dict, Path]) -> None:
    returned, out = result
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    assert data["kind"] == "accuracy" and data["device"] == "cpu" and data["commit"]
    assert len(data["date"]) == 10 and data["date"][4] == "-"
    assert data["command"].startswith("python -m benchmarks.training.attribution") and "torch" in data["versions"]
    assert data["config"] == "examples/configs/tiny.yaml" and data["checkpoint"]["step"] == 3
    assert data["capture"]["split"] == "validation (held out)" and data["capture"]["dtype"] == "float32"
    layers = sorted({row["layer"] for row in data["rows"]})
    assert [a["layer"] for a in data["activations"]] == layers
    for activation in data["activations"]:
        assert set(activation["stats"]) == {key for key, _, _ in attribution_report.STAT_COLUMNS} | {
            "q_rms",
            "k_rms",
            "q_channel_bias_max",
            "do_max_abs",
        }
        assert all(isinstance(v, float) and v == v for v in activation["stats"].values())
    assert [(v["layer"], v["smooth_k"]) for v in data["verdicts"]] == [(i, s) for i in layers for s in (True, False)]
    markdown = out.with_suffix(".md").read_text()
    assert "## Does dS dominate?" in markdown and "## Attribution per layer" in markdown
    assert len(re.findall(r"does dS dominate the dQ/dK error\? (yes|no|partly): over half", markdown)) == 2


def test_rows_name_the_source_and_the_shapes(
    from_checkpoint: tuple[dict, Path], from_training: tuple[dict, Path]
) -> None:
    per_layer = len(accuracy.SMOOTH_K["sagebwd"]) * len(accuracy.settings(True)) * len(accuracy.TENSORS)
    cases = [
        (from_checkpoint[0], "tiny/version_0/last.ckpt", "sage", list(range(LAYERS)), 2, SEQ),
        (from_training[0], "tiny-full-3steps.ckpt", "full", [1], 2, 32),
    ]
    for result, name, trained_with, layers, batch, seq in cases:
        assert result["checkpoint"]["name"] == name and result["checkpoint"]["trained_with"] == trained_with
        rows = result["rows"]
        assert len(rows) == len(layers) * per_layer
        assert sorted({row["layer"] for row in rows}) == layers
        for row in rows:
            assert set(row) == ROW_KEYS
            assert row["inputs"] == f"activations layer={row['layer']} ckpt={name} step=3"
            assert row["layer_name"] == f"model.blocks.{row['layer']}.attn" and row["path"] == "reference"
            # tiny: d_model 128, 4 query heads sharing 2 key/value heads (GQA), causal
            assert (row["heads"], row["kv_heads"], row["head_dim"]) == (4, 2, 32) and row["causal"] is True
            assert (row["batch"], row["seq"]) == (batch, seq)


def test_capture_matches_the_model_and_the_loss_gradient(changes: list[str], checkpoint: Path) -> None:
    config = specs.load_config(TINY, changes)
    data = TextDataModule(**config["data"])
    data.prepare_data()
    module, step = attribution.load_checkpoint(checkpoint, config, data)
    assert step == 3 and module.config.n_layers == LAYERS
    (batch,) = attribution.held_out_batches(data, SEQ, batches=1, batch_size=3)
    layers = attribution.capture(module, [batch], "cpu", None)
    cfg = module.config
    assert [layer["name"] for layer in layers] == [f"model.blocks.{i}.attn" for i in range(LAYERS)]
    for layer in layers:
        assert layer["is_causal"] is True
        assert layer["q"].shape == (3, cfg.n_heads, SEQ, cfg.head_dim)
        assert layer["k"].shape == layer["v"].shape == (3, cfg.kv_heads, SEQ, cfg.head_dim)
        assert layer["do"].shape == layer["q"].shape
        assert torch.isfinite(layer["do"]).all() and layer["do"].abs().max() > 0

    # dO is the LM loss's gradient of the attention output: the same as the gradient reaching wo's input.
    attention = module.model.blocks[1].attn
    seen: list[torch.Tensor] = []

    def keep(_: Any, args: tuple[torch.Tensor, ...]) -> None:
        args[0].retain_grad()
        seen.append(args[0])

    hook = attention.wo.register_forward_pre_hook(keep)
    module.loss(batch).backward()
    hook.remove()
    expected = seen[0].grad.view(3, SEQ, cfg.n_heads, cfg.head_dim).transpose(1, 2)
    torch.testing.assert_close(layers[1]["do"], expected)


def test_bf16_has_the_smallest_error(from_checkpoint: tuple[dict, Path]) -> None:
    rows = from_checkpoint[0]["rows"]
    for kind in dict.fromkeys(row["inputs"] for row in rows):
        for smooth_k in (True, False):
            table = accuracy.lookup(rows, kind, smooth_k)
            for tensor in ("O", "dQ", "dK", "dV"):
                baseline = table["bf16"][tensor]["rel_l2"]
                others = {label: by_tensor[tensor]["rel_l2"] for label, by_tensor in table.items() if label != "bf16"}
                # An "only X" setting whose product does not feed this tensor computes it as bf16 does (its error
                # then differs by summation order only): a tie within 1% is allowed, a smaller error is not.
                assert baseline <= min(others.values()) * 1.01, (kind, smooth_k, tensor, baseline, others)
                assert others["sagebwd"] > 1.5 * baseline and others["all7"] > 1.5 * baseline


def test_verdicts_follow_from_the_rows(from_checkpoint: tuple[dict, Path]) -> None:
    result, out = from_checkpoint
    rows = result["rows"]
    for verdict in result["verdicts"]:
        rel = {
            (row["label"], row["tensor"]): row["rel_l2"]
            for row in rows
            if row["layer"] == verdict["layer"] and row["smooth_k"] == verdict["smooth_k"]
        }
        shares = {t: (rel[("only ds", t)] / rel[("sagebwd", t)]) ** 2 for t in ("dQ", "dK")}
        assert verdict["ds_share"] == pytest.approx(shares)
        assert verdict["ds_dominates"] == (min(shares.values()) > 0.5)
        for tensor in attribution_report.GRADIENTS:
            products = ("qk", "pv", "dv", "ds")  # the INT8 products of the default
            top = max(products, key=lambda p, t=tensor: rel[(f"only {p}", t)])
            assert verdict["costliest"][tensor]["product"] == top
    dominated = [v["layer"] for v in result["verdicts"] if v["smooth_k"] and v["ds_dominates"]]
    line = next(line for line in out.with_suffix(".md").read_text().splitlines() if "smooth_k=True: does" in line)
    if len(dominated) == LAYERS:
        assert f"? yes: over half of the dQ and dK error in every layer measured ({LAYERS});" in line
    elif not dominated:
        assert f"? no: over half of the dQ and dK error in none of the {LAYERS} layers;" in line
    else:
        assert f"? partly: over half of the dQ and dK error in {len(dominated)} of {LAYERS} layers (" in line


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        ([], ["--checkpoint PATH", "--train-steps N", "received neither"]),
        (["--checkpoint", "{missing}"], ["--checkpoint: no file at", "missing.ckpt", "--train-steps N"]),
        (["--checkpoint", "{garbage}"], ["--checkpoint:", "garbage.ckpt", "is not a checkpoint", "ModelCheckpoint"]),
        (["--checkpoint", "{checkpoint}", "--layers", "0", "5"], ["--layers: received 0 5", "valid: 0 to 1"]),
        (["--checkpoint", "{checkpoint}", "--seq", "100"], ["--seq: received 100", "max_seq_len=64"]),
        (["--checkpoint", "{checkpoint}", "--batches", "1000"], ["--batches/--batch-size/--seq: 1000 x 1", "holds"]),
        (["--checkpoint", "{checkpoint}", "--set", "model.config.n_layers=3"], ["model.config.n_layers is 3", "2 in"]),
        (["--train-steps", "0"], ["--train-steps must be a positive integer; received 0"]),
    ],
)
def test_bad_arguments_name_the_argument(
    argv: list[str],
    fragments: list[str],
    overrides: list[str],
    checkpoint: Path,
    workdir: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    garbage = workdir / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    paths = {"missing": workdir / "missing.ckpt", "garbage": garbage, "checkpoint": checkpoint}
    argv = [arg.format(**paths) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        attribution.main([*overrides, *argv, "--out", str(workdir / "never.json")])
    assert exit_info.value.code == 2
    message = " ".join(capsys.readouterr().err.split())  # argparse wraps nothing, but be safe
    for fragment in fragments:
        assert fragment in message, message
    assert not (workdir / "never.json").exists()
