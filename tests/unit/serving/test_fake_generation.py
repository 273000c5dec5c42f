"""The fake generation server of the tests (tests/support/fake_generation.py) answers what it promises: the protocol's
routes by name, completions by its documented rule in vLLM's shape, scripts per route, and the engine simulator's
completions when delegated to."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fake_generation import ANY_ROUTE, simulated_generation

from grpo_core.serving import protocol
from grpo_core.serving.client import GenerationClient

GET_ROUTES = (
    protocol.HEALTH_PATH,
    protocol.METRICS_PATH,
    protocol.MODELS_PATH,
    protocol.IS_PAUSED_PATH,
    protocol.SERVER_INFO_PATH,
    protocol.WORLD_SIZE_PATH,
    protocol.NONCE_PATH,
)


def test_every_route_of_the_protocol_is_served_and_recorded_in_order(fake_generation):
    with httpx.Client(base_url=fake_generation.url, timeout=10) as http:
        for route in GET_ROUTES:
            assert http.get(route).status_code == 200, route
        for route in protocol.CONTROL_PATHS:
            body = {"lora_name": "a", "lora_path": "/x"} if "lora" in route else {}
            assert http.post(route, json=body, params={"mode": "keep"}).status_code == 200, route
        missing = http.get("/not/a/route")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404  # vLLM's error body
    sent = [*GET_ROUTES, *protocol.CONTROL_PATHS, "/not/a/route"]
    assert [r.route for r in fake_generation.requests] == sent
    assert fake_generation.calls(protocol.PAUSE_PATH)[0].query == {"mode": ["keep"]}
    assert fake_generation.version == 1  # one /update_weights
    assert fake_generation.adapters == {}  # loaded, then unloaded


def test_completions_follow_the_documented_rule(fake_generation):
    async def go():
        async with GenerationClient(fake_generation.url) as client:
            return await client.complete([4, 9], model="m", max_tokens=3, n=2, num_logprobs=1)

    choices = asyncio.run(go())
    # token k of choice c after a prompt ending in 9: 9 + 1 + c + k (the module docstring's rule)
    assert [c.token_ids for c in choices] == [[10, 11, 12], [11, 12, 13]]
    assert all(c.logprobs == [-1.0] * 3 and c.finish_reason == "length" for c in choices)
    assert fake_generation.calls(protocol.COMPLETIONS_PATH)[0].body["n"] == 2


def test_a_script_answers_its_statuses_then_the_normal_answer(fake_generation):
    fake_generation.script(protocol.PAUSE_PATH, statuses=[409, 500])
    fake_generation.script(ANY_ROUTE, status=401)
    with httpx.Client(base_url=fake_generation.url, timeout=10) as http:
        answers = [http.post(protocol.PAUSE_PATH).status_code for _ in range(3)]
        assert http.get(protocol.HEALTH_PATH).status_code == 401  # every other route
    assert answers == [409, 500, 200] and fake_generation.paused


def test_completions_can_come_from_the_engine_simulator():
    with simulated_generation(max_model_len=64, kv_budget_tokens=4096) as fake:
        answer = httpx.post(
            fake.url + protocol.COMPLETIONS_PATH,
            json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "n": 3, "ignore_eos": True, "seed": 7},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert fake.calls(protocol.COMPLETIONS_PATH), "the fake recorded the delegated request"
    assert len(choices) == 3 and all(c["finish_reason"] == "length" for c in choices)  # ignore_eos: max_tokens
    assert all(c["prompt_token_ids"] is None and c["logprobs"] is None for c in choices)  # not asked for
    with pytest.raises(ValueError, match="ANY_ROUTE"):
        fake.script("completions", status=500)
