"""Prefect flows of grpo-flow (thin: they call grpo_core). Filled in by the main-job issue."""
