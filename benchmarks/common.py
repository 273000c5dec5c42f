"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

import subprocess


def git_commit() -> str:
    """Short hash of the checked-out commit, for naming a baseline ("unknown" outside git)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
