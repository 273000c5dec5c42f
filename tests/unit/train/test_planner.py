"""Rank 0's planner: whole steps of micro-batches, prompt bookkeeping, pending samples,
and no stall when the rollout side stops short of filling a row."""

import pyarrow as pa

from grpo_core.packing import Sample, samples_to_arrow
from grpo_core.train.checkpoint import PromptTracker
from grpo_core.train.planner import Planner
from grpo_core.transport.types import PulledBatch, ResumeState


class ScriptedSource:
    """A sample source that answers pulls from a fixed script (then nothing, as a held-back rollout)."""

    def __init__(self, script):
        self.script = list(script)
        self.timeouts = []

    def pull(self, policy_version, *, min_samples=1, timeout_s=None):
        self.timeouts.append(timeout_s)
        if self.script:
            return self.script.pop(0)
        return PulledBatch(EMPTY)

    def report(self, policy_version, tokens_consumed):
        pass

    def metrics(self):
        return {}

    def close(self):
        pass


def group(prompt_index, n=2, version=0):
    return samples_to_arrow(
        [
            Sample.build(
                [100 + prompt_index, 2, 3, 4 + i],
                [0, 0, 1, 1],
                sample_id=prompt_index * 10 + i,
                group_id=prompt_index,
                prompt_index=prompt_index,
                policy_version=version,
            )
            for i in range(n)
        ]
    )


EMPTY = group(0).slice(0, 0)


def test_a_starved_source_gets_its_partial_micro_batch_trained():
    source = ScriptedSource([PulledBatch(group(0)), PulledBatch(group(1), consumed_prompt_indices=[2])])
    planner = Planner(source, num_ranks=1, token_budget=64, backend="rust", tracker=PromptTracker(), flush_after_s=0.01)
    step = planner.next_step(1, policy_version=0)
    assert step is not None and sum(r.num_samples for mb in step.micro_batches for r in mb) == 4
    assert source.timeouts[-1] == 0.01
    assert planner.pending_samples() is not None  # pulled, not yet trained
    planner.step_trained(step)
    assert planner.pending_samples() is None
    state = planner.tracker.state(step=1, policy_version=0)
    assert (state.first_untrained_prompt_index, state.trained_above) == (3, [])


def test_pending_samples_count_their_prompts_as_done_for_the_rollout():
    source = ScriptedSource([PulledBatch(group(1)), PulledBatch(group(0))])
    planner = Planner(source, num_ranks=1, token_budget=64, backend="rust", tracker=PromptTracker(), flush_after_s=0.01)
    planner.next_step(1, policy_version=0)  # pulls both, nothing trained yet
    pending = planner.pending_samples()
    assert isinstance(pending, pa.RecordBatch) and pending.num_rows == 4
    state = planner.tracker.state(step=0, policy_version=0)
    assert state.first_untrained_prompt_index == 2  # both saved as pending: the rollout skips them


def test_micro_batches_planned_beyond_the_step_stay_pending():
    big = pa.concat_batches([group(p, n=4) for p in range(6)])
    source = ScriptedSource([PulledBatch(big, exhausted=True)])
    planner = Planner(source, num_ranks=1, token_budget=12, backend="rust", tracker=PromptTracker())
    step = planner.next_step(1, policy_version=0)
    planner.step_trained(step)
    trained = {i for mb in step.micro_batches for r in mb for i in r.samples.column("sample_id").to_pylist()}
    assert len(planner.ready) >= 1  # the one push closed more micro-batches than the step took
    pending = set(planner.pending_samples().column("sample_id").to_pylist())
    assert pending == set(big.column("sample_id").to_pylist()) - trained


def test_replicas_behind_end_the_plan_early_keeping_what_was_pulled_and_the_header_asks_one_resync():
    """A pull reporting replicas behind the policy version (restarted with the base weights: their guard refuses the
    rollout's requests) ends ``next_step`` before the step is full, so the trainer can sync them; the samples pulled
    stay planned, and the trainer pushes its weights again once per policy version (``step_header``)."""
    from grpo_core.train.distributed import RESYNC, ROW, STOP
    from grpo_core.train.trainer import step_header

    behind = ["http://gpu-2:8000"]
    source = ScriptedSource(
        [PulledBatch(group(0), servers_behind=behind), PulledBatch(group(1)), PulledBatch(group(2), exhausted=True)]
    )
    planner = Planner(source, num_ranks=1, token_budget=8, backend="rust", tracker=PromptTracker(), flush_after_s=0.01)
    assert planner.next_step(2, policy_version=3) is None and planner.servers_behind == behind
    assert len(source.script) == 2, "it stopped pulling at the report"
    assert step_header(None, planner.servers_behind, resynced_version=-1, policy_version=3) == [RESYNC, 0]
    assert step_header(None, planner.servers_behind, resynced_version=3, policy_version=3) is None  # pull again
    step = planner.next_step(2, policy_version=3)  # the sync reached them: nothing behind, the step fills
    assert planner.servers_behind == [] and step is not None
    assert {p for mb in step.micro_batches for r in mb for p in r.samples.column("prompt_index").to_pylist()} == {0, 1}
    header = step_header(step, [], resynced_version=3, policy_version=3)
    assert header == [ROW, 2, 4, 4]  # per micro-batch: one group, 2 samples x 2 loss-mask ones
    assert step_header(None, [], resynced_version=3, policy_version=3) == [STOP, 0]


def prompts_of(step):
    return sorted({p for mb in step.micro_batches for r in mb for p in r.samples.column("prompt_index").to_pylist()})


def test_samples_held_past_max_staleness_are_dropped_when_the_step_is_assembled_and_their_prompts_settled():
    """One pull brings six groups of policy version 0; a step trains one micro-batch (two groups: 5 forwarded
    tokens each in a budget of 12), so four groups wait in the planner. The next step trains at policy version 2:
    with max_staleness 1 (2 - 0 > 1) they are dropped there, not trained; with max_staleness 2 they train."""
    for max_staleness, want in ((1, [6]), (2, [2, 3])):
        script = [PulledBatch(pa.concat_batches([group(p) for p in range(6)])), PulledBatch(group(6, version=2))]
        planner = Planner(
            ScriptedSource(script), 1, 12, "rust", PromptTracker(), flush_after_s=0.01, max_staleness=max_staleness
        )
        first = planner.next_step(1, policy_version=0)
        planner.step_trained(first)
        assert prompts_of(first) == [0, 1] and planner.pending_samples().num_rows == 8  # set-up: four groups wait
        second = planner.next_step(1, policy_version=2)
        assert prompts_of(second) == want
        if max_staleness == 1:
            assert planner.take_dropped_stale_count() == 8 and planner.take_dropped_stale_count() == 0
            assert planner.total.stale_samples == 8 and planner.total.dropped_groups == 4
            planner.step_trained(second)
            # prompts 0-6 settled: trained (0, 1, 6) or dropped as stale (2-5); nothing left to save as pending
            assert planner.pending_samples() is None
            assert planner.tracker.state(step=2, policy_version=2).first_untrained_prompt_index == 7
        else:
            assert planner.take_dropped_stale_count() == 0


def test_pending_samples_of_a_checkpoint_too_old_for_the_resumed_version_are_dropped_not_trained():
    resume = ResumeState(policy_version=3, step=5, first_untrained_prompt_index=2)
    pending = pa.concat_batches([group(0, version=1), group(1, version=3)])  # saved by the checkpoint
    planner = Planner(
        ScriptedSource([PulledBatch(EMPTY, exhausted=True)]),
        1,
        64,
        "rust",
        PromptTracker(resume),
        pending,
        max_staleness=1,
    )
    step = planner.next_step(1, policy_version=3)
    assert prompts_of(step) == [1] and planner.take_dropped_stale_count() == 2  # 3 - 1 > 1: prompt 0 dropped
    planner.step_trained(step)
    assert planner.pending_samples() is None
    assert planner.tracker.state(step=6, policy_version=3).first_untrained_prompt_index == 2
