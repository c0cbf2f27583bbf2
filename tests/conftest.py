"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's interpreter, which reads ``TRITON_INTERPRET`` when triton is
first imported: it must be set here, before any test module imports ``sage_lightning.kernels``. Importing
torch does not import triton, so asking torch whether CUDA is there first is safe.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
