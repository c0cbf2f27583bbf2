"""Pretraining with SageBwd against full-precision attention: the same config run once per attention setting.

Trains a config (``examples/configs/small.yaml`` by default) once per ``--attention`` value, everything else equal
(seed, data order, callbacks, step budget), and writes ``training-<device>-<date>-<tag>`` ``.json`` (kind
``training``: rows per ``trainer.log_every_n_steps`` steps and run as ``runs.run_one`` makes them, a ``summary`` per
run, the controller's ``decisions`` and ``decision_log``), ``.md`` and ``.png`` (where matplotlib is installed), and
TensorBoard logs, in ``--out-dir`` (``$OUT`` when set, else ``benchmarks/results``).

``--runs`` takes runs that differ in more than the attention, one ``ATTENTION[:KEY=VALUE,...]`` each, keys
``controller=on|off``, ``seed=N``, ``smooth_k=on|off``, ``smooth_q=on|off``, ``sdpa=BACKEND`` (the SDPA backend
``full`` layers call; ``cudnn_fp8``: cuDNN's FP8 attention, ``cudnn_fp8.py``) and ``name=NAME``; ``ATTENTION`` is a
key of ``examples.pretrain``'s ``ATTENTION_MODES``. ``--matrix evidence`` runs issue #7's matrix (``matrix.py``;
``--groups large-qknorm-d128``: issue 42's cuDNN FP8 baseline). ``--set section.key=value`` changes one config entry
for every run; no LightningCLI (no jsonargparse needed).

Example::

    python -m benchmarks.training.pretrain_compare --max-steps 2000 --max-minutes 3.3      # on one GPU
    python -m benchmarks.training.pretrain_compare --runs full sage:controller=off sage:controller=on \\
        sage:controller=off,smooth_k=off --max-steps 1000
    python -m benchmarks.training.pretrain_compare --runs sage:controller=off full:controller=off,sdpa=cudnn \\
        --set data.seq_len=4096 --set data.batch_size=8 --max-steps 100 --tag seq4096
    python -m benchmarks.training.pretrain_compare --matrix evidence --budget-minutes 20 \\
        --save-checkpoint large-qknorm/full
    python -m benchmarks.training.pretrain_compare --config examples/configs/tiny.yaml --max-steps 20 --tag tiny \\
        --out-dir /tmp/compare
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.result_file import REPO, RESULTS, device_slug
from benchmarks.training.matrix import run_matrix
from benchmarks.training.runs import run_device, run_one, warm_up
from benchmarks.training.specs import MATRICES, RUN_KEYS, SDPA_BACKENDS, load_config, run_specs
from benchmarks.training.summary import add_outcome, date_stamp, new_result, write_result
from examples.corpus import TextDataModule


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "configs" / "small.yaml")
    parser.add_argument("--attention", nargs="+", default=None, help="one run per value, in this order")
    parser.add_argument("--runs", nargs="+", default=None, metavar="ATTENTION[:KEY=VALUE,...]", help="one run per "
                        f"entry; keys {', '.join(RUN_KEYS)} (see the module docstring); instead of "
                        "--attention")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (the config's if unset)")
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-clock cap per run (Trainer.max_time)")
    parser.add_argument("--sdpa-backend", default="default", help=f"PyTorch SDPA backend forced in every run "
                        f"({', '.join(SDPA_BACKENDS)}); full layers call SDPA")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="change one config "
                        "entry for every run, e.g. data.seq_len=1024 or model.config.n_layers=4")  # fmt: skip
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per attention setting first, on a "
                        "throwaway model (compilation, autotuning); 0: none")  # fmt: skip
    parser.add_argument("--tag", help="file-name tag (default: the config's name; 'evidence' for --matrix)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps from step 10 of each run "
                        "(GPU time per kernel, wall time a step): its summary's 'profile'")  # fmt: skip
    parser.add_argument("--profile-copies", action="store_true", help="and aten::copy_ by shape and call site")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: $OUT when set, else benchmarks/results")
    parser.add_argument("--corpus-note", default=None, help="what the corpus is, kept in the result's header")
    parser.add_argument("--save-checkpoint", default=None, metavar="RUN | GROUP/RUN", help="save this run's final "
                        "model as <out-dir>/checkpoints/<tag>-<run>.ckpt (GROUP/RUN and <tag>-<group>-<run>.ckpt under "
                        "--matrix), its config beside it as .yaml")  # fmt: skip
    matrix = parser.add_argument_group("matrix (--matrix evidence)")
    matrix.add_argument("--matrix", default=None, help=f"run a whole matrix of groups: {', '.join(MATRICES)}")
    matrix.add_argument("--groups", default=None, help="comma-separated group names to run (default: all)")
    matrix.add_argument("--large-batch", type=int, default=64, help="sequences per step of the large groups")
    matrix.add_argument("--small-batch", type=int, default=8, help="sequences per step of the small group")
    matrix.add_argument("--budget-minutes", type=float, default=None, help="wall time for the whole matrix")
    matrix.add_argument("--tokens-per-run", type=int, default=None, help="tokens per training run (else planned)")
    matrix.add_argument("--calibration-steps", type=int, default=8, help="timed warm-up steps that plan the budget")
    matrix.add_argument("--evals", type=int, default=10, help="validations per training run (the last at its end)")
    matrix.add_argument("--val-sequences", type=int, default=64, help="validation sequences per validation")
    matrix.add_argument("--speed-steps", type=int, default=100, help="steps per run of the speed group")
    args = parser.parse_args(argv)

    def refuse(name: str, value: Any, works: str) -> None:
        parser.error(f"{name} must be {works}; received {value!r}.")

    for name, value, minimum in (
        ("--max-steps", args.max_steps, 1),
        ("--warmup-steps", args.warmup_steps, 0),
        ("--profile-steps", args.profile_steps, 0),
        ("--large-batch", args.large_batch, 1),
        ("--small-batch", args.small_batch, 1),
        ("--tokens-per-run", args.tokens_per_run, 1),
        ("--calibration-steps", args.calibration_steps, 0),
        ("--evals", args.evals, 1),
        ("--val-sequences", args.val_sequences, 1),
        ("--speed-steps", args.speed_steps, 1),
    ):
        if value is not None and value < minimum:
            refuse(name, value, f"an integer >= {minimum}")
    for name, value in (("--max-minutes", args.max_minutes), ("--budget-minutes", args.budget_minutes)):
        if value is not None and not (math.isfinite(value) and value > 0):
            refuse(name, value, "a positive number of minutes")
    if args.sdpa_backend not in SDPA_BACKENDS:
        refuse("--sdpa-backend", args.sdpa_backend, f"one of {', '.join(SDPA_BACKENDS)}")
    if args.profile_copies and not args.profile_steps:
        parser.error("--profile-copies profiles the steps of --profile-steps; received it without --profile-steps.")
    if args.attention is not None and args.runs is not None:
        parser.error("give --attention or --runs, not both; received both (--runs takes ATTENTION[:KEY=VALUE,...]).")
    if args.matrix is not None:
        if args.matrix not in MATRICES:
            refuse("--matrix", args.matrix, f"one of {', '.join(MATRICES)}")
        if args.attention is not None or args.runs is not None or args.max_steps is not None:
            parser.error(
                "--matrix plans its own runs and steps; received --attention, --runs or --max-steps with it "
                "(use --groups, --budget-minutes or --tokens-per-run)."
            )
        if args.budget_minutes is None and args.tokens_per_run is None:
            parser.error("--matrix needs --budget-minutes (planned from measured throughput) or --tokens-per-run.")
        if args.large_batch % args.small_batch:
            refuse("--large-batch", args.large_batch, f"a multiple of --small-batch ({args.small_batch})")
        if args.save_checkpoint is not None and args.save_checkpoint.count("/") != 1:
            refuse("--save-checkpoint", args.save_checkpoint, "GROUP/RUN under --matrix, e.g. large-qknorm/full")
    elif args.groups is not None:
        parser.error(f"--groups selects groups of --matrix; received --groups {args.groups!r} without --matrix.")
    elif args.save_checkpoint is not None and "/" in args.save_checkpoint:
        refuse("--save-checkpoint", args.save_checkpoint, "a run's name without --matrix (GROUP/RUN is --matrix's)")
    if args.attention is None and args.runs is None:
        args.attention = ["sage", "full"]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison (or ``--matrix``) and write its files; returns the result dict (the matrix: by group)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.matrix is not None:
        return run_matrix(args, argv)
    try:
        specs = run_specs(args)
    except ValueError as error:
        raise SystemExit(f"pretrain_compare.py: error: {error}") from None
    if args.save_checkpoint is not None and args.save_checkpoint not in {spec.name for spec in specs}:
        raise SystemExit(
            "pretrain_compare.py: error: --save-checkpoint must name one of the runs, "
            f"{', '.join(spec.name for spec in specs)}; received {args.save_checkpoint!r}."
        )
    config = load_config(args.config, args.set)
    tag = args.tag or args.config.stem
    out_dir = args.out_dir or Path(os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)

    data = TextDataModule(**(config.get("data") or {}))
    data.prepare_data()
    result = new_result(args, argv, data, run_device(config))
    if args.warmup_steps:
        for spec in {(s.attention, s.smooth_k, s.smooth_q, s.sdpa_backend): s for s in specs}.values():
            print(f"--- {tag}: warm-up, {spec.name}, {args.warmup_steps} steps", flush=True)
            start = time.perf_counter()
            warm_up(config, spec, args.warmup_steps, data, sdpa=args.sdpa_backend)
            result["warmup_s"][spec.name] = round(time.perf_counter() - start, 1)
    for spec in specs:
        print(f"--- {tag}: {spec.name}", flush=True)
        save_to = out_dir / "checkpoints" / f"{tag}-{spec.name}.ckpt" if spec.name == args.save_checkpoint else None
        outcome = run_one(config, spec, args, data, out_dir / "tensorboard", tag, save_to=save_to, changes=args.set)
        add_outcome(result, spec, outcome)

    out = out_dir / f"training-{device_slug(result['device'])}-{date_stamp(result)}-{tag}.json"
    write_result(result, out, tag)
    return result


if __name__ == "__main__":
    main()
