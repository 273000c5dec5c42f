"""Generation serving: vLLM provisioning, the embedded vLLM-compatible server, the HTTP client.

- ``launch``: ``vllm serve`` and embedded-server command lines from the typed config, launch/health/teardown,
  fallback to the embedded server; ``supervisor``: restarts of replicas that exit.
- ``embedded/``: the embedded server on transformers with vLLM's API and metric names (``server``, the entry
  point; ``app``, ``engine``, ``cache``, ``sampling``, ``weights``).
- ``protocol``: the HTTP protocol in one place: every route, header and error type the run uses (vLLM's and
  grpo-flow's own), the embedded server's wire shapes.
- ``client``: the async client the rollout uses against either server; ``sampling_defaults``: the sampling fields a
  request sends and the server-default checks.
- ``replicas``: several replicas as one (``ReplicaSet``: prefix-affinity routing, the one all-or-nothing control
  fan-out and its retry policy).
- ``router/``: the replicas as one OpenAI-compatible URL (``app``, the ASGI app; ``server``, the process and its
  launcher); ``python -m grpo_core.serving.router``.
- ``simulated/``: engines on CPU with vLLM's HTTP surface and a calibrated step cost (``cost``, ``engine``, ``app``,
  ``server``, ``reward``), for benchmarks and tests, never a run's own servers;
  ``python -m grpo_core.serving.simulated``.
- ``guard``: the ASGI middleware every replica runs (token, fence, pause cap; vLLM loads it by this name);
  ``limits``: listener limits and TLS options.

Nothing is imported here so ``python -m grpo_core.serving.embedded --help`` stays instant.
"""
