"""The grpo-train flow retries only failures a retry can cure (``grpo_core.run.retry.retry_can_cure``).

A deterministic failure (bad config met inside the flow, nothing to train, a refused resume, user code that
raises) used to be retried by ``@flow(retries=1)``: the retry met the same error and printed its tracebacks again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from grpo_core.errors import (
    ChildDiedError,
    ConfigError,
    NothingToTrainError,
    PortInUseError,
    RolloutError,
    RolloutProcessError,
    ServerUnavailableError,
    TrainerError,
    TransportError,
    UserCodeError,
)
from grpo_core.run.retry import raise_if_rollout_failed, retry_can_cure, rollout_failed, trainer_failed

ROOT = Path(__file__).resolve().parents[2]


def test_deterministic_errors_are_not_retried_and_transient_ones_are():
    for exc in (
        ConfigError("train.max_steps"),
        NothingToTrainError("no step"),
        UserCodeError("reward raised"),
        TypeError("bad call"),
        ModuleNotFoundError("no module"),
    ):
        assert not retry_can_cure(exc), exc
    for exc in (
        TransportError("rollout unreachable"),
        ServerUnavailableError("503"),
        PortInUseError("port"),
        TimeoutError("slow"),
        ConnectionResetError(),
        ChildDiedError("server replica 0 exited with -9"),
    ):
        assert retry_can_cure(exc), exc
    # The trainer's own record (`rank R: Type: message`, grpo_core.tracking.report.write_trainer_error) decides for it.
    assert not retry_can_cure(TrainerError("exit 1", ["NothingToTrainError"]))
    assert not retry_can_cure(TrainerError("exit 1", ["TransportError", "ConfigError"]))
    assert retry_can_cure(TrainerError("exit 1", ["TransportError"]))
    assert retry_can_cure(TrainerError("killed by SIGKILL, nothing recorded"))


def test_the_rollout_process_traceback_names_its_cause(tmp_path):
    error_file = tmp_path / "rollout_error.txt"
    for exc, curable in ((ConfigError("rollout.dataset: no such file"), False), (TransportError("gone"), True)):
        try:
            raise exc
        except Exception:  # noqa: BLE001 - the rollout process writes its traceback like this
            error_file.write_text(traceback.format_exc())
        try:
            raise_if_rollout_failed(error_file, tmp_path / "rollout.log", "exited with code 1")
        except RolloutProcessError as err:
            assert err.causes == [f"grpo_core.errors.{type(exc).__name__}"]
            assert retry_can_cure(err) is curable
        else:
            raise AssertionError("no RolloutProcessError")


def test_a_failure_raised_from_a_deterministic_one_is_not_retried_however_wrapped():
    try:
        try:
            raise UserCodeError("reward raised")
        except UserCodeError as cause:
            raise TransportError("the sample stream broke") from cause
    except TransportError as wrapped:
        assert not retry_can_cure(wrapped), "the root cause (user code) decides, not the transport error"
    try:
        try:
            raise KeyError("handled nearby")
        except KeyError:
            raise TransportError("gone") from None
    except TransportError as unrelated:
        assert retry_can_cure(unrelated), "an exception merely handled nearby is not a cause"


def test_the_rollouts_recorded_failure_is_the_root_cause_of_the_trainers(tmp_path):
    """The trainer sees a failed rollout only as a broken sample stream (TransportError, curable); the rollout's own
    record (a reward returning the wrong number of values: RolloutError) must decide: one attempt."""
    trainer = trainer_failed(1, "rank 0: grpo_core.errors.TransportError: stream broke", "...")
    assert retry_can_cure(trainer)
    rollout_failed(tmp_path, trainer)  # nothing recorded: nothing raised
    try:
        raise RolloutError("reward_fn returned 3 values for 4 completions")
    except RolloutError:
        (tmp_path / "rollout_error.txt").write_text(traceback.format_exc())
    try:
        rollout_failed(tmp_path, trainer)
    except RolloutProcessError as err:
        assert err.__context__ is trainer and err.__cause__ is None and err.causes == ["grpo_core.errors.RolloutError"]
        assert not retry_can_cure(err)
        assert "reward_fn returned 3 values" in str(err)
    else:
        raise AssertionError("the rollout's recorded failure was not raised")


def test_a_killed_trainer_is_reported_with_the_signal():
    assert str(trainer_failed(-9, "", "tail")).startswith("trainer was killed by SIGKILL")
    tail = "exitcode  : -9 (pid: 4242)\nerror_file: <N/A>\ntraceback : Signal 9 (SIGKILL) received by PID 4242"
    message = str(trainer_failed(1, "", tail))
    assert message.startswith("trainer exited with code 1 (a rank, pid 4242, was killed by SIGKILL)"), message


SCRIPT = """
import json, sys
from flows.cli import set_env_defaults
set_env_defaults()
from flows.local_api import start_local_api
start_local_api()
from prefect.client.orchestration import get_client
from flows.grpo_train import grpo_train
from grpo_core.config import load_config
cfg = load_config(sys.argv[1], sys.argv[2:])
state = grpo_train(cfg, return_state=True)
with get_client(sync_client=True) as client:
    run = client.read_flow_run(state.state_details.flow_run_id)
print("RESULT " + json.dumps({"state": state.type.value, "run_count": run.run_count,
                              "retries": run.empirical_policy.retries, "message": state.message}))
"""


def test_a_config_error_met_inside_the_flow_ends_after_one_attempt(tmp_path, prefect_api):
    # The CLI's own checks run before the flow; calling the flow directly meets the error in its prepare task.
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "OMP_NUM_THREADS": "1",
        "PREFECT_LOGGING_LEVEL": "INFO",
        **prefect_api.client_env(),  # the session's Prefect API: the flow run's count is read from there
    }
    overrides = [
        f"train.output_dir={tmp_path / 'runs'}",
        f"tracking.dir={tmp_path / 'mlflow'}",
        "rollout.reward_functions=[no_such_module_anywhere:reward]",
    ]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "configs" / "tiny.yaml"), *overrides],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["state"] == "FAILED", result
    assert result["run_count"] == 1, ("the deterministic failure was retried", result, output[-4000:])
    assert "ConfigError" in result["message"] and "no_such_module_anywhere" in result["message"]
    assert "not retrying the flow run: ConfigError" in output
    assert output.count("Retrying") == 0 and "AwaitingRetry" not in output
