"""Trainer throughput benchmarks: ``python -m benchmarks.trainer sweep|ranks`` (``__main__.py``: one device, tree vs
plain rows × eager vs compiled × shapes; the real trainer under torchrun on 1 and 2 ranks) and
``python -m benchmarks.trainer.hybrid`` (a Gated DeltaNet hybrid), over the workload of ``workload.py``.

Modules: ``workload.py`` (shapes, samples, rows, timing, tables), ``sweep.py``, ``ranks.py``, ``hybrid.py``; each
imports ``workload`` only (no cycle). Run from the repository root.
"""
