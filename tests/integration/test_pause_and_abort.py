"""Pause modes and aborted requests, against a real embedded server that aborts like vLLM 0.25.1.

vLLM's ``POST /pause`` without a mode aborts every in-flight request (HTTP 200,
``finish_reason: "abort"``, the tokens so far); ``mode=keep`` freezes them until ``/resume`` and
``mode=wait`` lets them finish first. The embedded server behaves the same, so these tests show
(1) its pause modes, (2) that the rollout never records an aborted reply as a finished turn — it
resubmits the continuation, and a group it cannot finish is dropped and counted — and (3) that
every weight sync pauses in keep mode, so a long generation survives a sync intact.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
from serving_helpers import TINY, embedded_server, generated_tokens, run, weights_dir
from waiting import async_wait_until

from grpo_core.config import RolloutConfig
from grpo_core.rollout import LoopRuntime, RolloutLoop
from grpo_core.rollout.loop import TurnAborted
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.serving.client import Completion, GenerationClient
from grpo_core.serving.replicas import ReplicaSet

PROMPT = [5, 17, 42, 99]
LONG = 200  # tokens: the tiny model needs a good fraction of a second for them on one thread


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("abort-server")) as handle:
        yield handle


async def _decoding(url: str, start: float) -> None:
    """Wait until the server at ``url`` has generated more than ``start`` tokens in all: a request is decoding."""

    async def moved() -> bool:
        return generated_tokens(url) > start

    await async_wait_until(moved, f"{url} to decode a token of the request", 60, 0.01)


async def freeze_mid_generation(c: GenerationClient, url: str, task: asyncio.Task, start: float) -> None:
    """Wait until the request has produced tokens, then pause in keep mode (it is frozen mid-way)."""
    await _decoding(url, start)
    await c.pause("keep")
    assert not task.done(), "the request finished before it could be frozen"


def test_pause_without_mode_aborts_in_flight_requests_with_their_tokens(server):
    async def go():
        async with GenerationClient(server.url, timeout_s=120) as c:
            start = generated_tokens(server.url)
            task = asyncio.create_task(
                c.complete(PROMPT, model=TINY, max_tokens=LONG, seed=1, ignore_eos=True, num_logprobs=2)
            )
            await freeze_mid_generation(c, server.url, task, start)
            response = await c._http.post("/pause")  # what vLLM receives from a client that sends no mode
            (out,) = await asyncio.wait_for(task, 30)
            paused = await c.is_paused()
            await c.resume()
            return response, out, paused

    response, out, paused = run(go())
    assert response.status_code == 200 and response.json() == {"status": "paused"} and paused
    assert out.finish_reason == "abort"
    assert 0 < len(out.token_ids) < LONG and len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_keep_and_wait_modes_finish_the_request_intact(server, mode):
    async def go():
        async with GenerationClient(server.url, timeout_s=120) as c:
            start = generated_tokens(server.url)
            task = asyncio.create_task(c.complete(PROMPT, model=TINY, max_tokens=LONG, seed=2, ignore_eos=True))
            await _decoding(server.url, start)
            await c.pause(mode)  # wait: returns once the request has finished
            try:  # still paused: a waited request's answer arrives, a kept one stays frozen
                await asyncio.wait_for(asyncio.shield(task), 5)
                finished_during_pause = True
            except TimeoutError:
                finished_during_pause = False
            queued = asyncio.create_task(c.complete(PROMPT, model=TINY, max_tokens=4, ignore_eos=True))
            await asyncio.sleep(0.5)
            held = not queued.done()
            await c.resume()
            return (await task)[0], finished_during_pause, held, (await queued)[0]

    out, finished_during_pause, held, later = run(go())
    assert out.finish_reason == "length" and len(out.token_ids) == LONG
    assert finished_during_pause == (mode == "wait") and held and len(later.token_ids) == 4


def test_unknown_pause_mode_is_a_400_naming_the_parameter(server):
    response = httpx.post(server.url + "/pause", params={"mode": "drain"}, headers=bearer_headers(run_token()))
    assert response.status_code == 400 and response.json()["error"]["param"] == "mode"
    assert httpx.get(server.url + "/is_paused", headers=bearer_headers(run_token())).json() == {"is_paused": False}


class RecordingClient(GenerationClient):
    """The real client, also keeping each request's prompt and answer (to check the continuation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests: list[tuple[list[int], int, Completion]] = []

    async def complete(self, prompt_ids, **kw):
        outs = await super().complete(prompt_ids, **kw)
        self.requests.append((list(prompt_ids), kw["max_tokens"], outs[0]))
        return outs


def make_loop(clients, **rollout) -> RolloutLoop:
    cfg = RolloutConfig(max_completion_length=LONG, num_sampler_logprobs=2, **rollout)
    runtime = LoopRuntime(
        tokenizer=None,
        server=ReplicaSet(clients),
        model_name=TINY,
        max_model_len=256,
        dataset=[],
        queue=None,
        allowance=TokenAllowance(1, 1000),
    )
    return RolloutLoop(cfg, runtime)


def test_aborted_turn_is_resubmitted_as_its_continuation(server):
    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    async def go():
        async with RecordingClient(server.url, timeout_s=120) as c:
            loop = make_loop([c])
            loop.tokenizer = Tokenizer()
            start = generated_tokens(server.url)
            turn_task = asyncio.create_task(loop.generate_one_turn(PROMPT))
            await _decoding(server.url, start)
            await c.pause("keep")
            await c.pause("abort")  # a sync by a client that forgot the mode
            await c.resume()
            turn = await asyncio.wait_for(turn_task, 60)
            loop.executor.shutdown()
            return turn, c.requests, loop.window.flush()

    turn, requests, metrics = run(go())
    (p1, m1, first), (p2, m2, second) = requests
    assert first.finish_reason == "abort" and 0 < len(first.token_ids) < LONG
    assert p1 == PROMPT and m1 == LONG
    assert p2 == PROMPT + first.token_ids and m2 == LONG - len(first.token_ids), "continuation of the cut reply"
    assert turn.output_ids == first.token_ids + second.token_ids and turn.finish_reason == second.finish_reason
    assert turn.finish_reason in ("stop", "length") and turn.output_log_probs == first.logprobs + second.logprobs
    assert turn.output_sampler_logprobs == first.top_logprobs + second.top_logprobs
    assert turn.prompt_ids == PROMPT and metrics["rollout/aborted_turn_count"] == 1


class AlwaysAborts:
    """A server double whose every reply was cut short after 3 tokens."""

    def __init__(self):
        self.calls = 0

    async def complete(self, prompt_ids, **kw):
        self.calls += 1
        return [Completion(list(prompt_ids), [7, 8, 9], [-1.0] * 3, [{7: -1.0}] * 3, "abort", "")]


class Queue:
    def __init__(self):
        self.groups, self.consumed_prompts = [], []

    def put_group(self, prompt_index, samples, tokens):
        self.groups.append(prompt_index)

    def consumed(self, prompt_index):
        self.consumed_prompts.append(prompt_index)


def test_group_that_keeps_being_aborted_is_dropped_and_counted():
    server = AlwaysAborts()
    loop = make_loop([server], max_abort_retries=2, num_generations=2)
    loop.runtime.queue = Queue()
    row = {"prompt": "hi"}
    loop.render = lambda messages, schemas=None: PROMPT

    async def go():
        await loop.run_group(prompt_index=3, row_index=3, epoch=0, row=row)
        with pytest.raises(TurnAborted, match="max_abort_retries"):
            await loop.generate_one_turn(PROMPT)

    run(go())
    metrics = loop.window.flush()
    loop.executor.shutdown()
    assert loop.runtime.queue.groups == [] and loop.runtime.queue.consumed_prompts == [3]
    assert metrics["rollout/aborted_group_count"] == 1
    assert metrics["rollout/aborted_turn_count"] == 2 * 3 + 3  # 3 attempts per rollout, two rollouts, then one turn
    assert server.calls == 2 * 3 + 3 and loop.runtime.allowance.in_flight_groups == 0


def test_long_generation_survives_a_full_weight_sync_intact(server):
    from grpo_core.config import ModelConfig
    from grpo_core.models import resolve_model_dir
    from grpo_core.train.weight_sync import DiskFullWeightSync

    # The served weights, copied into the run's weights folder (the only one the server reads): a real update,
    # same values.
    folder = weights_dir(server) / "served"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(resolve_model_dir(ModelConfig(name=TINY)) / "model.safetensors", folder)
    folder = str(folder)

    async def go():
        async with GenerationClient(server.url, timeout_s=120) as c:
            start = generated_tokens(server.url)
            task = asyncio.create_task(c.complete(PROMPT, model=TINY, max_tokens=LONG, seed=3, ignore_eos=True))
            await _decoding(server.url, start)
            await DiskFullWeightSync.phases(ReplicaSet([c]), folder, 1)  # what every sync does
            return (await task)[0]

    out = run(go())
    assert out.finish_reason == "length" and len(out.token_ids) == LONG
