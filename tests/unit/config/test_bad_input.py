"""Bad input is refused early with the field or row named (issue 9, items 6 and 7): config files that do not
parse, a later dataset row without a prompt, a tokenizer without a chat template, a LoRA name used as a
path, and reward-function arguments that preflight and scoring must agree on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from grpo_core.config import ModelConfig, RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.scoring import REWARD_ARGUMENTS, reward_kwargs
from grpo_core.rollout.types import Rollout, RolloutGroup
from grpo_core.rollout.window import MetricWindow
from grpo_core.run import preflight

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "name, text, where",
    [
        ("run.yaml", "model:\n  name: tiny-qwen3\ntrain: [max_steps: 2\n", "not valid YAML: line 4, column 1"),
        ("run.json", '{"model": {"name": "tiny-qwen3",}}', "not valid JSON: line 1, column 33"),
        ("run.toml", "[model]\nname = tiny-qwen3\n", "not valid TOML"),
    ],
)
def test_config_file_that_does_not_parse_names_the_file_and_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"config file {path} is {where}"):
        load_config(path)


def test_cli_reports_an_unparsable_config_file_as_a_config_error(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: [2\n")
    result = CliRunner().invoke(app, ["train", "--config", str(path)])
    output = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 2, output
    assert "not valid YAML: line 3, column 1" in output and "Traceback" not in output


def _json_rows(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"json:{path}"


GOOD = {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}


@pytest.mark.parametrize(
    "bad_row, problem",
    [
        ({"prompt": [], "answer": "3"}, "its 'prompt' is list []"),
        ({"prompt": "   ", "answer": "3"}, "its 'prompt' is an empty string"),
        ({"question": "2+1?", "answer": "3"}, "its 'prompt' is missing"),  # json fills the column with null
        ({"prompt": [{"role": "user", "content": ""}], "answer": "3"}, "messages without any content"),
        ({"prompt": [{"text": "2+1?"}], "answer": "3"}, "is not a {'role', 'content'} message"),
    ],
)
def test_a_later_row_without_a_usable_prompt_is_named(tmp_path, bad_row, problem):
    rows = [GOOD] * 6 + [bad_row] + [GOOD] * 3  # row 6: preflight used to read row 0 only
    cfg = RunConfig(rollout={"dataset": _json_rows(tmp_path, rows)})
    with pytest.raises(ConfigError, match=r"row 6: its 'prompt' is") as err:
        preflight.check_dataset(cfg)
    assert problem in str(err.value)


def test_a_later_list_row_without_a_reward_column_is_named(tmp_path):
    rows = [GOOD, GOOD, {"prompt": GOOD["prompt"]}]
    cfg = RunConfig(
        rollout={
            "dataset": "rollout_helpers:rows_of",
            "dataset_kwargs": {"rows": rows},
            "reward_functions": ["grpo_core.demo_rewards:numeric_answer_reward"],
        }
    )
    with pytest.raises(ConfigError, match="needs the dataset column 'answer'.*lacks in row 2"):
        preflight.check_dataset(cfg)


def test_tokenizer_without_chat_template_is_refused_before_a_server_starts(tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(resolve_model_dir(ModelConfig(name="tiny-qwen3")), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = RunConfig(
        model={"name": str(model)},
        train={"output_dir": tmp_path / "runs"},
        tracking={"dir": tmp_path / "mlflow"},
        rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4},
    )
    with pytest.raises(ConfigError, match=f"model.name='{model}': its tokenizer has no chat template"):
        preflight.check_run(cfg)
    # A loop class that renders prompts itself does not need one.
    preflight.check_chat_template(
        cfg.model_copy(
            update={"rollout": cfg.rollout.model_copy(update={"loop_class": "rollout_helpers:PlainRenderLoop"})}
        )
    )


@pytest.mark.parametrize("name", ["../escape", "a/b", "a\\b", "x..y", "/abs", ".hidden", ""])
def test_lora_name_that_is_not_a_plain_name_is_refused(name):
    with pytest.raises(ConfigError, match="train.lora.name"):
        load_config(ROOT / "configs" / "demo.yaml", [f"train.lora.name='{name}'"])


def test_lora_name_that_is_a_plain_name_is_kept():
    assert (
        load_config(ROOT / "configs" / "demo.yaml", ["train.lora.name=policy_v2.1-a"]).train.lora.name
        == "policy_v2.1-a"
    )


def test_preflight_and_scoring_read_one_list_of_reward_arguments(tmp_path):
    cfg = RunConfig(
        rollout={
            "dataset": _json_rows(tmp_path, [GOOD] * 3),
            "reward_functions": ["rollout_helpers:needs_every_supplied_argument"],
        }
    )
    assert preflight.required_reward_columns(cfg) == {"answer": "rollout_helpers:needs_every_supplied_argument"}
    preflight.check_dataset(cfg)
    group = RolloutGroup(
        prompt_index=5,
        row_index=5,
        epoch=2,
        row=dict(GOOD),
        prompts=[GOOD["prompt"]] * 2,
        rollouts=[Rollout(completion=[], completion_ids=[1], turns=[])] * 2,
        sequences=[[], []],
        policy_version=4,
        trainer_step=9,
    )
    window = MetricWindow()
    kwargs = reward_kwargs(group, window)
    assert set(kwargs) == set(REWARD_ARGUMENTS) | {"answer"}
    assert (kwargs["trainer_state"].step, kwargs["trainer_state"].policy_version, kwargs["trainer_state"].epoch) == (
        9,
        4,
        2,
    )
    assert kwargs["environments"] == [None, None] and kwargs["answer"] == ["2", "2"]
    kwargs["log_metric"]("my/metric", 3.0)
    assert window.drain() == {"my/metric": 3.0}


def test_reward_function_needing_log_extra_is_refused_in_prepare(tmp_path):
    cfg = RunConfig(
        rollout={"dataset": _json_rows(tmp_path, [GOOD] * 3), "reward_functions": ["rollout_helpers:needs_log_extra"]},
        train={"output_dir": tmp_path / "runs"},
        tracking={"dir": tmp_path / "mlflow"},
    )
    with pytest.raises(ConfigError, match="needs_log_extra needs 'log_extra', which grpo-flow does not supply"):
        preflight.check_run(cfg)


@pytest.mark.parametrize(
    "store, says",
    [
        (
            "{tmp}/no-mount/run",
            "train.adapter_store='{tmp}/no-mount/run': {tmp}/no-mount does not exist on this host; "
            "mount the shared store there (or create it), or fix the path",
        ),
        ("{tmp}/a-file", "train.adapter_store='{tmp}/a-file' is a file; give a folder every server host sees"),
        (
            "foo://bucket/run",
            "train.adapter_store='foo://bucket/run': unknown fsspec protocol 'foo'; write a shared folder",
        ),
        (
            "s3:/bucket/run",
            "train.adapter_store='s3:/bucket/run' looks like a URL with one slash; write 's3://bucket/run'",
        ),
        ("memory://run", "train.adapter_store='memory://run': fsspec's memory filesystem lives inside one process"),
    ],
)
def test_an_adapter_store_this_host_cannot_use_is_refused_before_anything_starts(tmp_path, store, says):
    """A missing mount, a file, an unknown protocol or a one-slash URL would fail the trainer at its first adapter
    (after the servers started), or fill a local folder no server host sees."""
    (tmp_path / "a-file").write_text("not a folder")
    cfg = RunConfig(
        train={"output_dir": tmp_path / "runs", "lora": {"enabled": True}, "adapter_store": store.format(tmp=tmp_path)},
        tracking={"dir": tmp_path / "mlflow"},
    )
    with pytest.raises(ConfigError) as info:
        preflight.check_run(cfg)
    assert str(info.value).startswith(says.format(tmp=tmp_path)), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "nothing created (no run folder, no 's3:')"
    assert (tmp_path / "a-file").read_text() == "not a folder"
    usable = tmp_path / "mnt" / "adapters"  # a new folder below an existing mount, a file:// URL
    (tmp_path / "mnt").mkdir()
    for good in (str(usable), f"file://{usable}"):
        preflight.check_adapter_store(
            cfg.model_copy(update={"train": cfg.train.model_copy(update={"adapter_store": good})})
        )


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "train.lora=true",
            "train.lora: a section, not one value (got True): set its keys, e.g. --set train.lora.enabled=true",
        ),
        ("eval=false", "eval: a section, not one value (got False): set its keys, e.g. --set eval.dataset=VALUE"),
        ("train=3", "train: a section, not one value (got 3): set its keys, e.g. --set train.output_dir=VALUE"),
        (
            "rollout.datasets=[rows.jsonl]",
            "rollout.datasets[0]: a section, not one value (got 'rows.jsonl'): set its "
            "keys, e.g. --set rollout.datasets[0].path=VALUE",
        ),
        (
            "rollout.dataset_kwargs=3",
            "rollout.dataset_kwargs: Input should be a valid dictionary (got 3); write a "
            "mapping, e.g. rollout.dataset_kwargs={name: value}",
        ),
    ],
)
def test_a_section_given_one_value_says_to_set_its_keys(override, says):
    """A section written as one value (new-user tryout: ``--set train.lora=true`` said only 'Input should be a valid
    dictionary or instance of LoraConfig') names an example key and the section's keys, read from the model."""
    from grpo_core.config import LoraConfig

    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    message = str(refused.value)
    assert says in message, message
    if override == "train.lora=true":  # every key of the section is listed (it has fewer than ten)
        assert message.endswith(f"its keys: {', '.join(LoraConfig.model_fields)}"), message
    assert "instance of" not in message, message
