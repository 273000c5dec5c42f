"""Generation serving: vLLM provisioning, the embedded vLLM-compatible server, the HTTP client.

- ``vllm``: ``vllm serve`` command lines from the typed config, launch/health/teardown,
  fallback to the embedded server.
- ``embedded/``: the embedded server on transformers with vLLM's API and metric names (``server``, the entry
  point; ``app``, ``engine``, ``cache``, ``sampling``, ``weights``).
- ``client``: the async client the rollout uses against either server.
- ``router/``: the replicas as one OpenAI-compatible URL (``app``, the ASGI app; ``server``, the process and its
  launcher); ``python -m grpo_core.serving.router``.

Nothing is imported here so ``python -m grpo_core.serving.embedded --help`` stays instant.
"""
