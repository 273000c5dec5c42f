"""Shared pytest set-up: offline Hugging Face, a persistent model cache, few CPU threads."""

import os
from pathlib import Path

# Nothing may be downloaded (DESIGN.md §8); converted models are cached across test runs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRPO_FLOW_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
