"""The tokens-per-step rule: at ``ds_tokens_per_step_high`` tokens per optimizer step or more, INT8 dS moves to FP8
(the ``ds_fp8`` rung, which no other rule takes) and stays there while the steps are that large. The policy on plain
numbers, the device's ladder, and a Trainer with the callback on a tiny model, resumed from its checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

import sage_lightning.checks
from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers
from sage_lightning.checks import without_fp8_rungs
from sage_lightning.policy import DEFAULT_LADDER, TOKENS_RUNG, LayerSignals, PrecisionPolicy, StepSignals

BASE = AttentionPrecision()
NAMES = ("blocks.0.attn", "blocks.1.attn")


def make(bases: dict[str, AttentionPrecision] | None = None, **config) -> PrecisionPolicy:
    config.setdefault("calm_steps", 10)
    config.setdefault("ds_tokens_per_step_high", 1000)
    return PrecisionPolicy(bases or dict.fromkeys(NAMES, BASE), config=PolicyConfig(**config))


def step(policy: PrecisionPolicy, index: int, tokens: int | None, ds_rel_err: float | None = None):
    layers = {name: LayerSignals(ds_rel_err=ds_rel_err) for name in policy.layer_names}
    return policy.decide(StepSignals(step=index, loss=2.0, grad_norm=1.0, layers=layers, tokens=tokens))


@pytest.mark.parametrize(("tokens", "moves"), [(999, False), (1000, True), (131_072, True), (None, False)])
def test_int8_ds_moves_to_fp8_from_the_threshold_on(tokens: int | None, moves: bool) -> None:
    policy = make()
    outcome = step(policy, 0, tokens)
    assert [d.layer for d in outcome.decisions] == (list(NAMES) if moves else [])
    for name in NAMES:
        assert policy.precision(name).ds == ("fp8" if moves else "int8")
        assert policy.rung(name) == (TOKENS_RUNG if moves else "base")
    if moves:
        reason = outcome.decisions[0].reason
        assert reason.startswith(f"{tokens:,} tokens per step >= ds_tokens_per_step_high 1,000")
        # The new rung is checked on the next step, as after every escalation.
        assert policy.signals_wanted(1).probe and policy.signals_wanted(1).ds_stats


def test_the_rung_holds_while_the_steps_are_large_and_steps_down_after_they_shrink() -> None:
    policy = make()
    step(policy, 0, 4096)
    # Long calm with dS error far under ds_rel_err_low: no step down while each step has 4096 tokens.
    for index in range(1, 60):
        assert step(policy, index, 4096, ds_rel_err=0.01).decisions == ()
    assert policy.precision(NAMES[0]).ds == "fp8"
    # Smaller steps (the tokens lever halved them, or the user's batch): the rung goes after its calm period.
    downs = [d for index in range(60, 80) for d in step(policy, index, 512, ds_rel_err=0.01).decisions]
    assert [(d.layer, d.new) for d in downs] == [(name, BASE.short_name) for name in NAMES]
    assert all(d.reason.startswith("calm for") for d in downs)


def test_no_other_rule_takes_the_fp8_rung() -> None:
    # A high dS error goes to ds_bf16, as before the rung existed; the tokens rule then leaves the layer alone.
    policy = make(ds_rel_err_patience=1, ds_tokens_per_step_high=None)
    step(policy, 0, 4096, ds_rel_err=0.5)
    assert policy.rung(NAMES[0]) == "ds_bf16"
    policy = make(ds_rel_err_patience=1)
    step(policy, 0, 100, ds_rel_err=0.5)
    assert step(policy, 1, 4096).decisions == () and policy.precision(NAMES[0]).ds == "bf16"
    # On FP8 dS, a high dS error still raises dS to bf16.
    policy = make(ds_rel_err_patience=1)
    step(policy, 0, 4096)
    (decision, _) = step(policy, 1, 4096, ds_rel_err=0.5).decisions
    assert decision.new == BASE.replace(ds="bf16").short_name and policy.rung(NAMES[0]) == "ds_bf16"


def test_layers_whose_ds_is_not_int8_are_left_alone() -> None:
    bases = {NAMES[0]: BASE.replace(ds="bf16"), NAMES[1]: AttentionPrecision(mode="attn_qat")}
    policy = make(bases)
    assert step(policy, 0, 4096).decisions == ()


def test_a_ladder_without_fp8_gives_the_rule_bf16_ds() -> None:
    ladder = tuple(rung for rung in DEFAULT_LADDER if rung.name != TOKENS_RUNG)
    policy = make(ladder=ladder)
    step(policy, 0, 4096)
    assert policy.rung(NAMES[0]) == "ds_bf16" and policy.precision(NAMES[0]).ds == "bf16"


def test_gpus_without_fp8_lose_the_fp8_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    config = PolicyConfig()
    assert without_fp8_rungs(config, torch.device("cpu")) is config  # the reference runs FP8 on the CPU
    for capability, kept in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(sage_lightning.checks, "device_capability", lambda device, c=capability: c)
        names = [rung.name for rung in without_fp8_rungs(config, torch.device("cuda", 0)).ladder]
        assert (TOKENS_RUNG in names) is kept and "ds_bf16" in names


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "64k"])
def test_a_bad_threshold_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"ds_tokens_per_step_high must be an int >= 1 or None \(off\); received"):
        PolicyConfig(ds_tokens_per_step_high=value)


def fit(tmp_path, config: PolicyConfig, *, steps: int, accumulate: int = 1, ckpt_path=None):
    controller = AdaptivePrecision(config, verbose=False)
    model = TinyLM()
    trainer = L.Trainer(
        **trainer_kwargs(tmp_path, max_steps=steps, accumulate_grad_batches=accumulate, enable_checkpointing=True),
        callbacks=[controller],
    )
    trainer.fit(model, token_loader(steps * accumulate, same_batch=True), ckpt_path=ckpt_path)
    return controller, model, trainer


def test_a_trainer_counts_every_micro_batch_of_a_step(tmp_path) -> None:
    # Micro-batches of 2 x 33 token ids: 66 tokens a step, 132 with two micro-batches a step.
    config = PolicyConfig(ds_tokens_per_step_high=100)
    quiet, model, _ = fit(tmp_path / "one", config, steps=4)
    assert quiet.history == [] and {s.precision.ds for s in attention_layers(model).values()} == {"int8"}
    loud, model, _ = fit(tmp_path / "two", config, steps=4, accumulate=2)
    moved = [d for d in loud.history if d.lever == "precision"]
    assert [d.layer for d in moved] == list(attention_layers(model)) and moved[0].step <= 2
    assert moved[0].reason.startswith("132 tokens per step >= ds_tokens_per_step_high 100")
    assert {s.precision.ds for s in attention_layers(model).values()} == {"fp8"}
    assert loud.int8_fraction == 1.0  # FP8 dS is still low-bit: every layer-step counts


def test_the_default_leaves_small_steps_alone_and_a_resumed_run_keeps_fp8_ds(tmp_path) -> None:
    quiet, _, _ = fit(tmp_path / "default", PolicyConfig(), steps=3)
    assert PolicyConfig().ds_tokens_per_step_high == 65_536 and quiet.history == []
    config = PolicyConfig(ds_tokens_per_step_high=64, calm_steps=1)
    first, _, trainer = fit(tmp_path / "first", config, steps=4)
    assert {d.new for d in first.history if d.lever == "precision"} == {BASE.replace(ds="fp8").short_name}
    ckpt = trainer.checkpoint_callback.best_model_path
    resumed, model, _ = fit(tmp_path / "first", config, steps=8, ckpt_path=ckpt)
    # calm_steps=1 and a dS error under ds_rel_err_low would step down; 66 tokens a step hold the rung.
    assert [d for d in resumed.history if d.step >= 4 and d.lever == "precision"] == []
    assert {s.precision.ds for s in attention_layers(model).values()} == {"fp8"}


def test_the_logged_ladder_is_the_one_the_gpu_runs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU without FP8 (an A100: capability 8.0) hparams.yaml and TensorBoard's HParams show the ladder the
    controller runs there, without ``ds_fp8``; the callback's own settings keep the ladder it was given."""
    import yaml
    from lightning.pytorch.loggers import TensorBoardLogger

    monkeypatch.setattr(sage_lightning.checks, "device_capability", lambda device: (8, 0))
    controller = AdaptivePrecision(verbose=False)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=1, logger=logger), callbacks=[controller])
    trainer.fit(TinyLM(), token_loader(1))
    logged = yaml.safe_load((tmp_path / "tb" / "version_0" / "hparams.yaml").read_text())
    assert logged["adaptive_precision"]["config"]["ladder"] == ["smooth_q", "qk_bf16", "ds_bf16", "dv_bf16", "full"]
    assert TOKENS_RUNG in controller.hparams["config"]["ladder"]
    assert TOKENS_RUNG not in [rung.name for rung in controller._policy.config.ladder]
