"""Several generation replicas as one: prefix-affinity routing and all-or-nothing control fan-out.

:class:`RoutingPolicy` decides, without I/O, which replica serves a request (DESIGN.md §10; issue 13):

* a request with an affinity key whose key already has a home replica goes there (**hit**): every
  request of a group (its G rollouts and their later turns) shares the prompt, which the home
  replica's prefix cache then prefills once;
* unless the home has more than ``route_imbalance`` requests in flight beyond the least loaded
  healthy replica: then it **spills** to the least loaded (the key keeps its home);
* a key seen for the first time, or whose home is down, is **unmatched**: it goes to the least
  loaded healthy replica, round robin among ties, which becomes its home.

The rollout's keys are (group id, policy version), and :meth:`ReplicaSet.complete` adds the model name (a
LoRA run's adapter version), so two policy versions never share a key.
With G requests per group, at most (G - 1) / G of them can hit (87.5% at G = 8).

:class:`ReplicaSet` sends completions through the policy (a replica whose request fails and whose
``/health`` fails too is marked down, the request goes to another, a probe re-admits the replica once
its ``/health`` answers 200; a failed request to a replica that is still healthy is simply retried) and fans
control calls (pause/resume, LoRA load/unload, weight updates) out to every replica, all or
nothing: each replica is retried every ``control_retry_s`` until ``control_timeout_s`` (shared
storage may lag), and when one still fails the replicas that succeeded are rolled back.

Metrics (per logging window, DESIGN.md §7): ``router/affinity_hit_frac``, ``router/unmatched_frac``,
``router/spill_frac`` (one 0/1 value per routed request, so the window mean is the fraction),
``router/inflight/<replica>`` (requests in flight, sampled at each concurrency poll) and
``router/replica_down_count``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from grpo_core.errors import (
    ReplicaBehindError,
    ServerRequestError,
    ServerStartError,
    ServerUnavailableError,
    ServingError,
)
from grpo_core.serving.client import Completion, GenerationClient, ServerMetrics, backoff_delay

logger = logging.getLogger(__name__)

T = TypeVar("T")

HIT, UNMATCHED, SPILL = "hit", "unmatched", "spill"
#: Seconds between ``/health`` probes of a replica marked down.
PROBE_INTERVAL_S = 1.0


#: Phrases of a 400 that no retry changes (vLLM's own messages, which the embedded server repeats): the adapter name
#: is taken, its rank exceeds the server's, a field is missing. Other 400s of a call that reads files from storage
#: (``fan_out(..., reads_storage=True)``) are retried: a LoRA folder on shared storage can show its config before its
#: weights ("doesn't contain tensors"). A 4xx of any other call (a bad ``/pause?mode=``) ends it at once
#: (:func:`refusal_is_final`).
PERMANENT_400 = ("has already been loaded", "is greater than max_lora_rank", "must be provided")


def refusal_is_final(status: int | None, text: str, reads_storage: bool) -> bool:
    """Whether a control call's error is a refusal no retry changes (ends its fan-out at once).

    Args:
        status: the HTTP status of the answer (None: no answer, e.g. a replica that is restarting; retried).
        text: the error's message (a 400 naming one of :data:`PERMANENT_400` is final).
        reads_storage: the call loads files from shared storage, which can lag: its 400s (not of
            :data:`PERMANENT_400`) and its 404 "No adapter found" (vLLM's words, and the embedded server's, for a
            LoRA folder it cannot see yet) are retried.

    Returns:
        True for a 4xx but 408/429 (the server asks to come back) and the storage refusals above; False for no
        answer or a 5xx. A plain 404 (a route the server lacks, e.g. vLLM without runtime LoRA updating) is final.
    """
    if status is None or not 400 <= status < 500 or status in (408, 429):
        return False
    if reads_storage and status == 400:
        return any(phrase in text for phrase in PERMANENT_400)
    if reads_storage and status == 404:
        return "No adapter found" not in text
    return True


class ControlFanOutError(ServingError):
    """A control call failed on some replica after its retries; the replicas that took it were rolled back.

    Attributes:
        failed: ``{url: error text}`` of the replicas that never succeeded.
        rolled_back: URLs of the replicas the rollback was applied to.
        statuses: ``{url: HTTP status}`` of the failed replicas' last answers (None: no answer, e.g. unreachable).
    """

    def __init__(
        self,
        message: str,
        failed: dict[str, str],
        rolled_back: list[str],
        statuses: dict[str, int | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.failed = failed
        self.rolled_back = rolled_back
        self.statuses = statuses or {}

    @property
    def common_refusal(self) -> int | None:
        """The 4xx every replica answered when none took the call (the request itself is at fault, as a single
        server would say), else None (replicas disagree or were unreachable: a gateway fault)."""
        codes = set(self.statuses.values())
        if self.rolled_back or len(self.statuses) != len(self.failed) or len(codes) != 1:
            return None
        code = codes.pop()
        return code if code is not None and 400 <= code < 500 else None


@dataclass
class RouteCounts:
    """Routed requests by outcome since the policy was made (counts)."""

    hits: int = 0
    unmatched: int = 0
    spills: int = 0
    replica_down: int = 0

    @property
    def total(self) -> int:
        """Requests routed."""
        return self.hits + self.unmatched + self.spills


class RoutingPolicy:
    """Which replica serves a request; pure bookkeeping, no I/O, one event loop (no locks).

    Args:
        num_replicas: replicas, indexed 0 .. num_replicas - 1.
        route_imbalance: requests in flight a home replica may hold beyond the least loaded healthy
            replica before its keys spill (``server.route_imbalance``; the seed uses 8).
        max_keys: affinity keys remembered (least recently used ones are forgotten first).
    """

    def __init__(self, num_replicas: int, route_imbalance: int = 8, max_keys: int = 1 << 16) -> None:
        if num_replicas < 1:
            raise ValueError(f"a replica set needs at least one replica, got {num_replicas}")
        self.inflight = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self.route_imbalance = route_imbalance
        self.max_keys = max_keys
        self.homes: OrderedDict[Hashable, int] = OrderedDict()
        self.counts = RouteCounts()
        self._next = 0

    def _least_loaded(self, candidates: list[int]) -> int:
        low = min(self.inflight[i] for i in candidates)
        n = len(self.inflight)
        for step in range(n):  # round robin among ties, from the replica after the last pick
            i = (self._next + step) % n
            if i in candidates and self.inflight[i] == low:
                self._next = (i + 1) % n
                return i
        raise AssertionError("no candidate replica")  # candidates is never empty

    def choose(self, key: Hashable | None, count: bool = True) -> tuple[int, str]:
        """The replica for a request with affinity ``key`` (None = no affinity) and how it was chosen.

        When no replica is healthy every replica is a candidate, taken in turn without affinity (a request must
        go somewhere; the caller's retries and backoff take over, and each retry tries the next replica, not the
        key's home again); the key keeps its home for when replicas are back.

        Returns:
            ``(replica index, HIT | UNMATCHED | SPILL)``; the count of that outcome is incremented when
            ``count`` (generation requests; not ``/v1/models`` and other reads).
        """
        counts = self.counts if count else RouteCounts()
        candidates = [i for i, ok in enumerate(self.healthy) if ok]
        if not candidates:
            counts.unmatched += 1
            return self._least_loaded(list(range(len(self.healthy)))), UNMATCHED
        home = self.homes.get(key) if key is not None else None
        if home is not None and home in candidates:
            self.homes.move_to_end(key)
            low = min(self.inflight[i] for i in candidates)
            if self.inflight[home] - low <= self.route_imbalance:
                counts.hits += 1
                return home, HIT
            counts.spills += 1
            return self._least_loaded(candidates), SPILL
        replica = self._least_loaded(candidates)
        if key is not None:
            self.homes[key] = replica
            self.homes.move_to_end(key)
            while len(self.homes) > self.max_keys:
                self.homes.popitem(last=False)
        counts.unmatched += 1
        return replica, UNMATCHED

    def mark_down(self, replica: int) -> bool:
        """Take a replica out of routing; returns whether it was healthy before (counted then)."""
        was = self.healthy[replica]
        if was:
            self.healthy[replica] = False
            self.counts.replica_down += 1
        return was

    def mark_up(self, replica: int) -> None:
        """Route to a replica again (its keys were re-homed while it was down)."""
        self.healthy[replica] = True


class ReplicaSet:
    """The generation replicas of a run behind one client-shaped object (see module docs).

    Args:
        urls: base URLs of the replicas (``http://host:port``), or ready ``GenerationClient`` objects (used as
            they are; give them ``max_retries=0`` so a failed replica is routed around at once).
        api_key: bearer token sent on every request and control call (``server.api_key``); None = none.
        route_imbalance: see :class:`RoutingPolicy` (``server.route_imbalance``).
        control_retry_s: seconds between retries of a control call on one replica (``server.control_retry_s``).
        control_timeout_s: seconds a control call may keep retrying before the fan-out fails and rolls back
            (``server.control_timeout_s``).
        max_connections, timeout_s: connection pool size and per-request timeout (seconds) of each replica.
        max_retries: re-routes of a completion after a replica failed it (connection error, timeout, 5xx).
        backoff_s, max_backoff_s: retry delay bounds in seconds (:func:`backoff_delay`), used when no replica
            is healthy.
        behind_wait_s: how long a request waits, on top of ``max_retries``, while the replicas that refuse it are
            behind the run's policy version (:class:`~grpo_core.errors.ReplicaBehindError`: the trainer syncs them
            when it next pulls samples; the rollout passes ``rollout.rollout_worker_timeout_s``).
        sink: where routing metrics go: any object with ``add(name, value)`` (a ``MetricWindow``); None = none.
    """

    def __init__(
        self,
        urls: Sequence[str | GenerationClient],
        *,
        api_key: str | None = None,
        route_imbalance: int = 8,
        control_retry_s: float = 0.5,
        control_timeout_s: float = 60.0,
        max_connections: int = 512,
        timeout_s: float = 1800.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        behind_wait_s: float = 300.0,
        sink: Any = None,
    ) -> None:
        if not urls:
            raise ServingError("no generation server URL: set server.urls or let the flow start server.num_replicas")
        self.clients = [
            GenerationClient(u, api_key=api_key, max_connections=max_connections, timeout_s=timeout_s, max_retries=0)
            if isinstance(u, str)
            else u
            for u in urls
        ]
        self.urls = [getattr(c, "base_url", f"replica {i}") for i, c in enumerate(self.clients)]
        self.policy = RoutingPolicy(len(urls), route_imbalance)
        self.control_retry_s, self.control_timeout_s = control_retry_s, control_timeout_s
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.behind_wait_s = behind_wait_s
        self.retry_count = 0
        self.sink = sink
        self._probes: dict[int, asyncio.Task] = {}
        #: replicas that refused a request for a policy version they do not hold (restarted with the base weights,
        #: :class:`~grpo_core.errors.ReplicaBehindError`), until they rejoin: the trainer's next sync reaches them
        self.behind: set[int] = set()

    @classmethod
    def from_config(cls, server: Any, urls: Sequence[str], **kwargs: Any) -> ReplicaSet:
        """A set over ``urls`` with the routing settings and bearer token of ``server`` (a ``ServerConfig``)."""
        return cls(
            urls,
            api_key=server.resolved_api_key(),
            route_imbalance=server.route_imbalance,
            control_retry_s=server.control_retry_s,
            control_timeout_s=server.control_timeout_s,
            **kwargs,
        )

    async def __aenter__(self) -> ReplicaSet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the health probes and close every connection pool."""
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        self._probes.clear()
        for client in self.clients:
            if hasattr(client, "aclose"):
                await client.aclose()

    # ----- routed requests -------------------------------------------------------------------------

    def _record(self, kind: str) -> None:
        if self.sink is not None:
            self.sink.add("router/affinity_hit_frac", float(kind == HIT))
            self.sink.add("router/unmatched_frac", float(kind == UNMATCHED))
            self.sink.add("router/spill_frac", float(kind == SPILL))

    def mark_down(self, replica: int, reason: str) -> None:
        """Route around ``replica`` until a ``/health`` probe finds it healthy again."""
        if self.policy.mark_down(replica):
            logger.warning(
                "replica %d (%s) marked down: %s; routing around it until /health answers",
                replica,
                self.urls[replica],
                reason,
            )
            if self.sink is not None:
                self.sink.add("router/replica_down_count", 1)
        if replica not in self._probes or self._probes[replica].done():
            self._probes[replica] = asyncio.create_task(self._probe(replica))

    async def failed(self, replica: int, error: ServerUnavailableError) -> bool:
        """A request to ``replica`` failed at the transport level (or answered 5xx): mark it down only when its
        ``/health`` fails too. A dropped connection from a live replica (a keep-alive race, a proxy reset) is
        retried instead of taking the replica out of the routing — with a single replica that stalled the whole
        rollout until the probe re-admitted it. Returns whether the replica was marked down."""
        if await self.clients[replica].health():
            logger.info(
                "request to replica %d (%s) failed but /health answers; retrying: %s",
                replica,
                self.urls[replica],
                str(error).splitlines()[0][:200],
            )
            return False
        self.mark_down(replica, str(error).splitlines()[0][:200])
        return True

    async def _probe(self, replica: int) -> None:
        while not await self.clients[replica].health():
            await asyncio.sleep(PROBE_INTERVAL_S)
        self.policy.mark_up(replica)
        self.behind.discard(replica)
        logger.info("replica %d (%s) healthy again; it rejoins the routing", replica, self.urls[replica])

    async def routed(
        self, key: Hashable | None, send: Callable[[GenerationClient], Awaitable[T]], count: bool = True
    ) -> T:
        """``await send(client)`` on the replica the policy picks for ``key``; re-routed on failure.
        ``count``: a generation request, counted in the routing metrics (reads such as ``/v1/models`` are not).

        Raises:
            ServerUnavailableError: every attempt (``max_retries + 1``) failed; names each replica tried, with its
                last error.
            ServerRequestError: a replica refused the request (4xx; not retried).
        """
        tried: dict[str, str] = {}  # replica URL -> its last error, in the order first tried
        attempt, behind_deadline = 0, time.monotonic() + self.behind_wait_s
        while True:
            replica, kind = self.policy.choose(key, count)
            if count:
                self._record(kind)
            self.policy.inflight[replica] += 1
            behind = False
            try:
                return await send(self.clients[replica])
            except ServerUnavailableError as exc:
                tried[self.urls[replica]] = str(exc)
                behind = isinstance(exc, ReplicaBehindError)
                if behind:
                    self.behind.add(replica)
                await self.failed(replica, exc)
            finally:
                self.policy.inflight[replica] -= 1
            # a replica behind the policy version is being healed (the trainer syncs it): wait, not an attempt
            waiting = behind and time.monotonic() < behind_deadline
            if attempt == self.max_retries and not waiting:
                break
            self.retry_count += 1
            if not any(self.policy.healthy):
                await asyncio.sleep(backoff_delay(attempt, self.backoff_s, self.max_backoff_s))
            attempt += 0 if waiting else 1
        raise ServerUnavailableError(
            f"request failed on every attempt ({self.max_retries + 1}) on {len(tried)} of {len(self.urls)} "
            f"replica(s); the last error of each: {'; '.join(f'{u}: {e}' for u, e in tried.items())}. "
            "Are the generation servers running and reachable?"
        )

    async def complete(
        self, prompt_ids: list[int], *, affinity_key: Hashable | None = None, model: str, **sampling: Any
    ) -> list[Completion]:
        """``GenerationClient.complete`` on the routed replica; ``affinity_key`` (e.g. the group id) is
        combined with ``model`` (the policy version's adapter), so versions never share a key."""
        key = None if affinity_key is None else (affinity_key, model)
        return await self.routed(key, lambda c: c.complete(prompt_ids, model=model, **sampling))

    # ----- the set as a whole ----------------------------------------------------------------------

    async def health(self) -> bool:
        """Healthy only when every replica's ``/health`` answers 200."""
        return all(await asyncio.gather(*(c.health() for c in self.clients)))

    async def models(self) -> list[dict[str, Any]]:
        """``/v1/models`` of the first healthy replica (routed; all replicas serve the same cards)."""
        return await self.routed(None, lambda c: c.models(), count=False)

    async def max_model_len(self, model: str | None = None) -> int:
        """``max_model_len`` of ``model`` as the replicas report it (the smallest, should they differ)."""
        return min(await asyncio.gather(*(c.max_model_len(model) for c in self.clients)))

    async def metrics(self) -> list[ServerMetrics | None]:
        """``/metrics`` of every healthy replica that answers (None where a replica has none); logs
        ``router/inflight/<i>``. A replica whose poll finds it unreachable is marked down (counted in
        ``retry_count``, like a failed request) until its ``/health`` probe re-admits it.

        Raises:
            ServerUnavailableError: no replica answered (the caller keeps its previous state).
        """
        if self.sink is not None:
            for i, n in enumerate(self.policy.inflight):
                self.sink.add(f"router/inflight/{i}", n)
        live = [i for i, ok in enumerate(self.policy.healthy) if ok]
        answers = await asyncio.gather(*(self.clients[i].metrics() for i in live), return_exceptions=True)
        snaps = []
        for i, answer in zip(live, answers):
            if isinstance(answer, ServerUnavailableError):
                self.retry_count += 1
                await self.failed(i, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                snaps.append(answer)
        if not snaps:
            raise ServerUnavailableError(f"/metrics: no replica answered ({', '.join(self.urls)})")
        return snaps

    async def fan_out(
        self,
        name: str,
        call: Callable[[GenerationClient], Awaitable[Any]],
        undo: Callable[[GenerationClient], Awaitable[Any]] | None = None,
        reads_storage: bool = False,
    ) -> None:
        """Run a control call on every replica, all or nothing.

        Each replica is retried every ``control_retry_s`` seconds until ``control_timeout_s``: an unreachable
        replica, a 5xx, a 408/429 always; a 400 or a 404 "No adapter found" only when ``reads_storage`` (the call
        loads files a replica may not see yet on shared storage), a 400 not of :data:`PERMANENT_400`; no other 4xx
        (:func:`refusal_is_final`). If one still fails, ``undo`` runs (with the same retries, errors logged) on the
        replicas that succeeded.

        Raises:
            ControlFanOutError: some replica never succeeded; names each and the rollback.
        """
        results = await asyncio.gather(*(self._retry(c, call, reads_storage) for c in self.clients))
        failed = {u: r[0] for u, r in zip(self.urls, results) if r is not None}
        if not failed:
            return
        statuses = {u: r[1] for u, r in zip(self.urls, results) if r is not None}
        took = [c for c, r in zip(self.clients, results) if r is None]
        if undo is not None and took:
            undone = await asyncio.gather(*(self._retry(c, undo) for c in took))
            for client, error in zip(took, undone):
                if error is not None:
                    logger.error("rollback of %s on %s failed: %s", name, client.base_url, error[0])
        rolled = [c.base_url for c in took] if undo is not None else []
        raise ControlFanOutError(
            f"{name} failed on {len(failed)} of {len(self.urls)} replicas (each retried up to "
            f"{self.control_timeout_s:.0f} s, server.control_timeout_s, unless said otherwise): "
            + "; ".join(f"{u}: {e}" for u, e in failed.items())
            + (f"; rolled back on {', '.join(rolled)}" if rolled else "; nothing to roll back"),
            failed,
            rolled,
            statuses,
        )

    async def _retry(
        self, client: GenerationClient, call: Callable[[GenerationClient], Awaitable[Any]], reads_storage: bool = False
    ) -> tuple[str, int | None] | None:
        """None when ``call(client)`` succeeded within ``control_timeout_s``, else the last error's text and HTTP
        status (None: no answer). A refusal that no retry changes (:func:`refusal_is_final`: 401 wrong token, 403 a
        path outside the replica's allowed folder, ...) ends it at once."""
        deadline = time.monotonic() + self.control_timeout_s
        while True:
            try:
                await call(client)
                return None
            except ServingError as exc:
                error, status, again = control_verdict(exc, deadline, self.control_retry_s, reads_storage)
            if not again:
                return error, status
            logger.warning(
                "control call on %s failed (%s); retrying in %.1f s", client.base_url, error, self.control_retry_s
            )
            await asyncio.sleep(self.control_retry_s)


def control_verdict(
    exc: ServingError, deadline: float, retry_s: float, reads_storage: bool = False
) -> tuple[str, int | None, bool]:
    """The one retry policy of control calls to a replica (every fan-out, async or not, asks it).

    Args:
        exc: the call's error (a :class:`ServerRequestError` carries the HTTP status; any other: no answer or 5xx).
        deadline: ``time.monotonic()`` past which no retry starts (now + ``server.control_timeout_s`` at the
            first attempt).
        retry_s: the pause before the next attempt (``server.control_retry_s``).
        reads_storage: the call loads files from shared storage (:func:`refusal_is_final`).

    Returns:
        ``(error text, HTTP status or None, whether to retry)``: no retry after a final refusal
        (:func:`refusal_is_final`, said in the text) or when the next attempt would start past ``deadline``.
    """
    error = f"{type(exc).__name__}: {str(exc)[:300]}"
    status = exc.status if isinstance(exc, ServerRequestError) and exc.status else None
    if refusal_is_final(status, str(exc), reads_storage):
        return f"{error} (not retried: a {status} does not change)", status, False
    return error, status, time.monotonic() + retry_s <= deadline


def retry_control(
    url: str, call: Callable[[], Any], retry_s: float, timeout_s: float, reads_storage: bool = False
) -> Any:
    """Run a blocking control call on one replica under :func:`control_verdict`'s policy (the synchronous twin of
    :meth:`ReplicaSet.fan_out`'s retries, for the trainer's weight sync).

    Raises:
        ServingError: the last error, its text saying whether it was final (then not retried).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except ServingError as exc:
            error, status, again = control_verdict(exc, deadline, retry_s, reads_storage)
            if not again and refusal_is_final(status, str(exc), reads_storage):
                raise ServerRequestError(f"{exc} (not retried: a {status} does not change)", status or 0) from None
            if not again:
                raise
        logger.warning("control call on %s failed (%s); retrying in %.1f s", url, error, retry_s)
        time.sleep(retry_s)


async def token_refused(rs: ReplicaSet) -> tuple[str, int] | None:
    """The first replica that refuses the set's bearer token (401/403 on ``GET /v1/models``; ``/health`` needs no
    token, so a healthy server can still refuse every request) and its status; None when none does. A replica that
    does not answer is skipped: the routing waits for it."""
    for url, client in zip(rs.urls, rs.clients):
        try:
            await client.models()
        except ServerRequestError as exc:
            if exc.status in (401, 403):
                return url, exc.status
        except ServingError:
            continue
    return None


def wait_external(server: Any, ca_file: str | None = None) -> list[str]:
    """Wait until every server of ``server.urls`` (a ``ServerConfig``; started elsewhere) answers ``/health``;
    ``https://`` ones are verified against ``ca_file`` (``tls.ca_file``; None = the system's CAs).

    Returns:
        The URLs, once all are healthy.

    Raises:
        ServerStartError: some URL did not answer 200 within ``server.startup_timeout_s``; names them.
        ConfigError: a server refuses the run's bearer token (401/403 on ``/v1/models``), naming it and the fix.
    """
    from grpo_core.errors import ConfigError

    async def go() -> list[str]:
        clients = [
            GenerationClient(u, api_key=server.resolved_api_key(), max_retries=0, ca_file=ca_file) for u in server.urls
        ]
        async with ReplicaSet.from_config(server, clients) as rs:
            deadline = time.monotonic() + server.startup_timeout_s
            while True:
                states = await asyncio.gather(*(c.health() for c in rs.clients))
                if all(states):
                    refused = await token_refused(rs)
                    if refused is not None:
                        raise ConfigError(
                            f"server.urls: {refused[0]} refuses the bearer token this run sends (HTTP {refused[1]}); "
                            "set server.api_key (or GRPO_SERVER_API_KEY) to the key its server was started with "
                            "(vLLM --api-key), or GRPO_RUN_TOKEN to the token its guard checks"
                        )
                    return rs.urls
                if time.monotonic() > deadline:
                    down = [u for u, ok in zip(rs.urls, states) if not ok]
                    raise ServerStartError(
                        f"server.urls: {', '.join(down)} did not answer /health within server.startup_timeout_s "
                        f"({server.startup_timeout_s:.0f} s); check that they run, the host and port are reachable "
                        "from this host, and server.api_key"
                    )
                await asyncio.sleep(PROBE_INTERVAL_S)

    return asyncio.run(go())
