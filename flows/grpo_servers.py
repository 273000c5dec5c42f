"""The ``grpo-servers`` flow: generation replicas in their own flow run, on another work pool (issue 13 step 3).

With ``server.deployment`` set (e.g. ``grpo-servers/gpu``, which ``grpo deploy`` registers on
``server.work_pool``), the ``grpo-train`` flow starts no server itself: :class:`ServerRun` runs that
deployment (``prefect.deployments.run_deployment(..., timeout=0)``, linked as a subflow run), waits up to
``server.startup_timeout_s`` for the replicas' URLs and routes over them; a worker of the servers' pool
(one on each GPU host) runs :func:`grpo_servers`, which

* starts ``server.num_replicas`` replicas (vLLM or embedded) through the one start path
  (``grpo_core.serving.launch.provision``), their logs in its own run log;
* publishes their URLs as a table artifact of its flow run (key ``grpo-servers-<train flow run id>``),
  read back by the train flow through Prefect's authenticated API;
* keeps them alive: a replica whose process exits is started again on its port (its URL stays valid; the
  routing re-admits it once ``/health`` answers), at most ``server.start_retries`` times;
* stops them when its flow run is cancelled (the train flow cancels it at its end, failed or not), when the
  train flow run reaches a final state, or when the train flow stops beating its lifeline (a Prefect variable
  it updates every ``server.lifeline_timeout_s / 4``; unchanged for ``lifeline_timeout_s``: the train
  flow's process is gone, e.g. killed with its worker) — so a crashed train flow never leaves GPUs held.

The servers' control key (derived from the run's bearer token, ``grpo_core.security.auth``; the token itself and
the membership key never reach the servers' host) and the config's secrets never appear in the flow run's
parameters: the train flow saves them in a Prefect ``Secret`` block (masked in the UI) named by the
``credentials`` parameter; the servers' flow reads it, deletes it, and gives the key to the replicas in
their environment only. A retry of the train flow cancels every unfinished servers' run of an earlier
attempt first (found by the tag ``grpo-train-run:<flow run id>``).
"""

from __future__ import annotations

import contextvars
import json
import secrets
import signal
import socket
import threading
import time
from typing import Any

from prefect import flow, get_run_logger, runtime
from prefect.states import Cancelled

from grpo_core.run import layout
from grpo_core.run.processes import RunProcesses, setup_logging
from grpo_core.security.auth import ROLE_CONTROL, derive_key

FLOW_NAME = "grpo-servers"
ENTRYPOINT = "flows/grpo_servers.py:grpo_servers"
DEFAULT_DEPLOYMENT = "gpu"
TRAIN_RUN_TAG = "grpo-train-run:"
"""Tag prefix of a servers' flow run naming the train flow run it serves."""
_POLL_S = 1.0


def artifact_key(train_flow_run_id: str) -> str:
    """Key of the URL table a servers' flow run publishes (lowercase letters, digits and dashes)."""
    return f"{FLOW_NAME}-{train_flow_run_id}".lower()


def advertised(url: str, host: str, advertise_host: str | None) -> str:
    """``url`` with the host others reach it by: ``advertise_host``, else this host's name when ``host`` binds
    every interface (``0.0.0.0``, ``::``), else unchanged."""
    public = advertise_host or (socket.getfqdn() if host in ("0.0.0.0", "::", "") else None)
    if public is None:
        return url
    scheme, port = url.split("://", 1)[0], url.rsplit(":", 1)[1]
    return f"{scheme}://{'[' + public + ']' if ':' in public else public}:{port}"


# ----- the servers' side -------------------------------------------------------------------------------------------


@flow(name=FLOW_NAME, log_prints=False, validate_parameters=True)
def grpo_servers(config: dict[str, Any], train_flow_run_id: str, credentials: str, lifeline: str):  # noqa: ANN201
    """Start the run's generation replicas here, publish their URLs, keep them until the train flow run ends.

    Args:
        config: the train flow run's config (``RunConfig`` as JSON, secrets redacted).
        train_flow_run_id: the ``grpo-train`` flow run these replicas serve.
        credentials: name of the Prefect ``Secret`` block holding the run's token and the config's secrets (read
            once, then deleted).
        lifeline: name of the Prefect variable the train flow beats.

    Returns:
        ``{"urls", "stopped"}`` (Completed) when the train flow run ended or stopped beating, or a Cancelled
        state when this flow run was cancelled.

    Raises:
        ServerStartError: a replica failed to start (its log's tail), or every replica died for good.
        ConfigError: the credentials block is missing (the train flow's attempt is gone) or the config is invalid.
    """
    from grpo_core.config import RunConfig
    from grpo_core.security.redact import apply_secrets, mask_values, redact_logs

    setup_logging()
    log = get_run_logger()
    token, run_secrets = _take_credentials(credentials)
    redact_logs(mask_values({**run_secrets, "token": token}))
    cfg = RunConfig.model_validate(apply_secrets(config, run_secrets))
    procs, urls = RunProcesses(token=token), []
    own_id = str(runtime.flow_run.id)
    stopped = "cancelled: the worker stopped this flow run (SIGTERM)"
    previous = _on_sigterm(_terminate)
    try:
        urls = _start(cfg, procs, log)
        _publish(procs.servers, urls, train_flow_run_id)
        log.info("replicas of train flow run %s serve at %s", train_flow_run_id, ", ".join(urls))
        stopped = _keep(cfg, procs, own_id, train_flow_run_id, lifeline, log)
        log.info("stopping the replicas: %s", stopped)
    except _Terminated:
        pass
    finally:
        _on_sigterm(signal.SIG_IGN)  # the worker's SIGTERM (a cancellation) does not cut the teardown short
        procs.stop_all()
        _on_sigterm(previous)
    log.info("replicas stopped: %s", stopped)
    if stopped.startswith("cancelled"):
        return Cancelled(message=stopped)
    return {"urls": urls, "stopped": stopped}


class _Terminated(BaseException):
    """SIGTERM reached the servers' flow run (its worker cancels it)."""


def _terminate(signum: int, frame: object) -> None:  # noqa: ARG001 - a signal handler
    raise _Terminated


def _on_sigterm(handler: Any) -> Any:
    """Install a SIGTERM handler (main thread only; elsewhere a no-op); returns the previous one."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: Prefect's own handling stops the run
        return None


def _take_credentials(name: str) -> tuple[str, dict[str, str]]:
    from prefect.blocks.system import Secret

    from grpo_core.errors import ConfigError

    try:
        data = Secret.load(name).get()  # the JSON object saved by ServerRun.start
    except ValueError as exc:  # prefect raises ValueError for a missing block
        raise ConfigError(
            f"credentials={name!r}: no such Secret block ({exc}); a grpo-servers run is started by "
            "a grpo-train flow run (server.deployment), which saves it"
        ) from None
    _delete_block(name)
    return data["token"], data.get("secrets", {})


def _start(cfg: Any, procs: RunProcesses, log: Any) -> list[str]:
    from grpo_core.serving.launch import choose_backend, provision

    backend = choose_backend(cfg)
    for i in range(cfg.server.num_replicas):
        procs.follow(cfg.server.log_dir / layout.replica_log(backend, i), log, f"[server {i}] ")
    procs.servers.extend(provision(cfg, control_key=procs.token))  # the block holds the servers' control key only
    return [advertised(h.url, cfg.server.host, cfg.server.advertise_host) for h in procs.servers]


def _publish(handles: list[Any], urls: list[str], train_flow_run_id: str) -> None:
    from prefect.artifacts import create_table_artifact

    rows = [{"replica": i, "url": url, "backend": h.spec.backend} for i, (url, h) in enumerate(zip(urls, handles))]
    create_table_artifact(
        rows,
        key=artifact_key(train_flow_run_id),
        description=f"generation replicas of grpo-train flow run {train_flow_run_id}",
    )


def _keep(cfg: Any, procs: RunProcesses, own_id: str, train_id: str, lifeline: str, log: Any) -> str:
    """Watch Prefect until a reason to stop (this run cancelled, the train run final or its lifeline silent for
    ``server.lifeline_timeout_s``) and keep the replicas serving meanwhile
    (:class:`grpo_core.serving.supervisor.ReplicaSupervisor`); returns the reason.

    Raises:
        ServerStartError: every replica exited with its restarts spent (``server.start_retries``).
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from grpo_core.serving.supervisor import ReplicaSupervisor

    period = min(2.0, cfg.server.lifeline_timeout_s / 4)
    supervisor = ReplicaSupervisor(cfg.server, procs.servers, procs.token, cfg.serves_lora(), log)
    last_beat, last_change = None, time.monotonic()
    try:
        with get_client(sync_client=True) as client:
            while True:
                try:
                    own, train = client.read_flow_run(own_id), client.read_flow_run(train_id)
                    beat = client.read_variable_by_name(lifeline)
                except ObjectNotFound:
                    return f"train flow run {train_id} (or this flow run) was deleted"
                except Exception as exc:  # noqa: BLE001 - the API unreachable: the lifeline timeout decides
                    log.warning("Prefect API not answering (%s); replicas kept until server.lifeline_timeout_s", exc)
                    own = train = beat = None
                if own is not None and own.state is not None and own.state.is_cancelling():
                    return f"cancelled: {own.state.message or 'flow run cancelled'}"
                if train is not None and train.state is not None and train.state.is_final():
                    return f"train flow run {train_id} is {train.state.name}"
                value = beat.value if beat is not None else None
                if value is not None and value != last_beat:
                    last_beat, last_change = value, time.monotonic()
                elif time.monotonic() - last_change > cfg.server.lifeline_timeout_s:
                    return (
                        f"train flow run {train_id} stopped beating its lifeline for "
                        f"{cfg.server.lifeline_timeout_s:.0f} s (server.lifeline_timeout_s)"
                    )
                supervisor.check()
                time.sleep(period)
    finally:
        supervisor.close()


# ----- the train flow's side ---------------------------------------------------------------------------------------


def check_deployment(client: Any, name: str) -> None:
    """Refuse a ``server.deployment`` that the Prefect server ``client`` talks to does not hold.

    Args:
        client: a synchronous Prefect client (``get_client(sync_client=True)``).
        name: ``flow/deployment``.

    Raises:
        ConfigError: no such deployment (names the field and how to register it).
    """
    from prefect.exceptions import ObjectNotFound

    from grpo_core.errors import ConfigError

    try:
        client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise ConfigError(
            f"server.deployment={name!r}: no such deployment on the Prefect server; register it "
            f"(`grpo deploy` registers {FLOW_NAME}/{DEFAULT_DEPLOYMENT} on server.work_pool) or fix "
            "the name"
        ) from None


class ServerRun:
    """The train flow's handle on the ``grpo-servers`` flow run serving it: start, URLs, lifeline, stop.

    Kept in the run's ``RunProcesses.servers``, so :meth:`stop` runs with the other processes' teardown.

    Args:
        config: the run config (``server.deployment`` set).
        train_flow_run_id: this flow run's id (tags the servers' run; the servers watch its state).
        token: the run's bearer token; the servers' flow run gets only the control key derived from it
            (``grpo_core.security.auth.derive_key``), or ``server.api_key`` (or ``GRPO_SERVER_API_KEY``) instead when
            set, as that is what the run's clients send. It reaches the servers through the credentials block, never
            a parameter.
        run_secrets: the config's secret values (``grpo_core.security.redact.secret_values``), through the same block.
        log: the run logger.
    """

    def __init__(self, config: Any, train_flow_run_id: str, token: str, run_secrets: dict[str, str], log: Any):
        self.config, self.train_id, self.secrets, self.log = config, train_flow_run_id, run_secrets, log
        # the servers' host gets their control key only (never the run's token, which derives the membership key)
        self.token = config.server.resolved_api_key() or derive_key(token, ROLE_CONTROL)
        key = secrets.token_hex(8)
        self.credentials, self.lifeline = f"grpo-run-credentials-{key}", f"grpo-lifeline-{key}"
        self.flow_run_id: str | None = None
        self.url = ""
        self._beating = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> list[str]:
        """Cancel a leftover servers' run of this flow run, run the deployment, wait for its URLs (and for each to
        answer ``/health`` from here) within ``server.startup_timeout_s``.

        Raises:
            ConfigError: ``server.deployment`` names no deployment on this Prefect server.
            ServerStartError: the servers' run ended before publishing, or no URLs within the timeout (names
                ``server.work_pool``: is a worker serving it?); the run is cancelled first.
        """
        from prefect.blocks.system import Secret
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment

        server = self.config.server
        deadline = time.monotonic() + server.startup_timeout_s
        with get_client(sync_client=True) as client:
            cancel_servers_of(client, self.train_id, "a new attempt of the train flow run starts its own servers")
            check_deployment(client, server.deployment)
        Secret(value={"token": self.token, "secrets": self.secrets}).save(self.credentials, overwrite=True)
        self._beat_once(0)
        params = {
            "config": self.config.model_dump(mode="json"),
            "train_flow_run_id": self.train_id,
            "credentials": self.credentials,
            "lifeline": self.lifeline,
        }
        try:
            run = run_deployment(
                server.deployment,
                parameters=params,
                timeout=0,
                as_subflow=True,
                tags=[f"{TRAIN_RUN_TAG}{self.train_id}"],
            )
            self.flow_run_id = str(run.id)
            self.log.info(
                "servers' flow run %s (%s) of %s started; waiting for its URLs", run.name, run.id, server.deployment
            )
            self._start_beating()
            urls = self._wait_urls(deadline)
            self._check_reachable(urls, deadline)
        except BaseException:
            self.stop()
            raise
        self.url = ",".join(urls)
        return urls

    def _wait_urls(self, deadline: float) -> list[str]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        from grpo_core.errors import ServerStartError

        server = self.config.server
        with get_client(sync_client=True) as client:
            while True:
                found = client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[self.flow_run_id]))
                )
                for artifact in found:
                    if artifact.key == artifact_key(self.train_id) and artifact.data:
                        rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
                        return [row["url"] for row in rows]
                state = client.read_flow_run(self.flow_run_id).state
                if state is not None and state.is_final():
                    raise ServerStartError(
                        f"the servers' flow run {self.flow_run_id} ({server.deployment}) ended "
                        f"{state.name} before publishing its URLs: {state.message}"
                    )
                if time.monotonic() > deadline:
                    where = f"{state.name}" if state is not None else "no state"
                    raise ServerStartError(
                        f"the servers' flow run {self.flow_run_id} ({server.deployment}) published no URLs within "
                        f"server.startup_timeout_s ({server.startup_timeout_s:.0f} s; it is {where}): is a worker "
                        f"serving work pool {server.work_pool!r} (server.work_pool)? `prefect worker start --pool "
                        f"{server.work_pool}` on a GPU host"
                    )
                time.sleep(_POLL_S)

    def _check_reachable(self, urls: list[str], deadline: float) -> None:
        from pydantic import SecretStr

        from grpo_core.serving.replicas import wait_external

        left = max(deadline - time.monotonic(), 5.0)
        # the replicas check server.api_key when set (as every client of the run sends it), else the control key
        key = {} if self.config.server.resolved_api_key() else {"api_key": SecretStr(self.token)}
        server = self.config.server.model_copy(update={"urls": urls, "startup_timeout_s": left, **key})
        wait_external(server, self.config.tls.client_ca())

    def _beat_once(self, count: int) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import VariableCreate, VariableUpdate

        with get_client(sync_client=True) as client:
            if client.read_variable_by_name(self.lifeline) is None:
                client.create_variable(VariableCreate(name=self.lifeline, value=count, tags=["grpo-lifeline"]))
            else:
                client.update_variable(VariableUpdate(name=self.lifeline, value=count))

    def _start_beating(self) -> None:
        period = self.config.server.lifeline_timeout_s / 4

        def beat() -> None:
            count = 0
            while not self._beating.wait(period):
                count += 1
                try:
                    self._beat_once(count)
                except Exception as exc:  # noqa: BLE001 - a missed beat; the servers wait lifeline_timeout_s
                    self.log.warning("lifeline beat %d not sent: %s", count, exc)

        context = contextvars.copy_context()  # the flow run's Prefect settings (API URL, auth)
        self._thread = threading.Thread(target=context.run, args=(beat,), name="grpo-servers-lifeline", daemon=True)
        self._thread.start()

    def watch(self, register: Any) -> None:
        """Fail the attempt (``register.fail``, a ``grpo_core.run.processes.RunProcesses``) as soon as the servers'
        flow run ends on its own (crashed, failed, cancelled by someone else) while this flow run still needs it;
        polled every second on a daemon thread in the flow run's Prefect context."""
        from prefect.client.orchestration import get_client

        def poll() -> None:
            while not self._beating.wait(_POLL_S):
                try:
                    with get_client(sync_client=True) as client:
                        state = client.read_flow_run(self.flow_run_id).state
                except Exception as exc:  # noqa: BLE001 - the API is briefly unreachable: ask again
                    self.log.warning("servers' flow run %s: state not read: %s", self.flow_run_id, exc)
                    continue
                if state is not None and state.is_final() and not self._beating.is_set():
                    register.fail(
                        f"the servers' flow run {self.flow_run_id} ({self.config.server.deployment}) ended "
                        f"{state.name}: {state.message or 'no message'}"
                    )
                    return

        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(poll,), name="grpo-servers-watch", daemon=True).start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop beating, cancel the servers' flow run and wait (``timeout_s``) until it is final; delete the
        credentials block and the lifeline variable. Idempotent."""
        from prefect.client.orchestration import get_client

        self._beating.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with get_client(sync_client=True) as client:
            if self.flow_run_id is not None:
                cancel_flow_run(client, self.flow_run_id, "the train flow run ended")
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    state = client.read_flow_run(self.flow_run_id).state
                    if state is None or state.is_final():
                        self.log.info("servers' flow run %s is %s", self.flow_run_id, state.name if state else "gone")
                        break
                    time.sleep(_POLL_S)
                else:
                    self.log.warning(
                        "servers' flow run %s not final %.0f s after its cancellation; its replicas "
                        "stop when its lifeline times out (server.lifeline_timeout_s)",
                        self.flow_run_id,
                        timeout_s,
                    )
            try:
                client.delete_variable_by_name(self.lifeline)
            except Exception:  # noqa: BLE001, S110 - gone already
                pass
        _delete_block(self.credentials)


def cancel_flow_run(client: Any, flow_run_id: str, message: str) -> None:
    """Cancel a flow run the Prefect way: a scheduled one at once (Cancelled), a running one through Cancelling (its
    worker stops its process; a servers' run also stops itself on seeing it). A final run is left as it is."""
    from prefect.states import Cancelling

    state = client.read_flow_run(flow_run_id).state
    if state is None or state.is_final():
        return
    new = Cancelled(message=message) if state.is_scheduled() else Cancelling(message=message)
    client.set_flow_run_state(flow_run_id, new, force=True)


def cancel_servers_of(client: Any, train_flow_run_id: str, message: str) -> list[str]:
    """Cancel every unfinished ``grpo-servers`` run tagged with ``train_flow_run_id`` (an earlier attempt's);
    returns their ids."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType

    final = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"{TRAIN_RUN_TAG}{train_flow_run_id}"]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=final)),
        )
    )
    for run in runs:
        cancel_flow_run(client, str(run.id), message)
    return [str(run.id) for run in runs]


def _delete_block(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            block = client.read_block_document_by_name(name, block_type_slug="secret")
            client.delete_block_document(block.id)
        except ObjectNotFound:
            pass
