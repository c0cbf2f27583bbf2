"""The pretraining example: the LLaMA-style model, the full-precision switch, and the command line end to end."""

from __future__ import annotations

import dataclasses
import glob
import io
import logging
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tiny_lightning import hparams_session

from examples.corpus import TextDataModule
from examples.llama import PRESETS, Llama, LlamaConfig
from examples.pretrain import LlamaPretraining, TokensPerSecond, warmup_cosine
from sage_lightning import AdaptivePrecision, PolicyConfig, attention_layers

REPO = Path(__file__).resolve().parent.parent

TINY = LlamaConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, qk_norm=True, max_seq_len=32)


def events(root: Path) -> EventAccumulator:
    (path,) = glob.glob(f"{root}/**/events.out.tfevents.*", recursive=True)
    accumulator = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def decision_texts(accumulator: EventAccumulator) -> list[str]:
    if "sage/decisions/text_summary" not in accumulator.Tags()["tensors"]:
        return []
    return [event.tensor_proto.string_val[0].decode() for event in accumulator.Tensors("sage/decisions/text_summary")]


# ------------------------------------------------------------------------------------------------------ the model


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"n_kv_heads": 3}, r"n_kv_heads must divide n_heads \(4\).*received 3"),
        ({"d_model": 30}, r"d_model must be a multiple of n_heads \(4\); received d_model=30"),
        ({"n_layers": 0}, "n_layers must be a positive integer; received 0"),
        ({"d_model": 36, "n_heads": 4}, "head dim .* must be even"),
    ],
)
def test_config_errors_name_the_argument(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **changes)


@pytest.mark.parametrize(
    "config",
    [TINY, dataclasses.replace(TINY, qk_norm=False, n_kv_heads=None, tie_embeddings=True, vocab_size=300)],
)
def test_parameter_count_matches_the_model(config: LlamaConfig) -> None:
    model = Llama(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.embed.num_embeddings == config.padded_vocab_size and config.padded_vocab_size % 64 == 0


def test_preset_sizes() -> None:
    assert 0.5e6 < PRESETS["tiny"].num_parameters() < 1.5e6
    assert 30e6 <= PRESETS["small"].num_parameters() <= 50e6
    assert abs(PRESETS["llama-325m"].num_parameters() - 325e6) < 5e6
    assert LlamaConfig.from_name("small", qk_norm=False).qk_norm is False
    with pytest.raises(ValueError, match="name must be one of"):
        LlamaConfig.from_name("huge")


def test_the_model_is_causal() -> None:
    torch.manual_seed(0)
    model = Llama(TINY)
    ids = torch.randint(0, 256, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (ids[:, 12] + 1) % 256
    logits, logits_changed = model(ids), model(changed)
    assert logits.shape == (2, 20, TINY.padded_vocab_size)
    assert torch.allclose(logits[:, :12], logits_changed[:, :12], atol=1e-6)
    assert not torch.allclose(logits[:, 12:], logits_changed[:, 12:])
    with pytest.raises(ValueError, match=r"at most max_seq_len \(32\); received 40"):
        model(torch.zeros(1, 40, dtype=torch.long))


def test_every_attention_call_runs_on_the_kernel() -> None:
    """GQA and QK-norm included: the swap serves the model's SDPA calls without falling back."""
    torch.manual_seed(0)
    module = LlamaPretraining(TINY)
    module.configure_model()
    layers = attention_layers(module)
    assert sorted(layers) == ["model.blocks.0.attn", "model.blocks.1.attn"]
    batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16))}
    module.loss(batch).backward()
    assert all(layer.calls == 1 and layer.fallback_calls == 0 for layer in layers.values())


def test_full_precision_switch_changes_the_attention_and_nothing_else() -> None:
    torch.manual_seed(0)
    sage = LlamaPretraining(TINY, attention="sage")
    torch.manual_seed(0)
    full = LlamaPretraining(TINY, attention="full")
    torch.manual_seed(0)
    plain = Llama(TINY)  # no swap at all
    for module in (sage, full):
        module.configure_model()
    assert {k: v for k, v in sage.hparams.items() if k != "attention"} == {
        k: v for k, v in full.hparams.items() if k != "attention"
    }
    for name, tensor in sage.model.state_dict().items():
        assert torch.equal(tensor, full.model.state_dict()[name]) and torch.equal(tensor, plain.state_dict()[name])
    assert [layer.precision.mode for layer in attention_layers(full).values()] == ["full", "full"]
    assert [layer.precision.mode for layer in attention_layers(sage).values()] == ["sagebwd", "sagebwd"]
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        reference = plain(ids)
        assert torch.equal(full(ids), reference)  # the full layers call PyTorch's SDPA as the plain model does
        difference = (sage(ids) - reference).abs().max().item()
    assert 0 < difference < 0.05  # INT8 attention: close, not equal
    with pytest.raises(ValueError, match="attention must be one of 'sage', 'sage_fp8_pv', .*'full'; received 'fp32'"):
        LlamaPretraining(TINY, attention="fp32")


@pytest.mark.parametrize(
    ("attention", "fp8"),
    [
        ("sage_fp8_pv", ("pv",)),
        ("sage_fp8_ds", ("ds",)),
        ("sage_fp8_pv_ds", ("pv", "ds")),
        ("sage_fp8", ("qk", "pv", "dv", "dp", "ds")),
    ],
)
def test_fp8_attention_choices_start_every_layer_in_their_formats(attention: str, fp8: tuple[str, ...]) -> None:
    module = LlamaPretraining(TINY, attention=attention)
    module.configure_model()
    precisions = {layer.precision for layer in attention_layers(module).values()}
    assert precisions == {module.sage_precision}
    (precision,) = precisions
    assert precision.mode == "sagebwd" and precision.fp8_products == fp8 and precision.smooth_k
    assert set(precision.int8_products) == {"qk", "pv", "dv", "ds"} - set(fp8)  # the rest as "sage" (dp in bf16)
    assert module.hparams["attention"] == attention


def test_learning_rate_schedule() -> None:
    factor = warmup_cosine(10, 110, 0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55) and factor(110) == pytest.approx(0.1) and factor(500) == pytest.approx(0.1)


# ------------------------------------------------------------------------------------- training, in the process


@pytest.fixture(scope="module")
def corpus_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text(
        "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    )
    return folder


@pytest.mark.parametrize("attention", ["sage", "full", "sage_fp8_pv_ds"])
def test_training_with_the_controller_and_the_throughput_log(
    attention: str, corpus_folder: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = LlamaPretraining(TINY, attention=attention, warmup_steps=2)
    data = TextDataModule(paths=[str(corpus_folder)], seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"))
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=1, ds_rel_err_high=1e-4, ds_rel_err_low=5e-5), verbose=False
    )
    throughput = TokensPerSecond(log_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        callbacks=[controller, throughput],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=3,
        limit_val_batches=2,
        check_val_every_n_epoch=None,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=data)
    assert [window["step"] for window in throughput.windows] == [2, 4, 6]
    assert throughput.tokens_seen == 6 * 4 * 32 == controller.tokens_seen
    assert all(window["tokens_per_s"] > 0 for window in throughput.windows)
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    if attention == "full":
        # Nothing to raise: the layers start on the ladder's last rung.
        assert controller.history == []
        assert {p.mode for p in controller.precisions().values()} == {"full"}
    else:
        assert any(d.lever == "precision" for d in controller.history)
    if attention == "sage_fp8_pv_ds":
        # A dS error over the threshold raises an FP8 dS to bf16 as it does an INT8 one; pv stays in FP8.
        assert {p.ds for p in controller.precisions().values()} == {"bf16"}
        assert {p.pv for p in controller.precisions().values()} == {"fp8"}


def test_the_progress_bar_reads_in_80_columns(corpus_folder: Path, tmp_path: Path) -> None:
    """In an 80-column terminal no metric breaks over two lines: they have a line of their own under the bar,
    counts print as integers and shares with their decimals."""
    rich = pytest.importorskip("rich")
    from examples.pretrain import StepProgressBar

    screen = io.StringIO()
    bar = StepProgressBar(console_kwargs={"file": screen, "width": 80, "force_terminal": True, "color_system": None})
    data = TextDataModule(paths=[str(corpus_folder)], seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[AdaptivePrecision(verbose=False), bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    try:
        trainer.fit(LlamaPretraining(TINY, warmup_steps=2), datamodule=data)
    finally:
        rich.reconfigure()  # Lightning's rich bar replaced rich's global console with this one
    lines = re.split(r"[\r\n]+", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()))
    assert max(len(line.rstrip()) for line in lines) <= 80
    metrics = [line.strip() for line in lines if "tokens_per_step" in line]
    assert metrics and re.fullmatch(r"train/loss: \d+\.\d{3} int8_share: 1\.000 tokens_per_step: 128", metrics[-1])
    assert any(line.startswith("Epoch 0 ") and "3/3" in line for line in lines)


def test_pretrain_logger_writes_one_hparams_session_and_no_epoch(tmp_path: Path) -> None:
    """The first hyperparameters call writes the session (the controller's, with the module's), with the losses as
    its metrics and no value logged for them; Lightning's ``epoch`` is left out. With ``default_hp_metric`` it is
    Lightning's logger."""
    from examples.pretrain import PretrainLogger

    logger = PretrainLogger(tmp_path, name="run")
    logger.log_hyperparams({"lr": 0.1, "adaptive_precision": {"config": {"calm_steps": 50}}})
    logger.log_hyperparams({"lr": 0.1})  # Lightning's own call, after the controller's
    logger.log_metrics({"val/loss": 2.5, "epoch": 0}, step=3)
    logger.finalize("success")
    accumulator = events(tmp_path / "run")
    assert accumulator.Tags()["scalars"] == ["val/loss"]
    hparams, metrics = hparams_session(accumulator)
    assert hparams == {"lr": 0.1, "adaptive_precision/config/calm_steps": 50} and metrics == ["val/loss", "train/loss"]
    (path,) = glob.glob(f"{tmp_path}/run/**/events.out.tfevents.*", recursive=True)
    sessions = [
        value.tag
        for event in EventFileLoader(path).Load()
        for value in event.summary.value
        if value.tag == "_hparams_/session_start_info"
    ]
    assert sessions == ["_hparams_/session_start_info"]

    placeholder = PretrainLogger(tmp_path, name="placeholder", default_hp_metric=True)
    placeholder.log_hyperparams({"lr": 0.1})
    placeholder.finalize("success")
    accumulator = events(tmp_path / "placeholder")
    assert hparams_session(accumulator) == ({"lr": 0.1}, ["hp_metric"]) and "hp_metric" in accumulator.Tags()["scalars"]
    with pytest.raises(ValueError, match="hparams_metrics must be a list of scalar tags"):
        PretrainLogger(tmp_path, hparams_metrics="val/loss")


# ---------------------------------------------------------------------------------------------- the command line


def test_command_line_trains_and_writes_the_sage_dashboard(tmp_path: Path) -> None:
    """``python -m examples.pretrain fit --config examples/configs/tiny.yaml`` for a few steps, as a user runs it."""
    pytest.importorskip("jsonargparse")
    command = [
        sys.executable,
        "-m",
        "examples.pretrain",
        "fit",
        "--config",
        "examples/configs/tiny.yaml",
        "--trainer.max_steps=6",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=2",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'runs'}",
        "--data.max_bytes=300000",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--model.config.n_layers=2",
        "--adaptive_precision.init_args.config.ds_stats_every_n_steps=1",
        "--adaptive_precision.init_args.config.ds_rel_err_high=0.0001",
        "--adaptive_precision.init_args.config.ds_rel_err_low=0.00005",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tensorboard = os.path.relpath(Path(sys.executable).parent / "tensorboard", REPO)
    assert f"open them: {tensorboard} --logdir" in done.stdout  # runs as printed, .venv/bin/tensorboard here
    (summary,) = [line for line in done.stderr.splitlines() if line.endswith("tokens seen")]  # Lightning's log
    assert re.fullmatch(
        r"AdaptivePrecision: 2 of 2 attention layers ran SageBwd \([\d,]+ calls, none sent to SDPA\), \d+ decisions?, "
        r"low-bit share [01]\.\d{3}, 12,288 tokens seen",
        summary,
    )

    run = tmp_path / "runs" / "tiny" / "version_0"
    accumulator = events(run)
    scalars = set(accumulator.Tags()["scalars"])
    for tag in (
        "sage/ds_rel_err/model.blocks.0.attn",
        "sage/precision_level/model.blocks.1.attn",
        "sage/int8_fraction",
        "sage/tokens_per_step",
        "sage/loss",
        "throughput/tokens_per_s",
        "train/loss",
        "val/loss",
    ):
        assert tag in scalars, tag
    decisions = decision_texts(accumulator)
    assert decisions and "ds_rel_err" in decisions[0]
    assert [e.value for e in accumulator.Scalars("sage/tokens_per_step")][-1] == 16 * 128
    # TensorBoard groups charts by the tag's first part, sorted by name, and opens on the first: sage/ (no epoch,
    # no hp_metric, the learning rate under train/).
    assert {"train/lr/decay", "train/lr/no_decay"} <= scalars and "epoch" not in scalars
    assert sorted({tag.split("/")[0] for tag in scalars}) == ["sage", "throughput", "train", "val"]
    # HParams: the model's shape and the controller's thresholds, with the real losses as its metrics.
    hparams, metrics = hparams_session(accumulator)
    assert hparams["config/n_layers"] == 2 and hparams["attention"] == "sage"
    assert hparams["adaptive_precision/config/ds_rel_err_high"] == pytest.approx(1e-4)
    assert metrics == ["val/loss", "train/loss"]
    saved = yaml.safe_load((run / "hparams.yaml").read_text())
    assert saved["config"]["n_layers"] == 2 and saved["adaptive_precision"]["config"]["ds_stats_every_n_steps"] == 1
    assert (run / "checkpoints" / "last.ckpt").is_file()
    # The saved configuration runs again: the controller's ladder is written as rungs, not as an error string.
    saved = (run / "config.yaml").read_text()
    assert "name: ds_bf16" in saved and "Unable to serialize" not in saved

    # The checkpoint loads back (its hyperparameters hold the model's config as plain values).
    restored = LlamaPretraining.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu")
    assert restored.config.n_layers == 2 and restored.config.vocab_size == 256 and restored.attention == "sage"


def test_command_line_switches(tmp_path: Path, corpus_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model.attention full`` and ``--adaptive_precision null``: the two switches, in the process."""
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])  # pytest's own arguments are not the CLI's

    common = [
        "--config",
        str(REPO / "examples/configs/tiny.yaml"),
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.paths=[{corpus_folder}]",
        "--data.seq_len=32",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--model.config.n_layers=1",
    ]
    cli = main(["fit", *common, "--model.attention=full"])
    assert cli.model.attention == "full"
    assert [layer.precision.mode for layer in attention_layers(cli.model).values()] == ["full"]
    assert any(isinstance(cb, AdaptivePrecision) for cb in cli.trainer.callbacks)
    assert cli.model.config.max_seq_len == 32  # linked to the data's seq_len

    cli = main(["fit", *common, "--adaptive_precision=null"])
    assert not any(isinstance(cb, AdaptivePrecision) for cb in cli.trainer.callbacks)
    assert any(isinstance(cb, TokensPerSecond) for cb in cli.trainer.callbacks)
    assert cli.trainer.global_step == 2

    cli = main(["fit", *common, "--model.attention=sage_fp8", "--adaptive_precision=null"])
    assert cli.model.attention == "sage_fp8" and cli.trainer.global_step == 2
    assert [layer.precision.fp8_products for layer in attention_layers(cli.model).values()] == [
        ("qk", "pv", "dv", "dp", "ds")
    ]


def test_command_line_refuses_an_unknown_attention(
    tmp_path: Path, corpus_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    with pytest.raises(SystemExit) as exit_info:
        main(_cli_args(tmp_path / "out", corpus_folder, "--model.attention=sage_fp4"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "LlamaPretraining: attention must be one of 'sage', 'sage_fp8_pv', 'sage_fp8_ds'" in err
    assert "'sage_fp8'" in err and "received 'sage_fp4'" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["tiny", "small", "llama-325m"])
def test_every_config_parses(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / f"examples/configs/{name}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "adaptive_precision:" in printed and "class_path: sage_lightning.AdaptivePrecision" in printed
    preset = PRESETS[name]
    for field in ("n_layers", "d_model", "n_heads", "qk_norm"):
        assert f"    {field}: {str(getattr(preset, field)).lower()}" in printed  # the configs match the presets
    # The tokens-per-step rule where the study measured it: no gap at 260K tokens per step, one at 2.1M.
    threshold = 1048576 if name == "llama-325m" else 65536
    assert f"ds_tokens_per_step_high: {threshold}" in printed


# ------------------------------------------------------------------------------------- resuming, folders, errors


def _resumable_trainer(root: Path, max_steps: int, **kwargs: object) -> tuple[L.Trainer, AdaptivePrecision]:
    controller = AdaptivePrecision(
        PolicyConfig(ds_stats_every_n_steps=1, ds_rel_err_high=1e-4, ds_rel_err_low=5e-5, calm_steps=2),
        verbose=False,
    )
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=root / "checkpoints", every_n_train_steps=4, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[controller, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(root),
        **kwargs,
    )
    return trainer, controller


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    """Stopped mid-epoch and resumed from its checkpoint, a run ends bit-identical to one never stopped.

    The corpus holds 6 training batches per epoch, so the 10 steps cross an epoch boundary and the checkpoint at
    step 4 is mid-epoch: the resumed run must continue the epoch's order where it stopped, then shuffle epoch 1
    as the uninterrupted run did. The controller acts on every step, so its state is resumed too.
    """
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "text.txt").write_text("".join(f"line {i}: the quick brown fox jumps\n" for i in range(24)))

    def data() -> TextDataModule:
        return TextDataModule(paths=str(folder), seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"), seed=7)

    torch.manual_seed(0)
    model = LlamaPretraining(TINY, warmup_steps=2)
    trainer, controller = _resumable_trainer(tmp_path / "whole", max_steps=10)
    datamodule = data()
    trainer.fit(model, datamodule=datamodule)
    assert len(datamodule.train_dataloader()) == 6  # steps 7 to 10 are epoch 1: the resumed run crosses into it
    assert controller.history  # the controller acted, so its state matters

    torch.manual_seed(123)  # the resumed run starts from other weights and another RNG state: the checkpoint decides
    resumed_model = LlamaPretraining(TINY, warmup_steps=2)
    resumed, resumed_controller = _resumable_trainer(tmp_path / "resumed", max_steps=10)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dataloader is not resumable")
        resumed.fit(resumed_model, datamodule=data(), ckpt_path=tmp_path / "whole" / "checkpoints" / "step=4.ckpt")

    assert resumed.global_step == trainer.global_step == 10
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, resumed_model.state_dict()[name]), name
    assert [str(d) for d in resumed_controller.history] == [str(d) for d in controller.history]


def test_loader_state_at_an_epoch_end_starts_the_next_epoch(tmp_path: Path, corpus_folder: Path) -> None:
    data = TextDataModule(paths=str(corpus_folder), seq_len=32, batch_size=4, cache_dir=str(tmp_path), seed=3)
    data.prepare_data()
    data.setup("fit")
    loader = data.train_dataloader()
    whole = [batch["input_ids"] for batch in loader]
    assert loader.state_dict() == {"seed": 3, "epoch": 0, "batches": len(whole)}  # no trainer: batches yielded
    resumed = data.train_dataloader()
    resumed.load_state_dict({"seed": 3, "epoch": 0, "batches": 2})
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(whole[2:], resumed, strict=True))
    resumed.load_state_dict(loader.state_dict())
    loader.epoch_shuffle.set_epoch(1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(loader, resumed, strict=True))
    assert not torch.equal(next(iter(loader))["input_ids"], whole[0])  # epoch 1 has an order of its own


def test_ranks_read_disjoint_shards_of_one_order() -> None:
    """Under DDP each rank takes its shard of the epoch's order; Lightning keeps the sampler (a DistributedSampler)."""
    from examples.corpus import EpochShuffle

    ranks = [EpochShuffle(11, seed=5, num_replicas=2, rank=rank) for rank in (0, 1)]
    assert all(isinstance(sampler, torch.utils.data.DistributedSampler) for sampler in ranks)
    shards = [list(sampler) for sampler in ranks]
    assert [len(shard) for shard in shards] == [5, 5] and not set(shards[0]) & set(shards[1])
    order = ranks[0].permutation().tolist()
    assert shards[0] == order[0:10:2] and shards[1] == order[1:10:2]
    ranks[1].skip(2)  # a resumed rank leaves out what it had read, from its own shard
    assert list(ranks[1]) == shards[1][2:] and list(ranks[1]) == shards[1]
    ranks[0].set_epoch(1)
    assert list(ranks[0]) != shards[0]


def _cli_args(root: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(REPO / "examples/configs/tiny.yaml"),
        "--trainer.max_steps=4",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_model_summary=false",
        "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {save_last: true}}]",
        f"--trainer.default_root_dir={root}",
        f"--data.paths={corpus}",  # one path, not a list
        "--data.seq_len=32",
        "--data.batch_size=4",
        f"--data.cache_dir={root.parent / 'cache'}",
        "--model.config.n_layers=1",
        "--adaptive_precision=null",
        *extra,
    ]


def test_command_line_folders_resume_and_hparams(
    tmp_path: Path, corpus_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """default_root_dir holds logs and checkpoints; --ckpt_path resumes into the same version; hparams.yaml."""
    pytest.importorskip("jsonargparse")
    from examples.pretrain import StepProgressBar, main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    monkeypatch.chdir(tmp_path)  # nothing may land in the working folder
    root = tmp_path / "out"
    cli = main(_cli_args(root, corpus_folder))
    run = root / "tiny" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    hparams = (run / "hparams.yaml").read_text()
    assert "config:" in hparams and "n_layers: 1" in hparams and "_instantiator" not in hparams
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    assert bar._get_train_description(0).strip() == "Epoch 0"  # not "Epoch 0/-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out"]

    cli = main(_cli_args(root, corpus_folder, "--trainer.max_steps=6", f"--ckpt_path={run / 'checkpoints/last.ckpt'}"))
    assert cli.trainer.global_step == 6
    assert sorted(p.name for p in (root / "tiny").iterdir()) == ["version_0"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # the resumed run wrote into the same folder
    assert cli.trainer.progress_bar_callback.total_train_batches == 6  # Lightning's: 2 (steps left) at bar position 6


def test_command_line_errors_are_one_paragraph_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    root = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(_cli_args(root, tmp_path / "nonexistent"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pretrain.py: error: TextDataModule: paths[0] must be an existing text file or folder" in err
    assert "Traceback" not in err and "Union" not in err

    short = tmp_path / "short.txt"
    short.write_text("too short for a window\n")
    with pytest.raises(SystemExit) as exit_info:
        main(_cli_args(root, short))
    assert exit_info.value.code == 2
    assert "too few for one training and one validation window" in capsys.readouterr().err
    assert not root.exists() or not any(root.rglob("*"))  # no empty version_N, no config.yaml


def test_the_quickstart_prints_what_matters_and_ends_with_the_summary(capsys: pytest.CaptureFixture) -> None:
    """Quiet by default: the attention call's four lines, the two lines' summary, and how to see more."""
    from examples.quickstart import main

    main([])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 8, lines
    assert lines[0].startswith("sage_attention on cpu") and lines[-1].startswith("(--verbose adds")
    assert lines[-2].startswith("AdaptivePrecision: 1 of 1 attention layer ran SageBwd (4 calls, none sent to SDPA)")


def test_a_misspelt_command_line_key_shows_the_error_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The one line that matters, and the name meant, before anything else (no 76 lines of usage); an abbreviation
    is a typo too (argparse would read --trainer.max_step as --trainer.max_steps and train)."""
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    for typo in ("--trainer.max_stesp=5", "--trainer.max_step=5"):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(REPO / "examples/configs/tiny.yaml"), typo])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines[0] == f"pretrain.py fit: error: unrecognized arguments: {typo}", lines[:3]
        assert lines[1] == "  did you mean --trainer.max_steps?" and "--help" in lines[2] and len(lines) == 3, lines[:5]


def test_a_misspelt_threshold_in_a_config_names_the_key_and_the_right_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A misspelt PolicyConfig field in a config file: where it is and the field meant, not a 17-line union error."""
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    config = tmp_path / "typo.yaml"
    config.write_text((REPO / "examples/configs/tiny.yaml").read_text().replace("ds_rel_err_high:", "ds_rel_err_hihg:"))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "pretrain.py fit: error: PolicyConfig (adaptive_precision.init_args.config) has no argument 'ds_rel_err_hihg'",
        "  did you mean 'ds_rel_err_high' (adaptive_precision.init_args.config.ds_rel_err_high)?",
        "  (every option: pretrain.py fit --help)",
    ]


def test_ctrl_c_on_the_command_line_prints_the_command_that_resumes(
    tmp_path: Path,
    corpus_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C after step 3: the configs' ModelCheckpoint(save_on_exception=True) keeps step 3 in last.ckpt, and the
    last line is the same command with --ckpt_path; run as printed, it resumes there and finishes."""
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    root = tmp_path / "out"
    callbacks = (
        "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {save_last: true, "
        "save_on_exception: true}}, {class_path: tiny_lightning.PressCtrlC, init_args: {step: 3}}]"
    )
    args = [
        arg
        for arg in _cli_args(root, corpus_folder, "--trainer.max_steps=5")
        if not arg.startswith(("--adaptive_precision", "--trainer.callbacks"))
    ]
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        with pytest.raises(SystemExit):
            main([*args, callbacks])
    last = root / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3
    resume = capsys.readouterr().out.splitlines()[-1]
    assert resume.startswith("resume it: ") and resume.endswith(f"--ckpt_path {last}"), resume
    said = "training interrupted at step 3. ModelCheckpoint(save_on_exception=True) saves this step"
    assert [r for r in caplog.records if said in r.getMessage()]

    words = shlex.split(resume.removeprefix("resume it: "))
    assert words[1].endswith("examples/pretrain.py") and words[2] == "fit"
    cli = main(words[2:])
    assert cli.trainer.global_step == 5
