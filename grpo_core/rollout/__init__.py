"""Rollout engine: the async rollout loop, rewards, advantages, tools/environments, pace.

The trainer side needs only the transport (``grpo_core.transport``: wire types, the Flight
client :class:`~grpo_core.transport.flight_client.FlightSource`) and :func:`start_rollout_process`;
users subclass :class:`RolloutLoop` to customise a run.
Heavy imports (transformers, the HTTP client) happen inside the rollout process only.
"""

from .loop import LoopRuntime, RolloutLoop
from .process import RolloutProcess, start_rollout_process
from .types import Rollout, RolloutGroup, TrainingSequence, TurnRecord, reconcile_turns

__all__ = [
    "LoopRuntime",
    "Rollout",
    "RolloutGroup",
    "RolloutLoop",
    "RolloutProcess",
    "TrainingSequence",
    "TurnRecord",
    "reconcile_turns",
    "start_rollout_process",
]
