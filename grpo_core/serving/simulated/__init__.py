"""Simulated generation engines for CPU: vLLM's HTTP surface with a calibrated step cost (issue 25, item 2).

- ``cost``: the step cost model ``a + b x running + c x prefill tokens`` and its calibrations (default: the H200
  fit in ``benchmarks/results/engine_calibration_h200_2026-12-05_1-2engines.json``), completion lengths.
- ``engine``: one engine's continuous batching, pause modes, weight updates and time accounting (asyncio time).
- ``app``: its FastAPI app (the routes the rollout and the weight sync call).
- ``server``: several engines in one process (``SimulatedServers`` for tests and benchmarks).
- ``reward``: a reward whose share of kept (unequal-reward) groups is a parameter.

Entry point: ``python -m grpo_core.serving.simulated --engines N --port P``. Nothing is imported here so
``--help`` stays quick.
"""
