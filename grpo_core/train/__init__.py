"""Training: tree attention, trained-token log-probs, the GRPO loss (and, later,
the FSDP2 trainer). Imports neither Prefect nor MLflow, so trainer code and
benchmarks run on GPU machines that have neither."""
