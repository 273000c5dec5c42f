"""Shared pytest set-up: offline Hugging Face, a persistent model cache, few CPU threads."""

import os
from pathlib import Path

# Nothing may be downloaded (DESIGN.md §8); converted models are cached across test runs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRPO_FLOW_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# The tests own the helper modules their configs name (reward functions, loop classes, environments): they join
# the allow-list of code a run may name (grpo_core.allowlist), here and in every process the tests start.
os.environ["GRPO_ALLOWED_MODULES"] = ",".join(
    filter(None, [os.environ.get("GRPO_ALLOWED_MODULES"), "rollout_helpers", "flow_helpers"]))
