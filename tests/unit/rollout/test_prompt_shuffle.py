"""``rollout.shuffle`` (issue 27 item 1): the prompts of each epoch in a seeded order of their own, and a resume from
any prompt position continues exactly the order the run had (DESIGN.md §5, resume)."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from grpo_core.config import RolloutConfig, RunConfig
from grpo_core.errors import ConfigError
from grpo_core.rollout.driver import epoch_order, produce, prompt_stream
from grpo_core.rollout.window import MetricWindow
from grpo_core.train.fingerprint import FINGERPRINT_FILE, check_resume, fingerprint_text
from grpo_core.transport.types import ResumeState

ROWS = [{"q": i} for i in range(10)]


def stream(rows, epochs, start=0, seed=None):
    return [(e, r, p, row["q"]) for e, r, p, row in prompt_stream(rows, epochs, start, seed)]


def test_each_epoch_is_a_seeded_permutation_of_its_own():
    got = stream(ROWS, 3, seed=7)
    assert [p for _, _, p, _ in got] == list(range(30))  # positions stay epoch * num_rows + k
    assert all(r == q for _, r, _, q in got)  # row_index is the dataset row handed out
    orders = [[r for e, r, _, _ in got if e == epoch] for epoch in range(3)]
    assert all(sorted(order) == list(range(10)) for order in orders)  # every row once per epoch
    assert len({tuple(o) for o in orders}) == 3 and list(range(10)) not in orders  # reshuffled each epoch
    assert stream(ROWS, 3, seed=7) == got  # the same seed, the same order
    assert [r for _, r, _, _ in stream(ROWS, 1, seed=8)] != orders[0]  # another seed, another order
    assert orders[1] == epoch_order(10, 7, 1)


def test_a_resume_from_any_position_continues_the_same_order():
    full = stream(ROWS, 3, seed=7)
    for start in range(31):
        assert stream(ROWS, 3, start=start, seed=7) == full[start:], start


class RecordingLoop:
    """What ``produce`` reads of a rollout loop; ``run_group`` records the prompts it is handed."""

    def __init__(self, config, resume=None):
        self.config, self.window, self.unfinished_rollouts, self.unscored_groups = config, MetricWindow(), 0, 0
        allowance = SimpleNamespace(may_start_group=lambda: True, completed_groups=0)
        self.runtime = SimpleNamespace(dataset=ROWS, resume=resume, allowance=allowance, queue=None)
        self.cap = SimpleNamespace(cap=1000)
        self.started = []

    def filter_prompt(self, row_index, row, epoch):
        return True

    async def run_group(self, prompt_index, row_index, epoch, row):
        self.started.append((epoch, row_index, prompt_index, row["q"]))


def produced(config, resume=None):
    loop = RecordingLoop(config, resume)

    async def main():
        async with asyncio.TaskGroup() as tasks:
            await produce(loop, tasks)

    asyncio.run(main())
    return loop.started


def test_the_rollout_starts_groups_in_the_shuffled_order_and_a_resume_continues_it():
    config = RolloutConfig(num_epochs=3, shuffle_seed=4, num_generations=2)
    full = produced(config)
    assert full == stream(ROWS, 3, seed=4) and [r for _, r, _, _ in full[:10]] != list(range(10))
    resume = ResumeState(policy_version=2, first_untrained_prompt_index=13, trained_above=[15, 22])
    assert produced(config, resume) == [g for g in full[13:] if g[2] not in (15, 22)]
    assert produced(config.model_copy(update={"shuffle": False})) == stream(ROWS, 3)


def test_without_a_seed_and_for_a_streaming_dataset_the_order_is_the_datasets():
    assert [r for _, r, _, _ in stream(ROWS, 2)] == list(range(10)) * 2

    class Streaming:  # no __len__: read in order, whatever the seed
        def __iter__(self):
            return iter(ROWS)

    assert [r for _, r, _, _ in stream(Streaming(), 2, seed=7)] == list(range(10)) * 2


def test_shuffle_is_on_by_default_and_an_unused_seed_is_warned_about(caplog):
    assert RunConfig().rollout.shuffle is True
    with caplog.at_level("WARNING", logger="grpo_core.config"):
        RunConfig.model_validate({"rollout": {"shuffle": False, "shuffle_seed": 3}})
    assert "rollout.shuffle_seed: no effect (rollout.shuffle is false)" in caplog.text


def _checkpoint(tmp_path, cfg, drop_shuffle_keys=False):
    folder = tmp_path / "step-0000002"
    folder.mkdir(exist_ok=True)
    data = json.loads(fingerprint_text(cfg.trainer_process()))
    if drop_shuffle_keys:  # a checkpoint written before rollout.shuffle existed
        data["dataset"] = {k: v for k, v in data["dataset"].items() if "shuffle" not in k}
    (folder / FINGERPRINT_FILE).write_text(json.dumps(data))
    return folder


def test_a_resume_with_another_prompt_order_is_refused(tmp_path):
    run = RunConfig(rollout={"dataset": "reasoning_gym:leg_counting", "shuffle_seed": 1})
    folder = _checkpoint(tmp_path, run)
    assert check_resume(run.trainer_process(), folder) == []
    for change in ({"shuffle_seed": 2}, {"shuffle": False}):
        other = RunConfig(rollout={"dataset": "reasoning_gym:leg_counting", "shuffle_seed": 1, **change})
        with pytest.raises(ConfigError, match=r"rollout.shuffle"):
            check_resume(other.trainer_process(), folder)


def test_a_checkpoint_from_before_shuffle_resumes_in_the_datasets_order_only(tmp_path):
    ordered = RunConfig(rollout={"dataset": "reasoning_gym:leg_counting", "shuffle": False})
    folder = _checkpoint(tmp_path, ordered, drop_shuffle_keys=True)
    assert check_resume(ordered.trainer_process(), folder) == []
    shuffled = RunConfig(rollout={"dataset": "reasoning_gym:leg_counting"})
    with pytest.raises(ConfigError, match=r"rollout.shuffle: False -> True"):
        check_resume(shuffled.trainer_process(), folder)
