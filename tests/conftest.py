"""Shared pytest set-up: offline Hugging Face, a persistent model cache, few CPU threads, and what lets the default
tier run on two xdist workers (``make test``: ``-n 2 --dist loadgroup``, then the ``serial`` tests alone).

Isolation between workers (each a process of its own, tests in any order):

* the tests of one shared server (``SHARED``: the Prefect stack, the Prefect API of ``grpo train``) carry the
  ``xdist_group`` of that server, so they run one after another on one worker, which starts it once and stops it
  after the last of them; every other test carries its file's group (module fixtures are built once);
* ``PREFECT_HOME`` is a folder of this process's own (a ``grpo`` command run in this process, or started from it
  without a ``PREFECT_HOME`` of its own, never writes the checkout's ``runs/prefect``), and every test gets back the
  environment it started with (an in-process ``grpo`` command sets Prefect's defaults in ``os.environ``);
* the model cache (``GRPO_FLOW_CACHE_DIR``) is shared: a model is built under a file lock into a temporary folder
  and renamed into place (``grpo_core.models``), and ``make models`` builds them all before the tests start.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Nothing may be downloaded (DESIGN.md §8); converted models are cached across test runs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRPO_FLOW_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# The helper modules (tests/support: flow_helpers, rollout_helpers, ...) are imported by name here and in every process
# the tests start ("rollout_helpers:even_share" in a config): first on this process's path and on PYTHONPATH, which a
# child inherits (a test that writes a PYTHONPATH of its own adds tests/support where a child imports a helper).
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
# The tests own the helper modules their configs name (reward functions, loop classes, environments): they join
# the allow-list of code a run may name (grpo_core.security.allowlist), here and in every process the tests start.
os.environ["GRPO_ALLOWED_MODULES"] = ",".join(
    filter(None, [os.environ.get("GRPO_ALLOWED_MODULES"), "rollout_helpers", "flow_helpers"])
)
# Prefect's home of this process (one per xdist worker), unless the environment names one: `grpo` commands default
# it to runs/prefect under the working folder, the checkout, which two workers would share.
_OWN_PREFECT_HOME = None if os.environ.get("PREFECT_HOME") else tempfile.mkdtemp(prefix="grpo-tests-prefect-")
if _OWN_PREFECT_HOME:
    os.environ["PREFECT_HOME"] = _OWN_PREFECT_HOME

import flow_helpers  # noqa: E402 - after the environment above, which its imports read
from flow_helpers import api, prefect_api, stack, stack_tmp  # noqa: E402, F401 - shared Prefect fixtures

SHARED = {"stack": flow_helpers.stop_shared_stack, "prefect_api": flow_helpers.stop_shared_api}
"""Session fixtures of a shared server → what stops it; each is the name of its tests' ``xdist_group``."""


def _shared(item) -> str | None:
    """The shared server ``item`` uses (a key of ``SHARED``), if any."""
    names = getattr(item, "fixturenames", ())
    return next((name for name in SHARED if name in names), None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group markers into the node ids
def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests of each shared server run one after another, from where the first of them was collected, and carry
    its ``xdist_group`` (one worker runs them all): the server starts once and is stopped after the last of them
    (below), instead of idling while other files run. Every other test carries its file's group: a file's module
    fixtures (a server, a reference run) are built once, on one worker, as ``--dist loadfile`` would do."""
    for name in SHARED:
        users = [item for item in items if _shared(item) == name]
        if not users:
            continue
        first, chosen = items.index(users[0]), set(map(id, users))
        rest = [item for item in items if id(item) not in chosen]
        items[:] = rest[:first] + users + rest[first:]
    if not config.pluginmanager.hasplugin("xdist"):  # pytest -p no:xdist: no groups to give (nor the marker)
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_shared(item) or item.nodeid.split("::")[0]))
        if getattr(config.option, "loadgroup", False) and hasattr(item, "_id"):  # an xdist worker, --dist loadgroup
            _suffix_group(item)


def _suffix_group(item) -> None:
    """Append ``@<group>`` to the node id, which the controller's loadgroup scheduler reads (xdist 3.8 writes it into
    ``item._nodeid``, which pytest 9.2's structured node ids no longer read, so every test ran where it fell:
    pytest-dev/pytest-xdist#1386). Names joined as xdist joins them."""
    from _pytest.nodeid import NodeId

    group = "_".join(
        sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
    )
    if not item.nodeid.endswith(f"@{group}"):
        item._id = NodeId.parse(f"{item.nodeid}@{group}")  # pytest 9.2: the node id is read from here


def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop a shared server once the last test that uses it is done (its processes use the 2 cores otherwise)."""
    name = _shared(item)
    if name is not None and (nextitem is None or _shared(nextitem) != name):
        SHARED[name]()


def pytest_unconfigure(config) -> None:
    """Remove this process's own Prefect home (above)."""
    if _OWN_PREFECT_HOME:
        shutil.rmtree(_OWN_PREFECT_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Every test ends with the environment it started with (after its session fixtures set theirs): an in-process
    ``grpo`` command's Prefect defaults (``flows.cli.set_env_defaults``) reach no later test."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _config_warnings_afresh():
    """Every test starts with no config warning shown yet, as a fresh process does: each is logged once per process
    (``grpo_core.config.shown_once``), so a test that checks a warning sees it whatever ran before it on its worker."""
    from grpo_core.config import forget_shown

    forget_shown()


@pytest.fixture
def fake_generation():
    """A started :class:`fake_generation.FakeGeneration` (tests/support/fake_generation.py): the one scriptable fake
    of the generation servers' HTTP API; ``fake_generation.url`` is its address, stopped after the test."""
    from fake_generation import FakeGeneration

    with FakeGeneration() as fake:
        yield fake
