"""``grpo``: the command line of grpo-flow (typer).

* ``grpo train --config FILE [--set key=value …]`` runs the ``grpo-train`` flow here, on Prefect's
  embedded API (or the server ``PREFECT_API_URL`` names), with a progress bar, and ends with a
  summary table;
* ``grpo deploy`` starts a Prefect server and process workers (``grpo-process``, and ``server.work_pool``
  for the servers' deployment) on loopback, registers the deployments and prints the UI URL (Ctrl-C stops them all);
* ``grpo resume RUN_ID`` starts a new run from the latest checkpoint of an MLflow run;
* ``grpo ui`` prints the Prefect and MLflow UI URLs, and with ``--mlflow`` serves the MLflow UI;
* ``grpo validate --config FILE`` runs every check of the flow's ``prepare`` task without starting
  anything; ``grpo config schema`` prints the JSON schema of the run config; ``grpo --version``.

The config is loaded and validated before Prefect is imported, so config errors are instant and
name the field.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from grpo_core.config import RunConfig


ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"
# Docstrings are rST: markdown mode shows ``code`` as text (rich mode printed the backticks) and reflows lines.
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0], rich_markup_mode="markdown")
config_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Inspect the run config.", rich_markup_mode="markdown"
)
app.add_typer(config_app, name="config")
console = Console(stderr=True)
#: Libraries whose versions ``grpo --version`` reports (read from package metadata, nothing imported).
VERSIONED = ("torch", "transformers", "peft", "prefect", "mlflow", "vllm")

SetOption = Annotated[
    list[str],
    typer.Option(
        "--set",
        help="override, e.g. train.max_steps=5 (repeatable); a secret off the command line: "
        "server.api_key=@env:NAME, @file:PATH or @stdin",
    ),
]
RetriesOption = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="flow retries after a failed attempt (each resumes from the latest checkpoint); default: the "
        "flow's own (1)",
    ),
]
ENV_DEFAULTS = {
    "PREFECT_HOME": "runs/prefect",  # under the working folder, like the run folders and the MLflow store
    "PREFECT_LOGGING_EXTRA_LOGGERS": "grpo_core",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}


# Exit codes of `grpo train` / `grpo resume` besides 0 (every step asked for was trained).
EXIT_FAILED, EXIT_CONFIG, EXIT_FEWER_STEPS = 1, 2, 3


def set_env_defaults() -> None:
    """Prefect settings of grpo-flow, unless the environment sets them (before prefect is imported). Prefect's home
    is ``runs/prefect`` under the working folder, made absolute now (was under the checkout, or inside
    site-packages for an installed package, whatever folder the command ran in)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, str(Path.cwd() / value) if key == "PREFECT_HOME" else value)


def _start_prefect_api() -> None:
    """Prefect's home folder, database and API ready before the flow starts; a failure exits at once."""
    from flows.local_api import PrefectApiError, start_local_api
    from grpo_core.errors import ConfigError

    try:
        start_local_api()
    except (ConfigError, PrefectApiError) as exc:
        console.print(f"[red]Prefect API not available[/red]: {exc}")
        raise typer.Exit(EXIT_FAILED) from None


def config_error(exc: BaseException) -> None:
    """Print ``config error: <message>`` on stderr: the message verbatim (no rich markup or emoji codes, e.g. the
    ``:x:`` of a quoted ``/etc/passwd`` line) and unwrapped, so each error stays one line in a log or a pipe."""
    from rich.text import Text

    console.print(Text.assemble(("config error", "red"), ": ", str(exc)), soft_wrap=True)


def _load(config: Path | None, overrides: list[str], trusted: bool | None = None) -> RunConfig:
    """Load and validate a config. ``trusted=True``: the caller's own file and overrides, whose code names join
    the allow-list of this process and its children (``grpo_core.security.allowlist.trust_config``); ``False`` (a config
    fetched from MLflow): its code names must already be allowed, checked here before anything starts;
    None: a config that runs nothing (``config show``, ``ui``)."""
    from grpo_core.config import load_config
    from grpo_core.errors import ConfigError
    from grpo_core.security import allowlist

    try:
        cfg = load_config(config, overrides)
        if trusted:
            allowlist.trust_config(cfg)
        elif trusted is False:
            allowlist.check_code_references(cfg)
        return cfg
    except ConfigError as exc:
        config_error(exc)
        raise typer.Exit(EXIT_CONFIG) from None


def version_text() -> str:
    """``grpo-flow X (torch …, transformers …, …)``: this package's and its main libraries' versions."""
    from importlib.metadata import PackageNotFoundError, version

    import grpo_core

    try:
        own = version("grpo-flow")
    except PackageNotFoundError:  # running from a source tree that is not installed
        own = grpo_core.__version__
    libs = []
    for name in VERSIONED:
        try:
            libs.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return f"grpo-flow {own} ({', '.join(libs)})"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="print the versions and exit")
    ] = False,
) -> None:
    """grpo-flow: asynchronous GRPO as a Prefect workflow."""


def _progress(output_dir: Path, max_steps: int, started: float, done: threading.Event) -> None:
    """Follow the newest ``<output_dir>/*/metrics.jsonl`` written after ``started`` with a rich progress bar."""
    import json

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from grpo_core.run.layout import METRICS

    columns = [
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        BarColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("perf/trained_tokens_per_s {task.fields[tps]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        job = bar.add_task("train", total=max_steps, reward="-", tps="-")
        while not done.wait(1.0):
            files = [p for p in output_dir.glob(f"*/{METRICS}") if p.stat().st_mtime >= started]
            if not files:
                continue
            lines = max(files, key=lambda p: p.stat().st_mtime).read_text().splitlines()
            if not lines or not lines[-1].strip():
                continue
            try:
                last = json.loads(lines[-1])
            except ValueError:
                continue
            reward = last.get("reward")
            bar.update(
                job,
                completed=last["step"],
                reward=f"{reward:.3f}" if reward is not None else "-",
                tps=f"{last.get('perf/trained_tokens_per_s', 0.0):.0f}",
            )


def summary_table(summary: dict) -> Table:
    """The end-of-run table: rates named as the metrics are (wall-clock rates over the whole training), paths
    wrapped, never cut (they are meant to be copied)."""
    table = Table(title="grpo-flow run", show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return str(int(v)) if v.is_integer() else f"{v:.3f}"
        return str(v)

    steps = summary.get("steps")
    if summary.get("steps_requested") is not None and steps != summary["steps_requested"]:
        steps = f"{fmt(steps)} of {fmt(summary['steps_requested'])} asked: {summary.get('stopped_early')}"
    rows = [
        ("steps", steps),
        ("resumed from", summary.get("resumed_from") or "no (a fresh start)"),
        ("time to first step (s, from the command's start)", summary.get("time_to_first_step_s")),
        ("reward, first 5 steps", summary.get("reward_first5")),
        ("reward, last 5 steps", summary.get("reward_last5")),
        ("rollout/generated_tokens_per_s (mean)", summary.get("generated_tokens_per_s")),
        ("perf/wall_clock_trained_tokens_per_s", summary.get("trained_tokens_per_s")),
        ("perf/wall_clock_forwarded_tokens_per_s", summary.get("forwarded_tokens_per_s")),
        ("MLflow run id", summary.get("mlflow_run_id")),
        ("MLflow tracking URI", summary.get("mlflow_uri")),
        ("checkpoint", summary.get("checkpoint")),
        ("reward curve", summary.get("reward_curve")),
    ]
    if summary.get("skipped_nonfinite_steps"):
        rows.insert(1, ("skipped steps (non-finite loss or gradient)", summary["skipped_nonfinite_steps"]))
    for name, value in rows:
        table.add_row(name, fmt(value))
    return table


def _log_to_file(cfg: RunConfig) -> Path:
    """The command's log file, ``<train.output_dir>/logs/grpo-train-<UTC time>-<pid>.log``: every Prefect log
    record of the command in full, tracebacks included, while the console prints grpo-flow's own failures as one
    line each (:mod:`flows.console_log`); the file takes records until the process exits. Returns its path."""
    from prefect.logging.handlers import PrefectConsoleHandler

    from flows import console_log
    from grpo_core.run.layout import cli_log

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = cli_log(cfg.train.output_dir.expanduser().resolve(), stamp, os.getpid())
    console_log.attach(path, PrefectConsoleHandler)
    return path


def _print_failure(exc: BaseException, log_path: Path | None = None) -> None:
    """The last lines of a failed run: what failed and its root cause, one line each, and where the tracebacks are
    (``log_path``, the command's log file, and the run folder's logs), without another traceback after them."""
    from rich.text import Text

    def first_line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else '(no message)'}"

    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    console.print(Text.assemble(("grpo train failed", "red"), ": ", first_line(exc)), soft_wrap=True)
    if root is not exc:
        console.print(Text.assemble(("root cause", "red"), ": ", first_line(root)), soft_wrap=True)
    where = f"tracebacks: {log_path}" if log_path is not None else "tracebacks: in the log above"
    console.print(f"({where}; the run folder keeps the children's logs)", soft_wrap=True)


def _share_console() -> None:
    """Prefect's console log handlers print through this command's console, so its lines scroll above the live
    progress bar instead of each leaving a frozen copy of the bar behind (rich keeps one live display per console)."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                handler.console = console


def run_locally(cfg: RunConfig, retries: int | None = None) -> dict:
    """Run the flow in this process with a progress bar; returns its summary.

    ``retries``: the flow run's retries after a failed attempt (Prefect's ``Flow.with_options``); None keeps the
    flow's own (``@flow(retries=1)``). A deployment run takes Prefect's per-run ``empirical_policy`` instead.

    Raises:
        typer.Exit: Prefect's API cannot start (code 1), or the run trained fewer steps than
            ``train.max_steps`` (code 3, after the summary table).
    """
    set_env_defaults()
    _start_prefect_api()
    if cfg.server.deployment:
        _check_servers_deployment(cfg, online=True)
    from flows.grpo_train import grpo_train

    done, started = threading.Event(), time.time()
    watcher = threading.Thread(
        target=_progress, args=(cfg.train.output_dir.resolve(), cfg.train.max_steps, started, done), daemon=True
    )
    from flows import console_log

    _share_console()
    log_path = _log_to_file(cfg)
    watcher.start()
    try:
        summary = (grpo_train if retries is None else grpo_train.with_options(retries=retries))(cfg)
    except Exception as exc:  # noqa: BLE001 - the run's failure, logged in full in the log file: end with its cause
        done.set()
        watcher.join(timeout=5)
        console_log.quiet()
        _print_failure(exc, log_path)
        raise typer.Exit(EXIT_FAILED) from None
    finally:
        done.set()
        watcher.join(timeout=5)
    console_log.quiet()
    console.print(summary_table(summary))
    if summary.get("stopped_early"):
        console.print(
            f"[red]trained {summary.get('steps', 0):.0f} of {summary.get('steps_requested')} steps[/red]: "
            f"{summary['stopped_early']}"
        )
        raise typer.Exit(EXIT_FEWER_STEPS)
    if summary.get("skipped_nonfinite_steps"):
        skipped, steps = summary["skipped_nonfinite_steps"], summary.get("steps", 0)
        console.print(
            f"[red]{skipped:.0f} of {steps:.0f} steps were skipped[/red]: "
            "their loss or gradient was not finite (NaN or inf), so the optimizer did not step; lower "
            "train.learning_rate (or check train.max_grad_norm and the rewards' scale) and run again",
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_FEWER_STEPS)
    return summary


def _check_servers_deployment(cfg: RunConfig, online: bool = False) -> None:
    """A run here with ``server.deployment`` needs the Prefect server that holds it (``PREFECT_API_URL``; Prefect's
    temporary server of ``grpo train`` has no deployments and no workers) and, ``online``, the deployment there.

    Raises:
        typer.Exit: code 2 after a one-line error naming ``server.deployment``, before any flow run or MLflow run.
    """
    from grpo_core.errors import ConfigError

    name = cfg.server.deployment
    if not name:
        return
    try:
        if not online and not os.environ.get("PREFECT_API_URL"):
            raise ConfigError(
                f"server.deployment={name!r} needs the Prefect server where `grpo deploy` registered "
                "it and a worker of server.work_pool runs: set PREFECT_API_URL (e.g. "
                "http://127.0.0.1:4200/api); without it `grpo train` runs on a temporary Prefect server "
                "that has no deployments (or unset server.deployment to start the replicas here)"
            )
        if online:
            from prefect.client.orchestration import get_client

            from flows.grpo_servers import check_deployment

            with get_client(sync_client=True) as client:
                check_deployment(client, name)
    except ConfigError as exc:
        config_error(exc)
        raise typer.Exit(EXIT_CONFIG) from None


def _checked(cfg: RunConfig, runs_here: bool = True) -> RunConfig:
    """``cfg`` after every check of the flow's ``prepare`` task (``preflight.check_run``); ``runs_here``: also that a
    run of it can start from this command (``server.deployment`` needs ``PREFECT_API_URL``), and its folders and
    MLflow store are created (not for ``grpo validate``, which creates nothing, and prints as a ``note:`` line what
    only the run's own hosts must have: vLLM, a multi-node run's shared token).

    Raises:
        typer.Exit: code 2 after a one-line error naming the field, before any flow run, server, process or MLflow
            run starts (a flow would only fail the same way on every retry).
    """
    from grpo_core.errors import ConfigError
    from grpo_core.run import preflight

    if runs_here:
        _check_servers_deployment(cfg)
    try:
        notes = preflight.check_run(cfg, create=runs_here)
    except (ConfigError, OSError, ImportError) as exc:  # bad config, missing files, unimportable code
        config_error(exc)
        raise typer.Exit(2) from None
    from rich.text import Text

    for note in notes:  # verbatim and unwrapped, as config_error prints
        console.print(Text.assemble(("note", "yellow"), ": ", note), soft_wrap=True)
    return cfg


@app.command()
def train(
    config: Annotated[Path, typer.Option(help="run config (YAML, JSON or TOML)")],
    set_: SetOption = [],
    retries: RetriesOption = None,
) -> None:
    """Run the grpo-train flow here (Prefect's embedded API), with a progress bar and a summary; the code the
    file names (reward functions, dataset, loop class, ...) joins the allow-list of this run. The config is
    checked first, as ``grpo validate`` does."""
    from grpo_core.run.startup import COMMAND_START_ENV

    os.environ.setdefault(COMMAND_START_ENV, str(time.time()))  # the summary's time to first step counts from here
    run_locally(_checked(_load(config, set_, trusted=True)), retries)


@app.command()
def validate(
    config: Annotated[Path, typer.Option(help="run config (YAML, JSON or TOML)")], set_: SetOption = []
) -> None:
    """Run every check of the flow's ``prepare`` task (config, model, dataset columns, reward functions,
    tools, export options, the ``resume_from`` run) without starting a server, a process or an MLflow run, and
    without creating the run folder or the MLflow store (only that the run could create them is checked)."""
    cfg = _checked(_load(config, set_, trusted=True), runs_here=False)  # may run elsewhere (a deployment)
    console.print(
        f"[green]{config}: valid[/green] (model {cfg.model.name}, dataset {cfg.rollout.prompts_summary()}, "
        f"{cfg.train.max_steps} steps)"
    )


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the run config (``grpo_core.config.RunConfig``), e.g. for an editor."""
    import json

    from grpo_core.config import RunConfig

    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=1))


@config_app.command("show")
def config_show(
    config: Annotated[Path | None, typer.Option(help="run config (YAML, JSON or TOML)")] = None, set_: SetOption = []
) -> None:
    """Print the resolved run config (file + overrides + defaults) as JSON."""
    typer.echo(_load(config, set_).model_dump_json(indent=1))


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="MLflow run id to continue from")],
    config: Annotated[Path | None, typer.Option(help="run config; default: the run's own")] = None,
    set_: SetOption = [],
    retries: RetriesOption = None,
) -> None:
    """Start a new run from the latest checkpoint of an MLflow run (resume_from=RUN_ID). The run's own config
    (fetched from MLflow) is checked like a run parameter: the code it names must be in GRPO_ALLOWED_MODULES;
    a --config file of yours joins the allow-list."""
    trusted = config is not None
    cfg = _checked(_load(config, [*set_, f"resume_from={run_id}"], trusted=trusted)) if trusted else None
    if config is None:
        from grpo_core.errors import ConfigError

        try:
            config = _run_config_of(run_id, set_)
        except ConfigError as exc:
            config_error(exc)
            raise typer.Exit(2) from None
        cfg = _checked(_load(config, [*set_, f"resume_from={run_id}"], trusted=False))
    run_locally(cfg, retries)


def _run_config_of(run_id: str, overrides: list[str]) -> Path:
    """Download ``config/run_config.json`` of an MLflow run (tracking settings from the overrides), made a resumed
    run's (``grpo_core.tracking.download_resume_config``)."""
    from grpo_core import tracking

    return tracking.download_resume_config(_load(None, overrides).tracking, run_id)


@app.command()
def deploy(
    port: Annotated[
        int, typer.Option(help="Prefect server port on 127.0.0.1 (0: a free one)", min=0, max=65535)
    ] = 4200,
    demo_config: Annotated[Path, typer.Option(help="parameters of grpo-train/demo")] = DEMO_CONFIG,
    cron: Annotated[
        str | None,
        typer.Option(
            help="schedule of grpo-train/nightly-retrain (UTC); default: keep its schedules as they are (0 2 * * * "
            "for a new one); schedules added in the UI are kept either way"
        ),
    ] = None,
    gpu_slots: Annotated[
        int | None,
        typer.Option(
            help="slots of the global concurrency limit 'gpu' (default: the GPUs visible here, at least 1)", min=1
        ),
    ] = None,
) -> None:
    """Start a Prefect server + process worker on loopback, register the deployments, serve until Ctrl-C."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        if cron is not None:
            CronSchedule(cron=cron)  # before the server starts
    except ValidationError:
        console.print(
            f"[red]bad --cron[/red] {cron!r}: not a cron string (five fields: minute hour day month "
            "weekday, e.g. '0 2 * * *' for 02:00 every day)"
        )
        raise typer.Exit(2) from None
    set_env_defaults()
    import signal

    from flows.serve import PrefectStack

    def interrupt(signum: int, frame: object) -> NoReturn:  # noqa: ARG001 - SIGTERM/SIGINT stop the stack like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    from flows.local_api import PrefectApiError, prepare_home
    from grpo_core.errors import ConfigError, PortInUseError
    from grpo_core.security.allowlist import ALLOWED_MODULES_ENV, trust_config

    demo = _load(demo_config, [])
    allowed = {ALLOWED_MODULES_ENV: ",".join(trust_config(demo))}  # the deployment's own file
    stack = PrefectStack(
        port=port,
        home=Path(os.environ["PREFECT_HOME"]),
        gpu_slots=gpu_slots,
        extra_env=allowed,
        server_pool=demo.server.work_pool,
    )
    try:
        prepare_home(Path(os.environ["PREFECT_HOME"]))
        stack.start()
    except (ConfigError, PortInUseError, PrefectApiError) as exc:
        console.print(f"[red]Prefect server cannot start[/red]: {exc}")
        raise typer.Exit(EXIT_FAILED) from None
    with stack:
        stack.register(demo_config, cron)
        console.print(
            f"Prefect UI: [bold]{stack.ui_url}[/bold]  (deployments grpo-train/demo, "
            f"grpo-train/nightly-retrain, grpo-servers/gpu on pool {demo.server.work_pool}; "
            f"Ctrl-C stops the server and the worker); the UI asks for the "
            f"API auth string: it is in {stack.auth_file} (or PREFECT_SERVER_API_AUTH_STRING when set)"
        )
        try:
            stack.wait()
        except KeyboardInterrupt:
            console.print("stopping the Prefect server and worker")


@app.command()
def ui(
    config: Annotated[Path | None, typer.Option(help="run config (for its tracking settings)")] = None,
    mlflow: Annotated[bool, typer.Option("--mlflow", help="serve the MLflow UI on --mlflow-port")] = False,
    mlflow_port: Annotated[int, typer.Option(min=1, max=65535)] = 5000,
    prefect_port: Annotated[int, typer.Option(min=1, max=65535)] = 4200,
) -> None:
    """Print the Prefect and MLflow UI URLs; ``--mlflow`` serves the MLflow UI until Ctrl-C, behind a password
    (``grpo_core.tracking.ui``: MLflow on a private Unix socket, an authenticating proxy on ``--mlflow-port``)."""
    tc = _load(config, []).tracking
    shown = tc.shown_tracking_uri()
    if mlflow:
        from grpo_core.errors import PortInUseError
        from grpo_core.security.auth import check_port_free

        try:  # before any URL is printed: another server there would be shown as ours while ours fails to bind
            check_port_free("127.0.0.1", mlflow_port, "--mlflow-port")
        except PortInUseError:
            config_error(
                PortInUseError(
                    f"127.0.0.1:{mlflow_port} is already in use: another MLflow UI (or another program) listens "
                    "there; open it if it is yours, or choose a free port with --mlflow-port"
                )
            )
            raise typer.Exit(2) from None
    console.print(f"Prefect UI: http://127.0.0.1:{prefect_port}  (started by `grpo deploy` / `make serve`)")
    console.print(f"MLflow tracking URI: {shown}")
    if not mlflow:
        console.print(f"MLflow UI: http://127.0.0.1:{mlflow_port}  (`grpo ui --mlflow`: behind a password)")
        return
    from grpo_core.tracking.ui import serve, ui_password

    password, where = ui_password(mlflow_port)
    console.print(
        f"MLflow UI: http://127.0.0.1:{mlflow_port}  (user grpo, password "
        + (f"in {where}, mode 0600)" if where is not None else "from $GRPO_UI_PASSWORD)"),
        soft_wrap=True,
    )
    code = serve(tc.resolved_tracking_uri(), tc.resolved_artifact_location(), mlflow_port, password)
    if code:
        console.print(f"[red]the MLflow UI exited with code {code}[/red]")
        raise typer.Exit(code if code > 0 else 1)


def main() -> None:
    """Console-script entry point. The working folder comes first on ``sys.path``, as for the rollout and trainer
    processes (``python -m`` puts it there): ``grpo validate`` and the run import the same ``module:callable`` a
    config names (an installed console script would otherwise see the checkout's copy, or none)."""
    if sys.path[:1] != [os.getcwd()]:
        sys.path.insert(0, os.getcwd())
    app()


if __name__ == "__main__":
    main()
