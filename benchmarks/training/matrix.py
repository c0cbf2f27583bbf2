"""Issue #7's evidence matrix (``pretrain_compare --matrix evidence``): the groups, the step plan, the runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.result_file import RESULTS, device_slug
from benchmarks.training.runs import check_sdpa_backend, model_config, run_device, run_dtype, run_one, warm_up
from benchmarks.training.specs import Group, RunSpec, apply_changes, load_config
from benchmarks.training.summary import add_outcome, date_stamp, new_result, write_result
from examples.corpus import TextDataModule


def evidence_groups(seed: int, large_batch: int, small_batch: int, seq_len: int) -> list[Group]:
    """Issue #7's matrix: which runs, in which groups, in the order they train. The large and small groups differ
    by ``large_batch / small_batch`` in tokens per step (the study's 2.1M and 260K: 8x). Full precision runs with
    seeds ``seed`` and ``seed + 1`` (the margin), every other run with ``seed``; the speed group (issue #4) trains
    at ``2 * seq_len`` with ``small_batch`` sequences: SageBwd against SDPA's cuDNN and flash backends."""
    full = RunSpec(name="full", attention="full", controller=False)
    full_b = RunSpec(name=f"full-seed{seed + 1}", attention="full", controller=False, seed=seed + 1)
    fixed = RunSpec(name="sage-fixed", attention="sage", controller=False)
    adaptive = RunSpec(name="sage-controller", attention="sage", controller=True)
    no_smooth_k = RunSpec(name="sage-fixed-no-smooth-k", attention="sage", controller=False, smooth_k=False)
    large, small = large_batch * seq_len, small_batch * seq_len
    long_seq = 2 * seq_len
    return [
        Group(
            "large-qknorm",
            f"{large:,} tokens per step ({large_batch} x {seq_len}), QK-norm",
            [f"data.batch_size={large_batch}", "model.config.qk_norm=true"],
            (full, fixed, adaptive, full_b, no_smooth_k),
        ),
        Group(
            "small-qknorm",
            f"{small:,} tokens per step ({small_batch} x {seq_len}), QK-norm",
            [f"data.batch_size={small_batch}", "model.config.qk_norm=true"],
            (full, fixed, adaptive, full_b),
        ),
        Group(
            "large-no-qknorm",
            f"{large:,} tokens per step ({large_batch} x {seq_len}), no QK-norm",
            [f"data.batch_size={large_batch}", "model.config.qk_norm=false"],
            (full, fixed, adaptive),
        ),
        Group(
            f"e2e-seq{long_seq}",
            f"speed at sequence {long_seq} ({small_batch} x {long_seq} tokens per step), QK-norm: SageBwd against "
            "SDPA cuDNN and flash",
            [f"data.batch_size={small_batch}", f"data.seq_len={long_seq}", "model.config.qk_norm=true"],
            (
                fixed,
                RunSpec(name="full-cudnn", attention="full", controller=False, sdpa_backend="cudnn"),
                RunSpec(name="full-flash", attention="full", controller=False, sdpa_backend="flash"),
            ),
            speed=True,
        ),
    ]


def baseline_groups(seed: int, large_batch: int, seq_len: int) -> list[Group]:
    """Groups run only when ``--groups`` names them. ``large-qknorm-d128`` (issue 42): large-qknorm's tokens per step
    with 5 heads of 128 (cuDNN's FP8 attention declines head dim 64 on Hopper), full precision, SageBwd fixed and
    cuDNN FP8 attention with delayed scaling (``sdpa=cudnn_fp8``), each with seeds ``seed`` and ``seed + 1``."""
    runs = []
    for second in (False, True):
        suffix, run_seed = (f"-seed{seed + 1}", seed + 1) if second else ("", None)
        off = {"controller": False, "seed": run_seed}
        runs += [
            RunSpec(f"full{suffix}", "full", **off),
            RunSpec(f"sage-fixed{suffix}", "sage", **off),
            RunSpec(f"cudnn-fp8{suffix}", "full", sdpa_backend="cudnn_fp8", **off),
        ]
    title = f"{large_batch * seq_len:,} tokens per step ({large_batch} x {seq_len}), QK-norm, 5 heads of 128"
    changes = [f"data.batch_size={large_batch}", "model.config.qk_norm=true", "model.config.n_heads=5"]
    return [Group("large-qknorm-d128", title, [*changes, "model.config.n_kv_heads=5"], tuple(runs))]


def plan_steps(
    seconds: float, groups: Sequence[tuple[str, int, Sequence[float]]], multiple: int
) -> tuple[int, dict[str, int]]:
    """Steps per group so that every run sees the same tokens and all of them train in ``seconds``."""
    unit = max(tokens for _, tokens, _ in groups)
    for name, tokens, _ in groups:
        if unit % tokens:
            raise ValueError(
                f"group {name}: its {tokens} tokens per step do not divide the largest group's {unit}; give batch "
                "sizes that divide each other (--large-batch a multiple of --small-batch)."
            )
    seconds_per_token = sum(1 / speed for _, _, speeds in groups for speed in speeds)
    tokens = seconds / seconds_per_token
    large_steps = int(tokens // unit // multiple) * multiple
    if large_steps < multiple:
        needed = multiple * unit * seconds_per_token
        raise ValueError(
            f"--budget-minutes leaves {seconds:.0f} s of training, too little for {multiple} steps of {unit} tokens "
            f"in each of the {sum(len(s) for _, _, s in groups)} runs (about {needed:.0f} s needed at the measured "
            "speeds); give a larger budget, fewer --groups or --tokens-per-run."
        )
    return large_steps * unit, {name: large_steps * unit // tokens_per_step for name, tokens_per_step, _ in groups}


def run_matrix(args: argparse.Namespace, argv: list[str]) -> dict[str, dict[str, Any]]:
    """Run ``--matrix evidence``: warm up and time every setting, plan the steps, then train group by group."""
    start = time.perf_counter()
    deadline = None if args.budget_minutes is None else start + 60 * args.budget_minutes
    tag = args.tag or "evidence"
    out_dir = args.out_dir or Path(os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, args.set)
    seed = int(base.get("seed_everything", 0) or 0)
    seq_len = int((base.get("data") or {}).get("seq_len", 256))
    groups = evidence_groups(seed, args.large_batch, args.small_batch, seq_len)
    extra = baseline_groups(seed, args.large_batch, seq_len)
    save = None
    if args.save_checkpoint is not None:
        save = tuple(args.save_checkpoint.split("/"))
        if save not in {(g.name, r.name) for g in groups for r in g.runs}:
            raise SystemExit(
                "pretrain_compare.py: error: --save-checkpoint must name a run of the matrix as GROUP/RUN, e.g. "
                f"{groups[0].name}/{groups[0].runs[0].name}; received {args.save_checkpoint!r}. Runs: "
                + ", ".join(f"{g.name}/{r.name}" for g in groups for r in g.runs)
                + "."
            )
    if args.groups is not None:
        names = [name.strip() for name in args.groups.split(",") if name.strip()]
        unknown = [name for name in names if name not in {g.name for g in groups + extra}]
        if unknown or not names:
            raise SystemExit(
                "pretrain_compare.py: error: --groups must name groups among "
                f"{', '.join(g.name for g in groups + extra)}; received {args.groups!r}."
            )
        groups = [g for g in groups + extra if g.name in names]
        if save is not None and save[0] not in names:
            print(
                f"--- {tag}: --save-checkpoint {args.save_checkpoint}: its group is left out (--groups): no checkpoint"
            )

    configs = {g.name: load_config(args.config, [*args.set, *g.changes]) for g in groups}
    datas = {g.name: TextDataModule(**(configs[g.name].get("data") or {})) for g in groups}
    for data in datas.values():
        data.prepare_data()

    speeds, warmup_s, overheads = warm_up_groups(args, groups, configs, datas, tag)
    try:
        steps, tokens_per_run, plan = plan_matrix(args, groups, datas, speeds, overheads, deadline)
    except ValueError as error:
        raise SystemExit(f"pretrain_compare.py: error: {error}") from None
    print(f"--- {tag}: plan {json.dumps(plan)}", flush=True)

    results: dict[str, dict[str, Any]] = {}
    for g in groups:
        config, data = configs[g.name], datas[g.name]
        group_steps = steps[g.name]
        evals = 0 if g.speed else min(args.evals, group_steps)
        val_batches = 0 if g.speed else max(1, args.val_sequences // data.batch_size)
        run_changes = [
            f"trainer.max_steps={group_steps}",
            "trainer.accumulate_grad_batches=1",
            "trainer.num_sanity_val_steps=0",
            f"trainer.limit_val_batches={val_batches}",
            f"trainer.val_check_interval={max(1, group_steps // max(1, evals))}",
            # Speed runs: fewer windows, fewer host syncs; training runs: about 50 points per curve.
            f"trainer.log_every_n_steps={max(1, group_steps // (10 if g.speed else 50))}",
            f"model.warmup_steps={max(1, group_steps // 10)}",
        ]
        apply_changes(config, run_changes)
        result = new_result(args, argv, data, run_device(config))
        result["warmup_s"] = warmup_s[g.name]
        result["matrix"] = {
            "name": args.matrix,
            "group": g.name,
            "title": g.title,
            "speed": g.speed,
            "tokens_per_run": None if g.speed else tokens_per_run,
            "steps": group_steps,
            "changes": [*args.set, *g.changes],
            "validation_sequences": val_batches * data.batch_size,
            "plan": plan,
        }
        out = out_dir / f"training-{device_slug(result['device'])}-{date_stamp(result)}-{tag}-{g.name}.json"
        for spec in g.runs:
            planned = plan["run_seconds"].get(f"{g.name}/{spec.name}")
            cap = None if planned is None else 1.5 * planned / 60 + 0.5
            if deadline is not None:
                left = (deadline - time.perf_counter()) / 60
                if left < 0.25:
                    print(f"--- {tag}/{g.name}: {spec.name} not run, the budget is spent", flush=True)
                    add_failure(result, spec, f"not run: the budget of {args.budget_minutes} minutes was spent")
                    write_result(result, out, f"{tag}-{g.name}", quiet=True, draw=spec is g.runs[-1])
                    continue
                cap = left if cap is None else min(cap, left)
            print(f"--- {tag}/{g.name}: {spec.name}, {group_steps} steps, cap {cap or 0:.1f} min", flush=True)
            save_to = None
            if save == (g.name, spec.name):
                save_to = out_dir / "checkpoints" / f"{tag}-{g.name}-{spec.name}.ckpt"
            try:
                outcome = run_one(
                    config, spec, args, data, out_dir / "tensorboard", f"{tag}-{g.name}", max_steps=group_steps,
                    max_minutes=cap, save_to=save_to, changes=[*args.set, *g.changes, *run_changes],
                )  # fmt: skip
                add_outcome(result, spec, outcome)
            except Exception as error:  # noqa: BLE001  (record the failure, go on with the next run)
                traceback.print_exc()
                add_failure(result, spec, f"{type(error).__name__}: {error}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            # After every run, so an interrupted matrix keeps what finished; the plot once the group is done.
            write_result(result, out, f"{tag}-{g.name}", quiet=True, draw=spec is g.runs[-1])
        results[g.name] = result
    print(f"--- {tag}: done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return results


def warm_up_groups(
    args: argparse.Namespace,
    groups: Sequence[Group],
    configs: dict[str, dict[str, Any]],
    datas: dict[str, TextDataModule],
    tag: str,
) -> tuple[dict[tuple[str, str], float | None], dict[str, dict[str, float]], list[float]]:
    """Warm up every (attention, controller, SDPA backend) of each group once, timed when the steps are planned."""
    timed = args.calibration_steps if args.tokens_per_run is None else 0
    speeds: dict[tuple[str, str], float | None] = {}
    warmup_s: dict[str, dict[str, float]] = {g.name: {} for g in groups}
    overheads: list[float] = []
    for g in groups:
        config, data = configs[g.name], datas[g.name]
        settings: dict[tuple[Any, ...], list[RunSpec]] = {}
        for run in g.runs:
            settings.setdefault((run.attention, run.controller, run.sdpa_backend), []).append(run)
        for runs in settings.values():
            spec = runs[0]
            speed = None
            if args.warmup_steps or timed:
                print(
                    f"--- {tag}/{g.name}: warm-up, {spec.name}, {args.warmup_steps} + {timed} timed steps", flush=True
                )
                begin = time.perf_counter()
                try:
                    backend = spec.sdpa_backend or args.sdpa_backend
                    check_sdpa_backend(
                        backend, model_config(config, data), data.seq_len, run_device(config), run_dtype(config)
                    )
                    speed = warm_up(config, spec, args.warmup_steps, data, timed, args.sdpa_backend)
                except Exception as error:  # noqa: BLE001  (one bad setting must not end the matrix)
                    print(f"warm-up of {g.name}/{spec.name} failed: {type(error).__name__}: {error}", flush=True)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                warmup_s[g.name][spec.name] = round(time.perf_counter() - begin, 1)
                if speed:
                    steps_s = (args.warmup_steps + timed) * data.batch_size * data.seq_len / speed
                    overheads.append(warmup_s[g.name][spec.name] - steps_s)
            speeds.update({(g.name, run.name): speed for run in runs})
    return speeds, warmup_s, overheads


def add_failure(result: dict[str, Any], spec: RunSpec, error: str) -> None:
    """Record a run that failed or was not run: a summary entry with ``error``, no rows."""
    result["runs"].append(dataclasses.asdict(spec))
    result["summary"].append(
        {"run": spec.name, "attention": spec.attention, "controller": spec.controller, "error": error}
    )
    result["decisions"][spec.name] = []
    result["decision_log"][spec.name] = []


def plan_matrix(
    args: argparse.Namespace,
    groups: Sequence[Group],
    datas: dict[str, TextDataModule],
    speeds: dict[tuple[str, str], float | None],
    overheads: Sequence[float],
    deadline: float | None,
) -> tuple[dict[str, int], int, dict[str, Any]]:
    """Steps per group, the tokens per training run, and the plan as recorded in the result files.

    The speed groups take ``--speed-steps``. The training groups share what is left of the budget after the speed
    runs, a fixed cost per run (the warm-ups' median beyond their steps, at least 3 s) and the validations, with a
    margin of 15%, at the measured speeds (:func:`plan_steps`); or ``--tokens-per-run`` fixes their tokens.
    """
    training = [g for g in groups if not g.speed]
    tokens_per_step = {g.name: datas[g.name].batch_size * datas[g.name].seq_len for g in groups}
    overhead = max(3.0, statistics.median(overheads)) if overheads else 5.0
    plan: dict[str, Any] = {
        "budget_minutes": args.budget_minutes,
        "tokens_per_s": {f"{g}/{r}": s for (g, r), s in speeds.items()},
        "run_overhead_s": round(overhead, 1),
        "run_seconds": {},
    }
    steps = {g.name: args.speed_steps for g in groups if g.speed}
    fallback = [s for s in speeds.values() if s] or [1.0]
    speed_of = {key: value or min(fallback) for key, value in speeds.items()}
    fixed_s = sum(
        args.speed_steps * tokens_per_step[g.name] / speed_of.get((g.name, r.name), min(fallback)) + overhead
        for g in groups
        if g.speed
        for r in g.runs
    )
    if args.tokens_per_run is not None:
        unit = max((tokens_per_step[g.name] for g in training), default=1)
        large_steps = max(1, args.tokens_per_run // unit)
        tokens_per_run = large_steps * unit
        steps.update({g.name: tokens_per_run // tokens_per_step[g.name] for g in training})
    elif training:
        assert deadline is not None
        runs = sum(len(g.runs) for g in training)
        val_tokens = args.evals * args.val_sequences * max(datas[g.name].seq_len for g in training)
        left = deadline - time.perf_counter() - fixed_s - runs * overhead
        # Validation (forward only, about a third of a training step's cost) and a safety margin of 15%.
        left -= runs * val_tokens / (3 * min(fallback))
        tokens_per_run, planned = plan_steps(
            0.85 * left,
            [(g.name, tokens_per_step[g.name], [speed_of[(g.name, r.name)] for r in g.runs]) for g in training],
            multiple=args.evals,
        )
        steps.update(planned)
    else:
        tokens_per_run = 0
    for g in groups:
        for r in g.runs:
            speed = speeds.get((g.name, r.name))
            if speed:
                plan["run_seconds"][f"{g.name}/{r.name}"] = round(
                    steps[g.name] * tokens_per_step[g.name] / speed + overhead, 1
                )
    plan["tokens_per_run"] = tokens_per_run
    plan["steps"] = steps
    return steps, tokens_per_run, plan
