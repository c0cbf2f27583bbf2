"""The tokens-per-step rule: at ``ds_tokens_per_step_high`` tokens per optimizer step or more, INT8 dS moves to the
large-step rung (FP8 dS, the ``ds_fp8`` rung, which no other rule takes; bf16 dS on Hopper) and stays there while the
steps are that large. The policy on plain numbers, the device's ladder and rung, and a Trainer with the callback on a
tiny model, resumed from its checkpoint."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from sage_lightning.kernels.plan import KernelSettings
from tiny_lightning import TinyLM, token_loader, trainer_kwargs

import sage_lightning.checks
from sage_lightning import AdaptivePrecision, AttentionPrecision, PolicyConfig, attention_layers
from sage_lightning.checks import for_device
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


@pytest.mark.parametrize(
    ("capability", "hopper_kernels", "given", "ladder_has_fp8", "rung"),
    [
        ((8, 0), False, None, False, None),  # an A100: no FP8, so the rules take ds_bf16 (the first ds-alone rung)
        ((8, 0), False, "ds_fp8", False, None),  # a rung the GPU cannot run is let go, not refused
        ((8, 9), False, None, True, None),  # FP8 on the portable kernels: ds_fp8
        ((9, 0), True, None, True, "ds_bf16"),  # the Hopper kernels, where bf16 dS is the faster
        ((9, 0), False, None, True, None),  # an H100 under an unverified Triton runs the portable kernels
        ((9, 0), True, "ds_fp8", True, "ds_fp8"),  # the user's choice stands
        ((9, 0), "off", None, True, None),  # SAGE_LIGHTNING_HOPPER=off: the portable kernels
    ],
)
def test_the_device_sets_the_ladder_and_the_large_step_rung(
    monkeypatch: pytest.MonkeyPatch, capability, hopper_kernels, given, ladder_has_fp8, rung
) -> None:
    config = PolicyConfig(large_step_rung=given)
    assert for_device(config, torch.device("cpu")) is config  # the reference runs FP8 on the CPU
    monkeypatch.setattr(sage_lightning.checks, "device_capability", lambda device: capability)
    monkeypatch.setattr(sage_lightning.checks, "verified_here", lambda device: bool(hopper_kernels))
    switch = KernelSettings.from_environment({"SAGE_LIGHTNING_HOPPER": "off" if hopper_kernels == "off" else "auto"})
    monkeypatch.setattr(sage_lightning.checks, "kernel_settings", lambda: switch)
    fitted = for_device(config, torch.device("cuda", 0))
    names = [r.name for r in fitted.ladder]
    assert (TOKENS_RUNG in names) is ladder_has_fp8 and "ds_bf16" in names and fitted.large_step_rung == rung
    # What the policy then moves INT8 dS to at large steps.
    policy = PrecisionPolicy(dict.fromkeys(NAMES, BASE), config=dataclasses.replace(fitted, ds_tokens_per_step_high=10))
    step(policy, 0, 4096)
    assert policy.rung(NAMES[0]) == (rung or ("ds_fp8" if ladder_has_fp8 else "ds_bf16"))


def test_on_the_bf16_rung_the_rules_hold_it_and_the_fp8_rung_stays_reserved() -> None:
    policy = make(large_step_rung="ds_bf16", ds_rel_err_patience=1)
    (decision, _) = step(policy, 0, 4096).decisions
    assert decision.new == BASE.replace(ds="bf16").short_name and policy.rung(NAMES[0]) == "ds_bf16"
    for index in range(1, 60):  # held while the steps are large, whatever the calm
        assert step(policy, index, 4096, ds_rel_err=0.01).decisions == ()
    downs = [d for index in range(60, 80) for d in step(policy, index, 512, ds_rel_err=0.01).decisions]
    assert [d.new for d in downs] == [BASE.short_name] * 2
    # A high dS error, the steps small: ds_bf16 as before; ds_fp8 is no rung of that rule.
    step(policy, 80, 512, ds_rel_err=0.5)
    assert policy.rung(NAMES[0]) == "ds_bf16"


def test_a_layer_on_fp8_ds_from_an_earlier_checkpoint_stays_until_calm() -> None:
    """A run saved when the rules took ``ds_fp8`` on Hopper resumes under ``ds_bf16`` (the ladder still has both):
    the layer keeps FP8 dS, the rule does not move it again, and it steps down after its calm period."""
    saved = make()
    step(saved, 0, 4096)
    policy = make(large_step_rung="ds_bf16")
    policy.load_state_dict(saved.state_dict())
    assert policy.rung(NAMES[0]) == TOKENS_RUNG and step(policy, 1, 4096).decisions == ()
    downs = [d for index in range(2, 40) for d in step(policy, index, 4096, ds_rel_err=0.01).decisions]
    assert [d.old for d in downs[:1]] == [BASE.replace(ds="fp8").short_name]


@pytest.mark.parametrize("value", ["dv_bf16", "ds_int4", "", 3])
def test_a_large_step_rung_that_is_not_a_ds_rung_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"large_step_rung must name a rung of the ladder that changes ds alone"):
        PolicyConfig(large_step_rung=value)


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


@pytest.mark.parametrize(("capability", "rung"), [((8, 0), None), ((9, 0), "ds_bf16")])
def test_the_logged_ladder_is_the_one_the_gpu_runs(tmp_path, monkeypatch: pytest.MonkeyPatch, capability, rung) -> None:
    """On a GPU without FP8 (an A100: capability 8.0) hparams.yaml and TensorBoard's HParams show the ladder the
    controller runs there, without ``ds_fp8``; on Hopper, the large-step rules' ``ds_bf16``. The callback's own
    settings keep what it was given."""
    import yaml
    from lightning.pytorch.loggers import TensorBoardLogger

    monkeypatch.setattr(sage_lightning.checks, "device_capability", lambda device: capability)
    monkeypatch.setattr(sage_lightning.checks, "verified_here", lambda device: capability == (9, 0))
    controller = AdaptivePrecision(verbose=False)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=1, logger=logger), callbacks=[controller])
    trainer.fit(TinyLM(), token_loader(1))
    logged = yaml.safe_load((tmp_path / "tb" / "version_0" / "hparams.yaml").read_text())
    fitted = logged["adaptive_precision"]["config"]
    assert (TOKENS_RUNG in fitted["ladder"]) is (capability == (9, 0)) and fitted["large_step_rung"] == rung
    assert (
        TOKENS_RUNG in controller.hparams["config"]["ladder"]
        and controller.hparams["config"]["large_step_rung"] is None
    )
    assert controller._policy.config.large_step_rung == rung
