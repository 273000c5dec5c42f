"""Run parameters never run code outside the allow-list (issue 11, item 1): a ``module:callable`` name from a
config is refused before its module is imported or anything is called, naming the field and
``GRPO_ALLOWED_MODULES``; the owner's own config file joins the allow-list."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core import allowlist, preflight
from grpo_core.allowlist import ALLOWED_MODULES_ENV, check_code_references, code_references, import_object
from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module ``planted_mod`` whose import, and whose ``run`` function, each create a marker file."""
    marker = tmp_path / "imported"
    (tmp_path / "planted_mod.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).touch()\n"
        "def run(**kwargs):\n"
        f"    Path({str(marker)!r} + '.called').touch()\n"
        "    return [{'prompt': [{'role': 'user', 'content': 'hi'}]}]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    sys.modules.pop("planted_mod", None)
    yield marker
    sys.modules.pop("planted_mod", None)


# Names of every kind a parameter could carry: a shell command (the example), builtins, os.system, a
# module-level attribute path through an allowed module into another one, a dunder walk, a foreign class
# re-exported by an allowed module, and a module that runs code on import.
BAD_NAMES = [
    ("rollout.dataset", "subprocess:getoutput", "'subprocess' is not in the allow-list"),
    ("rollout.dataset", "builtins:eval", "'builtins' is not in the allow-list"),
    ("rollout.reward_functions", ["os:system"], "'os' is not in the allow-list"),
    ("rollout.tools", ["posix:system"], "'posix' is not in the allow-list"),
    ("rollout.loop_class", "planted_mod:run", "'planted_mod' is not in the allow-list"),
    (
        "rollout.environment_factory",
        {"a": "grpo_core.demo_rewards:numeric_answer_reward", "b": "pty:spawn"},
        "'pty' is not in the allow-list",
    ),
    ("rollout.environment_factory", "importlib:import_module", "'importlib' is not in the allow-list"),
]


@pytest.mark.parametrize(("field", "value", "why"), BAD_NAMES)
def test_a_name_outside_the_allow_list_is_refused_in_preflight_before_any_import(planted, tmp_path, field, value, why):
    section, key = field.split(".")
    data = {section: {key: value, "dataset_kwargs": {"cmd": f"touch {tmp_path / 'shell'}"}}}
    if key != "dataset":
        data[section]["dataset"] = "reasoning_gym:chain_sum"
    cfg = RunConfig.model_validate(data)
    with pytest.raises(ConfigError, match=why) as info:
        preflight.check_run(cfg)
    assert ALLOWED_MODULES_ENV in str(info.value) and field in str(info.value)
    assert not planted.exists() and not (tmp_path / "shell").exists()  # nothing imported, no shell command ran
    assert "planted_mod" not in sys.modules


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("grpo_core.preflight:os.system", "is the module os"),
        ("grpo_core.rollout.data:json.loads", "is the module json"),
        ("grpo_core.config:Path", "defined in 'pathlib'"),
        ("grpo_core.config:RunConfig.model_validate", "defined in 'pydantic"),
        ("grpo_core.preflight:logger.info", "is no class of an allowed module"),
        ("grpo_core.config:RunConfig.__init__", "'__' is refused"),
        ("grpo_core.preflight:__builtins__", "'__' is refused"),
        ("grpo_core:..x", "must be 'module:attribute'"),
        ("grpo_coreX.y:z", "not in the allow-list"),
    ],
)
def test_an_attribute_path_may_not_leave_the_allowed_modules(monkeypatch, spec, why):
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    with pytest.raises(ConfigError, match=why):
        import_object(spec, "rollout.dataset")


def test_an_allowed_name_resolves_to_its_own_object(monkeypatch):
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    from grpo_core.demo_rewards import numeric_answer_reward
    from grpo_core.rollout.loop import RolloutLoop

    assert import_object("grpo_core.demo_rewards:numeric_answer_reward", "f") is numeric_answer_reward
    assert import_object("grpo_core.rollout.loop:RolloutLoop", "f") is RolloutLoop
    assert import_object("grpo_core.rollout.loop:RolloutLoop.render", "f") is RolloutLoop.render


def test_the_environment_variable_extends_the_allow_list_by_module_and_submodule(planted, monkeypatch):
    cfg = RunConfig(rollout={"dataset": "planted_mod:run"})
    with pytest.raises(ConfigError):
        check_code_references(cfg)
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "other, planted_mod")
    check_code_references(cfg)
    assert allowlist.is_allowed("planted_mod.sub") and not allowlist.is_allowed("planted_modx")
    assert not planted.exists()  # checking imports nothing
    assert import_object("planted_mod:run", "rollout.dataset")() and planted.exists()


def test_vllm_flags_that_load_code_are_names_of_code():
    cfg = RunConfig(
        server={
            "extra_args": [
                "--worker-extension-cls",
                "evil.ext.Worker",
                "--trust-remote-code",
                "--middleware=a.b.mw,c.d",
                "--max-num-seqs",
                "8",
            ]
        }
    )
    refs = {(r.spec, r.module) for r in code_references(cfg) if r.field.startswith("server")}
    assert refs == {
        ("evil.ext.Worker", "evil.ext"),
        ("--trust-remote-code", "--trust-remote-code"),
        ("a.b.mw", "a.b"),
        ("c.d", "c"),
    }
    with pytest.raises(ConfigError, match=r"server.extra_args\[0\].*'evil.ext'"):
        check_code_references(cfg, ("grpo_core",))
    with pytest.raises(ConfigError, match=f"add --trust-remote-code to {ALLOWED_MODULES_ENV}"):
        check_code_references(cfg, ("grpo_core", "evil"))
    check_code_references(cfg, ("grpo_core", "evil", "a", "c", "--trust-remote-code"))


def _cli(tmp_path: Path, *args: str, allowed: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, ALLOWED_MODULES_ENV: allowed, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_owners_config_file_joins_the_allow_list(planted, tmp_path):
    """``grpo validate --config FILE`` runs the file's own dataset factory; the same name is refused to a run
    whose config did not come from its owner (``check_code_references`` with the worker's allow-list)."""
    config = tmp_path / "mine.yaml"
    config.write_text(
        f"train: {{output_dir: {tmp_path / 'runs'}}}\ntracking: {{dir: {tmp_path / 'mlflow'}}}\n"
        "model: {name: tiny-qwen3}\nrollout: {dataset: 'planted_mod:run', num_generations: 2, "
        "max_completion_length: 16}\nserver: {max_model_len: 64}\n"
    )
    done = _cli(tmp_path, "validate", "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert Path(str(planted) + ".called").exists()  # the owner's factory ran


def test_grpo_resume_checks_a_fetched_config_like_a_parameter(planted, tmp_path):
    """The config ``grpo resume RUN_ID`` fetches from MLflow joins nothing: a name outside the allow-list is
    refused (exit code 2) before any process starts."""
    from grpo_core import tracking

    cfg = RunConfig(
        rollout={"dataset": "planted_mod:run"},
        tracking={"dir": tmp_path / "mlflow"},
        train={"output_dir": tmp_path / "runs"},
    )
    run_id, _ = tracking.start_run(cfg, None)
    done = _cli(tmp_path, "resume", run_id, "--set", f"tracking.dir={tmp_path / 'mlflow'}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert ALLOWED_MODULES_ENV in done.stderr and "rollout.dataset" in done.stderr
    assert not planted.exists() and not (tmp_path / "runs").exists()
