"""Register the deployments of ``grpo-train`` on a process work pool.

``python -m deployments.deploy [--config configs/demo.yaml] [--cron "0 2 * * *"] [--set key=value …]``
against the server ``PREFECT_API_URL`` names (``grpo deploy`` starts one and calls this):

* ``grpo-train/demo``: parameters prefilled from the config file (the UI form shows them);
* ``grpo-train/nightly-retrain``: the same parameters on a cron schedule;
* ``grpo-servers/gpu`` (``flows.grpo_servers``) on the config's ``server.work_pool`` (``grpo-gpu``): the
  generation replicas of a ``grpo-train`` run whose ``server.deployment`` names it, started by a worker of that
  pool (one on each GPU host); it has no parameters of its own (the train flow run passes them).

Python rather than ``prefect.yaml`` because two values are computed here: the parameters
(read and validated from the config file) and the absolute folder the worker runs the flow in.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/grpo_train.py:grpo_train"
DEMO, NIGHTLY = "demo", "nightly-retrain"


def parameters(config: Path, overrides: list[str]) -> dict:
    """The flow's parameters from a config file (validated; JSON-able)."""
    from grpo_core.config import load_config

    return {"config": load_config(config, overrides).model_dump(mode="json")}


def register(config: Path, cron: str, pool: str, overrides: list[str] | None = None) -> list[str]:
    """Create or update both deployments; returns their ids."""
    from prefect import flow
    from prefect.schedules import Cron

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
            schedules=[Cron(cron, timezone="UTC")],
            build=False,
            push=False,
            print_next_steps=False,
            description=f"nightly retraining ({cron} UTC)",
            tags=["grpo", "nightly"],
        ),
    ]
    ids.append(register_servers(server.deployment, server.work_pool, env))
    return [str(i) for i in ids]


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
    p.add_argument("--cron", default="0 2 * * *", help="schedule of nightly-retrain (UTC)")
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
