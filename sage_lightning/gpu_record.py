"""The kernels' digest, and the GPU-verification record's summary that ships with the package.

``python -m benchmarks.kernels.gpu_verify`` proves ``kernels/`` on an H100 or H200 and writes the full record
(``benchmarks/results/gpu-verified.json``); its digest, commit, device and date also go beside this module, to
``sage_lightning/gpu_record.json`` (``python -m benchmarks.kernels.gpu_record`` writes it), so that an installed
package can say whether its own kernel files are the ones that passed (``python -m sage_lightning``).
``tests/test_gpu_record.py`` keeps the two in step.

Example::

    from sage_lightning.gpu_record import installed_digest, recorded_summary

    print(installed_digest() == recorded_summary()["kernels_digest"])
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

#: The summary's file, beside this module (package data).
SUMMARY = Path(__file__).with_name("gpu_record.json")
#: The record's fields the summary keeps.
SUMMARY_FIELDS = ("kernels_digest", "commit", "device", "date", "passed")


def kernel_files(root: Path | None = None) -> dict[str, str]:
    """The sha256 of every file under ``root``, by its path relative to ``root`` (``/``-separated).

    Python's byte-code caches (``__pycache__``, ``*.pyc``) are left out: they are not source and appear when the
    package is imported.

    Args:
        root: the kernels' folder (``kernels/`` in a checkout, ``sage_lightning/kernels/`` installed); ``None`` is
            the folder this process imports ``sage_lightning.kernels`` from.

    Example::

        kernel_files(Path("kernels"))["backward.py"]   # '3f1c...'
    """
    if root is None:
        import sage_lightning.kernels as kernels

        root = Path(kernels.__file__).parent
    files = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        files[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def digest(files: dict[str, str]) -> str:
    """One sha256 over the sorted paths and their contents' digests (a file renamed changes it too).

    Example::

        digest(kernel_files(Path("kernels")))   # the record's "kernels_digest"
    """
    text = "".join(f"{path}\0{files[path]}\n" for path in sorted(files))
    return hashlib.sha256(text.encode()).hexdigest()


def installed_digest() -> str:
    """The digest of the kernel files this process imports (``sage_lightning.kernels``' folder)."""
    return digest(kernel_files())


def summary_of(record: dict[str, Any]) -> dict[str, Any]:
    """The fields of a full record that ship with the package (:data:`SUMMARY_FIELDS`).

    Example::

        summary_of(json.loads(Path("benchmarks/results/gpu-verified.json").read_text()))
    """
    return {name: record.get(name) for name in SUMMARY_FIELDS}


def recorded_summary(path: Path = SUMMARY) -> dict[str, Any] | None:
    """The shipped summary of the GPU record, or ``None`` where the file is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def verification_line() -> str:
    """One line: whether the installed kernels are the files that passed GPU verification, and which run that was.

    Example::

        print(verification_line())   # "yes: the kernels' digest d25f34dd... is that of the GPU record of ..."
    """
    summary = recorded_summary()
    current = installed_digest()
    if summary is None:
        return f"unknown: no GPU-record summary in this install ({SUMMARY.name}); kernels digest {current[:12]}"
    where = f"{summary.get('device')}, {summary.get('date')}, commit {str(summary.get('commit'))[:12]}"
    if summary.get("kernels_digest") != current:
        return (
            f"NO: the installed kernels (digest {current[:12]}) are not the files the GPU record proved ({where}, "
            f"digest {str(summary.get('kernels_digest'))[:12]}): a modified or unreleased build"
        )
    passed = "passed" if summary.get("passed") is True else "did NOT pass"
    return f"yes: digest {current[:12]}, the files the GPU record proved ({where}; it {passed})"
