"""How many requests the rollout keeps in flight, counted by a real HTTP server (DESIGN.md §5, token allowance).

The server answers the first groups at once and holds every later request, so the loop ends
blocked with its admission rule alone deciding how many requests sit at the server. A dropped
group (its rewards all tie) never reaches the trainer, so it must not count against the staleness
limit; a group waiting only for its slowest rollout holds no concurrency slot for the finished ones.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoTokenizer

from grpo_core.config import ModelConfig, RolloutConfig
from grpo_core.models import resolve_model_dir
from grpo_core.rollout.driver import drive
from grpo_core.rollout.loop import LoopRuntime, RolloutLoop, request_seed
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.serving.client import GenerationClient
from grpo_core.serving.replicas import ReplicaSet

G = 2
COMPLETION = 8  # tokens of every completion (finish "length")


class HoldingServer(ThreadingHTTPServer):
    """``/v1/completions`` over real HTTP: answers requests whose seed is in ``answer_now`` at once, holds the
    others until ``release`` is set; counts the requests it holds. ``/metrics`` is 404 (cap = its ceiling)."""

    daemon_threads = True

    def __init__(self, answer_now: set[int]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer_now = answer_now
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.held = 0
        self.prompt_lengths: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: HoldingServer

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.prompt_lengths.add(len(body["prompt"]))
        if body["seed"] not in srv.answer_now:
            with srv.lock:
                srv.held += 1
            srv.release.wait(timeout=120)
        ids = [7] * body["max_tokens"]
        choice = {
            "index": 0,
            "text": "x" * len(ids),
            "token_ids": ids,
            "prompt_token_ids": body["prompt"],
            "logprobs": {"token_logprobs": [-1.0] * len(ids)},
            "finish_reason": "length",
        }
        data = json.dumps({"choices": [choice]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client is gone (the test ended the loop)
            pass


def keep_pattern(completion_ids, keep, **_):
    """Rewards that vary inside a group whose row says ``keep`` (queued) and tie otherwise (dropped)."""
    return [float(i) if k else 0.0 for i, k in enumerate(keep)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(name="tiny-qwen3")))


def run_until_blocked(
    tokenizer, rows, step_groups: float, answered_groups: int = 2, first_rollout_answered: bool = False, **rollout
) -> tuple[int, RolloutLoop, int]:
    """Drive a real loop against a :class:`HoldingServer` until it admits nothing more; returns the requests
    held, the loop, and the tokens of one group. The first ``answered_groups`` groups are answered at once,
    and with ``first_rollout_answered`` the first rollout of every group too."""
    cfg = RolloutConfig(  # in the dataset's order: the server answers groups by their position
        num_generations=G,
        max_completion_length=COMPLETION,
        num_sampler_logprobs=0,
        max_staleness=1,
        shuffle=False,
        **rollout,
    )
    answer_now = {request_seed(cfg.seed, group, i, 0) for group in range(answered_groups) for i in range(G)}
    if first_rollout_answered:
        answer_now |= {request_seed(cfg.seed, group, 0, 0) for group in range(len(rows))}
    server = HoldingServer(answer_now)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def go():
        client = GenerationClient(server.url, max_connections=cfg.max_concurrent_rollouts, timeout_s=300, max_retries=0)
        probe = RolloutLoop(
            cfg,
            LoopRuntime(
                tokenizer=tokenizer,
                server=None,
                model_name="m",
                max_model_len=256,
                dataset=[],
                queue=None,
                allowance=TokenAllowance(1, 1),
            ),
        )
        prompt_tokens = len(probe.render([{"role": "user", "content": rows[0]["prompt"]}]))
        probe.executor.shutdown()
        group_tokens = G * (prompt_tokens + COMPLETION)
        allowance = TokenAllowance(cfg.max_staleness, int(step_groups * group_tokens))
        runtime = LoopRuntime(
            tokenizer=tokenizer,
            server=ReplicaSet([client]),
            model_name="m",
            max_model_len=256,
            dataset=rows,
            queue=SampleQueue(allowance, with_topk=False),
            allowance=allowance,
            reward_functions=[keep_pattern],
        )
        loop = RolloutLoop(cfg, runtime)
        task = asyncio.create_task(drive(loop))
        # Blocked: the first two groups are done, every started rollout sits at the server, and no group may start.
        for _ in range(12000):  # a guard against waiting forever, not a speed check
            if (
                allowance.completed_groups == answered_groups
                and server.held == loop.unfinished_rollouts
                and (not allowance.may_start_group() or loop.unfinished_rollouts + G > loop.cap.cap)
            ):
                break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"the loop never stopped admitting groups ({server.held} requests held)")
        for _ in range(20):  # nothing else arrives while it stays blocked
            await asyncio.sleep(0.01)
        held = server.held
        server.release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        return held, loop, group_tokens, prompt_tokens

    try:
        held, loop, group_tokens, prompt_tokens = asyncio.run(go())
    finally:
        server.release.set()
        server.shutdown()
    assert server.prompt_lengths == {prompt_tokens}, "every request carried the rendered prompt"
    return held, loop, group_tokens


def test_dropped_groups_do_not_count_against_the_staleness_limit(tokenizer):
    # Groups 0-7 are answered: group 0 is kept (it queues one group's tokens T), groups 1-7 are dropped.
    # Every later group is held in flight.
    rows = [{"prompt": "Count to 3.", "keep": i == 0} for i in range(200)]
    held, loop, group_tokens = run_until_blocked(tokenizer, rows, step_groups=5, answered_groups=8)
    assert loop.runtime.allowance.queued_tokens == group_tokens
    # Limit 10 T: (max_staleness 1 + 1) steps of 5 T. A group in flight may queue T times the Wilson upper bound
    # (z = 2) of the kept share, 1 of 8: (1/8 + 4/16 + 2 sqrt(7/512 + 4/256)) / (1 + 4/8) = 0.4782 (math, not the code).
    upper = (1 / 8 + 4 / 16 + 2 * math.sqrt(7 / 512 + 4 / 256)) / (1 + 4 / 8)
    assert abs(upper - 0.4782) < 1e-4
    # A group may start while T + n x upper T + upper T <= 10 T: n <= 17, so 18 groups end up in flight.
    n = max(k for k in range(200) if 1 + k * upper + upper <= 10)
    assert n == 17 and held == (n + 1) * G
    # The old rule (every group in flight at its full size T) stopped at T + n T + T <= 10 T: 9 groups.
    assert held > 9 * G


def test_a_groups_finished_rollouts_free_their_concurrency_slots(tokenizer):
    # Every group is kept and the allowance never binds; the cap is 6 rollouts. The server answers the first
    # rollout of each group and holds the second, so each group in flight has one unfinished rollout.
    rows = [{"prompt": "Count to 3.", "keep": True} for _ in range(200)]
    held, loop, _ = run_until_blocked(
        tokenizer, rows, step_groups=1000, first_rollout_answered=True, max_concurrent_rollouts=6
    )
    # A group of 2 may start while unfinished + 2 <= 6: with n groups of one unfinished rollout each, n <= 4,
    # so 5 groups sit at the server, one request each.
    assert loop.cap.cap == 6 and held == 5
    # Counting whole groups (2 slots each, finished or not) stopped at 3 groups: 3 requests for a cap of 6.
    assert held > 3
