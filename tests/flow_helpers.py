"""Helpers of the flow/deployment tests: a Prefect stack on loopback, the REST API, MLflow look-ups."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from grpo_core.serving.client import backoff_delay

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def tiny_overrides(tmp: Path) -> list[str]:
    """``--set`` overrides turning configs/tiny.yaml into the tests' run (own folders, a reward with variance).

    The reward is imported by name in the flow and rollout processes: the tests put ``tests/`` on PYTHONPATH.
    """
    return [f"train.output_dir={tmp / 'runs'}", f"tracking.dir={tmp / 'mlflow'}",
            "rollout.reward_functions=[flow_helpers:varied_reward]", "rollout.dataset_size=256"]


def varied_reward(completion_ids, **_):
    """A reward in [0, 1) that differs between different completions: no group of a random model has zero std,
    so every prompt is trained (the resume test checks that none is skipped)."""
    import zlib

    return [zlib.crc32(bytes(str(list(ids)), "ascii")) % 1000 / 1000 for ids in completion_ids]


class RetryTransport(httpx.HTTPTransport):
    """Retries the answers a loaded Prefect server gives for a moment (429/502/503), as Prefect's own
    client does (PREFECT_CLIENT_MAX_RETRIES, with jittered backoff); anything else, and the last attempt, is returned as is."""

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

    def run_deployment(self, name: str, parameters: dict) -> httpx.Response:
        """Create a flow run of a deployment with parameters (the UI's Run with custom parameters)."""
        return self.http.post(f"/deployments/{self.deployment(name)['id']}/create_flow_run",
                              json={"parameters": parameters})

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
        """The flow run's log lines, joined."""
        response = self.http.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                         "limit": 200, "sort": "TIMESTAMP_DESC"})
        return "\n".join(r["message"] for r in reversed(response.json()))


def with_changes(parameters: dict, **sections: dict) -> dict:
    """A deep copy of deployment parameters with ``section={key: value}`` changes of ``config``."""
    import copy

    out = copy.deepcopy(parameters)
    for section, values in sections.items():
        out["config"][section].update(values)
    return out


def infinite_reward(completion_ids, **_):
    """+inf for every rollout: the rollout process fails on the first scored group (a reward must be finite)."""
    return [float("inf")] * len(completion_ids)


def mlflow_run(tracking_dir: Path, flow_run_id: str, experiment: str = "grpo-tiny"):  # noqa: ANN201
    """``(MlflowClient, MLflow run id)`` of a flow run, found by its ``grpo.flow_run_id`` tag in the SQLite store
    under ``tracking_dir`` (``tracking.dir``). Raises AssertionError when no MLflow run has the tag."""
    from grpo_core import tracking
    from grpo_core.config import TrackingConfig

    tc = TrackingConfig(dir=tracking_dir, experiment_name=experiment)
    run_id = tracking.find_run(tc, flow_run_id)
    assert run_id is not None, f"no MLflow run tagged with flow run {flow_run_id}"
    return tracking.client(tc), run_id


def assert_mlflow_steps_once(mc, run_id: str, metrics_file: Path, max_steps: int) -> int:  # noqa: ANN001
    """Read back from the MLflow store, each training metric of the run's ``metrics.jsonl`` has each step at most
    once, within ``1..max_steps``, and those the file has at every step (``loss``, ``grad_norm``, ...) have exactly
    steps ``1..max_steps``: none twice, none missing. ``system/*`` (MLflow's sampler, its own step counter) is not
    a training metric. Returns the number of metrics checked.
    """
    from grpo_core.durable import read_jsonl
    from grpo_core.tracking import MetricNames

    records, names = read_jsonl(metrics_file), MetricNames()
    every_step = set.intersection(*(set(r) for r in records))
    for key in sorted(set().union(*records) - {"step"}):
        steps = sorted(m.step for m in mc.get_metric_history(run_id, names(key)))
        assert len(steps) == len(set(steps)), f"MLflow metric {names(key)!r}: a step logged twice: {steps}"
        assert set(steps) <= set(range(1, max_steps + 1)), f"MLflow metric {names(key)!r}: steps {steps}"
        if key in every_step:
            assert steps == list(range(1, max_steps + 1)), f"MLflow metric {names(key)!r}: steps {steps}"
    return len(set().union(*records)) - 1
