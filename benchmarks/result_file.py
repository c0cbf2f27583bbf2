"""What every result file of ``benchmarks/`` shares (``shared/RESULTS.md``): the header, the commit, the versions, the
paths and the JSON layout. Every tool writes its files through here: ``write({**header(...), "rows": rows}, path)``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def device_name(device: str) -> str:
    """``"cpu"`` or ``torch.cuda.get_device_name()`` for a CUDA device (torch imported here: the compile checks
    import this module before Triton sees its cache folder)."""
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"


def device_slug(name: str) -> str:
    """A short file-name slug for a device name: ``device_slug("NVIDIA H200")`` is ``"h200"``."""
    match = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def versions() -> dict[str, str]:
    """Installed versions of torch, triton and lightning (those present)."""
    import torch

    found = {"torch": torch.__version__}
    for package in ("triton", "lightning"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def commit() -> str:
    """``$GIT_COMMIT`` (the device's copy of the tree has no ``.git``: the caller passes the sha), else ``git
    rev-parse HEAD`` with ``+dirty`` when tracked files differ (it showed a stale ``.git`` copied to the device once,
    and shows a run of uncommitted code), else ``"unknown"``."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if done.returncode != 0 or not done.stdout.strip():
            return "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    dirty = status.returncode != 0 or bool(status.stdout.strip())
    return done.stdout.strip() + ("+dirty" if dirty else "")


def command(module: str, argv: list[str]) -> str:
    """The command line that reruns a tool from the repository root: ``python -m <module> <argv>``."""
    return shlex.join(["python", "-m", module, *argv])


def header(kind: str, device: str, module: str, argv: list[str]) -> dict[str, Any]:
    """The common header of a result file: kind, device, date, commit, command, versions."""
    return {
        "kind": kind,
        "device": device,
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": command(module, argv),
        "versions": versions(),
    }


def default_path(kind: str, device: str, tag: str = "") -> Path:
    """``results/<kind>-<device slug>-<YYYYMMDD><tag>.json``."""
    return RESULTS / f"{kind}-{device_slug(device)}-{datetime.date.today():%Y%m%d}{tag}.json"


def to_json(result: dict) -> str:
    """``result`` as JSON text: the header indented, one row per line."""
    head = json.dumps({key: value for key, value in result.items() if key != "rows"}, indent=1)
    rows = ",\n".join("  " + json.dumps(row) for row in result.get("rows", []))
    return head[:-2] + ',\n "rows": [\n' + rows + "\n ]\n}\n"


def write(result: dict, path: Path) -> Path:
    """Write ``result`` to ``path`` (folders made) in the layout of :func:`to_json`; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(result))
    return path
