"""Prefect flows of grpo-flow (thin: they call grpo_core): ``grpo-train``, the ``grpo`` CLI, a local Prefect stack."""
