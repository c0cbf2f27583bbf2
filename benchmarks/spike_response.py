"""What a fault costs the run, by the controller's response (issue 16, case 3): held-out loss at the end of the same
training with one loss spike x100, or one NaN loss, at step ``--fault-step``, with no controller, and with the
controller at two snapshot cadences.

Issue 16 measured (GPU, the small config): one spike x100 at step 30 with snapshots every 100 steps made the old
controller roll back about 31 steps, ending at held-out loss 2.652 against 2.464 with no callback at all. Now a
one-off spike skips its step. A NaN still rolls back, and the snapshot cadence sets how many steps it loses.

Run (the tiny config on CPU: about 4 minutes; on a GPU give ``--config examples/configs/small.yaml``)::

    python benchmarks/spike_response.py > benchmarks/results/spike-response-cpu-$(date +%Y%m%d).md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain_compare  # noqa: E402  (benchmarks/ is a folder of scripts)
from multi_gpu import LossFault  # noqa: E402
from pretrain_compare import TextDataModule  # noqa: E402

from sage_lightning import AdaptivePrecision  # noqa: E402

#: name -> (fault factor, controller's snapshot_every_n_steps or None for no controller).
SCENARIOS: dict[str, tuple[float | None, int | None]] = {
    "no fault, no controller": (None, None),
    "no fault, controller": (None, 100),
    "spike x100, no controller": (100.0, None),
    "spike x100, controller (snapshots every 100)": (100.0, 100),
    "NaN, controller (snapshots every 100)": (float("nan"), 100),
    "NaN, controller (snapshots every 25)": (float("nan"), 25),
}


def run(config: dict[str, Any], data: TextDataModule, factor: float | None, every: int | None, args: Any) -> dict:
    L.seed_everything(int(config.get("seed_everything", 0) or 0), workers=True)
    model = pretrain_compare.build_model(config, pretrain_compare.RunSpec(name="sage", attention="sage"), data)
    callbacks: list[Any] = [] if factor is None else [LossFault(args.fault_step, factor)]
    controller = None
    if every is not None:
        controller = AdaptivePrecision(snapshot_every_n_steps=every, verbose=False, progress_bar=False)
        callbacks.append(controller)
    trainer_args = {k: v for k, v in (config.get("trainer") or {}).items() if k not in pretrain_compare._TRAINER_OWN}
    trainer_args.update(max_steps=args.max_steps, val_check_interval=None, check_val_every_n_epoch=None)
    trainer_args.update(limit_val_batches=args.val_batches)
    trainer = L.Trainer(
        **trainer_args,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    (metrics,) = trainer.validate(model, datamodule=data, verbose=False)
    return {
        "val_loss": metrics["val/loss"],
        "rollbacks": None if controller is None else controller.rollbacks,
        "skipped": None if controller is None else controller.skipped_steps,
        "decisions": [] if controller is None else [str(d) for d in controller.history],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("examples/configs/tiny.yaml"))
    parser.add_argument("--max-steps", type=int, default=180)
    parser.add_argument("--fault-step", type=int, default=30)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="run these scenarios only")
    args = parser.parse_args(argv)
    config = pretrain_compare.load_config(args.config, [])
    data = TextDataModule(**(config.get("data") or {}))
    data.prepare_data()
    print(
        f"{args.config}, {args.max_steps} steps, fault at step {args.fault_step}, held-out loss on {args.val_batches} "
        "batches\n"
    )
    print("| scenario | held-out loss | rollbacks | skipped steps |")
    print("|---|---:|---:|---:|")
    notes = []
    for name, (factor, every) in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        result = run(config, data, factor, every, args)
        print(
            f"| {name} | {result['val_loss']:.4f} | {result['rollbacks'] if result['rollbacks'] is not None else ''} | "
            f"{result['skipped'] if result['skipped'] is not None else ''} |",
            flush=True,
        )
        notes += [f"- {name}: {d}" for d in result["decisions"]]
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
