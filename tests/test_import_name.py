"""The kernels directory seen as a top-level ``kernels`` must not register the custom ops a second time.

From the repository root (``python -m pytest``, a REPL started there) the directory that is installed as
``sage_lightning.kernels`` is also importable as ``kernels``, the name of Hugging Face's kernel hub, which
transformers imports to probe for it. A second execution of ``ops.py`` replaced the custom ops and freed the
operators ``sage_lightning.kernels`` still called: CI failed with ``vector::reserve`` and "doesn't have a schema
registered" errors, depending on what the freed memory held.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent(
    """
    import importlib
    import sys

    import torch._library.custom_ops as custom_ops

    import sage_lightning.kernels as package

    names = [name for name in custom_ops.OPDEF_TO_LIB if name.startswith("sage_lightning::")]
    before = {name: custom_ops.OPDEF_TO_LIB[name] for name in names}
    assert len(names) == 4, names

    top = importlib.import_module("kernels")
    ops = importlib.import_module("kernels.ops")
    from transformers.utils.import_utils import is_kernels_available

    assert top is package, (top, package)
    assert ops is sys.modules["sage_lightning.kernels.ops"]
    assert not is_kernels_available()
    after = {name: custom_ops.OPDEF_TO_LIB[name] for name in names}
    assert all(after[name] is before[name] for name in names), "a custom op was registered again"
    print("ok")
    """
)


def test_top_level_kernels_is_an_alias_and_registers_nothing() -> None:
    """``import kernels`` from the repository root gives the installed package; the custom ops stay registered once."""
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
