"""The trainer-side source of the rollout's samples (implemented in ``grpo_core.transport_flight``).

Re-exported here for users of the rollout package; the trainer imports it from
``grpo_core.transport_flight`` so that ``train`` never imports ``rollout``.
"""

from grpo_core.transport_flight import META_CONSUMED, META_EXHAUSTED, FlightSource, RolloutSource

__all__ = ["META_CONSUMED", "META_EXHAUSTED", "FlightSource", "RolloutSource"]
