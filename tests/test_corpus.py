"""The pretraining example's data: corpus files, the memory-mapped token file and its cache, windows, the split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from examples import corpus
from examples.corpus import ByteTokenizer, TextDataModule, corpus_files, stdlib_files


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    """A folder of user text: two text files (one nested), one file of another kind, one empty text file."""
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("the second document, " * 20)
    (folder / "sub" / "a.md").write_text("# héllo\n" + "a first document with some words. " * 20)
    (folder / "image.bin").write_bytes(bytes(range(256)))
    (folder / "empty.txt").write_text("")
    return folder


def data(folder: Path, tmp_path: Path, **kwargs) -> TextDataModule:
    kwargs.setdefault("seq_len", 16)
    module = TextDataModule(paths=[str(folder)], cache_dir=str(tmp_path / "cache"), **kwargs)
    module.prepare_data()
    module.setup("fit")
    return module


def test_byte_tokenizer_round_trip() -> None:
    text = "déjà vu: ∑ 1/n² — 🐍\n\tdone"
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text.encode())
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tokenizer.vocab_size == 256 and tokenizer.eos_id == 0


def test_user_folder_takes_text_files_in_path_order(text_folder: Path) -> None:
    files = corpus_files([str(text_folder)])
    assert [f.relative_to(text_folder).as_posix() for f in files] == ["b.txt", "empty.txt", "sub/a.md"]
    # A file given by path is read whatever its ending; folders and files mix.
    files = corpus_files([str(text_folder / "image.bin"), str(text_folder / "sub")])
    assert [f.name for f in files] == ["image.bin", "a.md"]


def test_token_file_holds_the_documents_joined_by_the_end_token(text_folder: Path, tmp_path: Path) -> None:
    module = data(text_folder, tmp_path, seq_len=16)
    tokens = np.memmap(module.token_file, dtype=module.meta["dtype"], mode="r")
    expected = b"".join(
        (text_folder / name).read_bytes() + b"\0" for name in ("b.txt", "sub/a.md")
    )  # the empty file adds nothing
    assert bytes(tokens) == expected
    assert module.meta["tokens"] == len(expected) and module.meta["documents"] == 2
    assert module.vocab_size == 256


def test_windows_and_the_validation_split(text_folder: Path, tmp_path: Path) -> None:
    seq = 16
    module = data(text_folder, tmp_path, seq_len=seq, val_fraction=0.2, batch_size=4)
    tokens = torch.from_numpy(np.memmap(module.token_file, dtype=np.uint8, mode="r").astype(np.int64))
    train, val = module.train_set, module.val_set
    total = module.meta["tokens"]
    split = total - int(total * 0.2)
    assert (train.start, train.stop, val.start, val.stop) == (0, split, split, total)
    assert len(train) == (split - 1) // seq and len(val) == (total - split - 1) // seq
    for dataset in (train, val):
        for index in (0, len(dataset) - 1):
            item = dataset[index]
            first = dataset.start + index * seq
            assert torch.equal(item["input_ids"], tokens[first : first + seq])
            assert torch.equal(item["labels"], tokens[first + 1 : first + seq + 1])
            assert first + seq + 1 <= dataset.stop  # no window reaches past its own range
    with pytest.raises(IndexError):
        train[len(train)]
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == (4, seq) and batch["input_ids"].dtype == torch.int64
    # The same split on every run.
    again = data(text_folder, tmp_path, seq_len=seq, val_fraction=0.2)
    assert (again.val_set.start, again.val_set.stop) == (val.start, val.stop)


def test_token_file_is_reused_and_rebuilt_when_the_corpus_changes(
    text_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = data(text_folder, tmp_path)
    written = first.token_file.stat().st_mtime_ns

    def no_tokenizing(self, data: bytes) -> np.ndarray:
        raise AssertionError("the cached token file should have been reused")

    with monkeypatch.context() as patch:
        patch.setattr(ByteTokenizer, "encode", no_tokenizing)
        second = data(text_folder, tmp_path)
    assert second.token_file == first.token_file and second.token_file.stat().st_mtime_ns == written
    assert second.meta == first.meta

    with (text_folder / "b.txt").open("a") as handle:
        handle.write("one more line\n")
    changed = data(text_folder, tmp_path)
    assert changed.token_file != first.token_file
    assert changed.meta["tokens"] == first.meta["tokens"] + len("one more line\n")
    capped = data(text_folder, tmp_path, max_bytes=100)
    assert capped.token_file not in (first.token_file, changed.token_file)
    assert capped.meta["text_bytes"] == 100 and capped.meta["documents"] == 1


def test_an_interrupted_build_leaves_nothing_to_reuse(
    text_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def fail_second(self, data: bytes) -> np.ndarray:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return np.frombuffer(data, dtype=np.uint8)

    monkeypatch.setattr(ByteTokenizer, "encode", fail_second)
    module = TextDataModule(paths=[str(text_folder)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(KeyboardInterrupt):
        module.prepare_data()
    assert list((tmp_path / "cache").iterdir()) == []


def test_bad_paths_name_the_argument(text_folder: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "no_such_folder")
    with pytest.raises(FileNotFoundError, match=r"paths\[1\].*no_such_folder.*does not exist"):
        TextDataModule(paths=[str(text_folder), missing])
    with pytest.raises(FileNotFoundError, match=r"tokenizer must be 'bytes' or a local folder.*nope"):
        TextDataModule(paths=[str(text_folder)], tokenizer=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="paths must be a text file or folder, a list of them"):
        TextDataModule(paths=42)


def test_empty_corpora_are_refused(tmp_path: Path) -> None:
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match=r"corpus is empty.*hold no file ending in \.txt"):
        TextDataModule(paths=[str(nothing)])
    (nothing / "blank.txt").write_text("")
    module = TextDataModule(paths=[str(nothing)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="corpus is empty.*hold no text"):
        module.prepare_data()


def test_a_corpus_too_short_for_the_windows_names_seq_len(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("just a few words")
    module = TextDataModule(paths=[str(tmp_path / "short.txt")], seq_len=64, cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    with pytest.raises(ValueError, match="too few for one training and one validation window of seq_len=64"):
        module.setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, "seq_len must be a positive integer; received 0"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer; received 2.5"),
        ({"val_fraction": 1.5}, "val_fraction must be a number between 0 and 1"),
        ({"max_bytes": 0}, "max_bytes must be a positive integer or None; received 0"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0; received -1"),
    ],
)
def test_bad_arguments_say_what_works(text_folder: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TextDataModule(paths=[str(text_folder)], **kwargs)


def test_the_built_in_corpus_is_the_standard_library_source(tmp_path: Path) -> None:
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == sorted(files)
    module = TextDataModule(seq_len=64, max_bytes=20_000, cache_dir=str(tmp_path))
    module.prepare_data()
    module.setup("fit")
    assert module.meta["text_bytes"] == 20_000 and module.meta["first_file"] == str(files[0])
    assert len(module.train_set) > 0 and len(module.val_set) > 0


def test_default_cache_folder_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert corpus.default_cache_dir() == tmp_path / "sage-lightning" / "tokens"


def test_hugging_face_tokenizer_from_a_local_folder(text_folder: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for f in corpus_files([str(text_folder)]) for w in f.read_text().split()})
    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        tmp_path / "tokenizer"
    )

    module = data(text_folder, tmp_path, tokenizer=str(tmp_path / "tokenizer"), seq_len=8)
    assert module.vocab_size == len(vocab) and module.meta["dtype"] == "uint16"
    tokens = np.memmap(module.token_file, dtype=np.uint16, mode="r").tolist()
    expected = []
    for name in ("b.txt", "sub/a.md"):
        expected += [vocab[w] for w in (text_folder / name).read_text().split()] + [1]
    assert tokens == expected
    assert module.tokenizer.decode(tokens[:3]) == " ".join((text_folder / "b.txt").read_text().split()[:3])
    # A byte-level token file of the same corpus is another file.
    assert data(text_folder, tmp_path).token_file != module.token_file
