"""Write ``state_v2.ckpt``: a Lightning checkpoint whose AdaptivePrecision state has the version-2 layout, for
``tests/test_callback.py``'s check that a checkpoint written before the two-step verdict lag still resumes.

Run it with the code of a commit that writes version 2 (33c9433, the last before the lag), from that checkout's
root, with its tests/tiny_lightning.py on the path::

    git worktree add /tmp/v2 33c9433 && cd /tmp/v2
    PYTHONPATH=tests python <this repository>/tests/data/make_state_v2_checkpoint.py \\
        <this repository>/tests/data/state_v2.ckpt

The run: a one-layer TinyLM (d_model 16, 2 heads), 8 steps in epochs of 6, saved at the first epoch's end; the
controller with a dS measurement every step and a probe every 4 steps against an impossible cosine (so it escalates
at step 4), its verdicts one step late (``check_before_step=False``, so the checkpoint holds a pending verdict and a
snapshot candidate).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_lightning import TinyLM, token_loader  # the checkout's tests/ (PYTHONPATH=tests)

from sage_lightning import AdaptivePrecision
from sage_lightning.callback import STATE_VERSION
from sage_lightning.policy import PolicyConfig

out = Path(sys.argv[1])
assert STATE_VERSION == 2, f"run this with code that writes version 2 (33c9433); this writes {STATE_VERSION}"
config = PolicyConfig(ds_stats_every_n_steps=1, probe_every_n_steps=4, probe_grad_cos_min=0.999999)
controller = AdaptivePrecision(config, verbose=False, check_before_step=False)
with tempfile.TemporaryDirectory() as folder:
    # Saved at the end of the first 6-step epoch, mid-fit: the last step's verdict is still pending there.
    checkpoints = ModelCheckpoint(folder, save_top_k=-1, save_on_train_epoch_end=True)
    trainer = L.Trainer(
        max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[controller, checkpoints],
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(TinyLM(layers=1, d_model=16, heads=2), token_loader(6, same_batch=True))
    (saved,) = Path(folder).glob("epoch=0-*.ckpt")
    state = torch.load(saved, weights_only=False)["callbacks"]
    (controller_state,) = [value for key, value in state.items() if key.startswith("AdaptivePrecision")]
    assert controller_state["version"] == 2 and controller_state["pending"] is not None
    shutil.copy(saved, out)
print(f"wrote {out}: pending step {controller_state['pending']['step']}, {len(controller_state['history'])} decisions")
