"""Register the deployments of ``grpo-train`` on a process work pool.

``python -m deployments.deploy [--config configs/demo.yaml] [--cron "0 2 * * *"] [--set key=value …]``
against the server ``PREFECT_API_URL`` names (``grpo deploy`` starts one and calls this):

* ``grpo-train/demo``: parameters prefilled from the config file (the UI form shows them);
* ``grpo-train/nightly-retrain``: the same parameters on a cron schedule.

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

    params = parameters(config, overrides or [])
    source = flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    env = {"PREFECT_LOGGING_EXTRA_LOGGERS": "grpo_core"}
    ids = [
        source.deploy(name=DEMO, work_pool_name=pool, parameters=params, job_variables={"env": env},
                      description=f"grpo-train with the parameters of {config.name}", build=False, push=False,
                      print_next_steps=False, tags=["grpo", "demo"]),
        source.deploy(name=NIGHTLY, work_pool_name=pool, parameters=params, job_variables={"env": env},
                      schedules=[Cron(cron, timezone="UTC")], build=False, push=False, print_next_steps=False,
                      description=f"nightly retraining ({cron} UTC)", tags=["grpo", "nightly"]),
    ]
    return [str(i) for i in ids]


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m deployments.deploy", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml", help="parameters of the deployments")
    p.add_argument("--cron", default="0 2 * * *", help="schedule of nightly-retrain (UTC)")
    p.add_argument("--pool", default="grpo-process", help="process work pool")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    ids = register(args.config, args.cron, args.pool, args.set)
    print(f"registered grpo-train/{DEMO} ({ids[0]}) and grpo-train/{NIGHTLY} ({ids[1]})")  # noqa: T201 - CLI output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
