"""Completion tables of a run: the sampled completions of each logging window as MLflow table artifacts.

``completions/steps_NNNNNNN-MMMMMMM.json`` (with ``tracking.log_completions``): one table (MLflow's table format, as
``mlflow.log_table`` writes it: step, prompt, completion, reward, advantage, ...) per :data:`COMPLETION_TABLE_STEPS`
steps, rewritten with each logging window of its steps; the newest :data:`MAX_LISTED_TABLES` are listed in the run's
``mlflow.loggedArtifacts`` tag (the UI's table view, ``MlflowClient.load_table``), older ones stay in the artifacts as
JSON.
"""

from __future__ import annotations

import json
from typing import Any


def completions_table(rows: list[dict[str, Any]], max_chars: int) -> dict[str, list[Any]]:
    """Rows (dicts) as the columns ``mlflow.log_table`` takes; text cells cut to ``max_chars`` (marked ``…``)."""
    columns: dict[str, list[Any]] = {}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    for row in rows:
        for key, values in columns.items():
            value = row.get(key)
            if isinstance(value, str) and len(value) > max_chars:
                value = value[: max_chars - 1] + "…"
            values.append(value)
    return columns


#: Steps whose completion rows share one table artifact (``completions/steps_NNNNNNN-MMMMMMM.json``).
COMPLETION_TABLE_STEPS = 10
#: Completion tables listed in the run's ``mlflow.loggedArtifacts`` tag (the newest ones).
MAX_LISTED_TABLES = 100
#: MLflow's tag that lists a run's tables (``mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS``).
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"


def completion_table_path(step: int) -> str:
    """The table artifact holding ``step``'s completion rows (``COMPLETION_TABLE_STEPS`` steps per table)."""
    first = (step - 1) // COMPLETION_TABLE_STEPS * COMPLETION_TABLE_STEPS + 1
    return f"completions/steps_{first:07d}-{first + COMPLETION_TABLE_STEPS - 1:07d}.json"


def listed_tables(tag_value: str | None, path: str, limit: int) -> str:
    """The ``mlflow.loggedArtifacts`` tag value listing ``path`` as a table, kept within MLflow's tag length.

    ``mlflow.log_table`` appends one entry per new table file to this tag and MLflow cuts a tag value at
    ``MAX_TAG_VAL_LENGTH`` (8000) characters: after about 130 tables the cut value is no JSON, and every later
    ``log_table`` fails while parsing it. Here the completion tables listed are the newest ``limit`` (older ones
    leave the list, never the artifacts), other entries are kept, and the value always parses and fits.

    Args:
        tag_value: the tag's current value; None, or a value that does not parse (cut by an older version), =
            an empty list.
        path: the table artifact to list.
        limit: most completion tables listed.

    Returns:
        The JSON value to set.
    """
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    try:
        entries = json.loads(tag_value or "[]")
        entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    except json.JSONDecodeError:
        entries = []
    entry = {"path": path, "type": "table"}
    entries = [e for e in entries if e != entry] + [entry]
    ours = [e for e in entries if str(e.get("path", "")).startswith("completions/")]
    dropped = {json.dumps(e, sort_keys=True) for e in ours[: max(len(ours) - limit, 0)]}
    entries = [e for e in entries if json.dumps(e, sort_keys=True) not in dropped]
    while len(value := json.dumps(entries)) > MAX_TAG_VAL_LENGTH and len(entries) > 1:
        entries.pop(0)
    return value
