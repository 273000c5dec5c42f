"""What a failed ``grpo train`` prints (issue 28, item 2): its last lines name the failing task and the cause in
one line, Prefect's failure records of grpo-flow's own errors are one line on the console (their tracebacks in the
command's log file), torchrun's report of a failed rank is one line that keeps the signal's name, and a misspelt
callable gets "did you mean"."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows import console_log
from grpo_core.errors import ConfigError, RolloutProcessError, TrainerError

ROOT = Path(__file__).resolve().parents[2]


def _record(name: str, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = None
    if exc is not None:
        try:
            raise exc
        except BaseException as raised:  # noqa: BLE001 - a real traceback on the record
            exc_info = (type(raised), raised, raised.__traceback__)
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, exc_info)


def _printed(record: logging.LogRecord, log_path: Path | None = None) -> str:
    """What a console handler with Prefect's kind of formatter prints for ``record`` (the traceback included)."""
    formatter = logging.Formatter("%(levelname)s | %(name)s - %(message)s")
    return formatter.format(console_log.short_record(record, log_path) or record)


def test_a_project_failure_is_one_line_on_the_console_and_whole_elsewhere(tmp_path):
    exc = TrainerError("trainer exited with code 1: rank 0: TransportError: stream broke\nlast output:\nline a\nline b")
    record = _record("prefect.task_runs", f"Task run failed with exception: {exc!r} - Retries are exhausted", exc)
    printed = _printed(record, tmp_path / "x.log")
    assert printed.count("\n") == 0 and "Traceback" not in printed, printed
    assert printed == (
        "ERROR | prefect.task_runs - Task run failed with exception: TrainerError: trainer exited with code 1: rank 0: "
        f"TransportError: stream broke - Retries are exhausted (traceback in {tmp_path / 'x.log'})"
    )
    # the record the file and API handlers get is untouched: its traceback and whole message are still there
    whole = logging.Formatter("%(message)s").format(record)
    assert "Traceback (most recent call last)" in whole and "line b" in whole


def test_a_state_message_over_several_lines_is_cut_and_a_foreign_exception_keeps_its_traceback():
    state = _record("prefect.flow_runs", "Finished in state Failed('RolloutProcessError: boom\\nTraceback ...')")
    assert _printed(state) == "ERROR | prefect.flow_runs - Finished in state Failed('RolloutProcessError: boom ...)"
    bug = _record("prefect.task_runs", "Task run failed with exception: KeyError('x')", KeyError("x"))
    assert console_log.short_record(bug) is None
    assert "Traceback (most recent call last)" in _printed(bug)
    child_line = _record("prefect.task_runs", " : Traceback (most recent call last):")  # a child's forwarded line
    assert console_log.short_record(child_line) is None


def test_torchruns_report_of_a_failed_rank_is_one_line_with_the_signals_name():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from grpo_core.run.retry import trainer_failed
    from grpo_core.train.launch import failure_lines

    killed = ProcessFailure(local_rank=0, pid=4242, exitcode=-signal.SIGKILL, error_file="/nonexistent")
    failed = ProcessFailure(local_rank=1, pid=4243, exitcode=1, error_file="/nonexistent")
    lines = failure_lines(ChildFailedError("grpo_core.train", {0: killed, 1: failed}))
    assert lines == [
        "torchrun: rank 0: Signal 9 (SIGKILL) received by PID 4242",
        "torchrun: rank 1 (pid 4243) exited with code 1",
    ]
    # the flow reads the signal's name from these lines
    assert str(trainer_failed(1, "", "\n".join(lines))).startswith(
        "trainer exited with code 1 (a rank, pid 4242, was killed by SIGKILL)"
    )


@pytest.mark.parametrize(
    ("field", "spec", "suggested"),
    [
        (
            "rollout.reward_functions[0]",
            "grpo_core.demo_rewards:even_token_rewrd",
            "grpo_core.demo_rewards:even_token_reward",
        ),
        ("rollout.loop_class", "grpo_core.rollout.loop:RolloutLop", "grpo_core.rollout.loop:RolloutLoop"),
        ("rollout.dataset", "my_data_h28:make_rowz", "my_data_h28:make_rows"),
    ],
)
def test_a_misspelt_callable_gets_did_you_mean(field, spec, suggested, tmp_path, monkeypatch):
    from grpo_core.security.allowlist import import_object

    (tmp_path / "my_data_h28.py").write_text(
        textwrap.dedent(
            """
            from grpo_core.entries import config_entry

            @config_entry("dataset")
            def make_rows(size: int = 4):
                return [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(size)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    allowed = ("grpo_core", "my_data_h28")
    with pytest.raises(ConfigError) as info:
        import_object(spec, field, allowed=allowed)
    assert f"did you mean {suggested}?" in str(info.value) and field in str(info.value)
    assert import_object(suggested, field, allowed=allowed).__name__ == suggested.rpartition(":")[2]


BAD_REWARD = '''
from grpo_core.entries import config_entry


@config_entry("reward")
def short_reward(completion_ids, **_):
    """One value too few: a bug in user code."""
    return [0.5 for _ in completion_ids][:-1]
'''


# Slow tier (a whole `grpo train`, ~42 s on the loaded CI box; the default tier's one is test_honest_runs): the
# default tier keeps its pieces, test_a_project_failure_is_one_line_on_the_console_and_whole_elsewhere (one console
# line, the traceback in the log file) and test_cli's test_a_failed_run_ends_with_what_failed_and_its_root_cause.
@pytest.mark.slow
def test_a_failed_run_ends_with_its_cause_and_prints_no_engine_traceback(tmp_path, prefect_api):
    """A real ``grpo train`` whose reward returns 3 values for 4 rollouts (its flow run on the session's Prefect
    API)."""
    (tmp_path / "badreward.py").write_text(BAD_REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", **prefect_api.client_env()}
    grpo = Path(sys.executable).parent / "grpo"
    done = subprocess.run(
        [
            str(grpo), "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
            "--set", f"train.output_dir={tmp_path / 'runs'}", "--set", f"tracking.dir={tmp_path / 'mlflow'}",
            "--set", "rollout.reward_functions=[badreward:short_reward]", "--set", "train.max_steps=2",
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-6000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines[-2].startswith("grpo train failed: RolloutProcessError: rollout process failed"), lines[-10:]
    assert "reward function 'short_reward' returned 3 rewards for a group of 4 rollouts" in lines[-2]
    logs = list((tmp_path / "runs" / "logs").glob("grpo-train-*.log"))
    assert len(logs) == 1 and lines[-1].startswith(f"(tracebacks: {logs[0]};"), (lines[-1], logs)
    # the task that failed is named in one line above
    assert any("Task run 'rollout-" in line and "RolloutProcessError: rollout process failed" in line for line in lines)
    # no frame of Prefect's engine or of torchrun's launcher on the console, nothing chained to another failure
    for noise in ("prefect/task_engine.py", "prefect/flow_engine.py", "torch/distributed/launcher", "During handling"):
        assert noise not in output, noise
    # ... and all of it in the log file
    text = logs[0].read_text()
    assert "prefect/task_engine.py" in text and "Traceback (most recent call last)" in text
    assert RolloutProcessError.__name__ in text


def test_a_trainer_that_recorded_no_error_is_reported_with_the_last_exception_of_its_output():
    """A rank can end by an exception the trainer does not record (DCP's CheckpointException is no Exception):
    the flow's message then names the last exception line of torchrun's output, not only the exit code."""
    from grpo_core.run.retry import trainer_failed

    tail = "\n".join(
        [
            ": Traceback (most recent call last):",
            ':   File "x.py", line 1, in save',
            ": torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0])",
            ": Traceback (most recent call last): (RANK 0)",
            ": RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598",
            "E1205 12:08:49.652000 23083 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1)",
            "torchrun: rank 0 (pid 23152) exited with code 1",
        ]
    )
    first = str(trainer_failed(1, "", tail)).splitlines()[0]
    assert (
        first
        == "trainer exited with code 1: RuntimeError: unexpected pos 704 vs 598 (the last exception in its output)"
    )
    # a recorded error still comes first, and a killed rank is still named by its signal
    assert str(trainer_failed(1, "rank 0: DiskFullError: no space", tail)).startswith(
        "trainer exited with code 1: rank 0: DiskFullError: no space"
    )
    assert str(trainer_failed(1, "", "torchrun: rank 0: Signal 9 (SIGKILL) received by PID 7")).splitlines()[0] == (
        "trainer exited with code 1 (a rank, pid 7, was killed by SIGKILL)"
    )


def test_a_trainer_ended_by_a_base_exception_records_it_for_the_flow(tmp_path, monkeypatch):
    """DCP's CheckpointException derives from BaseException: the trainer records it like any failure (the flow
    quotes trainer_error.txt as the cause); a Ctrl-C is not recorded."""
    import grpo_core.train.__main__ as entry
    import grpo_core.train.run as run_module
    from grpo_core.tracking.report import read_trainer_error

    class LikeCheckpointException(BaseException):
        pass

    def fail(cfg, server_urls):
        raise LikeCheckpointException("ranks: [0]")

    monkeypatch.setattr(run_module, "run_trainer", fail)
    monkeypatch.setattr("grpo_core.run.lifeline.watch", lambda parent=False: None)
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", f"train.output_dir={tmp_path}"]
    with pytest.raises(LikeCheckpointException):
        entry.main(args)
    assert read_trainer_error(tmp_path) == "rank 0: LikeCheckpointException: ranks: [0]"

    def interrupted(cfg, server_urls):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_trainer", interrupted)
    (tmp_path / "trainer_error.txt").unlink()
    with pytest.raises(KeyboardInterrupt):
        entry.main(args)
    assert read_trainer_error(tmp_path) == ""
