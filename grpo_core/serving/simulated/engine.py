"""A simulated vLLM engine on asyncio time: continuous batching whose steps cost what the cost model says.

One task per engine (:meth:`SimEngine.run`) loops: admit waiting sequences (at most ``max_num_seqs`` running, and
each reserves ``len(prompt) + max_tokens`` tokens of the KV budget, so nothing is preempted, as the embedded
engine does), then sleep one step's cost (:class:`~grpo_core.serving.simulated.cost.CostModel`: ``a + b x
running`` plus ``c x`` the prompt tokens admitted at that step) and give every running sequence one token. A
sequence whose drawn length is reached finishes (``"stop"``, its last token EOS, or ``"length"`` at ``max_tokens``).

Pause follows vLLM 0.25.1's modes (``PauseMode``, ``vllm/v1/engine/__init__.py``; ``shared/vllm-h200/README.md``):
``abort`` ends every running and waiting sequence at once with ``finish_reason: "abort"`` (tokens so far kept);
``keep`` freezes them until resume; ``wait`` admits nothing new and keeps stepping until the running sequences
finish, then pauses. A pause takes effect between steps: a step in progress completes. Requests that arrive while
paused wait.

The engine accounts its time on the event loop's clock (``loop.time()``, i.e. ``time.monotonic``) in three
states: *busy* (inside a step, sleep overrun included), *paused* and *idle* (nothing to run); ``modeled_busy_s``
is the sum of the steps' modelled costs (their difference is the host's lateness). Token ids are uniform in
``[0, vocab_size)`` (EOS excluded but as the last token of a ``"stop"``), log-probs ``-Exp(1)`` (negative, mean
-1 nat); both from a seeded generator per choice (the request's ``seed + choice`` when given).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from grpo_core.serving.simulated.cost import CostModel, LengthDistribution

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")  # vLLM's ``PauseMode``
STATES: tuple[str, ...] = ("busy", "paused", "idle")


@dataclass
class EngineSettings:
    """Static facts of one simulated engine.

    Attributes:
        max_num_seqs: most sequences running at once (vLLM ``--max-num-seqs``).
        kv_budget_tokens: KV-cache size in tokens; a sequence reserves ``len(prompt) + max_tokens`` of it.
        max_model_len: prompt + completion limit in tokens (longer requests get vLLM's 400).
        vocab_size: token ids are drawn in ``[0, vocab_size)``; prompt ids outside it are refused.
        eos_token_id: last token of a sequence that stops early; None = a random token.
        lengths: completion length distribution.
        update_s: simulated seconds one ``/update_weights`` call takes (times ``time_scale``).
        lora_load_s: simulated seconds one ``/v1/load_lora_adapter`` call takes (times ``time_scale``).
        seed: seed of the engine's generator (choices of unseeded requests draw from it).
        model_name: served model name.
    """

    max_num_seqs: int = 256
    kv_budget_tokens: int = 256 * 512
    max_model_len: int = 512
    vocab_size: int = 49152
    eos_token_id: int | None = 0
    lengths: LengthDistribution = field(default_factory=lambda: LengthDistribution("lognormal", 120.0, 0.6))
    update_s: float = 0.0
    lora_load_s: float = 0.0
    seed: int = 0
    model_name: str = "simulated"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "kv_budget_tokens", "max_model_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_budget_tokens < self.max_model_len:
            raise ValueError(
                f"EngineSettings.kv_budget_tokens ({self.kv_budget_tokens}) must hold one sequence of max_model_len "
                f"({self.max_model_len}); raise the budget or lower max_model_len"
            )
        if self.update_s < 0 or self.lora_load_s < 0:
            raise ValueError("EngineSettings.update_s and lora_load_s are seconds >= 0")


@dataclass
class SimSequence:
    """One choice of a request; the attributes ``grpo_core.serving.protocol.completion_response`` reads.

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: most tokens to generate.
        length: tokens it will generate unless aborted (drawn, ``<= max_tokens``).
        seed: seed of its token ids and log-probs.
        num_logprobs: top log-probs per token to report besides the sampled one; None = no log-probs.
        stop_token_ids: request's stop ids (the last token of an early stop is the first of them when no EOS).
        ignore_eos: never stop early (``length`` is then ``max_tokens``).
        generated: tokens generated so far.
        output_ids, logprobs, top_logprobs: filled when it finishes.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once done.
    """

    prompt_ids: list[int]
    max_tokens: int
    length: int
    seed: int
    num_logprobs: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    generated: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def reserved_tokens(self) -> int:
        """KV tokens it holds while running: prompt + ``max_tokens``."""
        return len(self.prompt_ids) + self.max_tokens


class SimEngine:
    """One simulated engine (see the module docstring). Create and run it inside the event loop that serves it.

    Args:
        cost: step cost model.
        settings: the engine's limits and distributions.
    """

    def __init__(self, cost: CostModel, settings: EngineSettings) -> None:
        self.cost, self.settings = cost, settings
        self.rng = random.Random(settings.seed)
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.reserved_tokens = 0
        self.pause_mode: str | None = None  # requested or in effect
        self.paused = False
        self._abort_pending = False
        self.version = 0
        self.num_weight_updates = 0
        self.num_lora_loads = 0
        self.adapters: dict[str, str] = {}
        self.num_steps = 0
        self.sum_running = 0  # Σ running over steps = generated tokens of decode steps
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.num_aborted = 0
        self.modeled_busy_s = 0.0
        self.step_log: deque[tuple[int, int, float]] = deque(maxlen=100_000)  # (running, prefill tokens, model s)
        self.time_s = {state: 0.0 for state in STATES}
        self._state = "idle"
        self._since = 0.0
        self._step_clock = 0.0  # when the step in progress ends on the schedule (loop clock)
        self._wake = asyncio.Event()
        self._paused_event = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ---- requests -------------------------------------------------------------------------------------------

    def new_sequence(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        seed: int | None = None,
        num_logprobs: int | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        ignore_eos: bool = False,
    ) -> SimSequence:
        """A sequence with its length drawn (from ``Random(seed)`` when given, else the engine's generator)."""
        rng = random.Random(seed) if seed is not None else self.rng
        seq_seed = rng.getrandbits(63)
        length = max_tokens if ignore_eos else self.settings.lengths.draw(rng, max_tokens)
        return SimSequence(
            list(prompt_ids), max_tokens, length, seq_seed, num_logprobs, stop_token_ids, ignore_eos=ignore_eos
        )

    def submit(self, seqs: list[SimSequence]) -> None:
        """Queue ``seqs``; each one's ``done`` event is set when it finishes."""
        self.waiting.extend(seqs)
        self._wake.set()

    def abort(self, seqs: list[SimSequence]) -> None:
        """End ``seqs`` now (a client that went away), with ``finish_reason: "abort"``."""
        for seq in seqs:
            if seq.finish_reason is None:
                if seq in self.running:
                    self.running.remove(seq)
                    self.reserved_tokens -= seq.reserved_tokens
                elif seq in self.waiting:
                    self.waiting.remove(seq)
                self._finish(seq, "abort")

    # ---- control ----------------------------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        """Pause in vLLM's ``mode`` and return once paused (after the step in progress; ``wait``: once the running
        sequences finished).

        Raises:
            ValueError: ``mode`` is not ``abort``, ``wait`` or ``keep``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}")
        self.pause_mode = mode
        self._abort_pending = mode == "abort"
        self._paused_event.clear()
        self._wake.set()
        await self._paused_event.wait()

    def resume(self) -> None:
        """Resume generation (no-op when not paused)."""
        self.pause_mode = None
        self._wake.set()

    async def update_weights(self) -> int:
        """One full-weight update: takes ``update_s`` (times ``time_scale``) and advances the served version.

        Returns:
            The version served from now on.
        """
        await asyncio.sleep(self.settings.update_s * self.cost.time_scale)
        self.num_weight_updates += 1
        self.version += 1
        return self.version

    async def load_adapter(self, name: str, path: str) -> None:
        """Register LoRA adapter ``name`` (served as a model) after ``lora_load_s`` (times ``time_scale``)."""
        await asyncio.sleep(self.settings.lora_load_s * self.cost.time_scale)
        self.adapters[name] = path
        self.num_lora_loads += 1

    # ---- the loop ---------------------------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Start :meth:`run` as a task of the running loop (once)."""
        if self._task is None:
            self._since = asyncio.get_running_loop().time()
            self._task = asyncio.create_task(self.run(), name="simulated-engine")
        return self._task

    async def stop(self) -> None:
        """Cancel the loop task; sequences still queued end with ``"abort"``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.abort(list(self.running) + list(self.waiting))

    async def run(self) -> None:
        """Step forever (see the module docstring)."""
        while True:
            if self.pause_mode is not None and not (self.pause_mode == "wait" and self.running):
                await self._hold_paused()
                continue
            admitted = self._admit() if self.pause_mode is None else 0
            if not self.running:
                self._mark("idle")
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step(admitted)

    async def _hold_paused(self) -> None:
        """Stay paused until resumed; each pause call is acknowledged (an abort-mode one aborts what is queued)."""
        self._mark("paused")
        self.paused = True
        while self.pause_mode is not None:
            if self._abort_pending:
                self._abort_pending = False
                self.abort(list(self.running) + list(self.waiting))
            self._paused_event.set()
            self._wake.clear()
            await self._wake.wait()
        self.paused = False

    def _admit(self) -> int:
        """Move waiting sequences to running within ``max_num_seqs`` and the KV budget; their prompt tokens."""
        settings, tokens = self.settings, 0
        while self.waiting and len(self.running) < settings.max_num_seqs:
            seq = self.waiting[0]
            if self.reserved_tokens + seq.reserved_tokens > settings.kv_budget_tokens:
                break
            self.waiting.popleft()
            self.running.append(seq)
            self.reserved_tokens += seq.reserved_tokens
            tokens += len(seq.prompt_ids)
        return tokens

    async def _step(self, prefill_tokens: int) -> None:
        running = len(self.running)
        model_s = self.cost.step_s(running, prefill_tokens)
        if self._state != "busy":  # no catching up across idle or paused time
            self._mark("busy")
            # the schedule starts at the busy interval's own start (one clock reading): a busy interval then lasts
            # at least the modelled time of its steps, however late the host runs between two readings
            self._step_clock = self._since
        # Steps run on a schedule (each ends model_s after the previous one's end), not sleep after sleep: a
        # late wake-up of a busy host shortens the next sleep, so the rate stays the model's on average.
        self._step_clock += model_s * self.cost.time_scale
        await asyncio.sleep(max(self._step_clock - asyncio.get_running_loop().time(), 0.0))
        self.num_steps += 1
        self.sum_running += running
        self.prompt_tokens += prefill_tokens
        self.modeled_busy_s += model_s * self.cost.time_scale
        self.step_log.append((running, prefill_tokens, model_s))
        still = []
        for seq in self.running:
            if seq.finish_reason is not None:  # aborted during the step
                continue
            seq.generated += 1
            self.generated_tokens += 1
            if seq.generated >= seq.length:
                self.reserved_tokens -= seq.reserved_tokens
                self._finish(seq, "length" if seq.length >= seq.max_tokens else "stop")
            else:
                still.append(seq)
        self.running = still

    def _finish(self, seq: SimSequence, reason: str) -> None:
        """Fill the sequence's tokens and log-probs and wake its request."""
        rng, vocab, eos = random.Random(seq.seed), self.settings.vocab_size, self.settings.eos_token_id
        ids = [rng.randrange(vocab) for _ in range(seq.generated)]
        if eos is not None:
            ids = [(t + 1) % vocab if t == eos else t for t in ids]
        last = eos if eos is not None else min(seq.stop_token_ids, default=None)
        if reason == "stop" and ids and last is not None:
            ids[-1] = last
        seq.output_ids = ids
        if seq.num_logprobs is not None:
            seq.logprobs = [-rng.expovariate(1.0) for _ in ids]
            seq.top_logprobs = [
                [(t, lp)] + [((t + k) % vocab, lp - k) for k in range(1, seq.num_logprobs)]
                for t, lp in zip(ids, seq.logprobs, strict=True)
            ]
        seq.finish_reason = reason
        if reason == "abort":
            self.num_aborted += 1
        seq.done.set()

    def _mark(self, state: str) -> None:
        """Close the current state's interval and enter ``state``."""
        now = asyncio.get_running_loop().time()
        self.time_s[self._state] += now - self._since
        self._state, self._since = state, now

    # ---- reading ----------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and cumulative seconds per state up to now (the state in progress included).

        Keys: ``busy_s``, ``paused_s``, ``idle_s``, ``modeled_busy_s``, ``num_steps``, ``sum_running``,
        ``generated_tokens``, ``prompt_tokens``, ``running``, ``waiting``, ``kv_usage``, ``num_weight_updates``,
        ``num_lora_loads``, ``num_aborted``, ``version``, ``clock_s`` (the loop's clock now).
        """
        now = asyncio.get_running_loop().time()
        times = dict(self.time_s)
        times[self._state] += now - self._since
        used = sum(len(s.prompt_ids) + s.generated for s in self.running)
        return {
            **{f"{state}_s": value for state, value in times.items()},
            "modeled_busy_s": self.modeled_busy_s,
            "num_steps": self.num_steps,
            "sum_running": self.sum_running,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_usage": used / self.settings.kv_budget_tokens,
            "num_weight_updates": self.num_weight_updates,
            "num_lora_loads": self.num_lora_loads,
            "num_aborted": self.num_aborted,
            "version": self.version,
            "clock_s": now,
        }
