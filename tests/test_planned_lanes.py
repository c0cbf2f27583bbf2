"""Every committed lanes file (``benchmarks/lanes/*.lanes``, what ``benchmarks/gpu_lanes.sh`` runs on a GPU machine)
checked here before device time is spent on it: each line names a GPU and a unique run, each ``train`` command parses
as ``pretrain_compare``'s arguments, names runs that exist, and every ``--set`` names a setting that exists (a Trainer
argument, the model's, the data module's, a model-shape field or a ``PolicyConfig`` field) with a value it takes:
``apply_changes`` would otherwise add a misspelt key silently, and the run would fail only after its warm-up."""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

import lightning as L
import pytest

from benchmarks.training import pretrain_compare
from benchmarks.training.runs import build_controller, run_controller
from benchmarks.training.specs import load_config
from examples.corpus import TextDataModule
from examples.llama import LlamaConfig
from examples.pretrain import LlamaPretraining

REPO = Path(__file__).resolve().parents[1]
LANES = sorted((REPO / "benchmarks" / "lanes").glob("*.lanes"))
SMALL = REPO / "examples" / "configs" / "small.yaml"


def lines(path: Path) -> list[tuple[str, str, str]]:
    """``(gpu, name, command)`` of each line that is not a comment, as ``gpu_lanes.sh`` reads it."""
    found = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            gpu, name, command = line.split(maxsplit=2)
            found.append((gpu, name, command))
    return found


def parameters(target: object) -> set[str]:
    return set(inspect.signature(target).parameters) - {"self", "args", "kwargs"}


def known(key: str) -> bool:
    """Whether ``SECTION.KEY`` (a ``--set`` key) names a setting the run reads."""
    section, _, rest = key.partition(".")
    if section == "trainer":
        return rest in parameters(L.Trainer.__init__)
    if section == "data":
        return rest in parameters(TextDataModule.__init__)
    if section == "model":
        field = rest.removeprefix("config.")
        return (
            field in LlamaConfig.__dataclass_fields__
            if rest.startswith("config.")
            else rest in parameters(LlamaPretraining.__init__)
        )
    if section == "adaptive_precision":
        return rest.startswith("init_args.config.")  # PolicyConfig(**...) checks the field and its value below
    return False


def test_there_are_lanes_files() -> None:
    assert LANES, "benchmarks/lanes holds no .lanes file"


@pytest.mark.parametrize("path", LANES, ids=[path.name for path in LANES])
def test_every_line_of_a_lanes_file_would_start(path: Path) -> None:
    found = lines(path)
    names = [name for _, name, _ in found]
    assert len(names) == len(set(names)), f"{path.name}: a run name twice: {names}"
    for gpu, name, command in found:
        assert re.fullmatch(r"\d+(\.\d+)?", gpu), (
            f"{path.name}: {name}: the first column must be a GPU index, or G.K for a second queue on GPU G; "
            f"received {gpu!r}"
        )
        words = shlex.split(command)
        if words[0] != "train":  # a shell line (the GPU hold of check_patch.sh's lanes, a kernel check)
            continue
        args = pretrain_compare.parse_args(["--config", str(SMALL), *words[1:]])
        specs = pretrain_compare.run_specs(args)
        bad = [change for change in args.set if not known(change.partition("=")[0])]
        assert not bad, f"{path.name}: {name}: --set of settings the run does not read: {bad}"
        config = load_config(args.config, args.set)
        LlamaConfig(**{**config["model"]["config"], "vocab_size": 256, "max_seq_len": config["data"]["seq_len"]})
        build_controller(config.get("adaptive_precision"))
        for spec in specs:
            run_controller(config, spec)  # PolicyConfig refuses a bad field or value by name


def test_a_misspelt_setting_is_caught() -> None:
    assert known("trainer.val_check_interval") and not known("trainer.val_chek_interval")
    assert known("model.config.n_heads") and not known("model.config.heads")
    assert known("model.warmup_steps") and known("data.batch_size") and not known("optimizer.lr")
    config = load_config(SMALL, ["adaptive_precision.init_args.config.noise_scale_ratio_hgh=4"])
    with pytest.raises(TypeError, match="noise_scale_ratio_hgh"):
        build_controller(config["adaptive_precision"])
