"""Run parameters never run code outside the allow-list (issue 11, item 1): a ``module:callable`` name from a
config is refused before its module is imported or anything is called, naming the field and
``GRPO_ALLOWED_MODULES``; the owner's own config file joins the allow-list. Issue 26, item 1: only registered
config entries of the field's kind can be named (no other function of grpo_core or of a listed module), and
``server.extra_args`` carries only allow-listed vLLM flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.run import preflight
from grpo_core.security import allowlist
from grpo_core.security.allowlist import ALLOWED_MODULES_ENV, check_code_references, code_references, import_object

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module ``planted_mod`` whose import, and whose ``run`` function, each create a marker file; it also holds
    a registered dataset entry ``good``, module-level rows ``ROWS``, a re-exported file writer and an unregistered
    subclass of a registered environment."""
    marker = tmp_path / "imported"
    (tmp_path / "planted_mod.py").write_text(
        "from pathlib import Path\n"
        "from grpo_core.run.durable import atomic_write_text\n"
        "from grpo_core.entries import config_entry\n"
        f"Path({str(marker)!r}).touch()\n"
        "ROWS = [{'prompt': [{'role': 'user', 'content': 'hi'}]}]\n"
        "def run(**kwargs):\n"
        f"    Path({str(marker)!r} + '.called').touch()\n"
        "    return ROWS\n"
        "@config_entry('dataset')\n"
        "def good(n=1):\n"
        "    return ROWS * n\n"
        "@config_entry('environment')\n"
        "class Env:\n"
        "    def reset(self, **row):\n"
        "        return None\n"
        "class SubEnv(Env):\n"
        "    pass\n"
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
        ("grpo_core.run.preflight:os.system", "not a registered dataset entry of grpo_core.run.preflight"),
        ("grpo_core.rollout.data:json", "not a registered dataset entry of grpo_core.rollout.data"),
        ("grpo_core.config.base:Path", "not a registered dataset entry of grpo_core.config.base"),
        ("grpo_core.config:RunConfig.model_validate", "not a registered dataset entry"),
        ("grpo_core.rollout.loop:RolloutLoop.render", "not a registered dataset entry"),
        ("grpo_core.config:RunConfig.__init__", "'__' is refused"),
        ("grpo_core.run.preflight:__builtins__", "'__' is refused"),
        ("grpo_core.demo_rewards:no_such_name", "cannot be imported"),
        ("grpo_core:..x", "must be 'module:attribute'"),
        ("grpo_coreX.y:z", "not in the allow-list"),
    ],
)
def test_nothing_but_a_registered_entry_of_grpo_core_can_be_named(monkeypatch, spec, why):
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    with pytest.raises(ConfigError, match=why):
        import_object(spec, "rollout.dataset")


# Functions of grpo_core that run code or write files when called with keyword arguments of the attacker's choice
# (issue 26, item 1): an atomic file writer, a private-file writer, and the helper that runs a module's __main__.
GADGETS = [
    ("grpo_core.run.durable:atomic_write_text", lambda target: {"path": str(target), "text": "written"}),
    ("grpo_core.security.redact:write_private", lambda target: {"path": str(target), "text": "written"}),
    ("grpo_core.run.lifeline:run_owned_module", lambda target: {"argv": ["planted_mod"]}),
]


@pytest.mark.parametrize(("spec", "kwargs"), GADGETS, ids=[g[0] for g in GADGETS])
def test_a_gadget_of_grpo_core_named_as_a_dataset_factory_is_refused_and_not_called(planted, tmp_path, spec, kwargs):
    """The dataset factory is called with ``rollout.dataset_kwargs`` (``load_dataset``, the rollout's own path):
    every function of grpo_core used to pass; now the name is refused before the call, saying what can be named."""
    from grpo_core.rollout.data import load_dataset

    target = tmp_path / "written.txt"
    cfg = RunConfig(rollout={"dataset": spec, "dataset_kwargs": kwargs(target)})
    check_code_references(cfg)  # the module is allowed (grpo_core): only the entry check stands in the way
    with pytest.raises(ConfigError, match="is not a registered dataset entry of grpo_core") as info:
        load_dataset(cfg.rollout)
    assert "rollout.dataset" in str(info.value) and "@config_entry" in str(info.value)
    assert not target.exists() and not planted.exists()  # nothing written, no module's __main__ ran


@pytest.mark.parametrize(
    ("spec", "field", "why"),
    [
        ("grpo_core.demo_rewards:numeric_answer_reward", "rollout.loop_class", "not a RolloutLoop subclass"),
        ("grpo_core.rollout.loop:RolloutLoop", "rollout.reward_functions[0]", "the class RolloutLoop, not a function"),
        ("rollout_helpers:CounterEnv", "rollout.dataset", "the class CounterEnv, not a function"),
        ("rollout_helpers:rows", "rollout.environment_factory", "a function object, not a class"),
        ("rollout_helpers:CounterEnv", "rollout.loop_class", "not a RolloutLoop subclass"),
        ("rollout_helpers:CurriculumLoop", "rollout.tools[0]", "not a function"),
        ("rollout_helpers:parity_reward", "rollout.tools[0]", "registered as a reward entry, not a tool"),
    ],
)
def test_each_kind_is_checked_where_a_config_names_it(monkeypatch, spec, field, why):
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "rollout_helpers")
    with pytest.raises(ConfigError, match=why) as info:
        import_object(spec, field)
    assert field in str(info.value)


def test_the_decorator_checks_the_kind_when_an_entry_is_registered():
    from grpo_core.entries import config_entry, registered

    def positional_only(completions, /):
        return completions

    class NoReset:
        pass

    for kind, obj, why in [
        ("reward", positional_only, "positional-only parameter 'completions'"),
        ("dataset", NoReset, "the class NoReset, not a function"),
        ("environment", NoReset, "has no reset method"),
        ("tool", len, "not a function"),
        ("loop_class", positional_only, "is not a class"),
    ]:
        with pytest.raises(ValueError, match=why):
            config_entry(kind)(obj)
    with pytest.raises(ValueError, match="one or more of dataset, reward"):
        config_entry("gadget")
    assert (
        registered(f"{__name__}:test_the_decorator_checks_the_kind_when_an_entry_is_registered.<locals>.NoReset")
        is None
    )


def test_a_module_level_object_re_export_or_subclass_that_is_not_registered_is_refused(planted, monkeypatch):
    """Listing a module admits its registered entries only: its rows, an unregistered function, a function it
    imported and an unregistered subclass of an entry are refused; an entry listed by name is admitted."""
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "planted_mod")
    assert (
        import_object("planted_mod:good", "rollout.dataset")(n=2)
        == [{"prompt": [{"role": "user", "content": "hi"}]}] * 2
    )
    assert import_object("planted_mod:Env", "rollout.environment_factory").__name__ == "Env"
    for spec, field in [
        ("planted_mod:ROWS", "rollout.dataset"),
        ("planted_mod:run", "rollout.dataset"),
        ("planted_mod:atomic_write_text", "rollout.dataset"),
        ("planted_mod:SubEnv", "rollout.environment_factory"),
    ]:
        kind = "environment" if "environment" in field else "dataset"
        with pytest.raises(ConfigError, match=f"is not a registered {kind} entry of planted_mod"):
            import_object(spec, field)
    assert not Path(str(planted) + ".called").exists()
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "planted_mod:run,planted_mod:ROWS,planted_mod:atomic_write_text")
    assert import_object("planted_mod:run", "rollout.dataset")() and Path(str(planted) + ".called").exists()
    with pytest.raises(ConfigError, match="a module-level object"):
        import_object("planted_mod:ROWS", "rollout.dataset")
    with pytest.raises(ConfigError, match="defined in 'grpo_core.run.durable'"):
        import_object("planted_mod:atomic_write_text", "rollout.dataset")
    with pytest.raises(ConfigError, match="not in the allow-list"):
        import_object("planted_mod:good", "rollout.dataset")  # the module itself is no longer listed


def test_every_entry_the_ready_configs_name_resolves(monkeypatch):
    """The configs in configs/ and the default loop class name registered entries of grpo_core only."""
    from grpo_core.config import load_config

    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    from grpo_core.demo_rewards import answer_format_reward, even_token_reward, numeric_answer_reward
    from grpo_core.rollout.loop import RolloutLoop

    named = set()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path, [])
        check_code_references(cfg)
        for ref in code_references(cfg):
            named.add(ref.spec)
            assert import_object(ref.spec, ref.field) is not None
    assert {f"grpo_core.demo_rewards:{f.__name__}" for f in (answer_format_reward, even_token_reward)} <= named
    assert import_object("grpo_core.demo_rewards:numeric_answer_reward", "rollout.reward_functions[0]") is (
        numeric_answer_reward
    )
    assert import_object("grpo_core.rollout.loop:RolloutLoop", "rollout.loop_class") is RolloutLoop


def test_the_environment_variable_extends_the_allow_list_by_module_and_submodule(planted, monkeypatch):
    cfg = RunConfig(rollout={"dataset": "planted_mod:good"})
    with pytest.raises(ConfigError):
        check_code_references(cfg)
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "other, planted_mod")
    check_code_references(cfg)
    assert allowlist.is_allowed("planted_mod.sub") and not allowlist.is_allowed("planted_modx")
    assert not planted.exists()  # checking imports nothing
    assert import_object("planted_mod:good", "rollout.dataset")() and planted.exists()


def _server_args(*args: str) -> RunConfig:
    return RunConfig(server={"extra_args": list(args)})


def test_vllm_flags_are_an_allow_list_not_a_deny_list():
    """Tuning flags pass with nothing listed; any other flag (a KV-transfer config imports its connector's module,
    --host opens a listener) must be listed itself, and the class path of a code-loading flag too."""
    check_code_references(
        _server_args("--max-num-seqs", "8", "--enable-prefix-caching", "--kv-cache-dtype=fp8", "--seed", "-1"),
        ("grpo_core",),
    )
    for args, why in [
        (("--kv-transfer-config", '{"kv_connector_module_path": "evil"}'), "'--kv-transfer-config' is not a vLLM flag"),
        (("--host", "0.0.0.0"), "'--host' is not a vLLM flag a run may set"),
        (("--trust-remote-code",), f"add --trust-remote-code to {ALLOWED_MODULES_ENV}"),
        (("--enforce-eager", "evil.py"), r"server.extra_args\[1\]='evil.py' is no vLLM flag"),
        (("--enforce-eager=1",), "takes no value"),
        (("--max-num-seqs",), "needs a value"),
    ]:
        with pytest.raises(ConfigError, match=why):
            check_code_references(_server_args(*args), ("grpo_core",))
    cfg = _server_args("--worker-extension-cls", "evil.ext.Worker", "--middleware=a.b.mw,c.d", "--trust-remote-code")
    refs = [r.spec for r in code_references(cfg) if r.field.startswith("server")]
    assert refs == ["--worker-extension-cls", "evil.ext.Worker", "--middleware", "a.b.mw", "c.d", "--trust-remote-code"]
    with pytest.raises(ConfigError, match=r"server.extra_args\[0\]='--worker-extension-cls'"):
        check_code_references(cfg, ("grpo_core", "evil", "a", "c"))  # modules no longer admit a flag or a class
    with pytest.raises(ConfigError, match=r"'evil.ext.Worker' names code vLLM imports"):
        check_code_references(cfg, ("grpo_core", "evil", "--worker-extension-cls", "--middleware"))
    check_code_references(cfg, ("grpo_core", *refs))


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


def test_vllm_is_launched_only_with_flags_the_launching_workers_allow_list_admits(monkeypatch):
    """The servers' flow run (``grpo-servers``) takes its config as a parameter and never runs preflight: the vLLM
    command line itself is checked against the allow-list where it is built."""
    from grpo_core.serving.launch import vllm_command

    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    cfg = RunConfig(
        model={"name": "tiny-llama"}, server={"extra_args": ["--kv-transfer-config", '{"kv_connector": "x"}']}
    )
    with pytest.raises(
        ConfigError, match=f"'--kv-transfer-config' is not a vLLM flag a run may set.*{ALLOWED_MODULES_ENV}"
    ):
        vllm_command(cfg)
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "--kv-transfer-config")
    assert "--kv-transfer-config" in vllm_command(cfg).argv
    safe = RunConfig(model={"name": "tiny-llama"}, server={"extra_args": ["--max-num-batched-tokens", "4096"]})
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    assert vllm_command(safe).argv[-2:] == ["--max-num-batched-tokens", "4096"]


@pytest.mark.parametrize("field", ["rollout.reward_functions[0]", "eval.reward_functions[0]"])
def test_a_misspelt_reward_of_the_users_own_module_gets_a_suggestion(tmp_path, monkeypatch, field):
    """A config passed to ``grpo train --config`` lists its own names (``trust_config``): a misspelt one of them,
    registered or a plain function of the user's module, is named with the closest name of the module."""
    (tmp_path / "my_scores.py").write_text(
        "def exact_match(completions, answer, **_):\n    return [0.0] * len(completions)\n\n"
        "def _exact_match_helper():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for path, suggestion in [
        ("my_scores:exact_mach", "my_scores:exact_match"),
        ("examples.rewards:contains_answr", "examples.rewards:contains_answer"),
        ("grpo_core.demo_rewards:even_token_rewrd", "grpo_core.demo_rewards:even_token_reward"),
    ]:
        with pytest.raises(ConfigError) as err:
            import_object(path, field, allowed=("grpo_core", path))
        message = str(err.value)
        assert message.startswith(f"{field}={path!r} cannot be imported"), message
        assert message.endswith(f"; did you mean {suggestion}?"), message


def test_preflight_refuses_a_sync_reward_that_cannot_be_pickled_for_the_reward_workers(tmp_path, monkeypatch):
    """A lambda or nested sync reward function passed validate and failed at the first group (the reward worker
    processes get each call pickled); async ones and ``reward_workers: 0`` need no pickling."""
    from grpo_core.config import RolloutConfig
    from grpo_core.config.evaluation import EvalConfig

    (tmp_path / "my_lambdas.py").write_text(
        "score = lambda completions, **_: [1.0] * len(completions)\n\n"
        "def _make():\n    def inner(completions, **_):\n        return [1.0] * len(completions)\n    return inner\n\n"
        "nested = _make()\n\n"
        "def good(completions, **_):\n    return [1.0] * len(completions)\n\n"
        "async def later(completions, **_):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["my_lambdas:score", "my_lambdas:nested", "my_lambdas:good", "my_lambdas:later"]
    monkeypatch.setenv(ALLOWED_MODULES_ENV, ",".join(["grpo_core", *names]))
    import my_lambdas  # the set-up: the lambda and the nested function really cannot be pickled, the others can

    for func in (my_lambdas.score, my_lambdas.nested):
        with pytest.raises(Exception):  # noqa: B017 - pickling raises PicklingError or AttributeError
            __import__("pickle").dumps(func)
    for name in ("my_lambdas:score", "my_lambdas:nested"):
        cfg = RunConfig(rollout=RolloutConfig(reward_functions=["my_lambdas:good", name], reward_workers=2))
        with pytest.raises(ConfigError) as err:
            preflight.check_reward_pickling(cfg)
        message = str(err.value)
        assert message.startswith(f"rollout.reward_functions: {name} cannot be pickled"), message
        for fix in ("top-level function", "make it async", "rollout.reward_workers: 0"):
            assert fix in message, message
        preflight.check_reward_pickling(
            cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"reward_workers": 0})})
        )
    preflight.check_reward_pickling(
        RunConfig(rollout=RolloutConfig(reward_functions=["my_lambdas:good", "my_lambdas:later"]))
    )
    evaluated = RunConfig(eval=EvalConfig(dataset="x.jsonl", reward_functions=["my_lambdas:score"]))
    assert evaluated.eval.enabled
    with pytest.raises(ConfigError, match=r"^eval\.reward_functions: my_lambdas:score cannot be pickled"):
        preflight.check_reward_pickling(evaluated)
