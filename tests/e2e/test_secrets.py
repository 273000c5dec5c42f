"""Secrets are never logged or saved (issue 11, item 5): the password of ``tracking.tracking_uri`` and the value
of ``--api-key``/tokens in ``server.extra_args`` appear nowhere — MLflow params, log output, files on disk — and
the run's config files are written with mode 0600."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from flow_helpers import grpo_env, grpo_train_command

from grpo_core.config import RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.run.children import free_port
from grpo_core.run.layout import run_folders
from grpo_core.security.redact import MASK, SECRETS_ENV, RedactFilter, redact_argv, reveal, secret_values, write_private

ROOT = Path(__file__).resolve().parents[2]
PASSWORD, API_KEY, HF_TOKEN = "pw-Zq81xT", "key-Yv27sLm", "hf_Wn93kPd"
DICT_SECRETS = ("sk-Dk41Jq", "hf_Rt58Vw", "pw-Lm02Hs", "cookie-Ua73Ze")  # values under secret keys of dict fields


def _config(**tracking) -> RunConfig:
    return RunConfig(
        tracking={"tracking_uri": f"https://grpo:{PASSWORD}@mlflow.example:5000", **tracking},
        server={"extra_args": ["--api-key", API_KEY, f"--hf-token={HF_TOKEN}", "--max-num-seqs", "8"]},
    )


def _no_secret(text: str) -> bool:
    return not any(s in text for s in (PASSWORD, API_KEY, HF_TOKEN))


def test_every_printed_form_of_a_config_masks_its_secrets():
    cfg = _config()
    for text in (
        cfg.model_dump_json(),
        json.dumps(cfg.model_dump(mode="json")),
        repr(cfg),
        str(cfg),
        cfg.tracking.shown_tracking_uri(),
        cfg.tracking.resolved_ui_url(),
    ):
        assert _no_secret(text), text
    shown = cfg.model_dump(mode="json")
    assert shown["tracking"]["tracking_uri"] == f"https://grpo:{MASK}@mlflow.example:5000"  # the host stays
    assert shown["server"]["extra_args"] == ["--api-key", MASK, "--hf-token", MASK, "--max-num-seqs", "8"]
    # ...while the processes that need them get the real values.
    assert cfg.tracking.resolved_tracking_uri() == f"https://grpo:{PASSWORD}@mlflow.example:5000"
    assert reveal(cfg.server.extra_args) == ["--api-key", API_KEY, "--hf-token", HF_TOKEN, "--max-num-seqs", "8"]


def test_a_redacted_file_gets_its_secrets_back_only_from_the_environment(tmp_path):
    cfg = _config()
    path = write_private(tmp_path / "run_config.json", cfg.model_dump_json())
    assert _no_secret(path.read_text()) and stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match=r"server.extra_args.1 holds a redacted value"):
        load_config(path)
    env = {SECRETS_ENV: json.dumps(secret_values(cfg))}
    again = load_config(path, secrets=json.loads(env[SECRETS_ENV]))
    assert again.tracking.resolved_tracking_uri() == cfg.tracking.resolved_tracking_uri()
    assert reveal(again.server.extra_args) == reveal(cfg.server.extra_args)


def test_write_private_makes_an_existing_file_0600(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "new"


def test_vllm_gets_api_key_and_token_by_environment_and_logs_a_redacted_command(tmp_path, caplog):
    from grpo_core.serving.launch import LaunchSpec, launch, vllm_command

    cfg = _config().model_copy(update={"model": RunConfig().model.model_copy(update={"name": "tiny-qwen3"})})
    spec = vllm_command(cfg)
    assert _no_secret(" ".join(reveal(spec.argv)))  # not on the command line (ps, vLLM's "non-default args")
    assert spec.env["VLLM_API_KEY"] == API_KEY and spec.env["HF_TOKEN"] == HF_TOKEN
    assert "--api-key" not in reveal(spec.argv) and "--max-num-seqs" in reveal(spec.argv)
    # A secret flag vLLM has no variable for stays in argv: revealed to the process, masked in the log.
    from pydantic import SecretStr

    marker = tmp_path / "argv.json"
    argv = [
        sys.executable,
        "-c",
        f"import sys, json; open({str(marker)!r}, 'w').write(json.dumps(sys.argv[1:]))",
        "--ssl-password",
        SecretStr(PASSWORD),
        f"--db-secret={API_KEY}",
    ]
    run = LaunchSpec(argv, {}, "embedded", 0, "127.0.0.1", 0, tmp_path / "log.txt")
    with caplog.at_level(logging.INFO, logger="grpo_core.serving.launch"):
        handle = launch(run, "run-token-xyz")
        handle.process.wait(timeout=60)
    assert json.loads(marker.read_text()) == ["--ssl-password", PASSWORD, f"--db-secret={API_KEY}"]
    assert "--ssl-password " + MASK in caplog.text and "--db-secret=" + MASK in caplog.text
    assert _no_secret(caplog.text) and "run-token-xyz" not in caplog.text
    assert (
        redact_argv(["--api-key", API_KEY, "--hf-token", "--enforce-eager"])
        == f"--api-key {MASK} --hf-token --enforce-eager"
    )


def test_redact_filter_masks_forwarded_lines(caplog):
    log = logging.getLogger("test_secrets.forwarded")
    log.addFilter(RedactFilter([API_KEY, PASSWORD]))
    with caplog.at_level(logging.INFO, logger="test_secrets.forwarded"):
        log.info("[server 0] args: %s", {"api_key": API_KEY, "uri": f"http://u:{PASSWORD}@h"})
    assert _no_secret(caplog.text) and MASK in caplog.text


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on loopback (it accepts any basic-auth credentials). Without MLflow's job
    runner (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION``: 8 more processes, huey consumers, that a tracking server does
    not need and that slow its start and stop on 2 cores)."""
    port = free_port()
    log = (tmp_path / "mlflow-server.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(480):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield port
    finally:
        from grpo_core.run.children import stop_child

        stop_child(process, timeout_s=15)
        log.close()
    assert process.poll() is not None


@pytest.mark.slow  # a whole `grpo train` against an MLflow server
@pytest.mark.timeout(1200)
def test_a_run_with_secrets_leaves_them_in_no_param_log_or_file(tmp_path, mlflow_server):
    """``grpo train`` with a tracking server password, a vLLM API key and a token in a dict field: none reaches the
    MLflow params, the command's output (the Prefect run log included), or any file under the test's folder (run
    files, Prefect's database with its logs and parameters, MLflow's stores); the run's config files are 0600, its
    folder 0700."""
    from mlflow.tracking import MlflowClient

    uri = f"http://grpo:{PASSWORD}@127.0.0.1:{mlflow_server}"
    cmd = grpo_train_command(
        tmp_path,
        f"tracking.tracking_uri={uri}",
        f"server.extra_args=[--api-key, {API_KEY}, --hf-token={HF_TOKEN}]",
        "train.max_steps=1",
        "train.flush_partial_after_s=1",
        "rollout.dataset_size=4",
        f"rollout.chat_template_kwargs={{enable_thinking: false, hf_token: {DICT_SECRETS[1]}}}",
    )
    env = grpo_env(tmp_path, PREFECT_LOGGING_LEVEL="DEBUG")
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "Finished in state Completed" in output and _no_secret(output)
    assert f"http://grpo:{MASK}@127.0.0.1:{mlflow_server}" in output  # the summary shows where, not how
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    params = runs[0].data.params
    assert params["tracking.tracking_uri"] == f"http://grpo:{MASK}@127.0.0.1:{mlflow_server}"
    assert json.loads(params["server.extra_args"]) == ["--api-key", MASK, "--hf-token", MASK]
    assert _no_secret(json.dumps(params))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "run_config.json" for p in files) and any(p.suffix == ".db" for p in files)
    assert params["rollout.chat_template_kwargs.hf_token"] == MASK
    assert DICT_SECRETS[1] not in output
    secrets = (PASSWORD, API_KEY, HF_TOKEN, DICT_SECRETS[1])
    leaks = [str(p) for p in files if any(s.encode() in p.read_bytes() for s in secrets)]
    assert not leaks
    (run_dir,) = run_folders(tmp_path / "runs")
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for name in ("run_config.json", "train_config.json"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600
    # Prefect's home (its database holds the run's parameters and log lines) is the user's only too
    home = tmp_path / "prefect"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "prefect.db").stat().st_mode) == 0o600


def test_secret_keys_of_dict_fields_are_masked_where_written_and_real_where_read(tmp_path):
    """A secret in a free-form dict field (found by its key's name, nested too) is masked in every JSON form a
    config is written or logged in (MLflow params and artifact, run config files, Prefect parameters, the model
    card, the checkpoint fingerprint, repr), while the run's processes, given ``GRPO_RUN_SECRETS``, read the real
    values: the dataset factory gets its rows back with the secret in them."""
    from grpo_core.models import hub
    from grpo_core.rollout.data import load_dataset
    from grpo_core.run.prepare import run_child_env
    from grpo_core.security.redact import secrets_from_env
    from grpo_core.tracking import flatten
    from grpo_core.train.fingerprint import fingerprint_text

    sk, hf, pw, cookie = DICT_SECRETS
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "auth": {"api_key": sk, "pin": 4417}}]
    cfg = RunConfig(
        train={"output_dir": str(tmp_path / "runs")},
        rollout={
            "dataset": "rollout_helpers:rows_of",
            "dataset_kwargs": {"rows": rows},
            "chat_template_kwargs": {"enable_thinking": False, "hfToken": hf, "max_tokens": 7},
            "loop_options": {"db": {"password": pw}, "Session-Cookie": cookie, "tokenizer": "plain"},
        },
    )
    card = hub.write_model_card(cfg, tmp_path / "model", {"steps": 1}, None, adapter=False).read_text()
    written = {
        "model_dump_json": cfg.model_dump_json(),
        "model_dump(json)": json.dumps(cfg.model_dump(mode="json")),
        "mlflow params": json.dumps(flatten(cfg.model_dump(mode="json"))),
        "repr": repr(cfg),
        "model card": card,
        "fingerprint": fingerprint_text(cfg.trainer_process()),
    }
    for name, text in written.items():
        leaked = [s for s in (*DICT_SECRETS, "4417") if s in text]
        assert not leaked, f"{name} holds {leaked}"
    shown = cfg.model_dump(mode="json")["rollout"]
    assert shown["dataset_kwargs"]["rows"][0]["auth"] == {"api_key": MASK, "pin": MASK}
    assert shown["chat_template_kwargs"] == {"enable_thinking": False, "hfToken": MASK, "max_tokens": 7}
    assert shown["loop_options"] == {"db": {"password": MASK}, "Session-Cookie": MASK, "tokenizer": "plain"}
    assert cfg.rollout.chat_template_kwargs["hfToken"] == hf  # the Python object keeps the value

    # a process of the run: the redacted file plus GRPO_RUN_SECRETS from the environment it is started with
    path = write_private(tmp_path / "run_config.json", cfg.model_dump_json())
    with pytest.raises(ConfigError, match=r"rollout\.\S+ holds a redacted value"):
        load_config(path)
    env = run_child_env(str(tmp_path / "runs" / "x"), secret_values(cfg))
    child = load_config(path, secrets=secrets_from_env(env))
    assert child.rollout.chat_template_kwargs == {"enable_thinking": False, "hfToken": hf, "max_tokens": 7}
    assert child.rollout.loop_options == {"db": {"password": pw}, "Session-Cookie": cookie, "tokenizer": "plain"}
    assert load_dataset(child.rollout) == rows  # the dataset factory receives the real values (the pin a number)


def test_which_dict_keys_name_a_secret():
    """By the key's words, as a reader would judge them: these name secrets, the others do not."""
    from grpo_core.security.redact import is_secret_key

    assert all(map(is_secret_key, ["auth", "api_key", "hfToken", "password", "Session-Cookie", "OPENAI_API_KEY"]))
    assert all(map(is_secret_key, ["access_token", "refresh-token", "db_password", "client_secret", "aws_secret_key"]))
    assert not any(map(is_secret_key, ["rows", "enable_thinking", "max_tokens", "tokenizer", "key", "pin", "db"]))
    # vocabulary tokens, columns and lookups: their values (a column name, "</s>") would be blanked in every log line
    vocabulary = ["eos_token", "pad_token", "bos_token", "add_bos_token", "token_limit", "max_token_length"]
    columns = ["prompt_key", "answer_key", "text_key", "sort_key", "cache_key", "key_column"]
    assert not any(map(is_secret_key, vocabulary + columns))
    assert not is_secret_key("storage_options.token"), "a key holding '.' cannot be named by a config path"
