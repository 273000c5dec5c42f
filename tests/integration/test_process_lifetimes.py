"""Processes never outlive their run, and a child's death ends the attempt (issue 10 item 6).

The children are the real entry points (embedded server, rollout process, torchrun and its rank in its own
session) started by the flow's own launch functions; every test collects the pids before the kill and
asserts that none lives after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from flow_helpers import grpo_train_command
from trainer_helpers import ROOT, trainer_config, write_samples
from waiting import wait_until

from grpo_core.rollout.process import start_rollout_process
from grpo_core.run.lifeline import interruptible
from grpo_core.run.processes import RunProcesses, child_env, stream, wait_child, watch_servers
from grpo_core.security.auth import TOKEN_ENV

DEATH_BOUND_S = 30  # the lifeline polls every 0.5 s; the bound only absorbs a loaded CI machine


def _config(tmp_path: Path) -> Path:
    server = {"backend": "embedded", "port": 0, "embedded_num_threads": 1, "log_dir": str(tmp_path / "servers")}
    return trainer_config(
        tmp_path, write_samples(tmp_path / "samples.arrow", 64), server, max_steps=10_000, save_steps=10_000
    )


def _rank(torchrun: psutil.Process, timeout_s: float = 240) -> psutil.Process:
    """The trainer rank torchrun started (it has its own session: torch 2.11)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ranks = [p for p in torchrun.children(recursive=True) if "grpo_core.train" in " ".join(p.cmdline())]
        if ranks:
            return ranks[0]
        time.sleep(0.2)
    raise AssertionError("torchrun started no rank")


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # it ended meanwhile
        return ""


def _named(procs: list[psutil.Process], marker: str) -> psutil.Process:
    (proc,) = [p for p in procs if marker in _cmdline(p)]
    return proc


@pytest.mark.slow  # real servers, rollout and trainer started and killed
def test_every_child_dies_with_its_sigkilled_flow_process(tmp_path):
    # Before: every child ran in its own session with no watchdog: all of them outlived the killed flow.
    owner = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "run_owner.py"), str(_config(tmp_path))],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    parent = psutil.Process(owner.pid)
    deadline = time.monotonic() + 60
    while len(parent.children()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    children = parent.children()
    torchrun = _named(children, "grpo_core.train.launch")
    rank = _rank(torchrun)
    server, rollout = _named(children, "serving.embedded"), _named(children, "grpo_core.rollout")
    run = [server, rollout, torchrun, rank]
    assert all(p.is_running() for p in run) and os.getsid(rank.pid) != os.getsid(torchrun.pid), "the hard case"
    owner.kill()
    owner.wait()
    _, alive = psutil.wait_procs(run, timeout=DEATH_BOUND_S)
    assert not alive, f"outlived the flow process: {[p.cmdline()[:3] for p in alive]}"


def _start_trainer(config: Path, procs: RunProcesses, result: dict) -> threading.Thread:
    """torchrun of the offline trainer, as the flow's ``train`` task streams it (registered in ``procs``)."""
    cmd = [
        sys.executable,
        "-m",
        "grpo_core.train.launch",
        "--nproc-per-node",
        "1",
        "-m",
        "grpo_core.train",
        "--config",
        str(config),
    ]
    env = child_env({TOKEN_ENV: procs.token, "OMP_NUM_THREADS": "1"})
    trainer = threading.Thread(
        target=lambda: result.update(code=stream(cmd, logging.getLogger("t"), "", env, register=procs)[0])
    )
    trainer.start()
    return trainer


def _assert_stopped(trainer: threading.Thread, result: dict, run: list[psutil.Process]) -> None:
    trainer.join(timeout=DEATH_BOUND_S * 2)
    assert not trainer.is_alive(), "the trainer was not stopped"
    assert result["code"] != 0
    _, alive = psutil.wait_procs(run, timeout=DEATH_BOUND_S)
    assert not alive


@pytest.mark.slow  # real servers, rollout and trainer started and killed
def test_a_sigkilled_rollout_process_stops_the_trainer_at_once(tmp_path):
    # Before: nothing watched the rollout process; the trainer noticed only after rollout_worker_timeout_s.
    config, procs, result = _config(tmp_path), RunProcesses(), {}
    trainer = _start_trainer(config, procs, result)
    env = child_env({TOKEN_ENV: procs.token, "OMP_NUM_THREADS": "1"})
    rollout = start_rollout_process(config, ["http://127.0.0.1:9"], tmp_path, env=env).process
    procs.processes.append(rollout)
    threading.Thread(target=wait_child, args=(rollout, procs, "rollout"), daemon=True).start()
    wait_until(lambda: len(procs.processes) >= 2, "the trainer's torchrun to join the run's processes", 120, 0.1)
    torchrun = psutil.Process(next(p for p in procs.processes if p is not rollout).pid)
    run = [torchrun, _rank(torchrun), psutil.Process(rollout.pid)]
    assert all(p.is_running() for p in run)
    os.kill(rollout.pid, signal.SIGKILL)
    _assert_stopped(trainer, result, run)
    assert procs.failure == f"the rollout process {rollout.pid} exited with code -9"


@pytest.mark.slow  # real servers, rollout and trainer started and killed
def test_a_sigkilled_generation_server_stops_the_trainer_at_once(tmp_path):
    # Before: nothing watched the servers the flow started; the trainer's weight update retried a dead server for
    # server.control_timeout_s (60 s) and the rollout's requests for rollout.max_retries before the attempt failed.
    from grpo_core.config import load_config
    from grpo_core.serving.launch import embedded_command, launch

    config, procs, result = _config(tmp_path), RunProcesses(), {}
    server = launch(embedded_command(load_config(config, []), 0), procs.token)
    procs.servers.append(server)
    watch_servers(procs)
    trainer = _start_trainer(config, procs, result)
    wait_until(lambda: procs.processes, "the trainer's torchrun to join the run's processes", 120, 0.1)
    torchrun = psutil.Process(procs.processes[0].pid)
    run = [torchrun, _rank(torchrun)]
    assert server.process.poll() is None and all(p.is_running() for p in run)
    os.kill(server.process.pid, signal.SIGKILL)
    _assert_stopped(trainer, result, run)
    assert procs.failure == f"the generation server embedded replica 0 process {server.process.pid} exited with code -9"
    assert procs.failure_log == server.spec.log_path


CHILD = """
import sys, threading, time
from grpo_core.run import lifeline  # an entry point imports it first: the parent is recorded now
from grpo_core.rollout.process import _linger
print("ready", flush=True)
time.sleep(2)  # the parent exits meanwhile: this process is re-parented
_linger(threading.Event(), None)
open(sys.argv[1], "w").write("returned")
"""


def test_rollout_linger_returns_when_its_parent_died_before_it_began(tmp_path):
    # Before: _linger read os.getppid() when it began, after the re-parenting, and served forever.
    out = tmp_path / "linger.txt"
    spawn = (
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
        "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True); p.stdout.readline(); print(p.pid)"
    )
    done = subprocess.run(
        [sys.executable, "-c", spawn, CHILD, str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    child = psutil.Process(int(done.stdout))
    try:
        child.wait(timeout=60)
    finally:
        if child.is_running():
            child.kill()
    assert out.read_text() == "returned"


def _trained_steps(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in out.glob("*/metrics.jsonl"))


@pytest.mark.slow  # a whole `grpo train`
def test_ctrl_c_of_grpo_train_records_the_crash_and_ends_every_process(tmp_path):
    # Ctrl-C in a terminal is SIGINT to the whole foreground process group. Before: Prefect's temporary API server
    # was in that group, died first, and the flow retried its final state on the dead API for minutes (seen on
    # the H200: a stopped run needed SIGKILL, 60 s after SIGTERM to the group).
    out = tmp_path / "runs"
    cmd = grpo_train_command(tmp_path, "train.max_steps=10000", "rollout.num_epochs=null")  # its runs: `out`
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "COLUMNS": "400",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PREFECT_API_URL", None)  # the command's own temporary API server is the case
    procs: list[psutil.Process] = []
    with (tmp_path / "cli.log").open("w") as log:
        # It leads its group and takes SIGINT's default action, as a terminal's foreground job does (a background
        # job of a script, e.g. a CI runner's, inherits SIGINT ignored, and Python keeps it ignored).
        cli = subprocess.Popen(
            cmd,
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=interruptible,
        )
        try:
            deadline = time.monotonic() + 300
            while _trained_steps(out) < 1 and cli.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _trained_steps(out) >= 1, "no step was trained before the interrupt"
            procs = psutil.Process(cli.pid).children(recursive=True)
            (api,) = [p for p in procs if "prefect.server.api.server:create_app" in _cmdline(p)]
            assert os.getsid(api.pid) != os.getsid(cli.pid), "the API server must be out of the terminal's group"
            assert any("grpo_core.train" in _cmdline(p) for p in procs), "the trainer runs at the interrupt"
            os.killpg(cli.pid, signal.SIGINT)
            code = cli.wait(timeout=60)  # before: still retrying after 100 s
        finally:
            if cli.poll() is None:
                os.killpg(cli.pid, signal.SIGKILL)
                cli.wait()
            _, alive = psutil.wait_procs(procs, timeout=DEATH_BOUND_S)
            survivors = [_cmdline(p)[:200] for p in alive]
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
    output = " ".join((tmp_path / "cli.log").read_text(errors="replace").split())
    assert code == 130, output[-3000:]
    assert "Flow run" in output and "Finished in state Crashed" in output, output[-3000:]
    assert "Stopping temporary server" in output
    assert not survivors, f"outlived the interrupted command: {survivors}"


API_OWNER = """
import sys, time
from flows.cli import set_env_defaults
set_env_defaults()  # as every grpo command does: the API's start-up timeout (240 s) covers a loaded machine
from flows.local_api import start_local_api
print(start_local_api(), flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # real servers, rollout and trainer started and killed
def test_the_temporary_prefect_api_dies_with_its_sigkilled_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    owner = subprocess.Popen(
        [sys.executable, "-c", API_OWNER], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        url = owner.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        (api,) = psutil.Process(owner.pid).children(recursive=True)
        assert "grpo_core.run.lifeline" in api.cmdline() and os.getsid(api.pid) == api.pid, api.cmdline()
    finally:
        owner.kill()
        owner.wait()
    _, alive = psutil.wait_procs([api], timeout=DEATH_BOUND_S)
    assert not alive, "Prefect's temporary API server outlived the SIGKILLed command"
