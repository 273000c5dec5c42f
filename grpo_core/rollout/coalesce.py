"""One request for the rollouts of a group that start sampling the same prompt together (``n`` choices).

A group's G rollouts open with the same prompt. Sent one by one (``n = 1``, as TRL's rollout worker also
does), each is a request the server parses, validates, schedules and answers on its own; on a small model
vLLM's single API-server process spends its CPU mostly per request, and on an H200 it held generation to a
fraction of what the engine could decode (``benchmarks/rollout.py``: CPU seconds of the API server, requests
in flight at the rollout but not running in vLLM). With ``rollout.batch_group_prompts`` the first requests of
a group's rollouts that reach the server in the same event-loop pass go as one request with ``n`` choices.

Seeds stay per rollout and do not depend on the batching: rollout ``i`` of a group samples its first turn with
seed ``base + i``, and a request seeded ``s`` samples choice ``j`` with seed ``s + j`` (vLLM 0.25.1
``ParentRequest.get_child_info``; the embedded server alike), so a request for rollouts ``a .. a+k-1`` is
seeded ``base + a``. Rollouts that joined out of order are sent as runs of consecutive indices.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

#: ``send(first_rollout, n)``: one request for rollouts ``first_rollout .. first_rollout + n - 1``; returns their
#: ``n`` completions in choice order.
Send = Callable[[int, int], Awaitable[list[Any]]]


def consecutive_runs(indices: list[int]) -> list[list[int]]:
    """Sorted ``indices`` split into runs of consecutive integers: ``[0, 1, 2, 5, 6]`` -> ``[[0, 1, 2], [5, 6]]``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class TurnCoalescer:
    """Gathers the requests made under one key in one event-loop pass and sends them as few requests.

    The key must hold everything the request depends on but the seed (group, policy version, model, prompt ids,
    token budget): members of one key differ only in their rollout index.
    """

    def __init__(self) -> None:
        self._pending: dict[Hashable, dict[int, asyncio.Future]] = {}
        self._sending: set[asyncio.Task] = set()
        self.requests = 0  # requests sent (one per run of consecutive rollouts)

    async def complete(self, key: Hashable, rollout: int, send: Send) -> Any:
        """The completion of ``rollout``, from a request shared with the other rollouts of ``key`` that ask in the
        same event-loop pass (``send`` of the first of them is used).

        Raises:
            Whatever ``send`` raised, in every rollout of that request.
            ValueError: ``rollout`` already waits under ``key``.
        """
        loop = asyncio.get_running_loop()
        members = self._pending.get(key)
        if members is None:
            members = self._pending[key] = {}
            loop.call_soon(self._flush, key, send)  # after the rollouts already scheduled in this pass
        if rollout in members:
            raise ValueError(f"rollout {rollout} already waits for a completion under {key!r}")
        future = members[rollout] = loop.create_future()
        return await future

    def _flush(self, key: Hashable, send: Send) -> None:
        members = self._pending.pop(key)
        live = [i for i, future in members.items() if not future.done()]  # a cancelled rollout asks for nothing
        for run in consecutive_runs(live):
            task = asyncio.ensure_future(self._send(send, run[0], [members[i] for i in run]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, send: Send, first: int, futures: list[asyncio.Future]) -> None:
        self.requests += 1
        try:
            outs = await send(first, len(futures))
            if len(outs) != len(futures):
                raise RuntimeError(f"asked for {len(futures)} choices, the server answered {len(outs)}")
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to every rollout of the request
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future, out in zip(futures, outs, strict=True):
            if not future.done():
                future.set_result(out)
