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
def test_a_secret_given_on_the_command_line_is_warned_about_once_naming_the_safer_forms(override, names, caplog):
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
        # no name at all: it looked up a variable named '' / read the working folder ("Is a directory")
        ("@env:", "name the environment variable after @env: (@env:NAME)"),
        ("@file:", "name the file after @file: (@file:PATH)"),
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


def test_a_list_field_read_from_the_environment_is_parsed_as_a_yaml_list(monkeypatch, caplog):
    # the form the command-line warning recommends for server.extra_args; it was refused as "not a valid list"
    monkeypatch.setenv("VLLM_ARGS", "[--max-num-seqs, '8', --api-key, sk-env-list-secret]")
    with caplog.at_level(logging.WARNING, logger="grpo_core.config.loading"):
        config = load_config(None, ["server.extra_args=@env:VLLM_ARGS"])
    shown = [a if isinstance(a, str) else a.get_secret_value() for a in config.server.extra_args]
    assert shown == ["--max-num-seqs", "8", "--api-key", "sk-env-list-secret"]
    assert not isinstance(config.server.extra_args[3], str)  # the key after --api-key is kept as a secret
    assert not [r for r in caplog.records if "puts a secret on the command line" in r.getMessage()]


def test_a_dict_field_read_from_a_file_is_parsed_as_a_yaml_mapping_and_a_string_field_keeps_the_text(
    tmp_path, monkeypatch
):
    kwargs = tmp_path / "kwargs.yaml"
    kwargs.write_text("api_key: sk-file-secret\nsplit: train\n")
    monkeypatch.setenv("MY_ENVIRONMENT", "my_envs:Game")  # str | dict field: a plain string stays the string
    monkeypatch.setenv("MY_SERVER_KEY", "[not,a,list]")  # a str field: the text as it is, never parsed
    config = load_config(
        None,
        [
            f"rollout.dataset_kwargs=@file:{kwargs}",
            "rollout.environment_factory=@env:MY_ENVIRONMENT",
            "server.api_key=@env:MY_SERVER_KEY",
        ],
    )
    assert config.rollout.dataset_kwargs == {"api_key": "sk-file-secret", "split": "train"}
    assert config.rollout.environment_factory == "my_envs:Game"
    assert config.server.api_key is not None and config.server.api_key.get_secret_value() == "[not,a,list]"


@pytest.mark.parametrize(
    ("override", "variable", "says"),
    [
        # not a YAML list: refused in a line naming the key and the form, without the value
        ("server.extra_args=@env:VLLM_ARGS", "--api-key sk-leak-1234", "server.extra_args takes a YAML list"),
        ("rollout.dataset_kwargs=@env:VLLM_ARGS", "api_key=sk-leak-1234", "takes a YAML mapping"),
        ("server.extra_args=@env:VLLM_ARGS", "[--api-key, 'sk-leak-1234", "is not YAML (line 1, column"),
        # a list that parses but that a check refuses, echoing its items in the message
        ("rollout.reward_functions=@env:VLLM_ARGS", "[sk-leak-1234]", "must be 'module:attribute'"),
        ("rollout.loop_class=@env:VLLM_ARGS", "sk-leak-1234", "must be 'module:attribute'"),
    ],
)
def test_an_error_about_a_value_read_off_the_command_line_never_shows_it(override, variable, says, monkeypatch):
    monkeypatch.setenv("VLLM_ARGS", variable)
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert says in message, message
    assert "sk-leak" not in message and "1234" not in message, message


def test_an_indexed_override_of_a_secret_list_item_is_warned_about(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_ARGS", "[--api-key, placeholder]")
    with caplog.at_level(logging.WARNING, logger="grpo_core.config.loading"):
        config = load_config(None, ["server.extra_args=@env:VLLM_ARGS", "server.extra_args[1]=sk-plain-item"])
    assert [a if isinstance(a, str) else a.get_secret_value() for a in config.server.extra_args] == [
        "--api-key",
        "sk-plain-item",
    ]
    lines = [r.getMessage() for r in caplog.records if "puts a secret on the command line" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("--set server.extra_args[1]=..."), lines
