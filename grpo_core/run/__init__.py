"""The run's plain-Python lifecycle, no Prefect: its children (start, stop, ports, log tails) and its folder's names.

``children`` is the one way a grpo-flow process starts and stops another; ``layout`` names every file and folder of
a run folder. Both are imported by ``flows/``, ``serving``, ``rollout`` and ``train`` alike (STYLE.md "Hallways").
"""
