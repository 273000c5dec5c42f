"""The replicas as one OpenAI-compatible URL: ``python -m grpo_core.serving.router --url URL --url URL ...``.

- ``app``: the ASGI app (affinity routing, the all-or-nothing control fan-out, health, routing metrics).
- ``server``: the process: its command line (``__main__.py`` runs :func:`server.main`) and
  :func:`server.start_router`, which launches it in front of a run's replicas.

For clients outside the rollout process (evaluation, a TRL-style single-endpoint trainer). It runs the
same :class:`~grpo_core.serving.replicas.ReplicaSet` as the rollout: completions and chat completions are
routed by prefix affinity (the ``X-Affinity-Key`` header when given, else a hash of the model name and
the first :data:`app.PREFIX_CHARS` characters of the prompt or messages), streamed answers included; control
calls (``/pause``, ``/resume``, LoRA load/unload, weight updates, ``/reset_prefix_cache``) fan out to
every replica all or nothing (a LoRA load that fails somewhere is unloaded where it succeeded; a pause is
resumed); ``/health`` is 200 only when every replica is healthy; ``/metrics`` has the routing counts.

Why not ``vllm-router`` (PyPI): it is a separate Rust binary whose ``cache_aware`` policy matches text
prefixes, with no notion of a policy version in the key (every adapter version of one prompt would share
a home), and it forwards a LoRA load to workers without an all-or-nothing rollback; the rollout also
needs the routing counts in its own metric window. This proxy is a thin face over the routing the
rollout already uses, so both follow one policy.

Every request to the router but ``/health`` must carry ``Authorization: Bearer`` with the run's token
(``$GRPO_RUN_TOKEN``) or the servers' key (``$GRPO_SERVER_API_KEY``, ``server.api_key``); neither is ever a
command-line argument that ``ps`` would show. Requests go on to the replicas with ``server.api_key``, else the
run's token.

Nothing is imported here so ``--help`` stays instant.
"""
