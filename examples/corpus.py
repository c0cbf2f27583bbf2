"""Text to token windows: a corpus of files, tokenized once into a memory-mapped file, served as fixed-length windows.

The default corpus needs no download: the Python standard library's own source files on this machine
(``sysconfig.get_paths()["stdlib"]``, ``*.py``, about 30 MB of real text). Tokens are bytes by default
(vocabulary 256, no tokenizer to fetch); a Hugging Face tokenizer saved in a local folder can be given
instead. The token file is written once per corpus and tokenizer into a cache folder, under a name derived
from a hash of the file list (paths, sizes, modification times), the tokenizer and the byte cap, and reused
from then on.

Example::

    from examples.corpus import TextDataModule

    data = TextDataModule(seq_len=256, batch_size=8)      # the standard library's source, byte tokens
    data.prepare_data()                                    # tokenizes once (a second or two), then reuses
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))            # {"input_ids": [8, 256], "labels": [8, 256]}
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

#: Bump when the token file's layout changes: older cache files are then rebuilt, not misread.
FORMAT_VERSION = 1
#: File endings read from a folder of user text (a file given by path is read whatever its ending).
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".rst", ".py")


def default_cache_dir() -> Path:
    """Where token files go unless told: ``$XDG_CACHE_HOME/sage-lightning/tokens`` (``~/.cache/...``)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sage-lightning" / "tokens"


def stdlib_files() -> list[Path]:
    """The Python standard library's ``*.py`` files on this machine, sorted (third-party packages left out).

    Example::

        files = stdlib_files()      # ~1800 files, ~30 MB on CPython 3.11
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if path.is_file() and not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts)
    )


def corpus_files(paths: Sequence[str | os.PathLike] | None, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """The files of a corpus, in a fixed order.

    Args:
        paths: text files and folders; ``None`` for the standard library's source (:func:`stdlib_files`). A
            folder contributes every file below it whose name ends in one of ``suffixes``, sorted by path.
        suffixes: file endings taken from folders.

    Raises:
        FileNotFoundError: a path that does not exist (the message names it and its position in ``paths``).
        ValueError: the paths hold no file to read.

    Example::

        corpus_files(["notes.txt", "docs/"])
    """
    if paths is None:
        files = stdlib_files()
        if not files:
            raise ValueError(
                f"TextDataModule: the built-in corpus is empty: no *.py file under the standard library folder "
                f"{sysconfig.get_paths()['stdlib']!r} (a Python installed without its sources); give paths=[...] "
                "with your own text files or folders."
            )
        return files
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for index, given in enumerate(paths):
        path = Path(given).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes))
        else:
            raise FileNotFoundError(
                f"TextDataModule: paths[{index}] must be an existing text file or folder; received {str(given)!r}, "
                "which does not exist. Leave paths unset (null) for the built-in corpus, the Python standard "
                "library's source."
            )
    if not files:
        raise ValueError(
            f"TextDataModule: the corpus is empty: paths {[str(p) for p in paths]} hold no file ending in "
            f"{', '.join(suffixes)}; give text files, or folders that contain some (or set suffixes)."
        )
    return files


class ByteTokenizer:
    """Bytes as tokens: vocabulary 256, no training, no download; byte 0 (never in a text file) ends a document.

    Example::

        tokenizer = ByteTokenizer()
        tokenizer.decode(tokenizer.encode("héllo".encode()))   # "héllo"
    """

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = 0
    dtype = np.uint8

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of one document's raw bytes."""
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of token ids (invalid UTF-8, e.g. a window cut inside a character, becomes U+FFFD)."""
        values = ids.tolist() if isinstance(ids, (np.ndarray, torch.Tensor)) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        """What identifies this tokenizer's output in the cache key."""
        return self.name


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (``save_pretrained`` output); no network access.

    Needs ``transformers`` (``pip install "sage-lightning[hf]"``).

    Args:
        path: the folder.

    Raises:
        FileNotFoundError: ``path`` is not a folder.
        ImportError: ``transformers`` is not installed.

    Example::

        tokenizer = HFTokenizer("~/tokenizers/llama")
    """

    def __init__(self, path: str | os.PathLike) -> None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"TextDataModule: tokenizer must be 'bytes' or a local folder holding a Hugging Face tokenizer "
                f"(what tokenizer.save_pretrained(folder) writes); received {str(path)!r}, which is not a folder."
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ImportError(
                f"TextDataModule: tokenizer={str(path)!r} needs the transformers package; "
                'pip install "sage-lightning[hf]", or use tokenizer="bytes".'
            ) from error
        self.path = folder.resolve()
        self.name = str(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of one document (decoded as UTF-8, invalid bytes replaced), without special tokens."""
        ids = self.tokenizer(data.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of token ids."""
        values = ids.tolist() if isinstance(ids, (np.ndarray, torch.Tensor)) else list(ids)
        return self.tokenizer.decode(values)

    def fingerprint(self) -> str:
        """The folder and a hash of its files' contents: a changed tokenizer gets a new token file."""
        digest = hashlib.sha256()
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(self.path)).encode())
            digest.update(file.read_bytes())
        return f"{self.path}:{digest.hexdigest()[:16]}"


def load_tokenizer(tokenizer: str) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` for :class:`ByteTokenizer`, a local folder for :class:`HFTokenizer`.

    Example::

        load_tokenizer("bytes").vocab_size   # 256
    """
    return ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(tokenizer)


def _read(files: Sequence[Path], max_bytes: int | None) -> Iterator[bytes]:
    """Each file's bytes, in order, stopping at ``max_bytes`` in all (the last file cut short)."""
    left = max_bytes
    for file in files:
        if left is not None and left <= 0:
            return
        data = file.read_bytes()
        if left is not None:
            data = data[:left]
            left -= len(data)
        yield data


def build_token_file(
    files: Sequence[Path],
    tokenizer: ByteTokenizer | HFTokenizer,
    cache_dir: str | os.PathLike,
    max_bytes: int | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Tokenize ``files`` into one flat token file in ``cache_dir``, or find the one an earlier run wrote.

    Documents are joined with the tokenizer's end-of-document token (when it has one). The file is written under
    a temporary name and renamed when complete, so an interrupted run never leaves a partial file to be reused.
    Beside it, ``<name>.json`` records the token count, dtype, vocabulary and what went in.

    Args:
        files: the documents, in order.
        tokenizer: a :class:`ByteTokenizer` or :class:`HFTokenizer`.
        cache_dir: the folder for token files (created if missing).
        max_bytes: read at most this many bytes of text in all; ``None`` for everything.

    Returns:
        The token file's path and its metadata.

    Raises:
        ValueError: the files hold no text.

    Example::

        path, meta = build_token_file(corpus_files(None), ByteTokenizer(), default_cache_dir())
        tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
    """
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = json.dumps(
        {"format": FORMAT_VERSION, "tokenizer": tokenizer.fingerprint(), "files": stats, "max_bytes": max_bytes}
    )
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser()
    path, meta_path = folder / f"{name}.tokens", folder / f"{name}.json"
    if meta_path.is_file() and path.is_file():
        meta = json.loads(meta_path.read_text())
        if path.stat().st_size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize:
            return path, meta
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{name}.tokens.{os.getpid()}.partial"
    tokens = text_bytes = documents = 0
    eos = None if tokenizer.eos_id is None else np.asarray([tokenizer.eos_id], dtype=tokenizer.dtype)
    try:
        with open(partial, "wb") as out:
            for data in _read(files, max_bytes):
                if not data:
                    continue
                ids = tokenizer.encode(data).astype(tokenizer.dtype, copy=False)
                out.write(ids.tobytes())
                tokens += len(ids)
                if eos is not None:
                    out.write(eos.tobytes())
                    tokens += 1
                text_bytes += len(data)
                documents += 1
        if text_bytes == 0:
            raise ValueError(
                f"TextDataModule: the corpus is empty: its {len(files)} file(s) hold no text "
                f"(first: {str(files[0]) if files else 'none'}); give files with some text in them."
            )
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    meta = {
        "format": FORMAT_VERSION,
        "tokens": tokens,
        "dtype": np.dtype(tokenizer.dtype).name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "documents": documents,
        "text_bytes": text_bytes,
        "files": len(files),
        "first_file": str(files[0]),
        "max_bytes": max_bytes,
    }
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return path, meta


class TokenWindows(Dataset):
    """Fixed-length windows of a token file: item ``i`` covers tokens ``[start + i*seq_len, ... + seq_len + 1)``.

    Consecutive windows share one token (the last target of one is the first input of the next), so every token
    of the range is a target once. The memory map is opened on first use, in whichever process reads it
    (DataLoader workers included).

    Args:
        path: the token file.
        dtype: its numpy dtype.
        start: first token of the range.
        stop: one past the last token of the range.
        seq_len: tokens a window feeds the model (it holds ``seq_len + 1``).

    Example::

        windows = TokenWindows(path, "uint8", 0, 10_000, seq_len=128)
        item = windows[0]     # {"input_ids": tensor[128], "labels": tensor[128]}
    """

    def __init__(self, path: str | os.PathLike, dtype: str, start: int, stop: int, seq_len: int) -> None:
        self.path, self.dtype, self.start, self.stop, self.seq_len = Path(path), dtype, start, stop, seq_len
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.stop - self.start - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"TokenWindows: index {index} out of range for {len(self)} windows.")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        first = self.start + index * self.seq_len
        window = torch.from_numpy(self._tokens[first : first + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __getstate__(self) -> dict[str, Any]:
        # A memory map does not travel to DataLoader workers: each opens its own.
        return {**self.__dict__, "_tokens": None}


class EpochShuffle(DistributedSampler):
    """A new permutation of ``range(size)`` each epoch, from ``seed`` and the epoch alone, sharded over ranks,
    able to start mid-epoch.

    Lightning calls :meth:`set_epoch` at each epoch's start. Because the order depends on nothing else (not on
    torch's global generator, which Lightning does not checkpoint), a resumed run sees the same order as the
    uninterrupted one; :meth:`skip` drops the indices an interrupted epoch had already served. Each of
    ``num_replicas`` ranks takes every ``num_replicas``-th index of the permutation (the tail that does not
    divide evenly is dropped). A ``DistributedSampler``, so Lightning's DDP keeps it rather than replacing it.

    Args:
        size: the number of items.
        seed: the shuffle's seed.
        num_replicas: the ranks sharing the data (the world size).
        rank: this process's rank among them.

    Example::

        sampler = EpochShuffle(10, seed=0)
        sampler.set_epoch(1)
        sampler.skip(4)
        list(sampler)       # the last 6 indices of epoch 1's permutation
    """

    def __init__(self, size: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(
            range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=int(seed), drop_last=True
        )
        self.size = size
        self._skip = 0

    def skip(self, count: int) -> None:
        """Leave out the first ``count`` indices of this rank's next iteration (once)."""
        self._skip = int(count)

    def permutation(self) -> torch.Tensor:
        """This epoch's order over all ranks, the same in every process and every run."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=generator)

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._skip, 0
        shard = self.permutation()[: self.num_samples * self.num_replicas][self.rank :: self.num_replicas]
        return iter(shard[start:].tolist())

    def __len__(self) -> int:
        return self.num_samples


class ResumableLoader(DataLoader):
    """Shuffled training batches that a checkpoint can resume mid-epoch (Lightning's ``state_dict`` interface).

    Lightning saves :meth:`state_dict` in each checkpoint and hands it back to :meth:`load_state_dict` before the
    resumed run's first batch, so the resumed run continues with the batch the interrupted one would have taken
    next. The position is the batches the training loop has consumed this epoch: ``position()`` when given
    (the Lightning trainer's count, which does not include the batch its data fetcher reads ahead), otherwise
    the batches this loader has yielded.

    Args:
        dataset: a map-style dataset.
        batch_size: items per batch; the last, partial batch of an epoch is dropped.
        seed: the shuffle's seed (:class:`EpochShuffle`).
        num_replicas: the ranks sharing the data, each reading its own shard (the world size).
        rank: this process's rank.
        position: returns the batches consumed in the current epoch (or ``None`` when it cannot tell); ``None``
            to count the yielded ones.
        **kwargs: the rest of :class:`torch.utils.data.DataLoader`'s arguments (not ``sampler`` or ``shuffle``).

    Example::

        loader = ResumableLoader(windows, batch_size=16, seed=1234)
        state = loader.state_dict()      # {"seed": 1234, "epoch": 0, "batches": 0}
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        position: Any = None,
        **kwargs: Any,
    ) -> None:
        self.epoch_shuffle = EpochShuffle(len(dataset), seed, num_replicas, rank)  # type: ignore[arg-type]
        self.position = position
        self._yielded = 0
        super().__init__(dataset, batch_size=batch_size, sampler=self.epoch_shuffle, drop_last=True, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        self._yielded = 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "epoch", "batches"}``: where the next batch comes from."""
        consumed = self.position() if self.position is not None else None
        batches = self._yielded if consumed is None else consumed
        return {"seed": self.epoch_shuffle.seed, "epoch": self.epoch_shuffle.epoch, "batches": int(batches)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (what :meth:`state_dict` returned in the interrupted run)."""
        self.epoch_shuffle.seed = int(state["seed"])
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= len(self):  # saved at an epoch's end: the next epoch starts from its beginning
            epoch, batches = epoch + 1, 0
        self.epoch_shuffle.set_epoch(epoch)
        self.epoch_shuffle.skip(batches * self.batch_size)


class TextDataModule(L.LightningDataModule):
    """Next-token prediction on a text corpus: tokenized once into a memory-mapped file, served as windows.

    ``prepare_data`` (once per node) writes the token file, or finds it in the cache; ``setup`` opens it and
    splits it: the last ``val_fraction`` of the tokens is the validation set, the rest training, so no window of
    one overlaps the other and the split is the same on every run. Batches are dicts of ``input_ids`` and
    ``labels`` (``[batch_size, seq_len]``, the labels shifted by one), training windows shuffled each epoch by a
    :class:`ResumableLoader`, so a run resumed from a mid-epoch checkpoint reads the batches the uninterrupted
    run would have read.

    Args:
        paths: a text file or folder, or a list of them; ``None`` (default) for the built-in corpus, the Python
            standard library's own ``*.py`` files on this machine (no download). Folders contribute files ending
            in ``suffixes``.
        tokenizer: ``"bytes"`` (default: byte-level tokens, vocabulary 256) or a local folder with a Hugging Face
            tokenizer (``save_pretrained`` output; needs ``sage-lightning[hf]``).
        seq_len: tokens per training sequence.
        batch_size: sequences per micro-batch (per device).
        val_fraction: share of the tokens held out for validation (at least one window).
        max_bytes: read at most this many bytes of text (``None``: all of it), to bound the tokenization time of
            a slow tokenizer on a large corpus.
        suffixes: file endings read from folders.
        cache_dir: folder for token files; ``None`` for ``~/.cache/sage-lightning/tokens``.
        num_workers: DataLoader worker processes (0 reads in the training process; windows are a memory copy).
        seed: the training order's seed; ``None`` for torch's initial seed when the first training loader is
            made (``seed_everything``'s seed). Kept in checkpoints.

    Raises:
        FileNotFoundError: a path or tokenizer folder that does not exist.
        ValueError: an argument out of range, an empty corpus, or a corpus too short for one training and one
            validation window; each message names the argument, the value received and what works.

    Example::

        data = TextDataModule(paths=["~/books"], tokenizer="~/tokenizers/llama", seq_len=1024, batch_size=16)
        trainer.fit(model, datamodule=data)
    """

    def __init__(
        self,
        paths: list[str] | str | None = None,
        tokenizer: str = "bytes",
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.005,
        max_bytes: int | None = None,
        suffixes: list[str] | None = None,
        cache_dir: str | None = None,
        num_workers: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TextDataModule: {name} must be a positive integer; received {value!r}.")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(
                f"TextDataModule: val_fraction must be a number between 0 and 1 (exclusive), e.g. 0.005; "
                f"received {val_fraction!r}."
            )
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"TextDataModule: max_bytes must be a positive integer or None; received {max_bytes!r}.")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"TextDataModule: num_workers must be an integer >= 0; received {num_workers!r}.")
        if paths is not None and not isinstance(paths, (str, os.PathLike, list, tuple)):
            raise ValueError(
                f"TextDataModule: paths must be a text file or folder, a list of them, or None for the built-in "
                f"corpus; received {type(paths).__name__}."
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"TextDataModule: seed must be an integer or None; received {seed!r}.")
        self.seed = seed
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.max_bytes, self.num_workers = max_bytes, num_workers
        self.suffixes = tuple(suffixes) if suffixes is not None else TEXT_SUFFIXES
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        # Loaded now (cheap, and errors early): the model needs the vocabulary size before the data is read.
        self.tokenizer = load_tokenizer(tokenizer)
        # Listed now too: a bad path fails before the model is built.
        self.files = corpus_files(self.paths, self.suffixes)
        self.token_file: Path | None = None
        self.meta: dict[str, Any] = {}
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (what the model's embedding needs)."""
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        """Write the token file (or find it in the cache)."""
        self.token_file, self.meta = build_token_file(self.files, self.tokenizer, self.cache_dir, self.max_bytes)

    def setup(self, stage: str | None = None) -> None:
        """Open the token file and split it into training and validation windows.

        Raises:
            ValueError: the corpus is too short for one training and one validation window of ``seq_len``.
        """
        if self.token_file is None:
            # prepare_data ran in another process (rank 0 of the node): the same call finds its file.
            self.prepare_data()
        assert self.token_file is not None
        total = self.meta["tokens"]
        val_tokens = max(self.seq_len + 1, int(total * self.val_fraction))
        split = total - val_tokens
        if split - 1 < self.seq_len:
            raise ValueError(
                f"TextDataModule: the corpus has {total} tokens, too few for one training and one validation window "
                f"of seq_len={self.seq_len} (about {2 * (self.seq_len + 1)} needed with val_fraction="
                f"{self.val_fraction}); give more text or lower seq_len."
            )
        dtype = self.meta["dtype"]
        self.train_set = TokenWindows(self.token_file, dtype, 0, split, self.seq_len)
        self.val_set = TokenWindows(self.token_file, dtype, split, total, self.seq_len)

    def train_dataloader(self) -> ResumableLoader:
        """Training windows, a new order each epoch from :attr:`seed` and the epoch, resumable mid-epoch.

        Under DDP each rank reads its own shard of that order (:class:`EpochShuffle` is a ``DistributedSampler``,
        which Lightning keeps as it is).
        """
        if self.train_set is None:
            raise RuntimeError("TextDataModule: call setup() before asking for a dataloader.")
        if self.seed is None:
            self.seed = torch.initial_seed() % 2**31
        trainer = self.trainer
        return ResumableLoader(
            self.train_set,
            batch_size=self.batch_size,
            seed=self.seed,
            num_replicas=trainer.world_size if trainer is not None else 1,
            rank=trainer.global_rank if trainer is not None else 0,
            position=self._batches_consumed,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation windows, in order."""
        if self.val_set is None:
            raise RuntimeError("TextDataModule: call setup() before asking for a dataloader.")
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def _batches_consumed(self) -> int | None:
        """Training batches the attached Trainer has taken this epoch (its read-ahead batch not included)."""
        trainer = self.trainer
        if trainer is None:
            return None
        return trainer.fit_loop.epoch_loop.batch_progress.current.ready
