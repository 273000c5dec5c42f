"""Shared pytest set-up: offline Hugging Face, a persistent model cache, few CPU threads."""

import os
from pathlib import Path

# Nothing may be downloaded (DESIGN.md §8); converted models are cached across test runs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRPO_FLOW_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# The tests own the helper modules their configs name (reward functions, loop classes, environments): they join
# the allow-list of code a run may name (grpo_core.security.allowlist), here and in every process the tests start.
os.environ["GRPO_ALLOWED_MODULES"] = ",".join(
    filter(None, [os.environ.get("GRPO_ALLOWED_MODULES"), "rollout_helpers", "flow_helpers"])
)

import flow_helpers
from flow_helpers import api, stack, stack_tmp  # noqa: F401 - the session's shared Prefect stack (fixtures)

SHARED_STACK = "stack"


def _uses_stack(item) -> bool:
    return SHARED_STACK in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests of the shared Prefect stack (``flow_helpers.stack``) run one after another, from where the first
    of them was collected: the stack starts once and is stopped after the last of them (below), instead of idling
    while other files run."""
    users = [item for item in items if _uses_stack(item)]
    if users:
        first, chosen = items.index(users[0]), set(map(id, users))
        rest = [item for item in items if id(item) not in chosen]
        items[:] = rest[:first] + users + rest[first:]


def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the shared stack once the last test that uses it is done (its processes use the 2 cores otherwise)."""
    if _uses_stack(item) and (nextitem is None or not _uses_stack(nextitem)):
        flow_helpers.stop_shared_stack()
