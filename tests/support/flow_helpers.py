"""Helpers of the flow/deployment tests: a Prefect stack on loopback, the REST API, MLflow look-ups.

The stack (a server and the workers of two process pools, ~30 s to start on 2 cores) is one per test session,
shared by ``test_flow_e2e`` and ``test_server_deployment`` through the fixtures ``stack``, ``api`` and
``stack_tmp`` (exported by conftest.py, which also runs the tests that use it one after another and stops it
after the last of them).

The ``grpo train`` runs of the default tier that do not test Prefect's server share one Prefect API per test session
(``prefect_api``: a server alone, no pool, no worker, ~25 s to start on 2 cores), which each ``grpo train`` would
otherwise start for itself; a run gets it through ``prefect_api.client_env()`` in its environment.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from waiting import wait_until

from flows.serve import SERVER_POOL, PrefectStack
from grpo_core.entries import config_entry
from grpo_core.serving.client import backoff_delay

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
CRON = "0 2 * * *"
"""Schedule of the shared stack's ``grpo-train/nightly-retrain``."""
SERVERS_POOL = SERVER_POOL
"""The shared stack's second pool (``server.work_pool``'s default): its worker runs ``grpo-servers/gpu``."""
_RUNNING: list = []


@pytest.fixture(scope="session")
def stack_tmp(tmp_path_factory) -> Path:
    """Folder of the shared stack's runs: ``runs/`` (``train.output_dir``), ``mlflow/`` (``tracking.dir``)."""
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="session")
def stack(stack_tmp):
    """The session's Prefect stack: pools ``grpo-process`` (train runs) and ``grpo-gpu`` (servers' runs), each with
    a worker polling every second, one ``gpu`` slot, the deployments registered from configs/tiny.yaml with
    ``tiny_overrides(stack_tmp)`` and 2 steps. Tests change a run's parameters with ``with_changes``, never the
    deployments."""
    from flows.serve import PrefectStack

    env = {"PYTHONPATH": str(ROOT / "tests" / "support"), "OMP_NUM_THREADS": "1"}
    with PrefectStack(
        port=0, home=stack_tmp / "prefect", extra_env=env, server_pool=SERVERS_POOL, worker_poll_s=1, gpu_slots=1
    ) as s:
        # 2 steps: what a test leaves at the default (the browser's run) only needs to complete
        s.register(ROOT / "configs" / "tiny.yaml", CRON, overrides=[*tiny_overrides(stack_tmp), "train.max_steps=2"])
        _RUNNING.append(s)
        yield s
        _RUNNING.remove(s)


@pytest.fixture(scope="session")
def api(stack) -> Api:
    """The shared stack's REST API, with its auth string."""
    return Api(stack.api_url, stack.auth_headers())


def stop_shared_stack() -> None:
    """Stop the session's stack now (conftest.py calls it after the last test that uses it)."""
    for s in _RUNNING:
        s.stop()


class PrefectApi(PrefectStack):
    """Prefect's API server alone on 127.0.0.1 (no work pool, no worker), with its own home and auth string: the
    server a ``grpo train`` finds in ``PREFECT_API_URL`` (``flows.local_api.start_local_api``) instead of starting
    its temporary one. Start with ``with PrefectApi(home) as server:``; it stops on exit."""

    def __init__(self, home: Path, startup_timeout_s: float = 240.0):
        super().__init__(port=0, home=home, server_pool=None, startup_timeout_s=startup_timeout_s)

    def start(self) -> PrefectApi:
        """Start the server and wait until it answers ``/health`` and proves to be ours.

        Raises:
            AssertionError: it exited or did not answer within ``startup_timeout_s`` (with its log's tail).
            PrefectApiError: another process serves the port.
        """
        from flows.local_api import prepare_home, verify_own_server

        prepare_home(self.home, self.env())
        server = self._spawn(["server", "start", "--host", "127.0.0.1", "--port", str(self.port)], "server.log")

        def healthy() -> bool:
            if server.poll() is not None:
                raise AssertionError(f"the Prefect API exited: {(self.home / 'server.log').read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(healthy, f"the Prefect API {self.api_url} to answer /health", self.startup_timeout_s, 0.5)
            verify_own_server(self.api_url, self.auth_string, server, "the tests' Prefect API")
        except BaseException:
            self.stop()
            raise
        return self

    def client_env(self) -> dict[str, str]:
        """What a ``grpo`` command's environment needs to run its flows here: the URL and the auth string."""
        return {"PREFECT_API_URL": self.api_url, "PREFECT_API_AUTH_STRING": self.auth_string}

    def api(self) -> Api:
        """Its REST API."""
        return Api(self.api_url, self.auth_headers())


_API: list[PrefectApi] = []


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator[PrefectApi]:
    """The session's Prefect API for ``grpo train`` runs that do not test Prefect's server (conftest.py runs its
    tests one after another on one xdist worker and stops it after the last of them)."""
    with PrefectApi(tmp_path_factory.mktemp("prefect-api")) as server:
        _API.append(server)
        yield server
        _API.remove(server)


def stop_shared_api() -> None:
    """Stop the session's Prefect API now (conftest.py calls it after the last test that uses it)."""
    for server in _API:
        server.stop()


VARIED = ("rollout.reward_functions=[flow_helpers:varied_reward]", "rollout.dataset_size=256")
"""Overrides of configs/tiny.yaml: a reward with variance in every group (every prompt trains), 256 prompts.

The reward is imported by name in the flow and rollout processes: the tests put ``tests/support/`` on PYTHONPATH."""


def tiny_overrides(tmp: Path) -> list[str]:
    """``--set`` overrides turning configs/tiny.yaml into the tests' run: own folders under ``tmp`` (``runs``,
    ``mlflow``, as :func:`grpo_train_command` writes them) and :data:`VARIED`."""
    return [*run_folders(tmp), *VARIED]


def run_folders(tmp: Path) -> list[str]:
    """The overrides that put a test run's output (``<tmp>/runs``) and MLflow store (``<tmp>/mlflow``) under ``tmp``."""
    return [f"train.output_dir={tmp / 'runs'}", f"tracking.dir={tmp / 'mlflow'}"]


TINY = ROOT / "configs" / "tiny.yaml"
"""The config of the tests' whole runs."""


def grpo_train_command(tmp_path: Path, *overrides: str, config: Path = TINY, options: Sequence[str] = ()) -> list[str]:
    """The command line of a ``grpo train`` that a test starts as a subprocess (``python -m flows.cli train``).

    The run's output and MLflow store go under the test's folder (``--set train.output_dir=<tmp_path>/runs``,
    ``--set tracking.dir=<tmp_path>/mlflow``), then each of ``overrides`` as a ``--set`` of its own, in order (a later
    one of the same key wins, as on the command line). Run it with ``env=grpo_env(tmp_path, ...)``.

    Args:
        tmp_path: the test's folder; the run writes ``tmp_path / "runs"`` and ``tmp_path / "mlflow"``.
        *overrides: ``key=value`` overrides of the config (``"train.max_steps=2"``), without ``--set``.
        config: the run's config file; configs/tiny.yaml unless given.
        options: other options of ``grpo train`` (``("--retries", "3")``), placed before the ``--set``s.

    Returns:
        A new list of arguments for ``subprocess.run``/``Popen``, starting with this interpreter.
    """
    sets = [*run_folders(tmp_path), *overrides]
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--config",
        str(config),
        *options,
        *(arg for override in sets for arg in ("--set", override)),
    ]


def grpo_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a ``grpo train`` (``python -m flows.cli train``) that a test starts as a subprocess.

    The test process's environment, plus: the repository and ``tests/support`` on ``PYTHONPATH`` (the flow and the
    processes it starts import ``grpo_core``, ``flows`` and the helpers a config names, e.g.
    ``flow_helpers:varied_reward``), a Prefect home of the test's own under ``tmp_path`` (``PREFECT_HOME``; the
    checkout's ``runs/prefect`` is shared by every worker), ``COLUMNS=400`` (the console does not wrap the summary and
    errors a test reads) and ``OMP_NUM_THREADS=1`` (one thread per process on the 2-core box).

    Args:
        tmp_path: the test's folder; the Prefect home is ``tmp_path / "prefect"``.
        **extra: variables set after the ones above, which they override (``**prefect_api.client_env()``, a
            ``PREFECT_HOME`` under test, ``PREFECT_LOGGING_LEVEL``...).

    Returns:
        A new dict of variable name to value, for ``subprocess.run(..., env=...)``.
    """
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")]),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "COLUMNS": "400",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


@config_entry("reward")
def varied_reward(completion_ids, **_):
    """A reward in [0, 1) that differs between different completions: no group of a random model has zero std,
    so every prompt is trained (the resume test checks that none is skipped)."""
    import zlib

    return [zlib.crc32(bytes(str(list(ids)), "ascii")) % 1000 / 1000 for ids in completion_ids]


class RetryTransport(httpx.HTTPTransport):
    """Retries the answers a loaded Prefect server gives for a moment (429/502/503), as Prefect's own
    client does (PREFECT_CLIENT_MAX_RETRIES, with jittered backoff); anything else, and the last attempt, is returned
    as is."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(6):
            response = super().handle_request(request)
            if response.status_code not in (429, 502, 503) or attempt == 5:
                return response
            response.close()
            time.sleep(backoff_delay(attempt, 0.5, 8.0))
        raise AssertionError("unreachable")


class Api:
    """The Prefect REST API of a test server (what the UI calls)."""

    def __init__(self, api_url: str, headers: dict[str, str] | None = None):
        self.url = api_url
        self.http = httpx.Client(base_url=api_url, timeout=30, transport=RetryTransport(), headers=headers)

    def deployment(self, name: str) -> dict:
        """``grpo-train/<name>``."""
        response = self.http.get(f"/deployments/name/grpo-train/{name}")
        response.raise_for_status()
        return response.json()

    def run_deployment(self, name: str, parameters: dict, retries: int | None = None) -> httpx.Response:
        """Create a flow run of a deployment with parameters (the UI's Run with custom parameters); ``retries``
        replaces the flow's own (``@flow(retries=1)``) for this run (its empirical policy), e.g. 0 for a run that
        is meant to fail."""
        body: dict = {"parameters": parameters}
        if retries is not None:
            body["empirical_policy"] = {"retries": retries}
        return self.http.post(f"/deployments/{self.deployment(name)['id']}/create_flow_run", json=body)

    def flow_run(self, flow_run_id: str) -> dict:
        """One flow run."""
        response = self.http.get(f"/flow_runs/{flow_run_id}")
        response.raise_for_status()
        return response.json()

    def wait(self, flow_run_id: str, timeout_s: float = 400.0) -> dict:
        """Poll until the flow run is in a terminal state; returns it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.flow_run(flow_run_id)
            if run["state_type"] in TERMINAL:
                return run
            time.sleep(1.0)
        raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s} s: {run['state_type']}")

    def flow_run_ids(self, deployment_id: str) -> list[str]:
        """Ids of the deployment's flow runs."""
        response = self.http.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment_id]}}})
        response.raise_for_status()
        return [r["id"] for r in response.json()]

    def new_flow_run(self, deployment_id: str, known: set[str], timeout_s: float = 60.0) -> str:
        """Wait for a flow run of the deployment that is not in ``known``; returns its id."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = set(self.flow_run_ids(deployment_id)) - known
            if new:
                return new.pop()
            time.sleep(0.5)
        raise TimeoutError(f"no new flow run of deployment {deployment_id} within {timeout_s} s")

    def logs(self, flow_run_id: str) -> str:
        """All the flow run's log lines, oldest first, joined (read in pages of the API's limit of 200)."""
        lines: list[str] = []
        while True:
            response = self.http.post(
                "/logs/filter",
                json={
                    "logs": {"flow_run_id": {"any_": [flow_run_id]}},
                    "limit": 200,
                    "offset": len(lines),
                    "sort": "TIMESTAMP_ASC",
                },
            )
            response.raise_for_status()
            page = [r["message"] for r in response.json()]
            lines += page
            if len(page) < 200:
                return "\n".join(lines)


def with_changes(parameters: dict, **sections: dict) -> dict:
    """A deep copy of deployment parameters with ``section={key: value}`` changes of ``config``."""
    import copy

    out = copy.deepcopy(parameters)
    for section, values in sections.items():
        out["config"][section].update(values)
    return out


@config_entry("reward")
def infinite_reward(completion_ids, **_):
    """+inf for every rollout: the rollout process fails on the first scored group (a reward must be finite)."""
    return [float("inf")] * len(completion_ids)


def mlflow_run(tracking_dir: Path, flow_run_id: str, experiment: str = "grpo-tiny"):
    """``(MlflowClient, MLflow run id)`` of a flow run, found by its ``grpo.flow_run_id`` tag in the SQLite store
    under ``tracking_dir`` (``tracking.dir``). Raises AssertionError when no MLflow run has the tag."""
    from grpo_core import tracking
    from grpo_core.config import TrackingConfig

    tc = TrackingConfig(dir=tracking_dir, experiment_name=experiment)
    run_id = tracking.find_run(tc, flow_run_id)
    assert run_id is not None, f"no MLflow run tagged with flow run {flow_run_id}"
    return tracking.client(tc), run_id


#: Metrics the trainer computes for every step it trains (the rollout's windowed ones, ``rollout/*``, ``router/*``,
#: ``reward*`` …, are absent from a step whose window saw no such event).
TRAINER_STEP_METRICS = (
    "loss",
    "entropy",
    "grad_norm",
    "learning_rate",
    "policy_version",
    "perf/step_s",
    "batch/samples_per_step",
    "batch/trained_tokens_per_step",
    "sampling/importance_sampling_ratio/mean",
)


def assert_mlflow_steps_once(mc, run_id: str, metrics_file: Path, max_steps: int) -> int:
    """Read back from the MLflow store, each training metric of the run's ``metrics.jsonl`` has each step at most
    once, within ``1..max_steps``, and the trainer's own (:data:`TRAINER_STEP_METRICS`) have exactly steps
    ``1..max_steps``: none twice, none missing. A step a killed attempt logged and the resumed one trained again
    keeps the first attempt's values in MLflow (no duplicate steps), whose rollout window may have lacked a metric
    the file's record has. ``system/*`` (MLflow's sampler, its own step counter) is not a training metric. Returns
    the number of metrics checked.
    """
    from grpo_core.run.durable import read_jsonl
    from grpo_core.tracking import MetricNames

    records, names = read_jsonl(metrics_file), MetricNames()
    every_step = set.intersection(*(set(r) for r in records)) & set(TRAINER_STEP_METRICS)
    assert every_step == set(TRAINER_STEP_METRICS), f"the trainer did not log at every step: {sorted(every_step)}"
    for key in sorted(set().union(*records) - {"step"}):
        steps = sorted(m.step for m in mc.get_metric_history(run_id, names(key)))
        assert len(steps) == len(set(steps)), f"MLflow metric {names(key)!r}: a step logged twice: {steps}"
        assert set(steps) <= set(range(1, max_steps + 1)), f"MLflow metric {names(key)!r}: steps {steps}"
        if key in every_step:
            assert steps == list(range(1, max_steps + 1)), f"MLflow metric {names(key)!r}: steps {steps}"
    return len(set().union(*records)) - 1
