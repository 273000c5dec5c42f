"""Every shipped config parses, and the GPU configs put vLLM and the trainer where their weight sync works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_core.config import RunConfig, TrainerProcessConfig, load_config, load_trainer_config
from grpo_core.errors import ConfigError
from grpo_core.serving.launch import check_gpu_layout

CONFIGS = sorted(Path(__file__).resolve().parents[3].glob("configs/*.yaml"))
GPU = [p for p in CONFIGS if p.name.startswith("gpu-")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(path, tmp_path):
    cfg = load_config(path)
    sub = load_trainer_config(path)  # the trainer's entry point takes a run config too
    assert sub == cfg.trainer_process()
    written = tmp_path / "train_config.json"  # what the flow writes; the trainer reads it back unchanged
    written.write_text(sub.model_dump_json())
    assert load_trainer_config(written) == sub


def test_the_gpu_configs_of_the_issue_exist():
    assert {p.name for p in GPU} >= {
        "gpu-1xh200.yaml",
        "gpu-1xh200-lora.yaml",
        "gpu-2xh200.yaml",
        "gpu-qwen3-0.6b-random.yaml",
    }


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.name)
def test_gpu_configs_place_vllm_and_trainer_for_their_weight_sync(path):
    cfg = load_config(path)
    assert cfg.server.backend == "vllm" and cfg.train.device == "cuda" and cfg.rollout.num_generations == 8
    check_gpu_layout(cfg)
    server_gpus, trainer_gpus = set(cfg.server.gpu_ids), set(cfg.train.gpu_ids)
    if cfg.train.lora.enabled:
        assert cfg.serves_lora() and server_gpus == trainer_gpus
    elif cfg.server.weight_transfer_backend == "ipc":
        assert server_gpus == trainer_gpus and cfg.server.gpu_memory_utilization <= 0.5  # the trainer needs the rest
    else:
        assert cfg.server.weight_transfer_backend == "nccl" and not server_gpus & trainer_gpus


@pytest.mark.parametrize(
    "backend, train_gpus, message",
    [
        ("nccl", [0], "'nccl' needs the trainer and vLLM on different GPUs"),
        ("ipc", [1], "'ipc' needs every vLLM GPU among the trainer's"),
    ],
)
def test_gpu_layout_that_cannot_sync_is_refused_naming_the_fields(backend, train_gpus, message):
    cfg = load_config(
        None,
        [
            "server.backend=vllm",
            "server.gpu_ids=[0]",
            f"server.weight_transfer_backend={backend}",
            f"train.gpu_ids={train_gpus}",
        ],
    )
    with pytest.raises(ConfigError, match=message):
        check_gpu_layout(cfg)


def test_trainer_gpu_ids_must_cover_its_ranks():
    with pytest.raises(ConfigError, match=r"train.gpu_ids lists 1 distinct GPUs but train.num_ranks is 2"):
        load_config(None, ["train.num_ranks=2", "train.gpu_ids=[3]"])


def test_the_trainer_gets_only_its_sub_config_from_the_owners(tmp_path):
    cfg = RunConfig(
        model={"name": "tiny-qwen3"},
        server={"max_model_len": 512, "api_key": "k-123", "control_retry_s": 2},
        rollout={
            "max_staleness": 3,
            "num_generations": 4,
            "top_k": 20,
            "dataset_size": 77,
            "max_completion_length": 64,
        },
        packing={"backend": "python"},
        export={"max_shard_size": "1GB"},
        train={"max_steps": 9},
    )
    sub = cfg.trainer_process()
    assert set(type(sub).model_fields) == {
        "process",
        "model",
        "train",
        "tracking",
        "rollout",
        "server",
        "packing",
        "export",
        "eval",
        "token_budget",
    }
    assert set(type(sub.eval).model_fields) == {"dataset", "every_steps", "at_end", "final_timeout_s"}
    assert sub.train == cfg.train and sub.model == cfg.model and sub.tracking == cfg.tracking
    assert (sub.rollout.max_staleness, sub.rollout.num_generations, sub.rollout.dataset_size) == (3, 4, 77)
    assert sub.rollout.uses_candidate_filter() and not RunConfig().trainer_process().rollout.uses_candidate_filter()
    assert (sub.server.resolved_api_key(), sub.server.control_retry_s) == ("k-123", 2)
    assert (sub.packing.backend, sub.export.max_shard_size) == ("python", "1GB")
    # nothing the trainer does not read: the servers' launch settings, the rollout's dataset code, the flow's section
    assert "max_model_len" not in type(sub.server).model_fields and "extra_args" not in type(sub.server).model_fields
    assert "reward_functions" not in type(sub.rollout).model_fields and "flow" not in type(sub).model_fields
    assert sub.token_budget == 512  # server.max_model_len when packing.token_budget is unset
    assert (
        RunConfig(packing={"token_budget": 96}, server={"max_model_len": 128}, rollout={"max_completion_length": 32})
        .trainer_process()
        .token_budget
        == 96
    )
    # written by the flow: the secret masked; the trainer gets it from GRPO_RUN_SECRETS under its run-config path
    path = tmp_path / "train_config.json"
    path.write_text(sub.model_dump_json(indent=1))
    assert "k-123" not in path.read_text()
    with pytest.raises(ConfigError, match="server.api_key holds a redacted value"):
        load_trainer_config(path)
    again = load_trainer_config(path, ["train.max_steps=5"], secrets={"server.api_key": "k-123"})
    assert again.server.resolved_api_key() == "k-123" and again.train.max_steps == 5
    # errors name the user-facing field
    with pytest.raises(ConfigError, match=r"(?s)rollout.seed.*only the fields the trainer reads"):
        load_trainer_config(path, ["rollout.seed=3"], secrets={"server.api_key": "k-123"})
    with pytest.raises(ConfigError, match=r"train.clip_min \(6.0\) must be below train.clip_max"):
        load_trainer_config(path, ["train.clip_min=6"], secrets={"server.api_key": "k-123"})
    with pytest.raises(ConfigError, match=r"rollout.max_staleness.*greater than or equal to 0"):
        load_trainer_config(path, ["rollout.max_staleness=-1"], secrets={"server.api_key": "k-123"})
    with pytest.raises(ValueError, match="train.rdzv_endpoint"):
        TrainerProcessConfig.model_validate({**sub.model_dump(), "server": {}, "train": {"nnodes": 2}})


def test_the_checkpoint_fingerprint_keeps_the_run_config_paths():
    from grpo_core.train.fingerprint import fingerprint

    cfg = RunConfig(
        rollout={"num_generations": 4, "max_staleness": 2, "dataset": "reasoning_gym:leg_counting", "dataset_seed": 5},
        train={"learning_rate": 3e-4},
    )
    fp = fingerprint(cfg.trainer_process())
    assert fp["config"]["rollout.num_generations"] == 4 and fp["config"]["rollout.max_staleness"] == 2
    assert fp["config"]["train.learning_rate"] == 3e-4 and fp["config"]["model.name"] == "smollm2-135m-instruct"
    assert (
        fp["dataset"]["rollout.dataset"] == "reasoning_gym:leg_counting" and fp["dataset"]["rollout.dataset_seed"] == 5
    )
    assert None not in fp["config"].values() or fp["config"]["train.epsilon_high"] is None  # every key resolved
    assert set(fp["config"]) - {k for k, v in fp["config"].items() if v is not None} <= {
        "model.revision",
        "train.epsilon_high",
        "train.save_total_limit",
        "train.tis_cap",
        "train.router_aux_loss_coef",
        "rollout.reward_weights",
        "rollout.overlong_buffer_len",
    }


@pytest.mark.parametrize(
    "urls", [["http://gpu-1:8000"], ["http://gpu-1:8000", "http://gpu-2:8000", "http://gpu-3:8000"]]
)
def test_num_replicas_that_contradicts_server_urls_is_refused(urls):
    """``server.num_replicas`` counts the servers the flow starts; with ``server.urls`` each URL is a replica, so
    another count was silently ignored: refused, naming both fields and the fix."""
    with pytest.raises(
        ValueError, match=rf"server.num_replicas \(2\).*server.urls lists {len(urls)}.*list every replica's URL"
    ):
        RunConfig.model_validate({"server": {"urls": urls, "num_replicas": 2}})
    assert RunConfig.model_validate({"server": {"urls": urls[:2], "num_replicas": len(urls[:2])}}).server.urls
    assert RunConfig.model_validate({"server": {"urls": urls}}).server.num_replicas == 1  # unset: the URLs count


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["server.port=8000", "server.num_replicas=2", "server.router_port=8001"],
            "server.router_port (8001) is also server.port + 1 (replica 1): two of the run's listeners cannot share a "
            "port; "
            "choose another server.router_port (0 = a free one)",
        ),
        (["server.port=8000", "server.router_port=8000"], "server.router_port (8000) is also server.port:"),
        (
            ["server.router_port=8100", "rollout.flight_port=8100"],
            "rollout.flight_port (8100) is also server.router_port:",
        ),
        (
            ["server.port=9000", "server.num_replicas=3", "rollout.flight_port=9002"],
            "rollout.flight_port (9002) is also server.port + 2 (replica 2):",
        ),
        (
            ["server.urls=[http://localhost:8000]", "server.router_port=8000"],
            "server.router_port (8000) is also the port of server.urls[0]:",
        ),
        (
            ["server.num_replicas=2", "server.gpu_ids=[0, 1, 2]"],
            "server.gpu_ids lists 3 GPUs but server.num_replicas * server.tensor_parallel_size = 2: the last 1 would "
            "hold "
            "no replica; list 2, or raise server.num_replicas to use them",
        ),
    ],
)
def test_replica_ports_and_gpus_the_run_could_not_use_are_refused(overrides, says):
    """Two listeners on one port: the later (the router, after every replica) failed at start with the replica's
    setting named; GPUs beyond the replicas were silently left idle."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert str(info.value).splitlines()[1].strip().startswith(says), str(info.value)


def test_ports_and_gpus_that_fit_the_replicas_are_kept():
    cfg = load_config(
        overrides=[
            "server.port=8000",
            "server.num_replicas=2",
            "server.router_port=8002",
            "rollout.flight_port=8003",
            "server.gpu_ids=[0, 0]",
            "server.gpu_memory_utilization=0.4",
        ]
    )
    assert (cfg.server.router_port, cfg.rollout.flight_port, cfg.server.gpu_ids) == (8002, 8003, [0, 0])
    assert load_config(overrides=["server.port=0", "server.router_port=0", "rollout.flight_port=0"]).server.port == 0
    elsewhere = load_config(overrides=["server.urls=[http://gpu-1:8000]", "server.router_port=8000"])
    assert elsewhere.server.router_port == 8000  # the replica's port is on another host


@pytest.mark.parametrize(
    "server, field, why",
    [
        ({"urls": ["http://gpu-1:8000"], "gpu_ids": [0, 1]}, "gpu_ids", "server.urls"),
        ({"urls": ["http://gpu-1:8000"], "backend": "vllm"}, "backend", "server.urls"),
        ({"backend": "embedded", "extra_args": ["--worker-cls", "evil.mod:W"]}, "extra_args", "vLLM only"),
        ({"backend": "vllm", "embedded_num_threads": 2}, "embedded_num_threads", "embedded server only"),
        ({"lifeline_timeout_s": 5}, "lifeline_timeout_s", "server.deployment only"),
        ({"route_imbalance": 2}, "route_imbalance", "one replica, nothing to route between"),
        ({"urls": ["http://gpu-1:8000"], "route_imbalance": 0}, "route_imbalance", "one replica"),
    ],
)
def test_a_server_setting_that_has_no_effect_is_warned_about(caplog, server, field, why):
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RunConfig.model_validate({"server": server})
    assert re.search(rf"server\.{field}(, server\.\w+)*: no effect \({why}", caplog.text), caplog.text
    assert caplog.text.rstrip().endswith("delete them" if ", server." in caplog.text else "delete it"), caplog.text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_set_nothing_that_has_no_effect(path, caplog):
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        load_config(path)
    assert "no effect" not in caplog.text, caplog.text


@pytest.mark.parametrize(
    "override, says",
    [
        ("train.max_stepz=3", "train.max_stepz: unknown key; did you mean train.max_steps"),
        ("trian.max_steps=3", "trian: unknown key; did you mean train"),
        ("server.num_replica=2", "server.num_replica: unknown key; did you mean server.num_replicas?"),
        ("train.lora.rr=3", "train.lora.rr: unknown key; did you mean train.lora.r?"),
        ("rollout.temprature=1", "did you mean rollout.temperature?"),
    ],
)
def test_an_unknown_key_names_the_closest_fields_of_its_section(override, says):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert says in str(info.value)


@pytest.mark.parametrize(
    "override, says",
    [
        ("train.temperature=0.5", "train.temperature: unknown key; did you mean rollout.temperature?"),
        ("rollout.learning_rate=0.1", "rollout.learning_rate: unknown key; did you mean train.learning_rate?"),
        ("max_steps=3", "max_steps: unknown key; did you mean train.max_steps?"),
        ("rollout.max_model_len=300", "rollout.max_model_len: unknown key; did you mean server.max_model_len?"),
        ("server.lora.enabled=true", "server.lora: unknown key; did you mean train.lora or server.max_loras?"),
        ("foo.bar=1", "foo: unknown key\n"),  # nowhere: no guess
    ],
)
def test_a_key_written_in_the_wrong_section_names_the_section_that_has_it(override, says):
    """New-user tryout: ``--set train.temperature=0.5`` said only 'unknown key' (no spelling is close). The section
    that has the key, as the field lists of the config's models say, comes first, before close spellings."""
    from grpo_core.config import RolloutConfig, ServerConfig, TrainConfig

    assert "temperature" in RolloutConfig.model_fields and "temperature" not in TrainConfig.model_fields  # set-up
    assert "max_model_len" in ServerConfig.model_fields and "max_model_len" not in RolloutConfig.model_fields
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert says in f"{info.value}\n", str(info.value)


@pytest.mark.parametrize(
    "override, field, value",
    [
        ("rollout.system_prompt=Answer: briefly", "rollout.system_prompt", "Answer: briefly"),  # YAML: a mapping
        ("rollout.system_prompt=- be brief", "rollout.system_prompt", "- be brief"),  # a list
        ("rollout.system_prompt=[x]", "rollout.system_prompt", "[x]"),
        ("rollout.system_prompt=# brief", "rollout.system_prompt", "# brief"),  # a comment: null
        ("tracking.experiment_name=2024", "tracking.experiment_name", "2024"),  # a number
        ("tracking.experiment_name=yes", "tracking.experiment_name", "yes"),  # YAML 1.1's true
        ("rollout.dataset=reasoning_gym:", "rollout.dataset", "reasoning_gym:"),  # then refused as no task, by name
        ("rollout.system_prompt=null", "rollout.system_prompt", None),  # null spelt out still unsets it
        ("rollout.system_prompt='Answer: x'", "rollout.system_prompt", "Answer: x"),  # quoted as before
        ("train.max_steps=7", "train.max_steps", 7),  # other fields keep their YAML value
        ("rollout.reward_functions=[a:b]", "rollout.reward_functions", ["a:b"]),
    ],
)
def test_a_text_field_takes_an_override_as_written(override, field, value):
    """New-user tryout: ``--set rollout.system_prompt=Answer: briefly`` was refused with 'Input should be a valid
    string' (YAML reads a mapping), and ``# brief`` silently unset the field. A field whose type is text only takes
    the text as written; the expected values are the command lines' own text."""
    section, name = field.split(".")
    before = [f"{field}=something else"] if value is None else []  # null unsets what an earlier override set
    assert getattr(getattr(load_config(overrides=before), section), name) != value  # set-up: not the value already
    assert getattr(getattr(load_config(overrides=[*before, override]), section), name) == value


@pytest.mark.parametrize(
    "override, says",
    [
        ("=5", "the key before '=' is empty"),
        (" =5", "the key before '=' is empty"),
        ("train..max_steps=5", "has an empty part"),
        ("train.=5", "has an empty part"),
    ],
)
def test_an_override_without_a_key_says_so(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        load_config(overrides=[override])
    assert "config" not in str(info.value)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["train.clip_min=9"], "train.clip_min (9.0) must be below train.clip_max"),
        (["server.urls=[http://gpu-1:8000]", "server.num_replicas=3"], "server.num_replicas (3) applies"),
        (["rollout.top_p=0.5"], "rollout.top_p < 1 needs rollout.top_k > 0"),
        (["server.urls=[ftp://x]"], "server.urls: 'ftp://x' is not an http(s) base URL"),
    ],
)
def test_a_cross_field_error_is_its_own_message_without_pydantic_prefixes(overrides, says):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    lines = str(info.value).splitlines()
    assert lines[1].strip().startswith(says), lines
    assert "Value error" not in str(info.value) and not any(line.strip().startswith("config:") for line in lines)


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "server.urls=http://gpu-1:8000",
            "server.urls: Input should be a valid list; write [http://gpu-1:8000] for one item",
        ),
        ("server.gpu_ids=3", "server.gpu_ids: Input should be a valid list; write [3] for one item"),
    ],
)
def test_one_value_where_a_list_goes_says_how_to_write_the_list(override, says):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert str(info.value).splitlines()[1:] == [f"  {says}"], str(info.value)
    assert load_config(overrides=[f"{override.split('=')[0]}={says.split('write ')[1].split(' for')[0]}"])


def test_an_indexed_override_sets_one_item_of_a_list_field(tmp_path):
    path = tmp_path / "mixture.yaml"
    path.write_text(
        "rollout:\n  datasets:\n    - {path: a.jsonl, weight: 1}\n    - {path: b.jsonl, weight: 2, name: bee}\n"
    )
    config = load_config(
        path,
        [
            "rollout.datasets[0].path=c.jsonl",
            "rollout.datasets[1].weight=5",
            "train.lora.target_modules[1]=up_proj",  # a list the file leaves at its default
            "train.adam_betas[1]=0.95",
        ],
    )
    assert [(d.path, d.weight, d.name) for d in config.rollout.datasets] == [
        ("c.jsonl", 1, None),
        ("b.jsonl", 5, "bee"),
    ]
    assert config.train.lora.target_modules == ["q_proj", "up_proj", "v_proj", "o_proj"]
    assert config.train.adam_betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"rollout.datasets\[1\].weight: Input should be greater than 0"):
        load_config(path, ["rollout.datasets[1].weight=0"])  # an item's own check names the indexed field


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "rollout.datasets[2].path=x.jsonl",
            "--set rollout.datasets[2].path: rollout.datasets has 2 item(s), so [2] is past its end; "
            "use an index below 2, or set the whole list (rollout.datasets=[...])",
        ),
        ("server.extra_args[0]=--enforce-eager", "server.extra_args is empty; set the whole list"),
        ("train.max_steps[0]=3", "--set train.max_steps[0]: train.max_steps is not a list; drop the [0]"),
        ("rollout.datasets[x].path=a", "'datasets[x]' is not a field name or name[INDEX]"),
    ],
)
def test_an_indexed_override_out_of_range_names_the_key_and_the_length(tmp_path, override, says):
    path = tmp_path / "mixture.yaml"
    path.write_text("rollout:\n  datasets:\n    - {path: a.jsonl}\n    - {path: b.jsonl}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["eval.every_steps=null", "eval.at_end=false"],
            "eval.every_steps is null and eval.at_end is false: the run would never evaluate eval.dataset",
        ),
        (
            ["eval.every_steps=11", "eval.at_end=false", "train.max_steps=10"],
            "eval.every_steps (11) is above train.max_steps (10) and eval.at_end is false",
        ),
    ],
)
def test_eval_settings_that_never_evaluate_are_refused_naming_both_fields(overrides, says):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["eval.dataset=reasoning_gym:chain_sum", *overrides])
    assert says in str(info.value), str(info.value)
    # each field alone evaluates (at the end, or at step 10), and without eval.dataset nothing is evaluated anyway
    assert load_config(overrides=["eval.dataset=reasoning_gym:chain_sum", "eval.at_end=false", "eval.every_steps=10"])
    assert load_config(overrides=["eval.dataset=reasoning_gym:chain_sum", "eval.every_steps=11"])
    assert not load_config(overrides=["eval.at_end=false"]).eval.enabled


def test_a_field_set_over_the_algorithm_preset_is_warned_about_once_naming_both_values(caplog):
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        config = load_config(None, ["algorithm=dapo", "train.epsilon_high=0.4", "train.epsilon=0.2"])
        load_config(None, ["algorithm=dapo", "train.epsilon_high=0.4"])  # grpo resume validates twice: one line
    assert config.train.epsilon_high == 0.4 and config.train.epsilon == 0.2  # the config's values are used
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("algorithm:")]
    # DAPO's clip-higher upper range is 0.28 (Yu et al. 2025, §3.1); epsilon 0.2 equals the preset's: no warning
    assert lines == [
        "algorithm: dapo sets train.epsilon_high: 0.28, but the config sets 0.4; the config's value is used "
        "(drop train.epsilon_high to keep the preset's)"
    ], lines
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        load_config(None, ["algorithm=dapo"])
        load_config(None, ["train.epsilon_high=0.4"])  # the default grpo preset sets nothing
    assert not [r for r in caplog.records if r.getMessage().startswith("algorithm:")], caplog.text


def test_a_union_field_error_is_one_line_without_pydantic_member_tags():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.lora.target_modules=x"])
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].strip().startswith("train.lora.target_modules: ") and "(got 'x')" in lines[0]
    assert "literal[" not in lines[0] and "list[str]" not in lines[0]
    with pytest.raises(ConfigError, match=r"server.extra_args\[1\]: Input should be a valid string$"):
        load_config(overrides=["server.extra_args=[--enforce-eager, 2]"])


@pytest.mark.parametrize(
    "task, kwargs, says",
    [
        ("chain_summ", {}, "did you mean reasoning_gym:chain_sum"),
        ("no_such_task", {}, "the tasks: "),  # nothing close: every task is listed
        ("chain_sum", {"max_digitz": 2}, "its options: "),
        ("chain_sum", {"min_terms": 5, "max_terms": 2}, "max_terms must be >= min_terms"),
    ],
)
def test_a_bad_reasoning_gym_task_names_the_tasks_or_options(task, kwargs, says):
    from reasoning_gym.factory import DATASETS

    from grpo_core.rollout.data import load_dataset

    cfg = RunConfig.model_validate({"rollout": {"dataset": f"reasoning_gym:{task}", "dataset_kwargs": kwargs}})
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        load_dataset(cfg.rollout)
    message = str(info.value)
    assert message.startswith(f"rollout.dataset='reasoning_gym:{task}'")
    if task == "no_such_task":
        assert all(name in message for name in DATASETS)
    if kwargs.get("max_digitz"):
        assert "max_digits" in message and "min_terms" in message


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.max_steps=true", "train.max_steps"),
        ("train.learning_rate=false", "train.learning_rate"),
        ("rollout.num_generations=true", "rollout.num_generations"),
        ("server.port=false", "server.port"),
        ("server.gpu_ids=[0, true]", "server.gpu_ids"),
        ("train.adam_betas=[true, 0.9]", "train.adam_betas"),
        ("train.selective_checkpointing=true", "train.selective_checkpointing"),
        ("packing.token_budget=true", "packing.token_budget"),
    ],
)
def test_a_boolean_where_a_number_goes_is_refused(override, field):
    """pydantic took ``true`` as 1 (``train.max_steps=true`` trained one step)."""
    with pytest.raises(ConfigError, match=re.escape(f"{field}: ") + ".*boolean"):
        load_config(overrides=[override])


def test_booleans_still_reach_bool_fields():
    cfg = load_config(
        overrides=[
            "train.lora.enabled=true",
            "train.gradient_checkpointing=true",
            "train.mixed_precision=false",
            "train.compile=false",
        ]
    )
    assert cfg.train.lora.enabled and cfg.train.gradient_checkpointing == "full"
    assert cfg.train.mixed_precision is False and cfg.train.compile is False


@pytest.mark.parametrize(
    "name, text, says",
    [
        (
            "top.yaml",
            "model:\n  name: tiny-qwen3\ntrain:\n  max_steps: 2\nmodel:\n  name: other\n",
            "line 5, column 1: the key 'model' is given twice (first on line 1)",
        ),
        (
            "nested.yaml",
            "train:\n  max_steps: 2\n  lora:\n    r: 4\n    r: 8\n",
            "line 5, column 5: the key 'r' is given twice (first on line 4)",
        ),
        ("flow.yaml", "rollout: {dataset_kwargs: {a: 1, a: 2}}\n", "the key 'a' is given twice"),
        ("twice.json", '{"train": {"max_steps": 1, "max_steps": 2}}', "the key 'max_steps' is given twice"),
    ],
)
def test_a_key_given_twice_is_refused_naming_the_key_and_line(tmp_path, name, text, says):
    """PyYAML and json keep the last of two equal keys silently (the first ``model:`` section was lost)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(path)


@pytest.mark.parametrize(
    "name, text", [("empty.yaml", ""), ("comments.yaml", "# nothing yet\n\n"), ("blank.json", "\n"), ("empty.toml", "")]
)
def test_an_empty_config_file_says_it_is_empty(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"config file {path} is empty")):
        load_config(path)


def test_a_yaml_merge_key_may_be_overridden_by_an_explicit_key(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("train:\n  <<: {max_steps: 2, save_steps: 1}\n  max_steps: 3\n")
    assert (load_config(path).train.max_steps, load_config(path).train.save_steps) == (3, 1)


@pytest.mark.parametrize(
    "data, path, why",
    [
        (
            {"rollout": {"dataset": "json:rows.jsonl", "dataset_kwargs": {"a": 1}}},
            "rollout.dataset_kwargs",
            "module:callable datasets only",
        ),
        ({"rollout": {"dataset": "json:rows.jsonl", "dataset_seed": 3}}, "rollout.dataset_seed", "reasoning_gym:"),
        (  # eval's generated-dataset settings beside a file (new-user tryout: passed silently)
            {"eval": {"dataset": "held_out.jsonl", "dataset_size": 10}},
            "eval.dataset_size",
            "read by reasoning_gym: eval datasets only",
        ),
        ({"eval": {"dataset": "hf:owner/name", "dataset_seed": 3}}, "eval.dataset_seed", "reasoning_gym: eval"),
        ({"eval": {"dataset": "held_out.jsonl", "dataset_kwargs": {"a": 1}}}, "eval.dataset_kwargs", "module:callable"),
        (  # says where it is read, not the opposite (it read 'no effect (reasoning_gym: datasets, ...)')
            {"rollout": {"dataset": "rows.jsonl", "dataset_size": 5}},
            "rollout.dataset_size",
            "read by reasoning_gym: datasets and by an environment's epoch without a dataset only",
        ),
        ({"train": {"selective_checkpointing": 2}}, "train.selective_checkpointing", "selective only"),
        ({"train": {"rdzv_endpoint": "trainer-0:29400"}}, "train.rdzv_endpoint", "train.nnodes > 1 only"),
        ({"train": {"lora": {"r": 8}}}, "train.lora.r", "train.lora.enabled is false"),
        ({"train": {"adapter_store": "/mnt/a"}}, "train.adapter_store", "train.lora.enabled is false"),
        ({"export": {"hub_revision": "dev"}}, "export.hub_revision", "export.push_to_hub is false"),
        (
            {"tracking": {"enabled": False, "registered_model_name": "m"}},
            "tracking.registered_model_name",
            "tracking.enabled is false",
        ),
        ({"flow": {"concurrency_limit": None, "concurrency_slots": 2}}, "flow.concurrency_slots", "concurrency_limit"),
    ],
)
def test_a_run_setting_that_has_no_effect_is_warned_about(caplog, data, path, why):
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RunConfig.model_validate(data)
    assert re.search(rf"{re.escape(path)}(, [\w.]+)*: no effect \([^)]*{re.escape(why)}", caplog.text), caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RunConfig()  # defaults: nothing to warn about
    assert "no effect" not in caplog.text


def test_user_paths_mean_the_same_to_validate_and_to_the_run(monkeypatch, tmp_path):
    """``~`` and ``$VARS`` in any path field are expanded when the config is read (a run used to write to a folder
    literally named ``~`` while ``grpo validate`` checked the home folder)."""
    from grpo_core.config import RunConfig, load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GRPO_TEST_RUNS", str(tmp_path / "runs"))
    cfg = RunConfig.model_validate(
        {
            "train": {"output_dir": "~/out", "samples_path": "$GRPO_TEST_RUNS/samples.arrow"},
            "tracking": {"dir": "${GRPO_TEST_RUNS}/mlflow"},
            "server": {"log_dir": "relative/servers"},
        }
    )
    assert cfg.train.output_dir == tmp_path / "home" / "out"
    assert cfg.train.samples_path == tmp_path / "runs" / "samples.arrow"
    assert cfg.tracking.dir == tmp_path / "runs" / "mlflow"
    assert cfg.server.log_dir == Path("relative/servers"), "a relative path stays relative to the working folder"
    overridden = load_config(None, ["train.output_dir=~/elsewhere"])
    assert overridden.train.output_dir == tmp_path / "home" / "elsewhere"
    unset = RunConfig.model_validate({"train": {"output_dir": "$GRPO_SURELY_UNSET_VAR/x"}})
    assert str(unset.train.output_dir) == "$GRPO_SURELY_UNSET_VAR/x"


def test_an_empty_config_file_names_a_form_that_loads(tmp_path):
    """It advised leaving out --config, which grpo train and grpo validate require; the one line it names now loads
    the defaults."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"is empty \(or holds only comments\).*one line `model: \{\}`") as info:
        load_config(empty, [])
    assert "leave out --config" not in str(info.value)
    (tmp_path / "one_line.yaml").write_text("model: {}\n")
    assert load_config(tmp_path / "one_line.yaml", []) == RunConfig()
