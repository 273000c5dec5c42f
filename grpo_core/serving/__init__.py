"""Generation serving: vLLM provisioning, the embedded vLLM-compatible server, the HTTP client.

- ``launch``: ``vllm serve`` and embedded-server command lines from the typed config, launch/health/teardown,
  fallback to the embedded server; ``supervisor``: restarts of replicas that exit.
- ``embedded/``: the embedded server on transformers with vLLM's API and metric names (``server``, the entry
  point; ``app``, ``engine``, ``cache``, ``sampling``, ``weights``).
- ``client``: the async client the rollout uses against either server.
- ``replicas``: several replicas as one (``ReplicaSet``: prefix-affinity routing, the one all-or-nothing control
  fan-out and its retry policy).
- ``router/``: the replicas as one OpenAI-compatible URL (``app``, the ASGI app; ``server``, the process and its
  launcher); ``python -m grpo_core.serving.router``.

Nothing is imported here so ``python -m grpo_core.serving.embedded --help`` stays instant.
"""
