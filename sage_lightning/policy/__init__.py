"""The controller's policy: signals in, decisions out, each with its reason.

Pure Python (no torch, no Lightning, no Triton): :class:`PrecisionPolicy` takes the numbers of one optimizer
step (:class:`StepSignals`) and returns what to do (:class:`StepOutcome`); the Lightning callback
(:class:`sage_lightning.AdaptivePrecision`) measures the signals, reduces them across ranks and carries the
decisions out. So every rule here is tested with tables of signals, and every rank that feeds it the same
reduced numbers takes the same decisions.

The package: :mod:`~sage_lightning.policy.vocabulary` (signals, rungs, decisions), :mod:`~.config` (thresholds,
budgets, the default ladder), :mod:`~.backoff` (the calm periods every lever shares), :mod:`~.tokens` (tokens
per step), :mod:`~.engine` (the decisions), :mod:`~.share` (the low-bit share), :mod:`~.replay` (recorded noise
readings through the rules). Thresholds and their measurements:
``docs/controller.md``.
"""

from sage_lightning.policy.backoff import Backoff
from sage_lightning.policy.config import DEFAULT_LADDER, TOKENS_RUNG, PolicyConfig
from sage_lightning.policy.engine import PrecisionPolicy
from sage_lightning.policy.replay import replay_noise_readings
from sage_lightning.policy.share import LowBitShare, runs_low_bit
from sage_lightning.policy.tokens import TokensLever
from sage_lightning.policy.vocabulary import (
    ACTIONS,
    CAUSES,
    LEVERS,
    PROBE_GRADIENTS,
    PROBE_TENSORS,
    SCOPES,
    Decision,
    LayerSignals,
    Rung,
    SignalRequest,
    StepOutcome,
    StepSignals,
)

__all__ = [
    "ACTIONS",
    "CAUSES",
    "DEFAULT_LADDER",
    "TOKENS_RUNG",
    "LEVERS",
    "PROBE_GRADIENTS",
    "PROBE_TENSORS",
    "SCOPES",
    "Backoff",
    "Decision",
    "LayerSignals",
    "LowBitShare",
    "PolicyConfig",
    "PrecisionPolicy",
    "Rung",
    "SignalRequest",
    "StepOutcome",
    "StepSignals",
    "TokensLever",
    "replay_noise_readings",
    "runs_low_bit",
]
