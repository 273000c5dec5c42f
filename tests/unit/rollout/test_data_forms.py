"""Data as users have it (issue 27, item 1): every common file form read back exactly as the test wrote it, a
prompt column and a system prompt, Hub ids from the local cache only, weighted mixtures (proportions, passes, a
resume continuing the exact order, per-source metrics), and preflight naming each prompt that cannot be trained.

Expected values come from the rows the tests write (with json, csv, pyarrow or ``datasets`` as the writer), the
binomial distribution, and the tokenizer's own ``apply_chat_template(tokenize=True)``."""

import asyncio
import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_core.config import ModelConfig, RolloutConfig, RunConfig
from grpo_core.errors import ConfigError
from grpo_core.rollout.data import iter_rows, load_dataset
from grpo_core.rollout.driver import produce, prompt_stream
from grpo_core.rollout.mixture import Mixture, Source
from grpo_core.rollout.window import MetricWindow
from grpo_core.run import preflight

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
#: A column whose rows hold different JSON kinds, each of which must come back as written.
MIXED = ["007", 7, "true", "null", None, 1.5, {"a": [1, "2"]}, True, "", 10**30]
ROWS = [{"prompt": MESSAGES, "answer": value, "id": i} for i, value in enumerate(MIXED)]


def rows_of(spec: str, **rollout) -> list[dict]:
    return list(iter_rows(load_dataset(RolloutConfig(dataset=spec, **rollout))))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("prefix", ["", "json:"])
def test_json_lines_values_come_back_as_written(tmp_path, prefix):
    """``"007"`` stayed 7, ``"true"`` True and ``"null"`` None through datasets' json loader (its Json feature keeps
    a string that parses as JSON unquoted)."""
    path = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    got = rows_of(f"{prefix}{path}")
    assert got == ROWS
    assert [type(r["answer"]) for r in got] == [type(v) for v in MIXED]  # "007" a str, True a bool, 1.5 a float


def test_csv_cells_are_strings_as_written_unless_typed(tmp_path):
    path = tmp_path / "rows.csv"
    table = [["question", "answer", "n"], ["2+5?", "007", "3"], ["x?", "", "4"], ["y?", "NA", "5"], ["z?", "1.50", "6"]]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(table)
    expected = [dict(zip(table[0], line, strict=True)) for line in table[1:]]
    assert rows_of(str(path), prompt_column="question") == [
        {**row, "prompt": [{"role": "user", "content": row["question"]}]} for row in expected
    ]
    typed = rows_of(f"csv:{path}", prompt_column="question", column_types={"n": "int"})
    assert [r["n"] for r in typed] == [3, 4, 5, 6] and [r["answer"] for r in typed] == ["007", "", "NA", "1.50"]
    with pytest.raises(ConfigError, match=r"row 0, column 'answer' is '007', not a json"):
        rows_of(str(path), prompt_column="question", column_types={"answer": "json"})


def _arrow_rows():
    return [
        {"prompt": MESSAGES, "answer": "007", "score": 1.5, "n": 2},
        {"prompt": MESSAGES, "answer": "x", "score": 0.0, "n": 3},
    ]


def test_parquet_arrow_and_saved_folders_come_back_as_written(tmp_path):
    import datasets

    rows = _arrow_rows()
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet")
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dict"))
    for spec in ("rows.parquet", "parquet:rows.parquet", "stream.arrow", "arrow:file.arrow", "saved", "disk:saved"):
        assert rows_of(str(tmp_path / spec.partition(":")[2]) if ":" in spec else str(tmp_path / spec)) == rows, spec
    assert rows_of(f"disk:{tmp_path / 'dict'}", dataset_split="test") == rows[:1]
    with pytest.raises(ConfigError, match=r"has no split 'train' \(splits: \['test'\]\)"):
        rows_of(f"disk:{tmp_path / 'dict'}")


def test_a_hub_id_is_read_from_the_local_cache_and_a_missing_one_says_how_to_get_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--someone--capitals"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    rows = _arrow_rows()  # the default configuration's files, under data/
    pq.write_table(pa.Table.from_pylist(rows), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), data / "test-00000-of-00001.parquet")
    other = repo / "snapshots" / commit / "other"  # a second configuration's folder
    other.mkdir()
    write_jsonl(other / "train.jsonl", [{"prompt": "x", "answer": "007"}])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert rows_of("hf:someone/capitals") == rows
    assert rows_of("hf:someone/capitals", dataset_split="test") == rows[:1]
    assert rows_of("hf:someone/capitals/other") == [{"prompt": "x", "answer": "007"}]
    assert rows_of(f"hf:someone/capitals@{commit}") == rows
    with pytest.raises(ConfigError, match=r"not in the local Hugging Face cache.*hf download someone/other"):
        rows_of("hf:someone/other")


def test_an_empty_json_lines_file_and_an_unknown_suffix_are_clear_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"empty.jsonl holds no JSON object \(an empty file\?\)"):
        rows_of(str(tmp_path / "empty.jsonl"))
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"the suffix does not tell the file's form"):
        rows_of(str(tmp_path / "rows.txt"))


def test_a_bare_relative_folder_name_reads_its_data_files_and_neither_form_names_both(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)  # `data` is relative to the working folder, as a user types it
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "part-0.jsonl", ROWS[:3])
    write_jsonl(tmp_path / "data" / "part-1.jsonl", ROWS[3:5])
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(_arrow_rows()), tmp_path / "pq" / "rows.parquet")
    datasets.Dataset.from_list(_arrow_rows()).save_to_disk(str(tmp_path / "saved"))
    assert sorted(rows_of("data"), key=lambda r: r["id"]) == ROWS[:5]  # both files' rows, values as written
    assert rows_of("pq") == _arrow_rows() and rows_of("saved") == _arrow_rows()
    assert rows_of("./data") and sorted(r["id"] for r in rows_of("data")) == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError) as info:
        rows_of("dat")  # neither a local path nor 'module:callable'
    assert "no such file or folder" in str(info.value) and "'module:callable'" in str(info.value), str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no JSON-lines, Parquet, CSV or Arrow file"):
        rows_of("empty")


def test_a_string_prompt_column_becomes_chat_messages_with_the_system_prompt(tmp_path):
    rows = [{"question": "2+2?", "answer": "4"}, {"question": [{"role": "system", "content": "own"}], "answer": "1"}]
    path = write_jsonl(tmp_path / "q.jsonl", rows[:1])
    got = rows_of(str(path), prompt_column="question", system_prompt="Be brief.")
    assert got == [
        {
            "question": "2+2?",
            "answer": "4",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        }
    ]
    from grpo_core.rollout.mixture import as_messages

    assert as_messages(rows[1]["question"], "Be brief.") == rows[1]["question"]  # its own system message kept


# ----- mixtures ---------------------------------------------------------------------------------------------------


def mixture(epoch_size=None, seed=3, shuffle=True, sizes=(7, 11, 3), weights=(1.0, 2.0, 5.0)):
    sources = [
        Source(f"s{i}", [{"src": i, "row": r} for r in range(n)], w)
        for i, (n, w) in enumerate(zip(sizes, weights, strict=True))
    ]
    return Mixture(sources, epoch_size, seed, shuffle)


def test_mixture_proportions_are_the_weights_within_binomial_tolerance():
    n, weights = 6000, (1.0, 2.0, 5.0)
    mix = mixture(epoch_size=n, weights=weights)
    rows = [row for _, _, _, row in prompt_stream(mix, 1)]
    assert len(rows) == n
    for source, weight in enumerate(weights):
        p = weight / sum(weights)
        count = sum(r["src"] == source for r in rows)
        assert abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (source, count, n * p)


def test_each_source_is_read_in_whole_passes_before_a_row_repeats():
    mix = mixture(epoch_size=500)
    rows = [row for _, _, _, row in prompt_stream(mix, 2)]
    for source, size in enumerate(mix.sizes):
        taken = [r["row"] for r in rows if r["src"] == source]
        passes = [taken[k : k + size] for k in range(0, len(taken) - size + 1, size)]
        assert passes and all(sorted(p) == list(range(size)) for p in passes), source  # each full pass: every row
        assert len({tuple(p) for p in passes}) > 1  # shuffled: passes differ
    ordered = [row for _, _, _, row in prompt_stream(mixture(epoch_size=500, shuffle=False), 1)]
    for source, size in enumerate(mix.sizes):
        taken = [r["row"] for r in ordered if r["src"] == source]
        assert taken == [k % size for k in range(len(taken))]  # shuffle off: the source's order, cycled


def test_a_mixture_resumes_at_any_position_in_the_exact_order():
    full = [(e, r, p) for e, r, p, _ in prompt_stream(mixture(), 3)]
    assert [p for _, _, p in full] == list(range(3 * 21))  # epoch_size = the rows together (7 + 11 + 3)
    assert len({tuple(r for e, r, _ in full if e == k) for k in range(3)}) == 3  # each epoch its own order
    for start in range(0, 64, 5):  # a fresh mixture, as a resumed process builds it
        assert [(e, r, p) for e, r, p, _ in prompt_stream(mixture(), 3, start)] == full[start:], start
    assert [(e, r, p) for e, r, p, _ in prompt_stream(mixture(seed=4), 3)] != full


def test_the_rollout_starts_a_mixtures_groups_in_order_after_a_resume_and_counts_them_per_source():
    from grpo_core.transport.types import ResumeState

    mix = mixture(epoch_size=30)

    def run(resume=None):
        window, started = MetricWindow(), []

        async def run_group(prompt_index, row_index, epoch, row):
            started.append((prompt_index, row_index))

        loop = SimpleNamespace(
            config=RolloutConfig(num_epochs=2, num_generations=2),
            window=window,
            unfinished_rollouts=0,
            unscored_groups=0,
            cap=SimpleNamespace(cap=1000),
            filter_prompt=lambda *a: True,
            run_group=run_group,
            runtime=SimpleNamespace(
                dataset=mix,
                resume=resume,
                queue=None,
                allowance=SimpleNamespace(may_start_group=lambda: True, completed_groups=0),
            ),
        )

        async def main():
            async with asyncio.TaskGroup() as tasks:
                await produce(loop, tasks)

        asyncio.run(main())
        return started, window

    full, window = run()
    assert [p for p, _ in full] == list(range(60))
    drained = window.drain()
    counts = {name: drained.get(f"rollout/source/{name}/prompt_count", 0) for name in ("s0", "s1", "s2")}
    assert counts == {f"s{i}": sum(mix.source_of(r) == f"s{i}" for _, r in full) for i in range(3)}
    resume = ResumeState(policy_version=1, first_untrained_prompt_index=17, trained_above=[20, 41])
    assert run(resume)[0] == [g for g in full[17:] if g[0] not in (20, 41)]


def test_without_shuffle_a_mixtures_order_does_not_depend_on_the_unrecorded_seed(tmp_path):
    """The checkpoint's fingerprint records no shuffle_seed with shuffle off: a resume that changed it must find the
    same order."""
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": str(i)} for i in range(5)])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": str(i)} for i in range(7)])
    sources = [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl"), "weight": 2}]

    def order(**kw):
        return [r for _, r, _, _ in prompt_stream(load_dataset(RolloutConfig(datasets=sources, **kw)), 2)]

    assert order(shuffle=False, shuffle_seed=1) == order(shuffle=False, shuffle_seed=2)
    assert order(shuffle_seed=1) != order(shuffle_seed=2)


def test_a_mixture_from_config_names_sources_and_loads_each_form(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "answer": "007"}])
    with (tmp_path / "b.csv").open("w") as f:
        f.write("question,answer\nq1,1\nq2,2\n")
    cfg = RolloutConfig(
        datasets=[
            {"path": str(tmp_path / "a.jsonl"), "weight": 1},
            {"path": str(tmp_path / "b.csv"), "weight": 3, "prompt_column": "question", "system_prompt": "S"},
        ],
        mixture_epoch_size=8,
    )
    mix = load_dataset(cfg)
    assert [s.name for s in mix.sources] == ["a", "b"] and mix.epoch_size == 8
    assert list(iter_rows(mix)) == [
        {"prompt": "x", "answer": "007"},  # nothing mapped: the rollout makes a string one user message
        *(
            {"question": q, "answer": a, "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": q}]}
            for q, a in (("q1", "1"), ("q2", "2"))
        ),
    ]
    with pytest.raises(ValueError, match="rollout.dataset and rollout.datasets are both set"):
        RolloutConfig(dataset="x.jsonl", datasets=[{"path": "y.jsonl"}])
    with pytest.raises(ValueError, match="two sources are named alike"):
        RolloutConfig(datasets=[{"path": "d1/x.jsonl"}, {"path": "d2/x.jsonl"}])


# ----- preflight --------------------------------------------------------------------------------------------------


def test_preflight_names_the_mixture_source_row_and_column_a_reward_needs(tmp_path):
    good = {"prompt": "2+2?", "answer": "4"}
    write_jsonl(tmp_path / "a.jsonl", [good, good])
    write_jsonl(tmp_path / "b.jsonl", [good, good, {"prompt": "3+3?"}])  # row 2: no answer (JSON lines: null)
    cfg = RunConfig(
        rollout={
            "datasets": [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl")}],
            "reward_functions": ["grpo_core.demo_rewards:numeric_answer_reward"],
        }
    )
    with pytest.raises(
        ConfigError, match=r"column 'answer', which rollout.datasets\[1\].path='.*b.jsonl' lacks in row 2"
    ):
        preflight.check_dataset(cfg)
    single = RunConfig(
        rollout={**cfg.rollout.model_dump(include={"reward_functions"}), "dataset": str(tmp_path / "b.jsonl")}
    )
    with pytest.raises(ConfigError, match=r"b.jsonl' lacks in row 2 \(null or missing there;"):
        preflight.check_dataset(single)


def _long_rows(tmp_path):
    rows = [{"prompt": "Say hi."}, {"prompt": "Say hi."}, {"prompt": " ".join(["word"] * 200)}]
    return str(write_jsonl(tmp_path / "long.jsonl", rows)), rows


def _tokens(messages):
    from transformers import AutoTokenizer

    from grpo_core.models import tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(ModelConfig(name="tiny-qwen3")))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return len(ids), tokenizer


def test_preflight_refuses_a_prompt_too_long_to_train_naming_its_row_and_length(tmp_path, caplog):
    path, rows = _long_rows(tmp_path)
    length, _ = _tokens([{"role": "user", "content": rows[2]["prompt"]}])
    short, _ = _tokens([{"role": "user", "content": rows[0]["prompt"]}])
    assert short <= 128 - 64 < length  # the set-up: one prompt over the limit, the others under it
    base = {"model": {"name": "tiny-qwen3"}, "server": {"max_model_len": 128}}
    cfg = RunConfig(**base, rollout={"dataset": path, "max_completion_length": 64})
    with pytest.raises(ConfigError, match=rf"long.jsonl' row 2: its prompt is {length} tokens .* = 64"):
        preflight.check_prompt_lengths(cfg)
    skip = RunConfig(**base, rollout={"dataset": path, "max_completion_length": 64, "skip_overlong_prompts": True})
    with caplog.at_level("WARNING", logger="grpo_core.run.preflight"):
        preflight.check_prompt_lengths(skip)
    assert "1 prompts are longer than" in caplog.text


def test_preflight_checks_the_eval_dataset_as_the_training_data(tmp_path, caplog):
    """A reward's missing column and an overlong prompt in eval.dataset were found only while evaluating (a failed
    evaluation, or completions cut short by the room left): preflight refuses them as it does training's rows."""
    good = {"prompt": "2+2?", "answer": "4"}
    write_jsonl(tmp_path / "train.jsonl", [good])
    write_jsonl(tmp_path / "held_out.jsonl", [good, {"prompt": "3+3?"}])  # row 1: no answer
    reward = ["grpo_core.demo_rewards:numeric_answer_reward"]  # it takes `answer`
    rollout = {"dataset": str(tmp_path / "train.jsonl"), "reward_functions": reward}
    cfg = RunConfig(rollout=rollout, eval={"dataset": str(tmp_path / "held_out.jsonl")})
    preflight.check_dataset(cfg)  # the set-up: the training rows have their answer
    with pytest.raises(ConfigError) as info:
        preflight.check_eval(cfg)
    assert str(info.value).startswith(
        "rollout.reward_functions (eval's): grpo_core.demo_rewards:numeric_answer_reward needs the dataset column "
        f"'answer', which eval.dataset='{tmp_path / 'held_out.jsonl'}' lacks in row 1"
    ), str(info.value)
    own = RunConfig(rollout=rollout, eval={"dataset": str(tmp_path / "held_out.jsonl"), "reward_functions": reward})
    with pytest.raises(ConfigError, match=r"^eval.reward_functions: .* lacks in row 1 \(null or missing there"):
        preflight.check_eval(own)
    # an eval prompt too long for server.max_model_len - eval.max_completion_length
    rows = [{"prompt": "Say hi."}, {"prompt": "Say hi."}, {"prompt": " ".join(["word"] * 60)}]
    path = str(write_jsonl(tmp_path / "long.jsonl", rows))
    length, _ = _tokens([{"role": "user", "content": rows[2]["prompt"]}])
    short, _ = _tokens([{"role": "user", "content": rows[0]["prompt"]}])
    assert short <= 128 - 64 < length <= 128 - 16  # the set-up: over the eval limit, within the training one
    base = {"model": {"name": "tiny-qwen3"}, "server": {"max_model_len": 128}}
    rollout = {"dataset": path, "max_completion_length": 16}
    cfg = RunConfig(**base, rollout=rollout, eval={"dataset": path, "max_completion_length": 64})
    preflight.check_prompt_lengths(cfg)  # the same prompts fit training's shorter completions
    with pytest.raises(ConfigError) as info:
        preflight.check_eval_prompt_lengths(cfg)
    assert f"long.jsonl' row 2: its prompt is {length} tokens" in str(info.value), str(info.value)
    assert "server.max_model_len (128) - eval.max_completion_length (64) = 64" in str(info.value), str(info.value)
    inherited = RunConfig(**base, rollout={**rollout, "max_completion_length": 64}, eval={"dataset": path})
    with pytest.raises(ConfigError, match=r"rollout.max_completion_length \(eval.max_completion_length unset\)"):
        preflight.check_eval_prompt_lengths(inherited)
    skip = RunConfig(**base, rollout={**rollout, "skip_overlong_prompts": True}, eval=cfg.eval.model_dump())
    with caplog.at_level("WARNING", logger="grpo_core.run.preflight"):
        preflight.check_eval_prompt_lengths(skip)
    assert "1 eval prompts are longer than server.max_model_len - eval.max_completion_length = 64" in caplog.text


def test_the_rollout_skips_and_counts_a_prompt_too_long_to_train(tmp_path):
    from grpo_core.rollout.loop import LoopRuntime, RolloutLoop
    from grpo_core.rollout.pace import TokenAllowance

    _, rows = _long_rows(tmp_path)
    length, tokenizer = _tokens([{"role": "user", "content": rows[2]["prompt"]}])
    consumed = []
    runtime = LoopRuntime(
        tokenizer=tokenizer,
        server=None,  # never reached: the prompt is refused before any request
        model_name="m",
        max_model_len=128,
        dataset=[],
        queue=SimpleNamespace(consumed=consumed.append),
        allowance=TokenAllowance(1, 10**9),
    )
    loop = RolloutLoop(RolloutConfig(max_completion_length=64, num_generations=2), runtime)
    try:
        assert loop.prompt_too_long(rows[2]) == length and loop.prompt_too_long(rows[0]) is None
        asyncio.run(loop.run_group(5, 2, 0, rows[2]))
    finally:
        loop.executor.shutdown()
    assert consumed == [5] and loop.window.drain()["rollout/overlong_prompt_count"] == 1


def test_top_level_mapping_beside_a_mixture_is_warned_about_once_set_not_when_a_saved_config_is_read(caplog):
    mixed = RolloutConfig(datasets=[{"path": "a.jsonl"}])
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RolloutConfig.model_validate_json(mixed.model_dump_json())  # the rollout process reads every field back
    assert "has no effect with rollout.datasets" not in caplog.text
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RolloutConfig(datasets=[{"path": "a.jsonl"}], prompt_column="question")
    assert "rollout.prompt_column has no effect with rollout.datasets: each source sets its own" in caplog.text


def test_a_resume_with_other_sources_weights_or_mapping_is_refused(tmp_path):
    from grpo_core.train.fingerprint import FINGERPRINT_FILE, check_resume, fingerprint_text

    def checkpoint(rollout):
        folder = tmp_path / "step-0000002"
        folder.mkdir(exist_ok=True)
        (folder / FINGERPRINT_FILE).write_text(fingerprint_text(RunConfig(rollout=rollout).trainer_process()))
        return folder

    def resume(rollout, folder):
        return check_resume(RunConfig(rollout=rollout).trainer_process(), folder)

    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])
    mix = {"datasets": [{"path": str(tmp_path / "a.jsonl")}, {"path": "reasoning_gym:chain_sum", "weight": 2}]}
    folder = checkpoint(mix)
    assert resume(mix, folder) == []
    for change in ({"weight": 3}, {"system_prompt": "S"}):
        other = {"datasets": [mix["datasets"][0], {**mix["datasets"][1], **change}]}
        with pytest.raises(ConfigError, match=r"rollout.datasets"):
            resume(other, folder)
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "y"}])  # the file's rows changed
    with pytest.raises(ConfigError, match=r"rollout.datasets\[0\] sha256"):
        resume(mix, folder)
    single = {"dataset": "reasoning_gym:chain_sum"}
    folder = checkpoint(single)  # a checkpoint of before these settings: none of them recorded at their defaults
    assert resume(single, folder) == []
    with pytest.raises(ConfigError, match=r"rollout.system_prompt: None -> 'Be brief.'"):
        resume({**single, "system_prompt": "Be brief."}, folder)


def test_a_misspelled_prompt_column_is_refused_naming_the_field_and_the_columns(tmp_path):
    """A prompt column the rows lack used to fall back to their own ``prompt`` (without the system prompt)."""
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    assert rows_of(str(path), prompt_column="prompt")[0]["prompt"] == "2+2?"  # the rows load as they are
    with pytest.raises(ConfigError) as err:
        load_dataset(RolloutConfig(dataset=str(path), prompt_column="questoin", system_prompt="Be brief."))
    message = str(err.value)
    assert f"rollout.prompt_column='questoin' is not a column of {path} (columns: answer, prompt)" in message
    assert "\n" not in message
    mixture = RolloutConfig(datasets=[{"path": str(path)}, {"path": str(path), "name": "b", "prompt_column": "qu"}])
    with pytest.raises(ConfigError, match=r"rollout\.datasets\[1\]\.prompt_column='qu' is not a column of"):
        load_dataset(mixture)
    # validate (preflight) refuses it too, before any row is scanned
    cfg = RunConfig(model=ModelConfig(name="m"), rollout=RolloutConfig(dataset=str(path), prompt_column="questoin"))
    with pytest.raises(ConfigError, match=r"rollout\.prompt_column='questoin' is not a column"):
        preflight.check_dataset(cfg)


def test_a_non_finite_mixture_weight_is_refused_and_huge_weights_normalise_without_overflow(tmp_path):
    """``.inf`` gave NaN probabilities; two weights of 1e308 overflowed their sum to inf (probabilities 0)."""
    from grpo_core.config import load_config

    config = tmp_path / "run.yaml"
    config.write_text("model: {name: m}\nrollout:\n  datasets:\n    - {path: a.jsonl, weight: .inf}\n")
    with pytest.raises(ConfigError, match=r"rollout\.datasets\[0\]\.weight: must be finite \(got inf\)"):
        load_config(config)
    with pytest.raises(ConfigError, match="finite"):
        Mixture([Source("a", [{"prompt": "x"}], math.inf)], None, 0, False)
    mix = mixture(epoch_size=4000, weights=(1e308, 1e308, 5e307))
    # the shares are the weights' ratios 2:2:1
    assert mix.probabilities.tolist() == pytest.approx([0.4, 0.4, 0.2])
    counts = [int((mix.draws(0) == s).sum()) for s in range(3)]
    for count, p in zip(counts, (0.4, 0.4, 0.2), strict=True):
        assert abs(count - 4000 * p) <= 4 * math.sqrt(4000 * p * (1 - p)), counts
