"""Async HTTP client of a generation server: real vLLM or the embedded server, same code.

One ``httpx.AsyncClient`` with a connection pool sized to the rollout's concurrency cap.
Connection errors, timeouts and 5xx answers are retried with exponential backoff and full
jitter (:func:`backoff_delay`, so many rollouts failing together do not retry in lockstep) and
counted in ``retry_count`` (logged as ``rollout/vllm_retry_count``, seed manual, rollout
metrics); after the retry budget a ``ServerUnavailableError`` names the URL. 4xx answers
are not retried: they raise ``ServerRequestError`` with vLLM's error message.

Idle pooled connections expire after :data:`KEEPALIVE_EXPIRY_S`, well before the server closes them
(uvicorn's default ``timeout_keep_alive`` is 5 s, vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` too; the servers
the flow starts use 60 s): with equal timers a request sent on a connection the server is closing at that
moment fails with ``ReadError`` without ever reaching it (seen on the H200 about every 10 s of a run).

Completions always use token ids in and out (``return_token_ids``,
``return_tokens_as_token_ids``) so no text round trip can change a token.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from grpo_core.errors import ReplicaBehindError, ServerRequestError, ServerUnavailableError
from grpo_core.security.auth import ROLE_CONTROL, bearer_headers, role_key
from grpo_core.serving.protocol import (
    BEHIND_ERROR_TYPE,
    COMPLETIONS_PATH,
    FINISH_WEIGHT_UPDATE_PATH,
    HEALTH_PATH,
    INIT_WEIGHT_TRANSFER_PATH,
    IS_PAUSED_PATH,
    LOAD_LORA_PATH,
    METRICS_PATH,
    MODELS_PATH,
    PAUSE_PATH,
    POLICY_VERSION_HEADER,
    RESET_PREFIX_CACHE_PATH,
    RESUME_PATH,
    SERVER_INFO_PATH,
    STALE_PATH,
    START_WEIGHT_UPDATE_PATH,
    UNLOAD_LORA_PATH,
    UPDATE_WEIGHTS_PATH,
)
from grpo_core.serving.sampling_defaults import request_sampling_fields

logger = logging.getLogger(__name__)

#: Seconds an idle pooled connection is kept for reuse: below every server keep-alive timeout we meet
#: (uvicorn and vLLM default to 5 s), so the client never reuses a connection the server is closing.
KEEPALIVE_EXPIRY_S = 2.0
#: Errors of one attempt that are retried (connection lost or refused, timeouts), from either HTTP library.
RETRIED_ERRORS = (httpx.TransportError, httpx.TimeoutException, aiohttp.ClientError, TimeoutError)


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): exponential backoff with full jitter.

    A uniform draw in ``[0, min(cap_s, base_s * 2**attempt)]`` ("full jitter", M. Brooker,
    "Exponential Backoff And Jitter", AWS Architecture Blog, 2015): clients that failed together
    spread their retries over the whole window instead of hitting a recovering server at once.

    Args:
        attempt: retries already made (0 for the first retry).
        base_s: upper bound of the first delay, in seconds.
        cap_s: largest upper bound, in seconds.
        rng: source of randomness (default: the ``random`` module's).
    """
    bound = min(cap_s, base_s * 2**attempt)
    return (rng or random).uniform(0.0, bound)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    Attributes:
        prompt_ids: the prompt's token ids, as the server saw them.
        token_ids: generated token ids (EOS/stop token included when it ended the turn).
        logprobs: per generated token, the sampler's processed log-prob (after temperature
            and top-k/top-p/min-p; vLLM ``processed_logprobs``), natural log; -9999.0 stands for -inf.
        top_logprobs: per generated token, ``{token_id: logprob}`` of the sampler's top
            ``num_logprobs`` tokens plus the sampled one; None when not requested.
        finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (max_tokens / max_model_len), or
            ``"abort"`` when the server cut the request short (e.g. ``/pause`` in abort mode); the tokens
            generated until then are kept. A missing finish reason reads as ``"abort"``.
        text: decoded text of ``token_ids`` (special tokens skipped).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str
    text: str


@dataclass(frozen=True)
class ServerMetrics:
    """One ``/metrics`` snapshot, aggregated over the server's engines as the seed manual says.

    Attributes:
        kv_cache_usage_frac: max over engines of ``vllm:kv_cache_usage_perc`` (a fraction 0-1).
        num_requests_running: sum of ``vllm:num_requests_running``.
        num_requests_waiting: sum of ``vllm:num_requests_waiting``.
        num_preemptions: sum of ``vllm:num_preemptions_total`` (cumulative count).
        kv_cache_size_tokens: sum of ``vllm:cache_config_info``'s ``kv_cache_size_tokens`` label, or None.
    """

    kv_cache_usage_frac: float
    num_requests_running: float
    num_requests_waiting: float
    num_preemptions: float
    kv_cache_size_tokens: int | None


def parse_metrics(text: str) -> ServerMetrics:
    """Parse Prometheus text exposition (vLLM's metric names) into ``ServerMetrics``."""
    usage, running, waiting, preemptions, kv_tokens = 0.0, 0.0, 0.0, 0.0, None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kv_cache_usage_perc":
                usage = max(usage, sample.value)
            elif sample.name == "vllm:num_requests_running":
                running += sample.value
            elif sample.name == "vllm:num_requests_waiting":
                waiting += sample.value
            elif sample.name == "vllm:num_preemptions_total":
                preemptions += sample.value
            elif sample.name == "vllm:cache_config_info" and "kv_cache_size_tokens" in sample.labels:
                kv_tokens = (kv_tokens or 0) + int(float(sample.labels["kv_cache_size_tokens"]))
    return ServerMetrics(usage, running, waiting, preemptions, kv_tokens)


def _parse_choice(choice: dict[str, Any], with_top: bool) -> Completion:
    block = choice.get("logprobs") or {}
    top = None
    if with_top:
        top = [
            {int(k.removeprefix("token_id:")): float(v) for k, v in (entry or {}).items()}
            for entry in block.get("top_logprobs") or []
        ]
    return Completion(
        prompt_ids=list(choice.get("prompt_token_ids") or []),
        token_ids=list(choice.get("token_ids") or []),
        logprobs=[float(x) for x in block.get("token_logprobs") or []],
        top_logprobs=top,
        finish_reason=choice.get("finish_reason") or "abort",
        text=choice.get("text") or "",
    )


class GenerationClient:
    """Async client of one server replica.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        max_connections: connection pool size; set it to the rollout concurrency cap.
        timeout_s: per-request timeout in seconds (a timed-out request is retried).
        max_retries: retries after connection errors, timeouts and 5xx answers.
        backoff_s: upper bound of the first retry delay in seconds; doubles per retry up to
            ``max_backoff_s``; each delay is drawn uniformly below its bound (:func:`backoff_delay`).
        max_backoff_s: largest bound of a retry delay in seconds.
        api_key: bearer token sent as ``Authorization: Bearer <api_key>`` on every request (health and
            control calls included), as vLLM's ``--api-key`` and hosted endpoints expect (``server.api_key`` for
            external servers); default the run's control key (``GRPO_CONTROL_KEY``, else derived from
            ``GRPO_RUN_TOKEN``: ``grpo_core.security.auth.role_key``), none when neither is set.
        ca_file: PEM CA file an ``https://`` server's certificate is verified against; default the run's
            ``tls.ca_file`` (``GRPO_TLS_CA_FILE``), else the system's trusted CAs.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 512,
        timeout_s: float = 1800.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        api_key: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        from grpo_core.security.auth import tls_files
        from grpo_core.serving.limits import client_ssl_context

        self.base_url = base_url.rstrip("/")
        self.ca_file = ca_file or tls_files()[2]
        self._ssl = client_ssl_context(self.ca_file)  # used by https:// URLs only
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retry_count = 0
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self._headers = bearer_headers(api_key or role_key(ROLE_CONTROL))
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        # control calls, health, metrics and streams (the router passes answers on as they come)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            limits=limits,
            timeout=httpx.Timeout(timeout_s),
            headers=self._headers,
            verify=self._ssl,
        )
        # Generation requests go through aiohttp: httpcore's pool walks every connection it holds on each request
        # and release (``_assign_requests_to_connections``, encode/httpcore#1035), and with hundreds of requests in
        # flight httpx cost ~2.4 ms of CPU per request against aiohttp's ~0.4 ms: the rollout process ran at one
        # CPU second per second on the H200 while vLLM idled (``benchmarks/rollout.py``).
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pools."""
        await self._http.aclose()
        if self._session is not None:
            await self._session.close()

    def _generation_session(self) -> aiohttp.ClientSession:
        """The aiohttp session of generation requests, made in the running event loop at first use."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, keepalive_timeout=KEEPALIVE_EXPIRY_S, ssl=self._ssl
            )
            # trust_env: HTTP(S)_PROXY / NO_PROXY apply as they do to httpx's control calls
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                trust_env=True,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        params: dict[str, Any] | None,
        headers: dict[str, str] | None,
        generation: bool,
    ) -> httpx.Response:
        """One attempt: a generation request through aiohttp, anything else through httpx; the answer as an
        ``httpx.Response`` either way."""
        if not generation:
            return await self._http.request(method, path, json=body, params=params, headers=headers)
        async with self._generation_session().request(
            method, self.base_url + path, json=body, params=params, headers=headers
        ) as answer:
            content = await answer.read()
        return httpx.Response(answer.status, content=content)

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        generation: bool = False,
    ) -> httpx.Response:
        last: str = ""
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._send(method, path, body, params, headers, generation)
            except RETRIED_ERRORS as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 503 and BEHIND_ERROR_TYPE in response.text:
                    raise ReplicaBehindError(f"{method} {self.base_url}{path}: HTTP 503: {response.text[:300]}")
                if response.status_code == 401:
                    raise ServerRequestError(
                        f"{self.base_url}{path} answered {response.status_code} (unauthorized): the server checks a "
                        "bearer token; set server.api_key (or the GRPO_SERVER_API_KEY environment variable) to its key",
                        response.status_code,
                        "AuthenticationError",
                    )
                if response.status_code < 500:
                    raise ServerRequestError.from_response(self.base_url + path, response.status_code, response.text)
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            if attempt == self.max_retries:
                break
            self.retry_count += 1
            delay = backoff_delay(attempt, self.backoff_s, self.max_backoff_s)
            logger.warning(
                "%s %s%s failed (%s); retry %d/%d in %.1f s",
                method,
                self.base_url,
                path,
                last,
                attempt + 1,
                self.max_retries,
                delay,
            )
            await asyncio.sleep(delay)
        raise ServerUnavailableError(
            f"{method} {self.base_url}{path} failed after {self.max_retries + 1} attempts; last error: {last}. "
            "Is the generation server running and reachable?"
        )

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One JSON request with this client's retries (any endpoint; the router forwards control calls with it).

        Raises:
            ServerRequestError: a 4xx answer (not retried).
            ReplicaBehindError: the replica's guard refused the request's policy version (not retried).
            ServerUnavailableError: connection errors, timeouts or 5xx answers past the retries.
        """
        return await self._request(method, path, body, params, headers)

    async def open_stream(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """Send one request and return the answer with its body not yet read (one attempt; a 4xx is returned as
        it is, for the router to pass on). Close it with ``aclose()``.

        Raises:
            ServerUnavailableError: connection error, timeout or a 5xx answer.
        """
        try:
            response = await self._http.send(self._http.build_request(method, path, json=body), stream=True)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise ServerUnavailableError(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500:
            text = (await response.aread()).decode(errors="replace")[:300]
            await response.aclose()
            raise ServerUnavailableError(f"{method} {self.base_url}{path}: HTTP {response.status_code}: {text}")
        return response

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        model: str,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        n: int = 1,
        stop_token_ids: list[int] | None = None,
        num_logprobs: int = 0,
        ignore_eos: bool = False,
        policy_version: int | None = None,
    ) -> list[Completion]:
        """Sample ``n`` continuations of one token-id prompt.

        Every sampling field is sent explicitly (top-k "off" as ``-1``, penalties at their neutral
        values), so no server-side default — a model's ``generation_config.json`` under vLLM's
        ``--generation-config auto`` — can change the distribution the trainer assumes
        (``grpo_core.serving.sampling_defaults``).

        Args:
            prompt_ids: prompt token ids.
            model: served model name, or a LoRA adapter name.
            max_tokens: most generated tokens per continuation.
            temperature, top_p, top_k, min_p: sampling parameters (top_k 0 = off).
            seed: sampling seed (choice i uses seed + i); None = server's own randomness.
            n: number of continuations.
            stop_token_ids: extra ids ending a continuation (kept in ``token_ids``).
            num_logprobs: top log-probs per token to return besides the sampled token's; 0 = none.
            ignore_eos: continue past EOS.
            policy_version: the full-weight policy version the tokens are tagged with, sent as
                ``X-GRPO-Policy-Version``: a guarded replica that holds no synced version of the run (restarted
                with the base weights) refuses it instead of sampling (``grpo_core.serving.guard``); None = not sent
                (LoRA runs name the version in ``model``).

        Raises:
            ReplicaBehindError: the replica holds no weights of ``policy_version`` (not retried here).
            ServerUnavailableError: no answer, or 5xx answers, past the retries.
            ServerRequestError: a 4xx answer.

        Returns:
            ``n`` ``Completion`` objects in choice order; ``finish_reason`` ``"abort"`` (or another value
            than ``"stop"``/``"length"``) marks a continuation the server cut short.
        """
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "n": n,
            "seed": seed,
            **request_sampling_fields(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p),
            "logprobs": num_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": ignore_eos,
            "stop_token_ids": list(stop_token_ids or ()),
        }
        version = None if policy_version is None else {POLICY_VERSION_HEADER: str(policy_version)}
        data = (await self._request("POST", COMPLETIONS_PATH, body, headers=version, generation=True)).json()
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return [_parse_choice(c, num_logprobs > 0) for c in choices]

    async def health(self) -> bool:
        """Whether ``/health`` answers 200 now (no retries)."""
        try:
            return (await self._http.get(HEALTH_PATH, timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> list[dict[str, Any]]:
        """The ``/v1/models`` cards (base model first, then LoRA adapters)."""
        return (await self._request("GET", MODELS_PATH)).json()["data"]

    async def max_model_len(self, model: str | None = None) -> int:
        """``max_model_len`` of ``model`` (default: the first card, the base model)."""
        for card in await self.models():
            if (model is None or card["id"] == model) and card.get("max_model_len"):
                return int(card["max_model_len"])
        raise ServerRequestError(f"{self.base_url}/v1/models lists no max_model_len for {model or 'the base model'}")

    async def metrics(self) -> ServerMetrics | None:
        """A ``/metrics`` snapshot, or None when the server has no metrics endpoint (404)."""
        try:
            response = await self._request("GET", METRICS_PATH)
        except ServerRequestError as exc:
            if exc.status == 404:
                return None
            raise
        return parse_metrics(response.text)

    async def pause(self, mode: str = "keep") -> None:
        """Pause generation (``POST /pause?mode=...``).

        Args:
            mode: ``"keep"`` (default) freezes in-flight requests until ``resume``; ``"wait"`` lets them
                finish first; ``"abort"`` — vLLM's default when no mode is sent — ends them with
                ``finish_reason: "abort"``. Weight syncs always keep.
        """
        await self._request("POST", PAUSE_PATH, params={"mode": mode})

    async def resume(self) -> None:
        """Resume generation (``POST /resume``)."""
        await self._request("POST", RESUME_PATH)

    async def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return bool((await self._request("GET", IS_PAUSED_PATH)).json()["is_paused"])

    async def server_info(self, config_format: str = "text") -> dict[str, Any]:
        """``GET /server_info`` (vLLM needs ``VLLM_SERVER_DEV_MODE=1``); ``config_format="json"`` gives vLLM's
        resolved config as a JSON tree instead of a string."""
        return (await self._request("GET", SERVER_INFO_PATH, params={"config_format": config_format})).json()

    async def init_weight_transfer_engine(self, init_info: dict[str, Any] | None = None) -> None:
        """``POST /init_weight_transfer_engine`` (once, before the first weight update)."""
        await self._request("POST", INIT_WEIGHT_TRANSFER_PATH, {"init_info": init_info or {}})

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """``POST /start_weight_update``: must finish before any weights are sent."""
        await self._request("POST", START_WEIGHT_UPDATE_PATH, {"is_checkpoint_format": is_checkpoint_format})

    async def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """``POST /update_weights``; the embedded server takes ``{"path": checkpoint folder}``."""
        return (await self._request("POST", UPDATE_WEIGHTS_PATH, {"update_info": update_info})).json()

    async def finish_weight_update(self) -> None:
        """``POST /finish_weight_update``, then ``/reset_prefix_cache?reset_running_requests=true``: no KV
        computed by the old weights survives (requests kept by the pause are recomputed on resume)."""
        await self._request("POST", FINISH_WEIGHT_UPDATE_PATH)
        await self._request("POST", RESET_PREFIX_CACHE_PATH, params={"reset_running_requests": "true"})

    async def update_weights_from_path(self, path: str) -> dict[str, Any]:
        """Full-weight update of the embedded server from a checkpoint-format folder (start → update → finish)."""
        await self.start_weight_update()
        try:
            result = await self.update_weights({"path": path})
        finally:
            await self.finish_weight_update()
        return result

    async def set_stale(self, stale: bool, reason: str = "", version: int | None = None) -> None:
        """Raise (``stale``) or lower the fence of a replica the run guards (``POST /grpo/stale``,
        :mod:`grpo_core.serving.guard`): fenced, it answers 503 on ``/health`` and generation requests. ``version``
        (lowering): the policy version the replica holds from now on."""
        body: dict[str, Any] = {"stale": stale, "reason": reason}
        if version is not None:
            body["version"] = version
        await self._request("POST", STALE_PATH, body)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in ``path`` as model ``name`` (vLLM needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""
        await self._request("POST", LOAD_LORA_PATH, {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name``; requests naming it get 404 afterwards."""
        await self._request("POST", UNLOAD_LORA_PATH, {"lora_name": name})
