"""An empty or truncated checkpoint is named, with what happened to it, instead of the unpickler's bare EOFError."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

from sage_lightning import AdaptivePrecision
from sage_lightning.layer_checkpoint import checkpoint_file_problem

REPO = Path(__file__).resolve().parent.parent


def test_checkpoint_file_problem_names_empty_and_truncated_files(tmp_path: Path) -> None:
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(64)}}, whole)
    assert checkpoint_file_problem(whole) is None
    assert checkpoint_file_problem(None) is None
    assert checkpoint_file_problem(tmp_path / "missing.ckpt") is None  # Lightning names a missing file itself
    assert checkpoint_file_problem("s3://bucket/last.ckpt") is None  # remote: not ours to open

    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    problem = checkpoint_file_problem(empty)
    assert problem is not None and repr(str(empty)) in problem and "is empty (0 bytes)" in problem

    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[:100])
    problem = checkpoint_file_problem(cut)
    assert problem is not None and repr(str(cut)) in problem and "is truncated (100 bytes" in problem
    with pytest.raises(Exception):  # noqa: B017, PT011  what the note stands beside: the reader's own error
        torch.load(cut)


def test_resuming_from_an_empty_checkpoint_names_the_file(tmp_path: Path) -> None:
    """Lightning loads the file after every setup hook; the callback adds the file and what happened to it under the
    unpickler's EOFError (the error keeps its type)."""
    empty = tmp_path / "last.ckpt"
    empty.write_bytes(b"")
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=2), callbacks=[AdaptivePrecision(verbose=False)])
    with pytest.raises(EOFError) as error:
        trainer.fit(TinyLM(layers=1, d_model=16, heads=2), token_loader(2), ckpt_path=empty)
    notes = getattr(error.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert notes == [checkpoint_file_problem(empty)] and str(empty) in notes[0]


def test_the_command_line_refuses_an_empty_checkpoint_before_making_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("jsonargparse")
    from examples.pretrain import main

    empty = tmp_path / "last.ckpt"
    empty.write_bytes(b"")
    corpus = tmp_path / "text.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    root = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    args = ["fit", "--config", str(REPO / "examples/configs/tiny.yaml"), f"--trainer.default_root_dir={root}"]
    args += [f"--data.paths={corpus}", f"--data.cache_dir={tmp_path / 'cache'}", f"--ckpt_path={empty}"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"The checkpoint {str(empty)!r} is empty (0 bytes)" in err and "Traceback" not in err
    assert not root.exists() or not any(root.rglob("*"))
