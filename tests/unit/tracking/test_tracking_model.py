"""MLflow beyond metrics (real SQLite store): the exported model as a loadable artifact, registry versions with an
alias, bounded completion tables, system metrics; and the Hugging Face export's card and Hub-push checks."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from waiting import wait_until

from grpo_core import tracking
from grpo_core.config import ModelConfig, RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.models import hub, resolve_model_dir
from grpo_core.rollout.window import CompletionSample
from grpo_core.train.export import save_full_model, save_tokenizer

TINY = "tiny-qwen3"


def _cfg(tmp: Path, export: dict | None = None, **tracking_fields) -> RunConfig:
    return RunConfig(
        model={"name": TINY},
        tracking={"dir": tmp / "mlflow", "experiment_name": "t", **tracking_fields},
        rollout={"dataset": "reasoning_gym:basic_arithmetic", "dataset_size": 4},
        export=export or {},
    )


def _exported(tmp: Path, shift: float) -> tuple[Path, dict[str, torch.Tensor]]:
    """A from_pretrained folder of the tiny model with every weight shifted by ``shift`` (tiny shards)."""
    base = resolve_model_dir(ModelConfig(name=TINY))
    sd = {k: v + shift for k, v in AutoModelForCausalLM.from_pretrained(base).state_dict().items()}
    out = tmp / f"export{shift}"
    save_full_model(base, dict(sd), out, max_shard_size="200KB")
    save_tokenizer(base, out)
    return out, sd


def test_export_is_sharded_with_index_generation_config_and_tokenizer(tmp_path):
    out, sd = _exported(tmp_path, 0.5)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, sd[name], rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(out)("1+1")["input_ids"]


def test_final_model_is_registered_and_the_alias_moves_to_the_new_version(tmp_path):
    cfg = _cfg(tmp_path, registered_model_name="grpo-tiny", registered_model_alias="candidate")
    versions = []
    for i, shift in enumerate((0.25, 0.75)):
        run_id, _ = tracking.start_run(cfg, f"flow-{i}")
        folder, sd = _exported(tmp_path, shift)
        source = tracking.log_model(cfg.tracking, run_id, folder)
        versions.append(tracking.register_model(cfg.tracking, run_id, source, description=f"run {i}"))
        tracking.end_run(cfg.tracking, run_id)
    mc = tracking.client(cfg.tracking)
    assert [int(v.version) for v in versions] == [1, 2]
    assert int(mc.get_model_version_by_alias("grpo-tiny", "candidate").version) == 2
    assert mc.get_model_version("grpo-tiny", "1").run_id != mc.get_model_version("grpo-tiny", "2").run_id
    # What a user promoting a version does: move another alias; and what a consumer does: load by alias.
    mc.set_registered_model_alias("grpo-tiny", "champion", "1")
    path = mlflow.artifacts.download_artifacts("models:/grpo-tiny@candidate", dst_path=str(tmp_path / "dl"))
    model = AutoModelForCausalLM.from_pretrained(path)
    name, tensor = next(iter(model.state_dict().items()))
    torch.testing.assert_close(tensor, sd[name], rtol=0, atol=0)  # the second run's weights (shift 0.75)
    champion = mlflow.artifacts.download_artifacts("models:/grpo-tiny@champion", dst_path=str(tmp_path / "dl1"))
    assert not torch.equal(AutoModelForCausalLM.from_pretrained(champion).state_dict()[name], tensor)
    assert mc.get_run(versions[1].run_id).data.tags[tracking.MODEL_KIND_TAG] == "full"


def test_completion_tables_are_logged_per_window_and_bounded(tmp_path):
    cfg = _cfg(
        tmp_path, log_completions=True, num_completions_to_print=4, completion_max_chars=50, log_system_metrics=False
    )
    run_id, _ = tracking.start_run(cfg, "flow-t")
    sample = CompletionSample(cfg.tracking.num_completions_to_print)
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    for step in (1, 2):
        for i in range(30):
            sample.offer({"prompt": f"p{i}", "completion": "x" * 500, "reward": float(i), "advantage": 0.5})
        sink.log(step, {"reward": 1.0})
        sink.log_completions(step, sample.drain())
    sink.close()
    mc = tracking.client(cfg.tracking)
    files = sorted(a.path for a in mc.list_artifacts(run_id, "completions"))
    assert files == ["completions/steps_0000001-0000010.json"]  # steps 1-10 share one table
    table = mc.load_table(mc.get_run(run_id).info.experiment_id, files[0], run_ids=[run_id])
    assert list(table["step"]) == [1] * 4 + [2] * 4 and set(table.columns) >= {"prompt", "completion", "reward"}
    assert table["completion"].str.len().max() == 50 and table["completion"].iloc[0].endswith("…")
    assert set(table["prompt"]) <= {f"p{i}" for i in range(30)}


def test_completion_tables_keep_working_past_the_tag_limit(tmp_path):
    """``log_table`` added one entry per table file to the run's ``mlflow.loggedArtifacts`` tag, which MLflow cuts
    at 8000 characters: 8000 / len(', {"path": "completions/step_0000001.json", "type": "table"}') = 133 windows,
    then the tag is no JSON and every later table upload failed. 20% more windows here (a table per 10 steps): every
    window's rows are in the artifacts, the tag parses, and the newest table loads."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    cfg = _cfg(tmp_path, log_completions=True, num_completions_to_print=2, log_system_metrics=False)
    run_id, _ = tracking.start_run(cfg, "flow-long")
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    entry = len(', {"path": "completions/step_0000001.json", "type": "table"}')
    num_steps = 6 * MAX_TAG_VAL_LENGTH // entry // 5  # past where one table per window broke
    for step in range(1, num_steps + 1):
        sink.log(step, {"reward": 1.0})
        sink.log_completions(step, [{"prompt": f"p{step}", "completion": "c", "reward": 1.0, "advantage": 0.0}] * 2)
    sink.close()
    assert sink.num_errors == 0
    mc = tracking.client(cfg.tracking)
    tag = mc.get_run(run_id).data.tags["mlflow.loggedArtifacts"]
    listed = [e["path"] for e in json.loads(tag)]  # parses: not cut
    assert len(tag) <= MAX_TAG_VAL_LENGTH and len(listed) == -(-num_steps // 10)
    files = sorted(a.path for a in mc.list_artifacts(run_id, "completions"))
    assert len(files) == -(-num_steps // 10) and listed == files[-len(listed) :]
    steps = []
    for path in files:
        body = json.loads(Path(mc.download_artifacts(run_id, path, str(tmp_path / "dl"))).read_text())
        steps += [row[body["columns"].index("step")] for row in body["data"]]
    assert steps == [s for s in range(1, num_steps + 1) for _ in range(2)]  # every window's two rows, once
    newest = mc.load_table(mc.get_run(run_id).info.experiment_id, files[-1], run_ids=[run_id])
    assert set(newest["step"]) == set(range((num_steps - 1) // 10 * 10 + 1, num_steps + 1))


def test_the_table_list_keeps_the_newest_tables_within_the_tag_limit():
    """The tag lists at most ``limit`` completion tables (the newest), keeps other tables, and always fits."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    other = {"path": "eval/results.json", "type": "table"}
    value = json.dumps([other])
    for step in range(1, 3001, 10):
        value = tracking.listed_tables(value, tracking.completion_table_path(step), limit=100)
    entries = json.loads(value)
    paths = [f"completions/steps_{s:07d}-{s + 9:07d}.json" for s in range(1, 3001, 10)]
    assert entries == [other] + [{"path": p, "type": "table"} for p in paths[-100:]]
    assert len(value) <= MAX_TAG_VAL_LENGTH
    long_paths = [f"completions/{'x' * 200}_{i}.json" for i in range(100)]  # entries too long for 100 to fit
    for path in long_paths:
        value = tracking.listed_tables(value, path, limit=100)
    assert len(value) <= MAX_TAG_VAL_LENGTH and json.loads(value)[-1]["path"] == long_paths[-1]


def test_a_resumed_sink_continues_the_open_table_and_a_cut_tag(tmp_path):
    """A resumed trainer continues the table its killed attempt began (rows up to the steps MLflow holds), and a
    tag an older version left cut (no JSON) is replaced by a valid list."""
    cfg = _cfg(tmp_path, log_completions=True, num_completions_to_print=1, log_system_metrics=False)
    run_id, _ = tracking.start_run(cfg, "flow-resume")
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    for step in (1, 2, 3):
        sink.log(step, {"reward": 1.0})
        sink.log_completions(step, [{"prompt": f"p{step}"}])
    sink.close()
    mc = tracking.client(cfg.tracking)
    mc.set_tag(run_id, "mlflow.loggedArtifacts", '[{"path": "completions/step_0000001.json", "type": "tab')
    resumed = tracking.MlflowSink(cfg.tracking, run_id)
    for step in (3, 4):  # step 3 is replayed (already in MLflow): not logged twice
        resumed.log(step, {"reward": 1.0})
        resumed.log_completions(step, [{"prompt": f"again{step}"}])
    resumed.close()
    assert resumed.num_errors == 0
    table = mc.load_table(mc.get_run(run_id).info.experiment_id, "completions/steps_0000001-0000010.json", [run_id])
    assert list(table["step"]) == [1, 2, 3, 4] and list(table["prompt"]) == ["p1", "p2", "p3", "again4"]
    assert json.loads(mc.get_run(run_id).data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "completions/steps_0000001-0000010.json", "type": "table"}
    ]


def test_completion_sample_keeps_each_row_with_equal_probability():
    counts = [0] * 20
    for seed in range(3000):
        sample = CompletionSample(5, seed=seed)
        for i in range(20):
            sample.offer({"i": i})
        for row in sample.drain():
            counts[row["i"]] += 1
    # Each of 20 rows is kept with probability 5/20: 750 of 3000 draws (binomial sd ~24).
    assert all(abs(c - 750) < 120 for c in counts), counts
    everything = CompletionSample(None)
    for i in range(7):
        everything.offer({"i": i})
    assert [r["i"] for r in everything.drain()] == list(range(7)) and everything.drain() == []


def test_trainer_sink_logs_system_metrics(tmp_path):
    cfg = _cfg(tmp_path, system_metrics_interval_s=1.0)
    run_id, _ = tracking.start_run(cfg, "flow-s")
    sink = tracking.MlflowSink(cfg.tracking, run_id)
    wanted = {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"}
    try:
        wait_until(
            lambda: wanted <= set(tracking.client(cfg.tracking).get_run(run_id).data.metrics),
            f"MLflow's system metrics sampler to log {sorted(wanted)}",
            timeout_s=60,
            interval_s=0.5,
        )
    finally:
        sink.close()
    metrics = tracking.client(cfg.tracking).get_run(run_id).data.metrics
    assert wanted <= set(metrics)
    assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100 * 64


def test_model_card_and_the_folder_that_would_be_pushed(tmp_path):
    cfg = _cfg(tmp_path, export={"push_to_hub": True, "hub_model_id": "me/tiny-grpo"})
    folder, _ = _exported(tmp_path, 0.0)
    curve = tmp_path / "curve.png"
    curve.write_bytes(b"\x89PNG\r\n\x1a\n")
    summary = {"steps": 3.0, "reward_first5": 0.25, "reward_last5": 0.5, "mlflow_run_id": "abc"}
    card_path = hub.write_model_card(cfg, folder, summary, curve, adapter=False)
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_path)
    assert card.data.base_model == TINY and card.data.library_name == "transformers"
    assert "basic_arithmetic" in card.data.datasets and "grpo" in card.data.tags
    assert "| reward, last 5 steps | 0.5000 |" in card.text and "![reward per step](reward_curve.png)" in card.text
    pushed = {p.name for p in folder.iterdir()}
    assert {
        "README.md",
        "reward_curve.png",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
    } <= pushed


def test_push_without_token_or_repo_fails_before_anything_starts(tmp_path, monkeypatch):
    from grpo_core.run import preflight

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="export.hub_model_id"):
        load_config(None, ["export.push_to_hub=true"])
    cfg = _cfg(tmp_path, export={"push_to_hub": True, "hub_model_id": "me/tiny-grpo"})
    with pytest.raises(ConfigError, match="HF_TOKEN"):
        preflight.check_run(cfg)
    bad = _cfg(tmp_path, export={"push_to_hub": True, "hub_model_id": "me/../x"})
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    with pytest.raises(ConfigError, match="export.hub_model_id"):
        preflight.check_run(bad)
    hub.check_push(cfg)  # a token and a well-formed id: nothing to object to before training


def _open_run(args) -> str:
    tmp, i, barrier = args
    barrier.wait()  # every process opens the fresh store at the same moment
    return tracking.start_run(_cfg(Path(tmp)), f"flow-{i}")[0]


def test_runs_starting_together_on_a_fresh_store_all_open(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            run_ids = pool.map(_open_run, [(str(tmp_path), i, barrier) for i in range(4)])
    assert len(set(run_ids)) == 4
    mc = tracking.client(_cfg(tmp_path).tracking)
    assert {mc.get_run(r).info.run_id for r in run_ids} == set(run_ids)
