"""The embedded server against its contract, through the real client, on a real subprocess.

One tiny random Qwen3 server (float32, CPU, 1 thread) is shared by the module. Log-probs
are checked against an independent unbatched forward pass with tolerance 1e-4 (absolute,
natural log): the server computes in float32 with left-padded batches, the reference
without padding, so only float32 reduction-order noise (~1e-6) separates them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from serving_helpers import TINY, adapter_dir, embedded_server, reference_logprobs, run, weights_dir
from waiting import async_wait_until

from grpo_core.config import ModelConfig
from grpo_core.errors import ServerRequestError
from grpo_core.models import load_model, resolve_model_dir
from grpo_core.security.auth import bearer_headers, run_token
from grpo_core.serving.client import GenerationClient

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 99], [1, 9038, 2684, 28, 253, 1046], list(range(300, 340))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("tiny-server")) as handle:
        yield handle


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model(ModelConfig(name=TINY))[0]


def client(server, **kw) -> GenerationClient:
    return GenerationClient(server.url, max_connections=64, timeout_s=120, **kw)


async def _complete(server, prompt, **kw):
    async with client(server) as c:
        return await c.complete(prompt, model=TINY, **kw)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.3, "top_k": 50, "top_p": 0.8},
        {"temperature": 0.9, "min_p": 0.1},
        {"temperature": 0.0},
    ],
)
def test_logprobs_match_independent_forward(server, model, sampling):
    for prompt in PROMPTS[:2]:
        (out,) = run(_complete(server, prompt, max_tokens=12, seed=11, num_logprobs=3, ignore_eos=True, **sampling))
        assert out.prompt_ids == prompt and len(out.token_ids) == len(out.logprobs) == 12
        ref = reference_logprobs(model, prompt, out.token_ids, **sampling)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
        for chosen, top in zip(out.token_ids, out.top_logprobs, strict=True):
            assert chosen in top and len(top) in (3, 4)
            assert max(top.values()) <= 0.0


def test_greedy_is_deterministic_and_seed_repeats(server):
    async def go():
        async with client(server) as c:
            greedy = [
                await c.complete(PROMPTS[1], model=TINY, max_tokens=16, temperature=0, ignore_eos=True)
                for _ in range(2)
            ]
            seeded = await asyncio.gather(
                *(c.complete(PROMPTS[0], model=TINY, max_tokens=16, seed=123, ignore_eos=True) for _ in range(3))
            )
            other = await c.complete(PROMPTS[0], model=TINY, max_tokens=16, seed=124, ignore_eos=True)
            return greedy, seeded, other

    greedy, seeded, other = run(go())
    assert greedy[0][0].token_ids == greedy[1][0].token_ids
    assert seeded[0][0].token_ids == seeded[1][0].token_ids == seeded[2][0].token_ids
    assert other[0].token_ids != seeded[0][0].token_ids


def test_n_choices_and_stop_token(server):
    outs = run(_complete(server, PROMPTS[0], max_tokens=8, n=4, seed=5, ignore_eos=True))
    assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) > 1
    stop = outs[0].token_ids[2]
    (first,) = run(_complete(server, PROMPTS[0], max_tokens=8, seed=5, stop_token_ids=[stop], ignore_eos=True))
    assert first.finish_reason == "stop" and first.token_ids[-1] == stop and len(first.token_ids) <= 3


def test_32_concurrent_requests_finish_and_metrics_move(server):
    async def go():
        async with client(server) as c:
            before = await c.metrics()
            tasks = [
                asyncio.create_task(c.complete(p, model=TINY, max_tokens=48, seed=i, ignore_eos=True))
                for i, p in enumerate(PROMPTS * 11)
            ][:32]
            peak_running, peak_usage = 0.0, 0.0
            while not all(t.done() for t in tasks):
                snap = await c.metrics()
                peak_running = max(peak_running, snap.num_requests_running)
                peak_usage = max(peak_usage, snap.kv_cache_usage_frac)
                await asyncio.sleep(0.05)
            return before, [t.result() for t in tasks], peak_running, peak_usage, await c.metrics()

    before, results, peak_running, peak_usage, after = run(go())
    assert all(len(r[0].token_ids) == 48 and r[0].finish_reason == "length" for r in results)
    assert before.kv_cache_size_tokens == 64 * 256
    assert peak_running > 1, "requests were not decoded in one batch"
    assert 0 < peak_usage <= 1 and after.num_requests_running == 0 and after.num_requests_waiting == 0
    text = httpx.get(server.url + "/metrics", headers=bearer_headers(run_token())).text
    assert 'vllm:num_preemptions_total{engine="0",model_name="tiny-qwen3"}' in text


def test_pause_blocks_until_resume(server):
    async def go():
        async with client(server) as c:
            await c.pause()
            assert await c.is_paused()
            task = asyncio.create_task(c.complete(PROMPTS[0], model=TINY, max_tokens=4, ignore_eos=True))
            await asyncio.sleep(1.5)
            blocked = not task.done()
            waiting = (await c.metrics()).num_requests_waiting
            await c.resume()
            out = await asyncio.wait_for(task, 30)
            return blocked, waiting, out, await c.is_paused()

    blocked, waiting, out, paused_after = run(go())
    assert blocked and waiting == 1 and len(out[0].token_ids) == 4 and not paused_after


def test_disconnected_client_frees_its_slot(server):
    async def go():
        async with client(server) as c:
            await c.pause()
            try:
                body = {"model": TINY, "prompt": [5, 6, 7], "max_tokens": 8}
                with pytest.raises(httpx.ReadTimeout):
                    await c._http.post("/v1/completions", json=body, timeout=0.5)
                queued = (await c.metrics()).num_requests_waiting

                async def freed() -> bool:
                    return (await c.metrics()).num_requests_waiting == 0

                await async_wait_until(freed, "the server to drop the disconnected client's queued request", 30)
                return queued, (await c.metrics()).num_requests_waiting
            finally:
                await c.resume()

    queued, after = run(go())
    assert queued == 1 and after == 0


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": TINY, "prompt": list(range(10, 260)), "max_tokens": 16}, 400, "input_tokens"),
        ({"model": "no-such-model", "prompt": [5], "max_tokens": 4}, 404, "model"),
        ({"model": TINY, "prompt": [5], "max_tokens": -1}, 400, "max_tokens"),
        ({"model": TINY, "prompt": [5], "max_tokens": 4, "logprobs": 50}, 400, "logprobs"),
    ],
)
def test_bad_requests_get_vllm_error_bodies(server, body, status, param):
    response = httpx.post(server.url + "/v1/completions", json=body, headers=bearer_headers(run_token()))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    if param == "max_tokens":
        assert error["message"].startswith("max_tokens must be at least 1, got -1")
    assert httpx.get(server.url + "/health").status_code == 200
    assert len(run(_complete(server, [5, 6], max_tokens=2))[0].token_ids) == 2


def test_malformed_json_and_client_error(server):
    response = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": [5,',
        headers={"content-type": "application/json", **bearer_headers(run_token())},
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(ServerRequestError, match="maximum context length is 256") as info:
        run(_complete(server, list(range(10, 260)), max_tokens=16))
    assert info.value.status == 400
    assert len(run(_complete(server, [5, 6], max_tokens=2))[0].token_ids) == 2


def test_models_and_max_model_len(server):
    async def go():
        async with client(server) as c:
            return await c.models(), await c.max_model_len()

    cards, max_len = run(go())
    assert cards[0]["id"] == TINY and max_len == 256


def test_full_weight_update_changes_logprobs_as_predicted(server, model):
    original = load_file(str(resolve_model_dir(ModelConfig(name=TINY)) / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    perturbed_dir, original_dir = weights_dir(server) / "perturbed", weights_dir(server) / "original"
    for path, tensors in ((perturbed_dir, perturbed), (original_dir, original)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"))
    expected_model = load_model(ModelConfig(name=TINY))[0]
    expected_model.load_state_dict(perturbed, strict=False)

    async def go():
        async with client(server) as c:
            before = await c.complete(PROMPTS[1], model=TINY, max_tokens=10, temperature=0, ignore_eos=True)
            assert (await c.update_weights_from_path(str(perturbed_dir)))["num_tensors"] == len(original)
            after = await c.complete(PROMPTS[1], model=TINY, max_tokens=10, temperature=0, ignore_eos=True)
            await c.update_weights_from_path(str(original_dir))
            restored = await c.complete(PROMPTS[1], model=TINY, max_tokens=10, temperature=0, ignore_eos=True)
            return before[0], after[0], restored[0]

    before, after, restored = run(go())
    ref = reference_logprobs(expected_model, PROMPTS[1], after.token_ids, temperature=0)
    torch.testing.assert_close(torch.tensor(after.logprobs), ref, atol=ATOL, rtol=0)
    assert after.logprobs != before.logprobs
    assert restored.token_ids == before.token_ids and restored.logprobs == before.logprobs


def test_lora_versions_side_by_side_then_unloaded(server):
    from peft import LoraConfig, get_peft_model

    folder = adapter_dir(server) / "side-by-side"

    base = load_model(ModelConfig(name=TINY))[0]
    expected = {}
    for version in (1, 2):
        torch.manual_seed(version)
        peft_model = get_peft_model(
            base,
            LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
        )
        peft_model.save_pretrained(folder / f"v{version}")
        expected[f"pol-v{version}"] = peft_model.merge_and_unload()
        base = load_model(ModelConfig(name=TINY))[0]

    async def go():
        async with client(server) as c:
            for version in (1, 2):
                await c.load_lora_adapter(f"pol-v{version}", str(folder / f"v{version}"))
            names = [card["id"] for card in await c.models()]
            outs = await asyncio.gather(
                *(
                    c.complete(PROMPTS[0], model=m, max_tokens=8, temperature=0, ignore_eos=True)
                    for m in (TINY, "pol-v1", "pol-v2")
                )
            )
            await c.unload_lora_adapter("pol-v1")
            with pytest.raises(ServerRequestError) as gone:
                await c.complete(PROMPTS[0], model="pol-v1", max_tokens=2)
            still = await c.complete(PROMPTS[0], model="pol-v2", max_tokens=8, temperature=0, ignore_eos=True)
            await c.unload_lora_adapter("pol-v2")
            names_after = [card["id"] for card in await c.models()]
            await c.load_lora_adapter("pol-v3", str(folder / "v1"))  # reload after the last left
            again = await c.complete(PROMPTS[0], model="pol-v3", max_tokens=8, temperature=0, ignore_eos=True)
            await c.unload_lora_adapter("pol-v3")
            return names, outs, gone.value, still, names_after, again

    names, (base_out, v1, v2), gone, still, names_after, again = run(go())
    assert again[0].token_ids == v1[0].token_ids
    assert names == [TINY, "pol-v1", "pol-v2"] and names_after == [TINY]
    for name, out in (("pol-v1", v1[0]), ("pol-v2", v2[0])):
        ref = reference_logprobs(expected[name], PROMPTS[0], out.token_ids, temperature=0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
    assert len({tuple(base_out[0].logprobs), tuple(v1[0].logprobs), tuple(v2[0].logprobs)}) == 3
    assert gone.status == 404 and still[0].token_ids == v2[0].token_ids
    assert len(run(_complete(server, PROMPTS[0], max_tokens=4, temperature=0))[0].token_ids) >= 1
    # Unloading the active adapter (pol-v1, loaded first) and decoding with the byte-level BPE tokenizer
    # must not warn: the server hands the active role over first and never asks for WordPiece clean-up.
    log = server.spec.log_path.read_text(errors="replace")
    assert "was active which is now deleted" not in log
    assert "clean_up_tokenization_spaces" not in log


def test_unloading_an_adapter_never_fails_the_sequences_batched_with_it(server):
    # Before: the unload deleted the adapter under running sequences; the next decode step raised and
    # failed every sequence of the batch, those of the base model too.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    folder = adapter_dir(server) / "retire"
    get_peft_model(load_model(ModelConfig(name=TINY))[0], lora).save_pretrained(folder / "v1")
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def go():
        async with client(server) as c:
            await c.load_lora_adapter("ret-v1", str(folder / "v1"))
            alone = [await c.complete(PROMPTS[1], model=m, **greedy) for m in ("ret-v1", TINY)]
            tasks = [asyncio.create_task(c.complete(PROMPTS[1], model=m, **greedy)) for m in ("ret-v1", TINY)]

            async def both_decoding() -> bool:
                return (await c.metrics()).num_requests_running >= 2

            await async_wait_until(both_decoding, "both requests to decode in one batch", 60, 0.01)
            await c.pause()  # keep: frozen mid-decode while the adapter is unloaded
            await c.unload_lora_adapter("ret-v1")
            with pytest.raises(ServerRequestError) as gone:
                await c.complete(PROMPTS[1], model="ret-v1", max_tokens=2)
            await c.resume()
            batched = await asyncio.gather(*tasks)
            return alone, batched, gone.value, [card["id"] for card in await c.models()]

    alone, batched, gone, names = run(go())
    for (solo,), (out,) in zip(alone, batched, strict=True):
        assert out.finish_reason == "length" and out.token_ids == solo.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(solo.logprobs), atol=ATOL, rtol=0)
    assert gone.status == 404 and "ret-v1" not in names, "new requests for the unloaded adapter are refused"


@pytest.mark.serial  # a bound in seconds on the retries: alone on the machine
def test_server_killed_mid_request_client_retries_then_names_url(tmp_path):
    with embedded_server(tmp_path) as handle:
        url = handle.url

        async def go():
            # a request timeout far above the bound: a client that waited for it instead of seeing the dead
            # server (the fault this catches) takes >= 120 s; one that notices takes ~1 s (two backoffs of 0.2 s)
            async with GenerationClient(url, timeout_s=120, max_retries=2, backoff_s=0.2) as c:
                await c.pause()  # the request is certainly in flight (queued) when the server dies
                task = asyncio.create_task(c.complete([5, 6, 7], model=TINY, max_tokens=200, ignore_eos=True))

                async def queued() -> bool:
                    return (await c.metrics()).num_requests_waiting == 1

                await async_wait_until(queued, "the request to wait in the paused server's queue", 30)
                os.killpg(handle.process.pid, signal.SIGKILL)  # a crash, not a graceful stop
                started = time.monotonic()
                with pytest.raises(Exception) as info:
                    await task
                return info.value, c.retry_count, time.monotonic() - started

        error, retries, elapsed = run(go())
    assert type(error).__name__ == "ServerUnavailableError" and url in str(error)
    assert retries == 2 and elapsed < 60  # half the request timeout: a 60-fold margin over the ~1 s it takes


def test_eos_ends_a_sequence_unless_ignore_eos():
    """The engine stops a sequence at an EOS id (kept as its last token, finish_reason "stop") and goes on past it
    only with ``ignore_eos``. Which id is EOS is chosen from a greedy run's own third token, so the test does not
    depend on what a random model happens to sample."""
    import torch

    from grpo_core.config import ModelConfig
    from grpo_core.models import load_model
    from grpo_core.serving.embedded.engine import Engine, Sequence

    torch.manual_seed(0)
    model = load_model(ModelConfig(name=TINY))[0]

    def greedy(eos: set[int], ignore_eos: bool) -> Sequence:
        engine = Engine(model, eos_token_ids=eos, max_model_len=256, max_num_seqs=2, kv_cache_size_tokens=1024)
        seq = Sequence(list(range(7, 19)), max_tokens=8, seed=0, temperature=0.0, ignore_eos=ignore_eos)
        engine.submit([seq])
        for _ in range(50):
            if seq.future.done():
                return seq
            engine._step()
        raise AssertionError("the sequence did not finish")

    free = greedy(set(), ignore_eos=False)
    assert free.finish_reason == "length" and len(free.output_ids) == 8
    eos = free.output_ids[2]
    first = free.output_ids.index(eos)  # greedy decoding repeats itself: the first place this id comes
    stopped = greedy({eos}, ignore_eos=False)
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[: first + 1]
    kept_going = greedy({eos}, ignore_eos=True)
    assert kept_going.finish_reason == "length" and kept_going.output_ids == free.output_ids
