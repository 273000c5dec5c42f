"""The ``grpo`` command line: --version, config schema/show, validate; ``--set`` on the trainer entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_own_folder(tmp_path, monkeypatch):
    """Each test runs in its own folder: the relative folders of a config (configs/tiny.yaml's runs/tiny, the
    default tracking.dir runs/mlflow), which ``validate`` checks by creating them, land under ``tmp_path``, never in
    the checkout that other tests and xdist workers share."""
    monkeypatch.chdir(tmp_path)


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_version_names_this_package_and_the_pinned_libraries():
    result = _invoke("--version")
    assert result.exit_code == 0
    text = result.output.strip()
    assert text.startswith("grpo-flow ")
    for lib in ("torch", "transformers", "prefect", "mlflow"):
        assert f"{lib} {version(lib)}" in text


def test_config_schema_accepts_every_shipped_config_and_rejects_bad_values():
    result = _invoke("config", "schema")
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert {"model", "server", "rollout", "packing", "train", "tracking"} <= set(schema["properties"])
    for path in [*(ROOT / "configs").glob("*.yaml")]:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    bad = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    bad.setdefault("rollout", {})["num_generations"] = 1  # G must be >= 2
    with pytest.raises(jsonschema.ValidationError, match="minimum"):
        jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        jsonschema.validate({"train": {"max_stepz": 3}}, schema)


def test_config_show_applies_overrides():
    result = _invoke("config", "show", "--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "train.max_steps=7")
    assert result.exit_code == 0
    assert json.loads(result.output)["train"]["max_steps"] == 7


def test_validate_passes_a_good_config_and_names_a_missing_column_without_starting_anything(tmp_path):
    runs, mlflow_dir = tmp_path / "runs", tmp_path / "mlflow"
    where = [f"train.output_dir={runs}", f"tracking.dir={mlflow_dir}"]
    ok = _invoke("validate", "--config", str(ROOT / "configs" / "tiny.yaml"), *sum((["--set", w] for w in where), []))
    assert ok.exit_code == 0, ok.output
    assert "valid" in ok.output
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    bad = _invoke(
        "validate",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--set",
        f"rollout.dataset=json:{rows}",
        *sum((["--set", w] for w in where), []),
    )
    assert bad.exit_code == 2
    assert "'prompt' column" in bad.output
    # Nothing runs and nothing is made: no run folder, no MLflow store (only that the run could make them).
    assert not runs.exists(), "validate created train.output_dir"
    assert not mlflow_dir.exists(), "validate created the MLflow store"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for field in ("train.output_dir", "tracking.dir"):
        cannot = _invoke(
            "validate",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            *sum((["--set", w] for w in where), []),
            "--set",
            f"{field}={blocker / 'below'}",
        )
        assert cannot.exit_code == 2 and f"{blocker} is a file" in " ".join(cannot.output.split()), cannot.output
        assert ("train.output_dir" if field == "train.output_dir" else "tracking.dir") in cannot.output
    assert not runs.exists() and not mlflow_dir.exists()


def test_validate_names_a_mixtures_sources_and_weights_in_its_summary(tmp_path):
    # a mixture leaves rollout.dataset unset: the summary said "dataset None"
    math_rows, code_rows = tmp_path / "math.jsonl", tmp_path / "code.jsonl"
    for path in (math_rows, code_rows):
        path.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    mixture = f"[{{path: {math_rows}, weight: 3}}, {{path: {code_rows}, weight: 1, name: coding}}]"
    where = [f"train.output_dir={tmp_path / 'runs'}", f"tracking.dir={tmp_path / 'mlflow'}"]
    sets = ["rollout.dataset=null", f"rollout.datasets={mixture}", *where]
    ok = _invoke("validate", "--config", str(ROOT / "configs" / "tiny.yaml"), *sum((["--set", w] for w in sets), []))
    assert ok.exit_code == 0, ok.output
    line = " ".join(ok.output.split())  # rich wraps long lines
    # shares from the weights: 3 / (3 + 1) and 1 / (3 + 1); names from the file stem and from `name`
    assert "dataset mixture of math (weight 3, 75%), coding (weight 1, 25%)" in line, line
    assert "dataset None" not in line


def test_validate_opens_an_existing_store_read_only_whatever_its_path(tmp_path):
    """An existing MLflow store is opened read-only by ``grpo validate`` (nothing written), also below a folder whose
    name holds URI characters (a raw ``file:`` URI cut the path at the '?' and created a stray database)."""
    import sqlite3

    from grpo_core.errors import ConfigError
    from grpo_core.run.stores import check_sqlite

    folder = tmp_path / "runs ?#%20"
    folder.mkdir()
    db = folder / "mlflow.db"
    sqlite3.connect(db).close()
    before = db.stat().st_mtime_ns
    check_sqlite(db, "tracking.dir", create=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs ?#%20"]
    assert sorted(p.name for p in folder.iterdir()) == ["mlflow.db"] and db.stat().st_mtime_ns == before
    db.write_bytes(b"not a database" * 100)
    with pytest.raises(ConfigError, match="tracking.dir: cannot open the SQLite database"):
        check_sqlite(db, "tracking.dir", create=False)


def test_validate_finds_the_resume_from_run_without_touching_the_store(tmp_path):
    """``grpo validate --set resume_from=ID`` looks the run up read-only: an MLflow client would make the store's lock
    file and migrate its schema. A run the store lacks, a run that finished no checkpoint upload (``grpo resume``
    of it used to start a flow and an MLflow run, then fail), and a store that does not exist, are named."""
    import mlflow

    store = tmp_path / "mlflow"
    store.mkdir()
    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiment = client.create_experiment("e")
    run_id = client.create_run(experiment).info.run_id
    client.set_tag(run_id, "grpo.latest_checkpoint_step", "2")  # what tracking.log_checkpoint sets after an upload
    unfinished = client.create_run(experiment).info.run_id  # stopped before its first checkpoint
    before = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    where = ["--set", f"train.output_dir={tmp_path / 'runs'}", "--set", f"tracking.dir={store}"]
    tiny = str(ROOT / "configs" / "tiny.yaml")
    ok = _invoke("validate", "--config", tiny, *where, "--set", f"resume_from={run_id}")
    assert ok.exit_code == 0, ok.output
    missing = _invoke("validate", "--config", tiny, *where, "--set", "resume_from=0123456789abcdef0123456789abcdef")
    assert missing.exit_code == 2 and "no such run in the MLflow store" in " ".join(missing.output.split())
    early = _invoke("validate", "--config", tiny, *where, "--set", f"resume_from={unfinished}")
    assert early.exit_code == 2 and "has no completely uploaded checkpoint" in " ".join(early.output.split())
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == before, "validate wrote to the store"
    elsewhere = _invoke(
        "validate", "--config", tiny, "--set", f"tracking.dir={tmp_path / 'none'}", "--set", f"resume_from={run_id}"
    )
    assert elsewhere.exit_code == 2 and "no such run" in " ".join(elsewhere.output.split())
    assert not (tmp_path / "none").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("folder", ["runs?x/mlflow", "runs%20x/mlflow"])
def test_a_tracking_dir_the_sqlite_url_cannot_carry_is_refused(folder, tmp_path):
    from pydantic import ValidationError

    from grpo_core.config import RunConfig

    with pytest.raises(ValidationError, match=r"tracking.dir: .* holds a '\?' or '%'"):
        RunConfig.model_validate({"tracking": {"dir": str(tmp_path / folder)}})


def test_trainer_entry_point_takes_set_overrides(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "grpo_core.train",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--set",
        "train.max_steps=0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert "train.max_steps" in done.stderr


def test_train_and_resume_refuse_a_bad_config_before_any_flow_or_mlflow_run(tmp_path):
    """A problem only the flow's ``prepare`` found (a reward function that does not exist, a ``resume_from`` run the
    store lacks) used to start the flow, fail it on every retry with pages of tracebacks and exit 1, leaving MLflow
    runs RUNNING; it is a config error, exit 2, before anything starts."""
    runs, mlflow_dir = tmp_path / "runs", tmp_path / "mlflow"
    where = sum((["--set", w] for w in (f"train.output_dir={runs}", f"tracking.dir={mlflow_dir}")), [])
    tiny = str(ROOT / "configs" / "tiny.yaml")
    bad_reward = _invoke(
        "train", "--config", tiny, *where, "--set", "rollout.reward_functions=[grpo_core.demo_rewards:no_such_reward]"
    )
    assert bad_reward.exit_code == 2, bad_reward.output
    assert "rollout.reward_functions" in bad_reward.output and "Traceback" not in bad_reward.output
    for args in (
        ("resume", "0123456789abcdef", "--config", tiny),
        ("validate", "--config", tiny, "--set", "resume_from=0123456789abcdef"),
    ):
        result = _invoke(*args, *where)
        assert result.exit_code == 2, result.output
        assert "resume_from='0123456789abcdef'" in result.output and "no such run" in result.output
    own_config = _invoke("resume", "0123456789abcdef", *where)  # the run's own config is fetched from MLflow
    assert own_config.exit_code == 2, own_config.output
    assert "'0123456789abcdef'" in own_config.output and "Traceback" not in own_config.output
    assert not [p for p in runs.glob("*") if p.is_dir()], "a run folder was made"
    from mlflow import MlflowClient

    store = f"sqlite:///{mlflow_dir / 'mlflow.db'}"
    if (mlflow_dir / "mlflow.db").exists():
        assert not MlflowClient(store).search_runs([e.experiment_id for e in MlflowClient(store).search_experiments()])


@pytest.mark.parametrize(
    "args, says",
    [
        (("deploy", "--port", "99999"), "--port"),
        (("deploy", "--gpu-slots", "0"), "--gpu-slots"),
        (("deploy", "--cron", "not a cron"), "--cron"),
        (("ui", "--mlflow", "--mlflow-port", "99999"), "--mlflow-port"),
    ],
)
def test_bad_options_end_with_exit_2_before_a_server_starts(args, says):
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


def test_an_infinite_learning_rate_is_refused():
    from grpo_core.config import RunConfig

    with pytest.raises(ValueError, match="train.learning_rate|learning_rate"):
        RunConfig.model_validate({"train": {"learning_rate": float("inf")}})


@pytest.mark.parametrize(
    "name, text, says",
    [
        (
            "passwd",
            "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n",
            "line 1 is not JSON",
        ),
        ("broken.jsonl", '{"prompt": "a"}\n\n{"prompt": "b"\n{"prompt": "c"}\n', "line 3 is not JSON"),
        ("list.jsonl", '{"prompt": "a"}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
        ("latin1.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "line 2 is not UTF-8"),
        ("array.json", '[{"prompt": "a"},\n', "is not a JSON array of objects"),
        ("missing.jsonl", None, "no such file"),
        ("folder", "DIR", "is a folder"),
    ],
)
def test_a_json_dataset_that_is_not_json_lines_is_a_one_line_config_error(tmp_path, name, text, says):
    """``rollout.dataset=json:FILE`` with FILE missing or not JSON lines used to end in a HF datasets traceback
    (exit 1) or an error not naming the field: it names ``rollout.dataset``, the file and the line, exit 2."""
    path = tmp_path / name
    if text == "DIR":
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    where = [
        f"train.output_dir={tmp_path / 'runs'}",
        f"tracking.dir={tmp_path / 'mlflow'}",
        f"rollout.dataset=json:{path}",
    ]
    result = _invoke(
        "validate", "--config", str(ROOT / "configs" / "tiny.yaml"), *sum((["--set", w] for w in where), [])
    )
    assert result.exit_code == 2, result.output
    assert f"rollout.dataset='json:{path}'" in result.output and says in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_here_or_names_the_host_it_needs(path, tmp_path, monkeypatch):
    """On this CPU box every shipped config validates, except those whose LoRA adapter store is a shared mount this
    box lacks: they name the host they need. Those that start vLLM on the flow's own host validate too while vLLM is
    not installed here (``grpo validate`` may run ahead of deployment), with a note naming the host they need.
    Servers elsewhere (``server.urls``, ``server.deployment``, e.g. multihost-pools.yaml) need no vLLM here."""
    import importlib.util

    data = yaml.safe_load(path.read_text()) or {}
    server, train = data.get("server", {}), data.get("train", {})
    needs_vllm_here = server.get("backend") == "vllm" and not server.get("urls") and not server.get("deployment")
    store = train.get("adapter_store") if (train.get("lora") or {}).get("enabled") else None
    where = [f"train.output_dir={tmp_path / 'runs'}", f"tracking.dir={tmp_path / 'mlflow'}"]
    monkeypatch.chdir(ROOT)  # the configs name their data from the checkout, where they are run; the folders above
    result = _invoke("validate", "--config", str(path), *sum((["--set", w] for w in where), []))
    if store and "://" not in store and not Path(store).parent.is_dir():
        assert result.exit_code == 2, result.output
        assert result.output.startswith(
            f"config error: train.adapter_store={store!r}: {Path(store).parent} does not "
            "exist on this host; mount the shared store there"
        ), result.output
    elif needs_vllm_here and importlib.util.find_spec("vllm") is None:
        import torch

        assert result.exit_code == 0, result.output
        notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
        vllm = [n for n in notes if "server.backend is 'vllm' and this host starts the replicas" in n]
        no_gpu = [n for n in notes if n.startswith("note: train.device is 'cuda' but torch sees no CUDA GPU")]
        lacks_gpu = train.get("device") == "cuda" and torch.cuda.device_count() == 0  # noted too (preflight)
        assert len(vllm) == 1 and len(no_gpu) == int(lacks_gpu) and len(notes) == 1 + int(lacks_gpu), notes
        assert "GPU host with vLLM" in result.output and "valid" in result.output
    else:
        assert result.exit_code == 0, result.output
        assert "valid" in result.output


def _command_paths(group, prefix=()):
    for name, command in group.commands.items():
        yield (*prefix, name)
        if getattr(command, "commands", None):  # a group (typer's own click)
            yield from _command_paths(command, (*prefix, name))


def test_help_shows_docstrings_as_text_without_rst_backticks():
    """Command docstrings are written in rST (``grpo validate``); ``--help`` used to print the double backticks."""
    import typer

    paths = [(), *_command_paths(typer.main.get_command(app))]
    assert {("validate",), ("train",), ("resume",), ("config", "show")} <= set(paths)
    for path in paths:
        result = _invoke(*path, "--help")
        assert result.exit_code == 0, (path, result.output)
        assert "``" not in result.output, (path, result.output)
    validate_help = " ".join(_invoke("validate", "--help").output.split())
    assert "every check of the flow's prepare task" in validate_help  # the words kept, the markup gone


def test_json_datasets_datasets_reads_still_load(tmp_path):
    """The JSON-lines check leaves alone what the datasets json loader reads: a compressed file, one JSON array,
    a glob over several files."""
    import gzip

    from grpo_core.rollout.data import iter_rows, json_lines_dataset

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    (tmp_path / "array.json").write_text(json.dumps(rows))
    for i, row in enumerate(rows):
        (tmp_path / f"part-{i}.jsonl").write_text(json.dumps(row) + "\n")
    for pattern in ("rows.jsonl.gz", "array.json", "part-*.jsonl"):
        assert list(iter_rows(json_lines_dataset(str(tmp_path / pattern)))) == rows, pattern


def test_train_with_a_servers_deployment_but_no_prefect_server_to_hold_it_stops_before_anything(tmp_path, monkeypatch):
    """Without ``PREFECT_API_URL`` ``grpo train`` runs on Prefect's temporary server, which holds no deployment:
    the run failed in ``provision_servers`` after its MLflow run and folder existed. ``validate`` still passes the
    config (a deployment's run may start it elsewhere)."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    runs, mlflow_dir = tmp_path / "runs", tmp_path / "mlflow"
    where = [
        "--set",
        f"train.output_dir={runs}",
        "--set",
        f"tracking.dir={mlflow_dir}",
        "--set",
        "server.deployment=grpo-servers/gpu",
    ]
    result = _invoke("train", "--config", str(ROOT / "configs" / "tiny.yaml"), *where)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(
        "config error: server.deployment='grpo-servers/gpu' needs the Prefect server where `grpo deploy` registered it"
    ), result.output
    assert "set PREFECT_API_URL" in result.output and len(result.output.strip().splitlines()) == 1
    assert not runs.exists() and not mlflow_dir.exists(), "nothing was created"
    ok = _invoke("validate", "--config", str(ROOT / "configs" / "tiny.yaml"), *where)
    assert ok.exit_code == 0, ok.output


def test_ui_mlflow_on_a_taken_port_fails_naming_it_before_printing_a_url():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _invoke("ui", "--mlflow", "--mlflow-port", str(port))
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"127.0.0.1:{port} is already in use" in out and "--mlflow-port" in out
    assert "MLflow UI: http" not in out, "the other server's URL must not be shown as ours"


def _summary(tmp_path, **extra) -> dict:
    deep = tmp_path / ("a-long-folder-name-" * 6) / "checkpoints" / "step-0000004"
    return {
        "steps": 4.0,
        "steps_requested": 4,
        "stopped_early": None,
        "skipped_nonfinite_steps": 0,
        "reward_first5": 0.25,
        "reward_last5": 0.5,
        "generated_tokens_per_s": 100.0,
        "trained_tokens_per_s": 40.0,
        "forwarded_tokens_per_s": 60.0,
        "checkpoint": str(deep),
        "reward_curve": str(deep.parent.parent / "reward_curve.png"),
        "mlflow_run_id": "0" * 32,
        "mlflow_uri": f"sqlite:///{tmp_path}/mlflow/mlflow.db",
        "resumed_from": None,
        **extra,
    }


def test_the_summary_at_80_columns_keeps_every_path_whole_and_names_rates_as_the_metrics(tmp_path):
    from rich.console import Console

    from flows.cli import summary_table

    summary = _summary(tmp_path, resumed_from=str(tmp_path / "run" / "checkpoints" / "step-0000002"))
    narrow = Console(width=80, record=True, force_terminal=False)
    narrow.print(summary_table(summary))
    text = narrow.export_text()
    joined = "".join(line.strip("│ ").strip() for line in text.splitlines())  # the folded cells, rejoined
    for path in (summary["checkpoint"], summary["reward_curve"], summary["resumed_from"]):
        assert path.replace(" ", "") in joined.replace(" ", ""), f"cut: {path}"
    assert "…" not in text
    assert "perf/wall_clock_trained_tokens_per_s" in text and "resumed from" in text


def test_a_run_with_skipped_non_finite_steps_exits_3_naming_the_setting(tmp_path, monkeypatch):
    import typer

    import flows.cli as cli
    import flows.grpo_train as grpo_train_module
    from grpo_core.config import RunConfig

    monkeypatch.setattr(cli, "_start_prefect_api", lambda: None)
    monkeypatch.setattr(grpo_train_module, "grpo_train", lambda cfg: _summary(tmp_path, skipped_nonfinite_steps=2))
    cfg = RunConfig.model_validate({"train": {"output_dir": str(tmp_path / "runs"), "max_steps": 4}})
    with cli.console.capture() as captured, pytest.raises(typer.Exit) as exit_:
        cli.run_locally(cfg)
    assert exit_.value.exit_code == 3
    out = " ".join(captured.get().split())
    assert "2 of 4 steps were skipped" in out and "train.learning_rate" in out
    labels = list(cli.summary_table(_summary(tmp_path, skipped_nonfinite_steps=2)).columns[0].cells)
    assert "skipped steps (non-finite loss or gradient)" in labels


def test_prefect_log_lines_go_through_the_progress_bars_console():
    """rich keeps one live display per console: Prefect's lines printed through another console each left a frozen
    copy of the progress bar in the scrollback."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    import flows.cli as cli

    handler = PrefectConsoleHandler()
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    try:
        assert handler.console is not cli.console
        cli._share_console()
        assert handler.console is cli.console
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)


def test_prefects_home_is_under_the_working_folder(tmp_path, monkeypatch):
    import flows.cli as cli

    monkeypatch.delenv("PREFECT_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    cli.set_env_defaults()
    assert os.environ["PREFECT_HOME"] == str(tmp_path / "runs" / "prefect")
    monkeypatch.setenv("PREFECT_HOME", "/elsewhere/prefect")
    cli.set_env_defaults()
    assert os.environ["PREFECT_HOME"] == "/elsewhere/prefect", "the environment's own setting wins"


def test_validate_imports_user_code_from_the_working_folder_as_the_run_does(tmp_path):
    """The rollout and trainer processes (``python -m``) import ``module:callable`` from the working folder; the
    ``grpo`` console script did not (its sys.path starts at the venv's bin folder), so validate refused a reward file
    of the user's own folder ("No module named") or checked the checkout's copy of a same-named one."""
    (tmp_path / "my_fresh_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config["rollout"]["reward_functions"] = ["my_fresh_rewards:length_reward"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    grpo = Path(sys.executable).parent / "grpo"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(grpo), "validate", "--config", "run.yaml", "--set", "train.output_dir=runs", "--set", "tracking.dir=mlf"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump({**config, "rollout": {**config["rollout"], "reward_functions": ["not_here_at_all:f"]}})
    )
    missing = subprocess.run(
        [str(grpo), "validate", "--config", "run.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "modules are found in the working folder" in " ".join(missing.stderr.split())


def test_a_failed_run_ends_with_what_failed_and_its_root_cause(tmp_path, monkeypatch):
    import typer

    import flows.cli as cli
    import flows.grpo_train as grpo_train_module
    from grpo_core.config import RunConfig
    from grpo_core.errors import RolloutError, RolloutProcessError, TrainerError

    def failing(cfg):
        trainer = TrainerError("trainer exited with code 1: rank 0: TransportError: stream broke\nlast output:\n...")
        try:
            raise RolloutProcessError(
                "rollout process failed: RolloutError: reward returned 3 values for 4"
            ) from trainer
        except RolloutProcessError as exc:
            raise exc from RolloutError("reward_fn returned 3 values for 4 completions")

    monkeypatch.setattr(cli, "_start_prefect_api", lambda: None)
    monkeypatch.setattr(grpo_train_module, "grpo_train", failing)
    cfg = RunConfig.model_validate({"train": {"output_dir": str(tmp_path / "runs")}})
    with cli.console.capture() as captured, pytest.raises(typer.Exit) as exit_:
        cli.run_locally(cfg)
    assert exit_.value.exit_code == 1
    lines = [line for line in captured.get().splitlines() if line.strip()]
    assert lines[-3].startswith("grpo train failed: RolloutProcessError: rollout process failed")
    assert lines[-2] == "root cause: RolloutError: reward_fn returned 3 values for 4 completions"
    assert "Traceback" not in captured.get()
