"""What ``AdaptivePrecision`` costs per optimizer step: the same training with and without the callback.

A small transformer (by default 8 layers, d_model 1024, 16 heads, seq 2048, batch 4, bf16-mixed, SageBwd attention)
trains on a fixed random Markov chain's tokens once per setting of :data:`SETTINGS` (the baseline without the callback,
the defaults, ``check_before_step=True``, then each signal alone on every step for ``--breakdown-steps``). Step time:
the measured steps' wall time over their number, the device synchronised at each step's end (``--no-step-sync``: at
the window's ends only). Each of ``--repeats`` rounds runs every setting in turn (the order reversed every other
round), each paired with the baseline runs just before and after it (run order mattered: at dc3c3c8 on an H100 the
defaults' median step was 42.65 ms early in a round and 49.33 ms late), each isolated (``overhead_timing.isolated``);
rows report medians over rounds and every round's figures (``round_*``).

Example::

    python -m benchmarks.controller.overhead              # GPU defaults, writes benchmarks/results/
    python -m benchmarks.controller.overhead --device cpu --layers 2 --d-model 32 --heads 2 --seq 32 --batch 2 \\
        --steps 6 --warmup 2 --precision 32-true --repeats 1 --out /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from sage_lightning.kernels import use_backend
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.controller.overhead_profile import PROFILED, ProfilerWindow, format_profile, traced_hooks
from benchmarks.controller.overhead_timing import HookClock, StepTimer, isolated
from benchmarks.result_file import default_path, device_name, header, write
from sage_lightning import AdaptivePrecision, PolicyConfig, SageAttentionMixin

VOCAB = 4096


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention`` (what the mixin swaps)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(SageAttentionMixin, L.LightningModule):
    """A decoder-only language model: embedding, ``layers`` blocks of width ``d_model`` and ``heads`` heads, a tied
    head; AdamW at ``lr`` (``fused``: its fused implementation, what GPU training usually runs)."""

    def __init__(
        self, layers: int = 4, d_model: int = 512, heads: int = 8, lr: float = 3e-4, fused: bool = False
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"TransformerLM: d_model ({d_model}) must be a multiple of heads; received {heads}.")
        self.lr = lr
        self.fused = fused
        self.embed = nn.Embedding(VOCAB, d_model)
        # GPT-2's scale: the tied head's logits start near zero, so the loss starts near log(VOCAB).
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=self.fused or None)


def markov_tokens(sequences: int, seq: int, seed: int = 0, branching: int = 8) -> torch.Tensor:
    """Token ids ``[sequences, seq + 1]`` from a fixed random Markov chain: each token has ``branching``
    possible successors, so a model can learn the data and the loss falls as in real training.
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, branching), generator=generator)
    ids = torch.empty(sequences, seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (sequences,), generator=generator)
    for position in range(1, seq + 1):
        pick = torch.randint(0, branching, (sequences,), generator=generator)
        ids[:, position] = successors[ids[:, position - 1], pick]
    return ids


#: A period that never comes within a benchmark run: turns one signal off.
NEVER = 10**9


def _callback(
    ds_stats: int | None = None,
    probe: int | None = None,
    snapshot: int = 100,
    check_before_step: bool | None = None,
    noise: int | None = None,
) -> Callable[[], AdaptivePrecision]:
    """A factory of the callback with some periods changed (``None``: the default; ``noise``: the noise ratio measured
    every ``noise`` steps and never acted on, so the run stays calm). The tokens-per-step rule is off: at 131K tokens
    it changes dS's format at step 0, a precision priced in docs/controller.md (Which dS rung), not the hooks' cost."""
    changes = {"ds_stats_every_n_steps": ds_stats, "probe_every_n_steps": probe, "noise_every_n_steps": noise}
    changes["noise_ratio_high"] = None if noise is None else 1e9
    config = PolicyConfig(ds_tokens_per_step_high=None, **{k: v for k, v in changes.items() if v is not None})
    return lambda: AdaptivePrecision(
        config, snapshot_every_n_steps=snapshot, check_before_step=check_before_step, progress_bar=False, verbose=False
    )


#: The setting every other one is compared with.
BASELINE = "no callback"
#: The slowest measured steps each run records (step, milliseconds, the controller's host milliseconds in it).
SLOWEST = 3
#: label -> (callback factory or None, whether it runs --steps (True) or --breakdown-steps (False)).
SETTINGS: dict[str, tuple[Callable[[], AdaptivePrecision] | None, bool]] = {
    "no callback": (None, True),
    "callback, defaults": (_callback(), True),
    "callback, defaults, check_before_step=True": (_callback(check_before_step=True), True),
    "callback, signals and snapshots off": (_callback(ds_stats=NEVER, probe=NEVER, snapshot=NEVER), False),
    "callback, signals and snapshots off, check_before_step=True": (
        _callback(ds_stats=NEVER, probe=NEVER, snapshot=NEVER, check_before_step=True),
        False,
    ),
    "callback, dS statistics every step": (_callback(ds_stats=1, probe=NEVER, snapshot=NEVER), False),
    "callback, probe every step": (_callback(ds_stats=NEVER, probe=1, snapshot=NEVER), False),
    "callback, snapshot every step": (_callback(ds_stats=NEVER, probe=NEVER, snapshot=1), False),
    "callback, defaults, noise ratio every 25 steps": (_callback(noise=25), True),
    "callback, noise ratio every step": (_callback(ds_stats=NEVER, probe=NEVER, snapshot=NEVER, noise=1), False),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One setting's run: mean and median milliseconds per measured step, the measured steps, and the callback's
    decisions over the whole fit, warm-up included (a decision changes what the next steps run, and each
    escalation arms a probe: a run that decides is not the calm run the overhead is meant to measure)."""

    step_ms: float
    median_step_ms: float
    steps: int
    decisions: list[str]
    verdict_waits: int = 0
    gc_ms: float = 0.0
    alloc_retries: int = 0
    hook_ms: dict = dataclasses.field(default_factory=dict)
    slowest: list = dataclasses.field(default_factory=list)
    durations: list = dataclasses.field(default_factory=list)  # every measured step's ms, in order
    end_ms: float = 0.0  # after the last step, until on_train_end (StepTimer.end_ms)


def setting_steps(args: argparse.Namespace, label: str) -> int:
    """The measured steps of a setting: ``--steps`` for the baseline and the defaults, ``--breakdown-steps`` else."""
    return args.steps if SETTINGS[label][1] else args.breakdown_steps


def run_once(
    args: argparse.Namespace,
    label: str,
    data: torch.Tensor,
    window: ProfilerWindow | None = None,
    steps: int | None = None,
) -> Run:
    """Train one setting for ``--warmup`` plus its measured steps (``steps``: that many instead; ``window``: the
    profiled ones, the controller's hooks traced), after collecting what earlier runs left; return its times, step
    count and decisions.
    """
    factory = SETTINGS[label][0]
    if steps is None:
        steps = window.steps if window else setting_steps(args, label)
    with isolated(args.device) as costs:
        torch.manual_seed(args.seed)
        model = TransformerLM(layers=args.layers, d_model=args.d_model, heads=args.heads, fused=args.device == "cuda")
        timer = StepTimer(step_sync=not args.no_step_sync, skip=args.warmup)
        controller = None if factory is None else factory()
        clock = None if controller is None else HookClock(controller)
        callbacks = ([] if controller is None else [controller]) + [timer] + ([window] if window else [])
        if window and controller:
            traced_hooks(controller)
        trainer = L.Trainer(
            accelerator=args.device,
            devices=1,
            precision=args.precision,
            max_steps=args.warmup + steps,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        loader = DataLoader(TensorDataset(data), batch_size=args.batch, shuffle=False, num_workers=0)
        with use_backend(args.backend):
            trainer.fit(model, loader)
    decisions = [] if controller is None else [str(decision) for decision in controller.history]
    waits = 0 if controller is None else controller.verdict_waits
    mean, median = timer.step_ms(skip=args.warmup), timer.median_step_ms(skip=args.warmup)
    hooks = {} if clock is None else clock.summary(skip=args.warmup)
    hook_ms = {key: value for key, value in hooks.items() if key != "step_ms"}
    durations = timer.durations_ms(skip=args.warmup)
    slowest, end, gc_ms = _slowest(durations, hooks, args), timer.end_ms(skip=args.warmup), costs.gc_ms
    return Run(mean, median, steps, decisions, waits, gc_ms, costs.alloc_retries, hook_ms, slowest, durations, end)


def _slowest(durations: list[float], hooks: dict, args: argparse.Namespace) -> list[dict]:
    """The :data:`SLOWEST` slowest measured steps, in step order: step, milliseconds, the hooks' host ms in it."""
    slowest = sorted(range(len(durations)), key=durations.__getitem__, reverse=True)[:SLOWEST]
    in_hooks = hooks.get("step_ms", {})
    return [
        {"step": args.warmup + i, "ms": durations[i], "hook_ms": in_hooks.get(args.warmup + i, 0.0)}
        for i in sorted(slowest)
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000, help="measured steps of the baseline and the defaults")
    parser.add_argument("--breakdown-steps", type=int, default=30, help="measured steps of the other settings")
    parser.add_argument("--warmup", type=int, default=20, help="steps run before timing starts")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the settings (medians are reported)")
    parser.add_argument("--precision", default="bf16-mixed", help="Lightning precision, e.g. bf16-mixed, 32-true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "triton", "reference"),
        help="sage_attention's implementation (auto: the Triton kernels on CUDA, the reference elsewhere)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-step-sync",
        action="store_true",
        help="synchronise the device only where the measured steps start and end, not at every step's end",
    )
    parser.add_argument("--skip", action="append", default=[], choices=list(SETTINGS)[1:], help="leave a setting out")
    parser.add_argument("--profile-steps", type=int, default=0, help="then profile this many steps of three settings")
    parser.add_argument("--out", type=Path, default=None, help="JSON path; the .md table is written beside it")
    args = parser.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "steps", "breakdown_steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if args.warmup < 1:
        parser.error(f"--warmup must be >= 1 (the first step compiles and allocates); received {args.warmup}")
    return args


def format_table(result: dict) -> str:
    """The markdown table of one result file, then the defaults' host time, the slowest steps and the collector."""
    lines = [
        "| setting | steps | step_ms | baseline_step_ms | overhead (paired) | rounds (ms; / paired baseline) "
        "| median step, rounds (ms) | decisions, rounds | verdicts that waited, rounds "
        "| controller's host ms per step: median / mean, rounds |",
        "|---|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    by_label = {row["what"]: row for row in result["rows"]}
    for row in result["rows"]:
        paired = row.get("round_baseline_step_ms") if row["what"] != BASELINE else None
        each = ", ".join(
            f"{ms:.2f}" + (f" / {paired[i]:.2f}" if paired else "") for i, ms in enumerate(row["round_step_ms"])
        )
        medians = ", ".join(f"{ms:.2f}" for ms in row.get("round_median_step_ms", [])) or "-"
        decided = ", ".join(str(len(made)) for made in row.get("round_decisions", [])) or "-"
        waited = ", ".join(str(n) for n in row.get("round_verdict_waits", [])) or "-"
        hooks = [clock for clock in row.get("round_hook_host_ms", []) if clock]
        host = ", ".join(f"{clock['median_ms']:.2f} / {clock['mean_ms']:.2f}" for clock in hooks) or "-"
        lines.append(
            f"| {row['what']} | {row['steps']} | {row['step_ms']:.2f} | {row['baseline_step_ms']:.2f} | "
            f"{row['overhead']:+.2%} | {each} | {medians} | {decided} | {waited} | {host} |"
        )
    base = by_label[BASELINE]["step_ms"]
    lines.append("")
    defaults = [clock for clock in by_label.get("callback, defaults", {}).get("round_hook_host_ms", []) if clock]
    if defaults:
        median = statistics.median(clock["median_ms"] for clock in defaults)
        mean = statistics.median(clock["mean_ms"] for clock in defaults)
        lines.append(
            f"The defaults' hooks on the host: {median:.3f} ms in the median step, {mean:.3f} ms in the mean "
            f"({median / base:.2%} and {mean / base:.2%} of the baseline's step; a host-bound step pays them in full)."
        )
    slow = []
    for row in result["rows"]:
        first = (row.get("round_slowest_steps") or [[]])[0]
        if first:
            steps = "; ".join(f"step {s['step']} {s['ms']:.1f} ms ({s['hook_ms']:.1f} in the hooks)" for s in first)
            slow.append(f"{row['what']}: {steps}")
    if slow:
        lines.append("Slowest steps of the first round: " + " | ".join(slow) + ".")
    if all("round_gc_ms" in row for row in result["rows"]):
        gc_ms = max(max(row["round_gc_ms"]) for row in result["rows"])
        retries = sum(sum(row["round_alloc_retries"]) for row in result["rows"])
        lines.append(f"Garbage collector: at most {gc_ms:.1f} ms in a run; CUDA allocator retries: {retries}.")
    return "\n".join(lines)


def measure_rounds(args: argparse.Namespace, data: torch.Tensor) -> tuple[dict[str, list[Run]], dict[str, list[float]]]:
    """``--repeats`` rounds of every setting, each between two baseline runs; returns each setting's runs by round
    (the baseline's: one per round, the medians of that round's baseline runs) and, for the others, by round, the
    mean step time of the two baseline runs around it.
    """
    others = [label for label in SETTINGS if label not in (BASELINE, *args.skip)]
    rounds: dict[str, list[Run]] = {label: [] for label in (BASELINE, *others)}
    paired: dict[str, list[float]] = {label: [] for label in others}

    def measured(label: str, steps: int | None = None) -> Run:
        run = run_once(args, label, data, steps=steps)
        print(
            f"{label}: {run.step_ms:.2f} ms/step (median {run.median_step_ms:.2f}) over {run.steps} steps, "
            f"{len(run.decisions)} decisions, {run.gc_ms:.1f} ms in the garbage collector",
            flush=True,
        )
        for decision in run.decisions:
            print(f"  {decision}", flush=True)
        return run

    for repeat in range(args.repeats):
        order = others[:: 1 if repeat % 2 == 0 else -1]
        around: list[Run] = []
        for i in range(len(order) + 1):
            neighbours = order[max(0, i - 1) : i + 1]
            lengths = [setting_steps(args, label) for label in neighbours]
            around.append(measured(BASELINE, max(lengths, default=args.steps)))
            if i < len(order):
                rounds[order[i]].append(measured(order[i]))
        for i, label in enumerate(order):
            paired[label].append((around[i].step_ms + around[i + 1].step_ms) / 2)
        rounds[BASELINE].append(
            Run(
                statistics.median(run.step_ms for run in around),
                statistics.median(run.median_step_ms for run in around),
                max(run.steps for run in around),
                [],
                gc_ms=max(run.gc_ms for run in around),
                alloc_retries=sum(run.alloc_retries for run in around),
            )
        )
    return rounds, paired


def main(argv: list[str] | None = None) -> dict:
    """Measure every setting, print the table, write the JSON and markdown; returns the JSON dict."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("overhead: --device cuda needs a GPU; pass --device cpu (with small sizes) to try it")
    most = max(args.steps, args.breakdown_steps, args.profile_steps)
    data = markov_tokens(args.batch * (args.warmup + most), args.seq, seed=args.seed)
    rounds, baselines = measure_rounds(args, data)
    shape = {
        name: getattr(args, name) for name in ("layers", "d_model", "heads", "seq", "batch", "precision", "backend")
    }
    rows = []
    for label, runs in rounds.items():
        means = [run.step_ms for run in runs]
        paired = baselines.get(label, means)
        rows.append(
            {
                "what": label,
                "step_ms": statistics.median(means),
                "baseline_step_ms": statistics.median(paired),
                "overhead": statistics.median(ms / base - 1 for ms, base in zip(means, paired, strict=True)),
                "steps": runs[0].steps,
                "round_step_ms": means,
                "round_baseline_step_ms": paired,
                "round_median_step_ms": [run.median_step_ms for run in runs],
                "round_decisions": [run.decisions for run in runs],
                "round_verdict_waits": [run.verdict_waits for run in runs],
                "round_gc_ms": [run.gc_ms for run in runs],
                "round_alloc_retries": [run.alloc_retries for run in runs],
                "round_hook_host_ms": [run.hook_ms for run in runs],
                "round_slowest_steps": [run.slowest for run in runs],
                "round_step_durations_ms": [run.durations for run in runs],
                "round_end_ms": [run.end_ms for run in runs],
                **shape,
            }
        )
    name = device_name(args.device)
    out = args.out or default_path("overhead", name)
    result = {**header("overhead", name, "benchmarks.controller.overhead", argv), "rows": rows}
    table = format_table(result)
    if args.profile_steps > 0:  # overhead_profile: where the time goes, per kernel and hook
        windows = {label: ProfilerWindow(args.warmup, args.profile_steps) for label in PROFILED}
        for label, window in windows.items():
            run_once(args, label, data, window)
        result["profile"] = {label: window.per_step() for label, window in windows.items()}
        table += "\n\nProfiled (`--profile-steps`):\n\n" + format_profile(result["profile"])
    print(table)
    write(result, out)
    synchronised = "where the measured steps start and end only" if args.no_step_sync else "at every step's end"
    heading = (
        f"# AdaptivePrecision overhead per optimizer step\n\n{name}, {result['date']}, commit {result['commit']}\n\n"
        f"`{result['command']}`\n\n{args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, {args.precision}, backend {args.backend}; mean over the measured steps after "
        f"{args.warmup} warm-up steps; medians of {args.repeats} rounds, each setting paired with the baseline runs "
        f"just before and after it; the device synchronised {synchronised}.\n\n"
    )
    out.with_suffix(".md").write_text(heading + table + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
