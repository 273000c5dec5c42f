"""Metric names as MLflow accepts them: one mapping per sink, kept distinct, each renaming warned about once."""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

# What MLflow accepts in a metric name (mlflow.utils.validation): letters, digits, "_", "-", ".", " ", "/"
# (":" too, except on Windows servers: replaced here as well), no empty, "." or ".." path segment, no leading
# or trailing "/", at most 250 characters.
_UNSAFE_CHARS = re.compile(r"[^\w.\- /]")
_MAX_METRIC_NAME = 250


def mlflow_safe_name(name: str) -> str:
    """``name`` as MLflow accepts it: unsafe characters become ``_``, bad path segments are dropped or replaced.

    ``rewards/<lambda>/mean`` -> ``rewards/_lambda_/mean``; ``a//b/`` -> ``a/b``; ``x/../y`` -> ``x/_/y``.
    A name MLflow accepts is returned unchanged.
    """
    safe = _UNSAFE_CHARS.sub("_", name)
    segments = ["_" if part in (".", "..") else part for part in safe.split("/") if part]
    return ("/".join(segments) or "_")[:_MAX_METRIC_NAME]


class MetricNames:
    """The one place metric names become MLflow names: :func:`mlflow_safe_name`, kept distinct, warned once.

    Two names that map to the same safe name get suffixes ``_2``, ``_3`` … in the order they are first seen.
    """

    def __init__(self) -> None:
        self._safe: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, name: str) -> str:
        """The MLflow name of ``name`` (warns the first time a name is renamed)."""
        if name in self._safe:
            return self._safe[name]
        safe = base = mlflow_safe_name(name)
        number = 1
        while safe in self._taken:
            number += 1
            safe = f"{base[: _MAX_METRIC_NAME - len(str(number)) - 1]}_{number}"
        self._safe[name] = safe
        self._taken.add(safe)
        if safe != name:
            logger.warning("metric %r is logged to MLflow as %r (MLflow refuses the name as it is)", name, safe)
        return safe
