"""The first step sooner (issue 25, item 6): the trainer loads while the servers start, compile caches persist in the
cache folder, and the run reports its time to first step.

The overlap is asserted from the times the run's processes recorded in the run folder (``startup.jsonl``: the
trainer's own events, the flow's ``servers_healthy``), never from wall-clock bounds: the servers' start waits until
the trainer says it has built its model, so on code that starts the trainer after the servers the trainer never
does, the gate gives up, and the order is the other way round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.config import RunConfig
from grpo_core.run import layout, startup
from grpo_core.run.commands import compile_cache_env, trainer_launch
from grpo_core.tracking.report import summarize

ROOT = Path(__file__).resolve().parents[2]

# The flow, with the servers' start held until the trainer has recorded its built model (or 240 s went by).
GATED_RUN = """
import sys, time
from pathlib import Path

import grpo_core.serving.launch as launch
from grpo_core.run import startup

real = launch.provision


def gated(config, *args, **kwargs):
    run_dir = Path(config.train.output_dir)  # the prepared run config's output folder is the run folder
    deadline = time.monotonic() + 240
    while "policy_built" not in startup.events(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    return real(config, *args, **kwargs)


launch.provision = gated
from flows.cli import main

sys.argv = ["grpo", *sys.argv[1:]]
main()
"""


def test_inputs_are_handed_over_whole_and_a_missing_file_is_waited_for_then_reported_absent(tmp_path):
    path = tmp_path / layout.TRAINER_INPUTS
    assert startup.wait_inputs(path, timeout_s=0.3) is None  # nothing written: the bound ends the wait
    startup.write_inputs(path, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "grpc://127.0.0.1:3")
    assert startup.wait_inputs(path, timeout_s=0.3) == (
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        "grpc://127.0.0.1:3",
    )


def test_each_attempt_starts_its_events_afresh_and_the_first_record_of_an_event_counts(tmp_path):
    startup.begin(tmp_path, 100.0)
    startup.mark(tmp_path, "servers_healthy", "flow", 105.0)
    startup.mark(tmp_path, "servers_healthy", "flow", 107.0)
    assert startup.events(tmp_path) == {"command_start": 100.0, "servers_healthy": 105.0}
    startup.begin(tmp_path, 200.0)  # a retried attempt
    assert startup.events(tmp_path) == {"command_start": 200.0}


def test_the_waiting_budget_covers_every_server_start_attempt_and_the_rollouts_start():
    # startup_timeout_s x (start_retries + 1) + the rollout's 600 s + a minute
    assert startup.inputs_timeout_s(600.0, 1, 600.0) == 600 * 2 + 600 + 60


def test_compile_caches_go_to_the_cache_folder_unless_the_user_set_them(tmp_path):
    cfg = RunConfig(model={"name": "tiny-qwen3", "cache_dir": str(tmp_path / "cache")})
    assert compile_cache_env(cfg, on_gpu=True, environ={}) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "compile" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "compile" / "triton"),
    }
    assert compile_cache_env(cfg, on_gpu=False, environ={}) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "compile" / "inductor")
    }
    assert compile_cache_env(cfg, on_gpu=True, environ={"TORCHINDUCTOR_CACHE_DIR": "/mine"}) == {
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "compile" / "triton")
    }


def test_vllm_replicas_keep_their_compile_cache_in_the_cache_folder_unless_the_user_set_one(tmp_path, monkeypatch):
    from grpo_core.serving.launch import vllm_command

    cfg = RunConfig(model={"name": "tiny-qwen3", "cache_dir": str(tmp_path / "cache")}, server={"backend": "vllm"})
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    assert vllm_command(cfg, port=8000).env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache" / "vllm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/mine")
    assert "VLLM_CACHE_ROOT" not in vllm_command(cfg, port=8000).env  # the child inherits the user's


def test_the_trainer_is_launched_without_servers_and_told_where_its_inputs_will_be(tmp_path, monkeypatch):
    from grpo_core.run.prepare import SECRETS

    # torch's inductor sets TORCHINDUCTOR_CACHE_DIR in the process that compiled (another test of this worker did),
    # and a variable set is the user's: kept, not replaced (the test of compile caches above)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = RunConfig(model={"name": "tiny-qwen3", "cache_dir": str(tmp_path / "cache")})
    cfg.train.output_dir = run_dir
    (run_dir / layout.RUN_CONFIG).write_text(cfg.model_dump_json())
    SECRETS[str(run_dir)] = {}
    try:
        cmd, env = trainer_launch(str(run_dir), log=None)
    finally:
        SECRETS.pop(str(run_dir))
    sub = json.loads((run_dir / layout.TRAIN_CONFIG).read_text())
    assert "--server-url" not in cmd and sub["train"]["rollout_location"] is None
    assert sub["train"]["inputs_path"] == str(run_dir / layout.TRAINER_INPUTS)
    assert sub["train"]["inputs_timeout_s"] == 600 * 2 + 600 + 60  # the defaults: 600 s, one retry
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "compile" / "inductor")


def test_the_summary_reports_the_last_starts_time_to_first_step(tmp_path):
    metrics = tmp_path / layout.METRICS
    lines = [
        {"step": 1, "perf/time_to_first_step_s": 40.0, "reward": 0.5},
        {"step": 2, "reward": 0.5},
        {"step": 3, "perf/time_to_first_step_s": 12.5, "reward": 0.5},  # a resumed start
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert summarize(metrics)["time_to_first_step_s"] == 12.5
    metrics.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    assert summarize(metrics)["time_to_first_step_s"] is None


@pytest.mark.slow  # a whole `grpo train` of configs/tiny.yaml (about a minute on 2 cores)
def test_the_trainer_builds_its_model_before_the_servers_are_healthy(tmp_path, prefect_api):
    # Before: the flow started the trainer only once the servers were healthy and the rollout served.
    script = tmp_path / "gated_run.py"
    script.write_text(GATED_RUN)
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(script), "train", "--config", str(ROOT / "configs" / "tiny.yaml")]
    for override in (
        f"train.output_dir={runs}",
        f"tracking.dir={tmp_path / 'mlflow'}",
        "train.max_steps=2",
        "train.save_steps=2",
        "train.flush_partial_after_s=1",
    ):
        cmd += ["--set", override]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "COLUMNS": "400",
        "OMP_NUM_THREADS": "1",
        **prefect_api.client_env(),
    }
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = layout.run_folders(runs)
    events = startup.events(run_dir)
    assert {"command_start", "trainer_start", "policy_built", "servers_healthy", "first_step"} <= set(events), events
    # the trainer's model was built while the servers were starting, and it trained only once it had its inputs
    assert events["trainer_start"] < events["policy_built"] < events["servers_healthy"]
    assert events["servers_healthy"] < events["rollout_serves"] <= events["inputs_ready"] < events["first_step"]
    # the time to first step it logged and the summary printed is the span its own events bound
    (first,) = [r for r in map(json.loads, (run_dir / layout.METRICS).read_text().splitlines()) if r.get("step") == 1]
    assert first["perf/time_to_first_step_s"] == pytest.approx(events["first_step"] - events["command_start"])
    assert "time to first step" in done.stdout + done.stderr  # the summary table (the console writes to stderr)
