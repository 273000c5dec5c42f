"""The embedded server: a vLLM-compatible generation server on transformers (CPU or CUDA), with vLLM's API and
metric names, so one client and one router serve both.

- ``server``: the entry point (``python -m grpo_core.serving.embedded``): arguments, socket, uvicorn.
- ``app``: the FastAPI routes and the Prometheus metrics.
- ``engine``: continuous batching over the model (pause, abort, LoRA rows); ``cache``: its batched KV cache;
  ``sampling``: its per-row sampler.
- ``weights``: LoRA adapters and full-weight updates.

The wire shapes are ``grpo_core.serving.protocol``'s. Nothing is imported here so ``--help`` stays instant.
"""
