"""``AttentionPrecision`` for the policy, without importing torch.

``sage_lightning.kernels.precision`` is plain Python, but importing it the usual way first runs
``sage_lightning.kernels/__init__.py``, which imports the kernels (torch, Triton). The policy only needs the
dataclass, so this module loads that one file under its own package name when the kernels are not imported yet;
``sage_lightning.kernels`` then finds it in ``sys.modules`` and uses the same module, so there is one class.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "sage_lightning.kernels.precision"


def _load():
    module = sys.modules.get(_NAME)
    if module is not None:
        return module
    spec = importlib.util.find_spec("sage_lightning.kernels")  # imports sage_lightning only, not the kernels
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location, "precision.py")
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location(_NAME, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[_NAME] = module
            try:
                file_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[_NAME]
                raise
            return module
    return importlib.import_module(_NAME)  # an unusual install: the ordinary import


_module = _load()
AttentionPrecision = _module.AttentionPrecision
#: The 8-bit product formats (``"int8"``, ``"fp8"``): what the policy's rules raise to ``"bf16"``.
LOW_BIT_FORMATS: tuple[str, ...] = _module.LOW_BIT_FORMATS

__all__ = ["LOW_BIT_FORMATS", "AttentionPrecision"]
