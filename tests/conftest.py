"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's interpreter, which reads ``TRITON_INTERPRET`` when triton is
first imported: it must be set here, before any test module imports ``sage_lightning.kernels``. Importing
torch does not import triton, so asking torch whether CUDA is there first is safe.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _kernel_switches_from_the_environment() -> None:
    """Each test plans with the kernel switches its environment holds: the plan reads them once per process
    (``sage_lightning.kernels.plan.settings``), and an earlier test's ``monkeypatch`` has restored them since."""
    plan = sys.modules.get("sage_lightning.kernels.plan")
    if plan is not None:
        plan.refresh_settings()


@pytest.fixture
def kernel_switch(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str | None], None]:
    """``kernel_switch(name, value)``: set a kernel switch (``SAGE_LIGHTNING_HOPPER``, ...; ``None`` unsets it) for
    this test and have the plan read it."""
    from sage_lightning.kernels.plan import refresh_settings

    def set_switch(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        refresh_settings()

    return set_switch
