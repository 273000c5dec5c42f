"""Register the deployments of ``grpo-train`` on a process work pool.

``python -m deployments.deploy [--config configs/demo.yaml] [--cron "0 2 * * *"] [--set key=value …]``
against the server ``PREFECT_API_URL`` names (``grpo deploy`` starts one and calls this):

* ``grpo-train/demo``: parameters prefilled from the config file (the UI form shows them);
* ``grpo-train/nightly-retrain``: the same parameters on a cron schedule (``--cron``, default ``0 2 * * *`` UTC),
  at most one run at a time: a run that would start while another holds the deployment's slot is Cancelled
  ("Deployment concurrency limit reached."), so the nightly runs a stopped worker missed make one catch-up run,
  not one after another (:data:`NIGHTLY_CONCURRENCY`);
* ``grpo-servers/gpu`` (``flows.grpo_servers``) on the config's ``server.work_pool`` (``grpo-gpu``): the
  generation replicas of a ``grpo-train`` run whose ``server.deployment`` names it, started by a worker of that
  pool (one on each GPU host); it has no parameters of its own (the train flow run passes them).

Registering again (every ``grpo deploy`` start) updates the deployments and keeps their schedules: one added or
edited in the UI stays; the cron schedule ``--cron`` manages is the one with slug :data:`CRON_SLUG`, created when
missing and changed only when ``--cron`` is given (:func:`nightly_schedules`).

Python rather than ``prefect.yaml`` because two values are computed here: the parameters
(read and validated from the config file) and the absolute folder the worker runs the flow in.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/grpo_train.py:grpo_train"
FLOW_NAME = "grpo-train"
DEMO, NIGHTLY = "demo", "nightly-retrain"
DEFAULT_CRON = "0 2 * * *"
CRON_SLUG = "grpo-cron"
"""Slug of the nightly deployment's schedule that ``--cron`` manages (a schedule of another slug, or none, is the
user's: never changed here)."""
NIGHTLY_CONCURRENCY = {"limit": 1, "collision_strategy": "CANCEL_NEW"}
"""Prefect's deployment concurrency of ``nightly-retrain``: one run at a time, and a run that meets a full slot is
Cancelled instead of queued (Prefect's ``ENQUEUE`` would run every missed night back to back)."""


def parameters(config: Path, overrides: list[str]) -> dict:
    """The flow's parameters from a config file (validated; JSON-able)."""
    from grpo_core.config import load_config

    return {"config": load_config(config, overrides).model_dump(mode="json")}


def register(config: Path, cron: str | None, pool: str, overrides: list[str] | None = None) -> list[str]:
    """Create or update the deployments; returns their ids.

    Args:
        config: the run config whose parameters the deployments carry.
        cron: the nightly schedule (UTC) to set; None keeps the deployment's own (``0 2 * * *`` for a new one).
        pool: the process work pool of ``grpo-train``.
        overrides: ``--set`` overrides of ``config``.
    """
    from prefect import flow
    from prefect.client.schemas.objects import ConcurrencyLimitConfig

    from grpo_core.config import load_config

    params = parameters(config, overrides or [])
    server = load_config(config, overrides or []).server
    source = flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    env = {"PREFECT_LOGGING_EXTRA_LOGGERS": "grpo_core"}
    ids = [
        source.deploy(
            name=DEMO,
            work_pool_name=pool,
            parameters=params,
            job_variables={"env": env},
            description=f"grpo-train with the parameters of {config.name}",
            build=False,
            push=False,
            print_next_steps=False,
            tags=["grpo", "demo"],
        ),
        source.deploy(
            name=NIGHTLY,
            work_pool_name=pool,
            parameters=params,
            job_variables={"env": env},
            schedules=nightly_schedules(cron),
            concurrency_limit=ConcurrencyLimitConfig.model_validate(NIGHTLY_CONCURRENCY),
            build=False,
            push=False,
            print_next_steps=False,
            description="nightly retraining (its schedules: the deployment's Schedules tab; one run at a time, "
            "missed nights make one catch-up run)",
            tags=["grpo", "nightly"],
        ),
    ]
    ids.append(register_servers(server.deployment, server.work_pool, env))
    return [str(i) for i in ids]


def nightly_schedules(cron: str | None) -> list:
    """The schedules to register ``nightly-retrain`` with: the ones it has now, kept, and its cron schedule (slug
    :data:`CRON_SLUG`).

    Prefect replaces every schedule of a deployment registered again (a schedule added in the UI included, even
    when none is passed), so the current ones are read first and passed back as they are (schedule, active,
    parameters, slug). The cron schedule: none of the slug yet -> one from ``cron`` or :data:`DEFAULT_CRON` (a
    schedule of an older registration without a slug and with that cron takes the slug instead of being doubled);
    one exists -> set to ``cron`` when given, else left as it is.

    Returns:
        ``DeploymentScheduleCreate`` objects (``prefect.client.schemas.actions``).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.exceptions import ObjectNotFound

    wanted = CronSchedule(cron=cron or DEFAULT_CRON, timezone="UTC")
    with get_client(sync_client=True) as client:
        try:
            current = client.read_deployment_by_name(f"{FLOW_NAME}/{NIGHTLY}").schedules
        except ObjectNotFound:
            current = []
    kept = [
        DeploymentScheduleCreate(
            schedule=s.schedule,
            active=s.active,
            parameters=s.parameters,
            slug=s.slug,
            max_scheduled_runs=s.max_scheduled_runs,
        )
        for s in current
    ]
    ours = [k for k in kept if k.slug == CRON_SLUG]
    older = [
        k for k in kept if k.slug is None and isinstance(k.schedule, CronSchedule) and k.schedule.cron == wanted.cron
    ]
    if ours and cron is not None:
        ours[0].schedule = wanted
    elif not ours and older:
        older[0].slug = CRON_SLUG
    elif not ours:
        kept.append(DeploymentScheduleCreate(schedule=wanted, active=True, slug=CRON_SLUG))
    return kept


def register_servers(deployment: str | None, pool: str, env: dict[str, str]) -> str:
    """Create or update the servers' deployment (``server.deployment``'s name when it names ``grpo-servers``, else
    ``grpo-servers/gpu``) on work pool ``pool``; returns its id."""
    from prefect import flow

    from flows.grpo_servers import DEFAULT_DEPLOYMENT, FLOW_NAME
    from flows.grpo_servers import ENTRYPOINT as SERVERS_ENTRYPOINT

    flow_name, _, name = (deployment or "").partition("/")
    name = name if flow_name == FLOW_NAME else DEFAULT_DEPLOYMENT
    source = flow.from_source(source=str(ROOT), entrypoint=SERVERS_ENTRYPOINT)
    return str(
        source.deploy(
            name=name,
            work_pool_name=pool,
            job_variables={"env": env},
            build=False,
            push=False,
            print_next_steps=False,
            tags=["grpo", "servers"],
            description="generation replicas of a grpo-train run (server.deployment), started "
            "by a worker of this pool on a GPU host",
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m deployments.deploy", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml", help="parameters of the deployments")
    p.add_argument(
        "--cron",
        default=None,
        help=f"schedule of nightly-retrain (UTC); default: keep the deployment's ({DEFAULT_CRON} for a new one)",
    )
    p.add_argument("--pool", default="grpo-process", help="process work pool")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    ids = register(args.config, args.cron, args.pool, args.set)
    print(
        f"registered grpo-train/{DEMO} ({ids[0]}), grpo-train/{NIGHTLY} ({ids[1]}) and the servers' "
        f"deployment ({ids[2]})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
