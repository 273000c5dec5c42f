"""Prefect deployment definitions of grpo-flow. Filled in by the main-job issue."""
