"""grpo-flow's Python library: config, packing, serving, rollout, training, tracking.

Knows nothing of Prefect (see DESIGN.md §4). Imports stay light here so that
``python -m grpo_core.<process> --help`` is instant.
"""

__version__ = "0.1.0"
