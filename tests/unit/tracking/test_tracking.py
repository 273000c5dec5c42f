"""MLflow tracking (real SQLite store in a temp folder), preflight checks, report and CLI config errors."""

from __future__ import annotations

import importlib
import json
import shutil
import threading
from pathlib import Path

import pytest

from grpo_core import tracking
from grpo_core.config import RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.run import preflight
from grpo_core.tracking import mlflow_sink, report
from grpo_core.tracking.metrics import JsonlSink

ROOT = Path(__file__).resolve().parents[3]


def _cfg(tmp: Path, **tracking_fields) -> RunConfig:
    return RunConfig(
        tracking={"dir": tmp / "mlflow", "experiment_name": "t", **tracking_fields},
        rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4},
    )


def _checkpoint(root: Path, step: int, payload_bytes: int = 10) -> Path:
    path = root / "checkpoints" / f"step-{step:07d}"
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / "data").write_bytes(b"x" * payload_bytes)
    (path / "rollout_state.json").write_text(json.dumps({"step": step, "policy_version": step}))
    return path


def test_run_is_found_by_flow_run_id_and_sink_skips_replayed_steps(tmp_path):
    cfg = _cfg(tmp_path)
    run_id, continued = tracking.start_run(cfg, "flow-1", "demo")
    assert not continued
    assert tracking.start_run(cfg, "flow-1", "demo") == (run_id, True)
    sink = tracking.MlflowSink(cfg.tracking, run_id, inner=JsonlSink(tmp_path / "m.jsonl"))
    for step in (1, 2, 3):
        sink.log(step, {"loss": float(step), "reward": 0.5, "bad": float("nan")})
    sink.on_checkpoint(_checkpoint(tmp_path / "out", 2), 2)
    sink.close()
    resumed = tracking.MlflowSink(cfg.tracking, run_id)  # a trainer resumed from step 2 replays step 3
    assert resumed.skip_through == 3
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    mc = tracking.client(cfg.tracking)
    assert [(m.step, m.value) for m in mc.get_metric_history(run_id, "loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    run = mc.get_run(run_id)
    assert run.data.params["rollout.num_generations"] == "8"
    assert run.data.tags["grpo.latest_checkpoint_step"] == "2"
    assert len(JsonlSink.read(tmp_path / "m.jsonl")) == 3


def test_checkpoint_download_and_large_checkpoint_as_uri(tmp_path):
    cfg = _cfg(tmp_path, checkpoint_artifact_max_mib=0.5)
    run_id, _ = tracking.start_run(cfg, "flow-2")
    tracking.log_checkpoint(cfg.tracking, run_id, _checkpoint(tmp_path / "a", 2))
    got = tracking.download_latest_checkpoint(cfg.tracking, run_id, tmp_path / "b")
    assert got == tmp_path / "b" / "checkpoints" / "step-0000002" and (got / "dcp" / "data").exists()
    big = _checkpoint(tmp_path / "a", 4, payload_bytes=2**20)
    tracking.log_checkpoint(cfg.tracking, run_id, big)
    mc = tracking.client(cfg.tracking)
    names = {a.path.rsplit("/", 1)[-1] for a in mc.list_artifacts(run_id, "checkpoints/step-0000004")}
    assert names == {"rollout_state.json", tracking.CHECKPOINT_URI_FILE}
    got = tracking.download_latest_checkpoint(cfg.tracking, run_id, tmp_path / "c")
    assert got == tmp_path / "c" / "checkpoints" / "step-0000004" and (got / "dcp" / "data").stat().st_size == 2**20


def test_preflight_names_the_missing_column_and_the_bad_model(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match="'prompt' column"):
        preflight.check_run(RunConfig(rollout={"dataset": f"json:{rows}"}))
    with pytest.raises(ConfigError, match="model.name"):
        preflight.check_run(RunConfig(model={"name": "no-such-model"}, rollout={"dataset": f"json:{rows}"}))
    preflight.check_run(load_config(ROOT / "configs" / "tiny.yaml"))


def _leaves(data: dict, prefix: tuple = ()):
    """(path, value) of every leaf of a nested YAML mapping; a list of mappings (e.g. ``rollout.datasets``) is
    descended by index."""
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                yield from _leaves(item, (*prefix, key, i))
        else:
            yield (*prefix, key), value


def test_every_config_file_loads_each_value_it_sets():
    import yaml

    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.name for p in files} >= {"demo.yaml", "tiny.yaml"}
    for path in files:
        cfg, count = load_config(path), 0
        for keys, value in _leaves(yaml.safe_load(path.read_text())):
            loaded = cfg
            for key in keys:
                loaded = loaded[key] if isinstance(loaded, dict | list) else getattr(loaded, key)
            if isinstance(loaded, Path):
                value = Path(value)
            elif isinstance(loaded, tuple):
                loaded = list(loaded)
            assert loaded == value, f"{path.name}: {'.'.join(keys)} = {value!r} in the file, {loaded!r} loaded"
            count += 1
        assert count >= 10, f"{path.name}: only {count} values checked"


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="rollout.num_generations"):
        load_config(ROOT / "configs" / "demo.yaml", ["rollout.num_generations=1"])


def test_report_summary_and_plot(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    sink = JsonlSink(metrics)
    for step in range(1, 11):
        sink.log(
            step,
            {
                "reward": step / 10,
                "perf/step_s": 2.0,
                "batch/trained_tokens_per_step": 100.0,
                "batch/forwarded_tokens_per_step": 300.0,
                "rollout/generated_tokens_per_s": 50.0,
            },
        )
    sink.close()
    summary = report.summarize(metrics)
    assert summary["steps"] == 10 and summary["reward_first5"] == pytest.approx(0.3)
    assert summary["reward_last5"] == pytest.approx(0.8) and summary["trained_tokens_per_s"] == pytest.approx(50.0)
    png = report.plot_reward_curve(metrics, tmp_path / "curve.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_summary_reward_weighs_each_step_by_the_groups_its_window_scored(tmp_path):
    """The demo's last step once logged reward 0 from a window that closed on one group, and counted as a whole
    step in the last-five mean; weighted by groups it counts as one group of the 25 those windows scored."""
    metrics = tmp_path / "metrics.jsonl"
    sink = JsonlSink(metrics)
    for step, (reward, groups) in enumerate([(0.2, 4), (0.4, 4), (0.2, 4), (0.4, 4), (0.2, 4), (0.8, 6), (0.0, 1)], 1):
        sink.log(step, {"reward": reward, "rollout/group_count": float(groups)})
    sink.close()
    summary = report.summarize(metrics)
    # first five: (0.2*4 + 0.4*4 + 0.2*4 + 0.4*4 + 0.2*4) / 20; last five: (0.2*4 + 0.4*4 + 0.2*4 + 0.8*6 + 0*1) / 19
    assert summary["reward_first5"] == pytest.approx(5.6 / 20)
    assert summary["reward_last5"] == pytest.approx(8.0 / 19)


def test_cli_config_error_names_the_field_before_anything_starts():
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(
        app, ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "rollout.num_generations=1"]
    )
    assert result.exit_code == 2
    assert "rollout.num_generations" in result.output


UNSAFE = {
    "loss": 1.0,
    "rewards/<lambda>/mean": 0.5,
    "a//b/": 2.0,
    "/lead": 3.0,
    "x/../y": 4.0,
    "colon:name": 5.0,
    "ünï cödé": 6.0,
    "n" * 300: 7.0,
    "a<b": 8.0,
    "a>b": 9.0,
}
# What each becomes, written out by hand from MLflow's rules (letters, digits, _ - . space /; no empty, "."
# or ".." segment; at most 250 characters); two names that collide are told apart by a suffix.
SAFE = {
    "loss": 1.0,
    "rewards/_lambda_/mean": 0.5,
    "a/b": 2.0,
    "lead": 3.0,
    "x/_/y": 4.0,
    "colon_name": 5.0,
    "ünï cödé": 6.0,
    "n" * 250: 7.0,
    "a_b": 8.0,
    "a_b_2": 9.0,
}


def test_metric_names_mlflow_refuses_are_renamed_once_and_no_metric_is_lost(tmp_path, caplog):
    # Before: one refused name (a lambda reward's) made MLflow refuse the batch, and the step kept no metric.
    cfg = _cfg(tmp_path)
    run_id, _ = tracking.start_run(cfg, "flow-names")
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    with caplog.at_level("WARNING", logger="grpo_core.tracking"):
        sink.log(1, UNSAFE)
        sink.log(2, UNSAFE)
        sink.close()
    mc = tracking.client(cfg.tracking)
    assert mc.get_run(run_id).data.metrics == SAFE
    assert [m.step for m in mc.get_metric_history(run_id, "rewards/_lambda_/mean")] == [1, 2]
    renamed = [r for r in caplog.records if "is logged to MLflow as" in r.getMessage()]
    assert len(renamed) == len(UNSAFE) - 2  # once per renamed name ("loss" and "ünï cödé" are fine)
    assert tracking.last_logged_step(cfg.tracking, run_id) == 2 and sink.num_errors == 0


def test_a_refused_batch_keeps_the_other_metrics_and_the_resume_step(tmp_path, caplog, monkeypatch):
    # A name that reaches MLflow unchanged and is refused there: only that metric is lost.
    from grpo_core.tracking import names

    monkeypatch.setattr(names, "mlflow_safe_name", lambda name: name)  # MetricNames reads it there
    cfg = _cfg(tmp_path)
    run_id, _ = tracking.start_run(cfg, "flow-refused")
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    with caplog.at_level("WARNING", logger="grpo_core.tracking"):
        for step in (1, 2, 3):
            sink.log(step, {"rewards/<lambda>/mean": 0.5, "reward": 0.25 * step} | ({"loss": 1.0} if step < 3 else {}))
        sink.close()
    mc = tracking.client(cfg.tracking)
    assert mc.get_run(run_id).data.metrics == {"reward": 0.75, "loss": 1.0}
    assert [m.step for m in mc.get_metric_history(run_id, "reward")] == [1, 2, 3]
    assert sum("MLflow refuses metric 'rewards/<lambda>/mean'" in r.getMessage() for r in caplog.records) == 1
    assert sink.num_errors == 3
    # Step 3 logged no "loss": the resume point is still step 3 (before: read from "loss", so 2).
    assert tracking.last_logged_step(cfg.tracking, run_id) == 3


def test_only_a_completely_uploaded_checkpoint_is_fetched_and_an_unreachable_one_fails(tmp_path):
    from grpo_core.errors import CheckpointError
    from grpo_core.run.prepare import fetch_checkpoint

    cfg = _cfg(tmp_path, checkpoint_artifact_max_mib=0.5)
    run_id, _ = tracking.start_run(cfg, "flow-3")
    tracking.log_checkpoint(cfg.tracking, run_id, _checkpoint(tmp_path / "a", 2))
    # step 4's upload was cut short: its folder is there, the latest-checkpoint tag still names step 2
    tracking.client(cfg.tracking).log_artifacts(run_id, str(_checkpoint(tmp_path / "a", 4)), "checkpoints/step-0000004")
    got = tracking.download_latest_checkpoint(cfg.tracking, run_id, tmp_path / "b")
    assert got == tmp_path / "b" / "checkpoints" / "step-0000002"
    # a large checkpoint is logged as its URI; on a host where that folder is gone the resume fails loudly
    big = _checkpoint(tmp_path / "a", 6, payload_bytes=2**20)
    tracking.log_checkpoint(cfg.tracking, run_id, big)
    shutil.rmtree(big)
    with pytest.raises(CheckpointError, match=rf"step-0000006 of MLflow run {run_id}.*not reachable"):
        tracking.download_latest_checkpoint(cfg.tracking, run_id, tmp_path / "c")
    resumed = cfg.model_copy(update={"resume_from": run_id})
    with pytest.raises(CheckpointError, match=rf"step-0000006 of MLflow run {run_id}"):
        fetch_checkpoint(resumed, tmp_path / "d", continued=False)
    empty, _ = tracking.start_run(cfg, "flow-4")  # resume_from a run that never finished an upload
    with pytest.raises(CheckpointError, match=rf"resume_from={empty}.*no completely uploaded checkpoint"):
        fetch_checkpoint(cfg.model_copy(update={"resume_from": empty}), tmp_path / "e", continued=False)
    assert fetch_checkpoint(cfg, tmp_path / "f", continued=False) is None  # a fresh run fetches nothing


def test_a_resume_logs_each_step_to_mlflow_once_whatever_the_killed_attempt_uploaded(tmp_path):
    # Found by the flow chaos run: MLflow's system-metrics sampler had logged samples 1..5 over the killed attempts,
    # so the resumed trainer took step 5 for the run's last step and never logged steps 2..5. And a kill can stop
    # the upload queue behind a checkpoint: the steps up to that checkpoint are not replayed, so they were lost too.
    cfg = _cfg(tmp_path)
    run_id, _ = tracking.start_run(cfg, "flow-chaos")
    mc = tracking.client(cfg.tracking)
    first = tracking.MlflowSink(cfg.tracking, run_id)  # the killed attempt: only step 1 reached MLflow
    first.log(1, {"loss": 1.0})
    first.close()
    for sample in range(1, 6):
        mc.log_metric(run_id, "system/cpu_utilization_percentage", 10.0, step=sample)
    assert tracking.last_logged_step(cfg.tracking, run_id) == 1
    # resumed from the step-3 checkpoint: the metrics file (cut back to it) holds steps 1-3
    trained = [{"step": s, "loss": float(s)} for s in (1, 2, 3)]
    resumed = tracking.MlflowSink(cfg.tracking, run_id, trained=trained)
    for step in (4, 5):
        resumed.log(step, {"loss": float(step)})
    resumed.close()
    assert [(m.step, m.value) for m in mc.get_metric_history(run_id, "loss")] == [(s, float(s)) for s in range(1, 6)]


def test_save_total_limit_keeps_a_checkpoint_until_its_upload_is_done_and_the_tag_moved_on(tmp_path, monkeypatch):
    # Checkpoints over checkpoint_artifact_max_mib are logged as their folder's URI: deleting such a folder while
    # the run's latest-checkpoint tag names it leaves MLflow pointing at nothing; deleting one mid-upload leaves a
    # partial copy. Uploads are held here by events (a slow upload) while the trainer's rotation runs.
    from grpo_core.train.trainer import rotate_checkpoints

    cfg = _cfg(tmp_path, checkpoint_artifact_max_mib=0.5)
    run_id, _ = tracking.start_run(cfg, "flow-rotate")
    out = tmp_path / "out"
    release = {2: threading.Event(), 4: threading.Event()}
    started = {2: threading.Event(), 4: threading.Event()}
    uploaded = {2: threading.Event(), 4: threading.Event()}
    real_upload = tracking.log_checkpoint

    def slow_upload(tc, rid, path):
        step = int(Path(path).name[5:])
        started[step].set()
        assert release[step].wait(120), "the test never released the upload"
        real_upload(tc, rid, path)
        uploaded[step].set()

    monkeypatch.setattr(mlflow_sink, "log_checkpoint", slow_upload)  # the sink's upload thread calls it there
    mc = tracking.client(cfg.tracking)
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    try:
        step2 = _checkpoint(out, 2, payload_bytes=2**20)  # over 0.5 MiB: logged as its URI
        sink.on_checkpoint(step2, 2)
        assert rotate_checkpoints(out, 1, step2, sink) == []
        step4 = _checkpoint(out, 4)
        sink.on_checkpoint(step4, 4)
        assert started[2].wait(120)
        assert rotate_checkpoints(out, 1, step4, sink) == [] and step2.is_dir(), "deleted while uploading"
        release[2].set()
        assert uploaded[2].wait(120) and started[4].wait(120)
        assert mc.get_run(run_id).data.tags[tracking.LATEST_STEP_TAG] == "2"
        assert rotate_checkpoints(out, 1, step4, sink) == [] and step2.is_dir(), "deleted while the tag names it"
        release[4].set()
    finally:
        for event in release.values():
            event.set()
        sink.close()
    assert mc.get_run(run_id).data.tags[tracking.LATEST_STEP_TAG] == "4"
    assert rotate_checkpoints(out, 1, None, sink) == [step2] and not step2.exists() and step4.is_dir()
    got = tracking.download_latest_checkpoint(cfg.tracking, run_id, tmp_path / "fresh")
    assert got is not None and got.name == step4.name


def test_the_tracking_package_loads_mlflow_only_when_its_mlflow_api_is_used():
    # The rollout process and every trainer rank import the metric windows (grpo_core.tracking.metrics): they must not
    # pay mlflow's import (about 2 s); the MLflow API re-exported by the package loads it on first use.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import grpo_core.tracking, grpo_core.tracking.metrics, grpo_core.tracking.report\n"
        "assert 'mlflow' not in sys.modules, 'the metric windows imported mlflow'\n"
        "from grpo_core.tracking import MlflowSink, start_run\n"
        "assert 'mlflow' in sys.modules and MlflowSink.__module__ == 'grpo_core.tracking.mlflow_sink'\n"
        "assert start_run.__module__ == 'grpo_core.tracking.runs'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    # Every re-exported name resolves to the object its module defines (none missing from __all__ or the table).
    assert sorted(tracking.__all__) == sorted(tracking._HOME_OF)
    for name in tracking.__all__:
        home = importlib.import_module(f"grpo_core.tracking.{tracking._HOME_OF[name]}")
        assert getattr(tracking, name) is getattr(home, name), name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tracking.no_such_name  # noqa: B018 - the attribute access is the test


def test_grpo_resume_takes_the_runs_config_without_what_belonged_to_that_run(tmp_path):
    # grpo resume RUN_ID (no --config) starts from the run's logged config: its own MLflow run, resume point, rollout
    # location, run folder and server logs are the new run's to choose; everything else is kept.
    cfg = RunConfig(
        tracking={"dir": tmp_path / "mlflow", "experiment_name": "t", "run_id": "an-earlier-run"},
        rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4},
        train={"output_dir": tmp_path / "runs" / "run-1", "rollout_location": "grpc://10.0.0.1:8815"},
        server={"log_dir": tmp_path / "server-logs"},
        resume_from="the-run-before",
    )
    logged = json.loads(cfg.model_dump_json())
    assert logged["train"]["rollout_location"] and logged["tracking"]["run_id"] and logged["resume_from"]  # set up
    run_id, _ = tracking.start_run(cfg, "flow-resume-config")
    got = json.loads(tracking.download_resume_config(cfg.tracking, run_id).read_text())
    assert got["tracking"]["run_id"] is None and got["resume_from"] is None and got["train"]["rollout_location"] is None
    assert got["train"]["output_dir"] == str(tmp_path / "runs")  # the run folder's parent: a new run folder there
    assert got["server"]["log_dir"] == "runs/servers"  # ServerConfig's default
    for section in ("model", "rollout"):
        assert got[section] == logged[section]
    assert RunConfig.model_validate(got).train.output_dir == tmp_path / "runs"  # loads as a run config
