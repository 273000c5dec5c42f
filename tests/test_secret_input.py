"""Secrets given to ``--set`` off the command line (``@env:``, ``@file:``, ``@stdin``), and a warning for one on it.

A secret on the command line is readable by every user of the host in ``/proc/<pid>/cmdline`` for the whole run
(issue 26, item 7). Real processes read the indirect forms here; their argv is checked to hold no secret.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from grpo_core.config import load_config
from grpo_core.config import loading as config_loading
from grpo_core.errors import ConfigError

# Loads a config from the overrides given as arguments and prints its secrets' real values and its own argv.
_LOADER = """
import json, sys
from grpo_core.config import load_config
from grpo_core.security.redact import secret_values
config = load_config(None, sys.argv[1:])
print(json.dumps({"secrets": secret_values(config), "cmdline": open("/proc/self/cmdline", "rb").read().decode()}))
"""


def test_secrets_read_from_the_environment_a_file_and_stdin_stay_off_the_command_line(tmp_path):
    key_file = tmp_path / "hf.key"
    key_file.write_text("sk-from-a-file\n")  # as `echo` writes it: the newline is not part of the key
    env = {**os.environ, "MY_SERVER_KEY": "sk-from-the-environment"}
    argv = [
        "server.api_key=@env:MY_SERVER_KEY",
        f"rollout.dataset_kwargs.api_key=@file:{key_file}",
        "rollout.chat_template_kwargs.auth_token=@stdin",
        "train.max_steps=7",
    ]
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, *argv],
        input="sk-from-stdin\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["secrets"] == {
        "server.api_key": "sk-from-the-environment",
        "rollout.dataset_kwargs.api_key": "sk-from-a-file",
        "rollout.chat_template_kwargs.auth_token": "sk-from-stdin",
    }
    assert "train.max_steps=7" in seen["cmdline"]  # the process's real command line was read
    assert not any(secret in seen["cmdline"] for secret in seen["secrets"].values())
    assert "puts a secret on the command line" not in done.stderr  # nothing to warn about


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("server.api_key=sk-plain", "--set server.api_key=@env:NAME"),
        ("rollout.dataset_kwargs={api_key: sk-plain, split: train}", "--set rollout.dataset_kwargs.api_key=@env:NAME"),
        ("rollout.dataset_kwargs.hf_token=hf_plain", "--set rollout.dataset_kwargs.hf_token=@env:NAME"),
        ("server.extra_args=[--api-key, sk-plain]", "--set server.extra_args=@env:NAME"),
        ("tracking.tracking_uri=https://me:pw@mlflow.example", "--set tracking.tracking_uri=@env:NAME"),
    ],
)
def test_a_secret_given_on_the_command_line_is_warned_about_once_naming_the_safer_forms(
    override, names, caplog, monkeypatch
):
    monkeypatch.setattr(config_loading, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="grpo_core.config.loading"):
        load_config(None, [override, "train.max_steps=3"])
        load_config(None, [override])  # grpo resume loads its overrides twice: one warning
    lines = [r.getMessage() for r in caplog.records if "puts a secret on the command line" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "/proc/<pid>/cmdline" in lines[0] and names in lines[0] and "@file:PATH or @stdin" in lines[0]
    assert "sk-plain" not in lines[0] and "pw@" not in lines[0]


@pytest.mark.parametrize(
    "override",
    [
        "tracking.tracking_uri=sqlite:///runs/mlflow.db",  # a URL without a password holds no secret
        "rollout.dataset_kwargs={prompt_key: question, split: train}",  # a column name, not a key
        "server.extra_args=[--max-num-seqs, '8']",
        "server.api_key=@env:MY_SERVER_KEY",
    ],
)
def test_no_warning_without_a_secret_on_the_command_line(override, caplog, monkeypatch):
    monkeypatch.setattr(config_loading, "_warned", set())
    monkeypatch.setenv("MY_SERVER_KEY", "sk-env")
    with caplog.at_level(logging.WARNING, logger="grpo_core.config.loading"):
        load_config(None, [override])
    assert not [r for r in caplog.records if "puts a secret on the command line" in r.getMessage()]


def test_the_cli_warns_in_one_line_on_stderr(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "config", "show", "--set", "server.api_key=sk-plain-cli"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    warned = [line for line in done.stderr.splitlines() if "puts a secret on the command line" in line]
    assert len(warned) == 1 and "--set server.api_key=@env:NAME, @file:PATH or @stdin" in warned[0], done.stderr
    assert "sk-plain-cli" not in done.stdout + done.stderr  # the config shown masks it too


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("@env:GRPO_TEST_UNSET_VARIABLE", "the environment variable 'GRPO_TEST_UNSET_VARIABLE' is unset or empty"),
        ("@file:/nonexistent/grpo/key", "cannot read /nonexistent/grpo/key"),
        ("@vault:x", "must be @env:NAME, @file:PATH or @stdin"),
    ],
)
def test_an_unreadable_indirect_value_is_a_clear_error(value, says, monkeypatch):
    monkeypatch.delenv("GRPO_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match="--set server.api_key=") as info:
        load_config(None, [f"server.api_key={value}"])
    assert says in str(info.value)


def test_two_overrides_read_from_stdin_are_refused_naming_both_keys_and_the_other_forms():
    # a real process with two lines on its standard input: before the fix the second key got the second line (or
    # an empty string with one line); now neither reads it and the command names both keys
    argv = ["server.api_key=@stdin", "rollout.dataset_kwargs.api_key=@stdin"]
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, *argv],
        input="sk-first\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "ConfigError" in done.stderr, done.stdout + done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert "--set server.api_key=@stdin" in error and "--set rollout.dataset_kwargs.api_key=@stdin" in error, error
    assert "@file:PATH" in error and "@env:NAME" in error, error


def test_one_override_read_from_stdin_beside_an_env_one_still_loads(monkeypatch):
    monkeypatch.setenv("MY_SERVER_KEY", "sk-env")
    monkeypatch.setattr(config_loading, "_stdin_line", lambda key: "sk-stdin")
    config = load_config(None, ["server.api_key=@env:MY_SERVER_KEY", "rollout.dataset_kwargs.api_key=@stdin"])
    assert config.server.api_key is not None and config.server.api_key.get_secret_value() == "sk-env"
    assert config.rollout.dataset_kwargs["api_key"] == "sk-stdin"  # a dict's secret key holds the value itself
