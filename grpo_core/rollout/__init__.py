"""Rollout engine: the async rollout loop, rewards, advantages, tools/environments, pace, Flight transport.

The trainer side needs only :class:`RolloutSource` (``grpo_core.rollout.source``) and
:func:`start_rollout_process`; users subclass :class:`RolloutLoop` to customise a run.
Heavy imports (transformers, the HTTP client) happen inside the rollout process only.
"""

from grpo_core.transport import PulledBatch, ResumeState

from .loop import LoopRuntime, RolloutLoop
from .process import RolloutJob, check_picklable, start_rollout_process
from .source import RolloutSource
from .types import Rollout, RolloutGroup, TrainingSequence, TurnRecord, reconcile_turns

__all__ = [
    "LoopRuntime",
    "PulledBatch",
    "ResumeState",
    "Rollout",
    "RolloutGroup",
    "RolloutJob",
    "RolloutLoop",
    "RolloutSource",
    "TrainingSequence",
    "TurnRecord",
    "check_picklable",
    "reconcile_turns",
    "start_rollout_process",
]
