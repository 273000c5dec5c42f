"""Prefect deployments of grpo-flow: ``python -m deployments.deploy`` registers grpo-train/demo and nightly-retrain."""
