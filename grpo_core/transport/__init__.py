"""The rollout↔trainer contract, in one place (DESIGN.md §3, §4; STYLE.md "Every contract has one home").

Both the rollout process and the trainer import this package; neither imports the other.

- :mod:`grpo_core.transport.types`: the wire types (:class:`~grpo_core.transport.types.PulledBatch`,
  :class:`~grpo_core.transport.types.SampleSource`, :class:`~grpo_core.transport.types.ResumeState`).
- :mod:`grpo_core.transport.flight_server`: the rollout side, the sample queue and the Arrow Flight
  server over it (``DoGet`` samples; ``DoAction`` report, metrics, completions, heartbeat, shutdown).
- :mod:`grpo_core.transport.flight_client`: the trainer side, :class:`~grpo_core.transport.flight_client.FlightSource`.
- :mod:`grpo_core.transport.file_source`: an Arrow IPC file as a sample source (tests, benchmarks, offline runs).

The Sample Arrow schema itself is ``grpo_core.packing.sample_schema``.
"""
