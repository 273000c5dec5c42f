"""The deployments ``grpo deploy`` registers, against a real Prefect API (the session's ``prefect_api``, which holds
no other deployment: the other tests run their flows directly):

* a schedule added in the UI survives the next registration (every ``grpo deploy`` start), and the cron schedule
  that ``--cron`` manages changes only when ``--cron`` is given (issue 28, item 6);
* nightly runs that piled up while no worker ran make one catch-up run: the first to start takes the deployment's
  one slot, every other is Cancelled by Prefect's own orchestration (issue 26, item 12).

The runs are taken the way a worker takes them: a proposed Pending state for each, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from flows.cli import set_env_defaults
set_env_defaults()
from flows.local_api import start_local_api
start_local_api()
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.schedules import IntervalSchedule
from prefect.states import Pending, Scheduled
from deployments.deploy import NIGHTLY, register

config, overrides = Path(sys.argv[1]), sys.argv[2:]
out = {}

def schedules(client, deployment_id):
    d = client.read_deployment(deployment_id)
    return sorted(  # [slug or "", cron or "", interval in s or 0]
        [s.slug or "", getattr(s.schedule, "cron", None) or "",
         s.schedule.interval.total_seconds() if getattr(s.schedule, "interval", None) else 0] for s in d.schedules
    )

with get_client(sync_client=True) as client:
    for pool in ("grpo-process", "grpo-gpu"):  # train runs; the servers' deployment (server.work_pool)
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    nightly = register(config, None, "grpo-process", overrides)[1]
    out["first"] = schedules(client, nightly)
    d = client.read_deployment(nightly)
    out["limit"] = d.global_concurrency_limit.limit if d.global_concurrency_limit else None
    out["strategy"] = str(d.concurrency_options.collision_strategy.value) if d.concurrency_options else None
    # what the UI's "+ Schedule" does: a schedule without a slug
    client.create_deployment_schedules(nightly, [(IntervalSchedule(interval=timedelta(hours=6)), True)])
    register(config, None, "grpo-process", overrides)
    out["kept"] = schedules(client, nightly)
    register(config, "30 3 * * *", "grpo-process", overrides)
    out["changed"] = schedules(client, nightly)
    # three nights missed: runs scheduled in the past, then a worker takes them one after another
    past = datetime.now(timezone.utc) - timedelta(days=3)
    runs = [
        client.create_flow_run_from_deployment(nightly, state=Scheduled(scheduled_time=past + timedelta(days=i)))
        for i in range(3)
    ]
    out["taken"] = []
    for run in runs:
        client.set_flow_run_state(run.id, Pending())
        state = client.read_flow_run(run.id).state
        out["taken"].append([state.type.value, state.message])
print("RESULT " + json.dumps(out))
"""


def test_ui_schedules_survive_registration_and_missed_nights_make_one_catch_up_run(tmp_path, prefect_api):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "OMP_NUM_THREADS": "1",
        **prefect_api.client_env(),
    }
    overrides = [f"train.output_dir={tmp_path / 'runs'}", f"tracking.dir={tmp_path / 'mlflow'}"]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "configs" / "tiny.yaml"), *overrides],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (done.stdout + done.stderr)[-6000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))

    # a new deployment: the default cron (02:00 UTC), under the slug --cron manages
    assert out["first"] == [["grpo-cron", "0 2 * * *", 0]], out
    # registered again without --cron: the UI's 6-hour schedule and the cron both kept as they were
    assert out["kept"] == [["", "", 6 * 3600.0], ["grpo-cron", "0 2 * * *", 0]], out
    # --cron changes its own schedule only
    assert out["changed"] == [["", "", 6 * 3600.0], ["grpo-cron", "30 3 * * *", 0]], out

    # one slot, and a run meeting a full slot is cancelled (not queued to run after)
    assert out["limit"] == 1 and out["strategy"] == "CANCEL_NEW", out
    states = [state for state, _ in out["taken"]]
    assert states == ["PENDING", "CANCELLED", "CANCELLED"], out["taken"]
    assert all("concurrency limit" in (message or "") for _, message in out["taken"][1:]), out["taken"]
