"""The rollout loop and its hooks (seed manual, "customising the rollout loop"; DESIGN.md §3, §5).

Each prompt goes through ``filter_prompt`` → G x ``generate_one`` (which calls
``generate_one_turn`` per sampling request) → rewards (functions, environment, rollout) →
``compute_advantages`` → samples, pushed to the sample queue the Flight server serves.
Users subclass :class:`RolloutLoop`, override hooks, optionally give it a ``config_class``
(a ``RolloutConfig`` subclass with their own fields, filled from ``rollout.loop_options``)
and name it in ``rollout.loop_class``. Create clients in ``setup`` (it runs on the loop's
event loop), not in ``__init__``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_core.config import RolloutConfig
from grpo_core.entries import config_entry
from grpo_core.errors import ChatTemplateError, RolloutError, ServerRequestError, UserCodeError, UserCodeTimeout
from grpo_core.transport.types import ResumeState

from .coalesce import TurnCoalescer
from .debug_dump import RolloutDump
from .pace import ConcurrencyCap, TokenAllowance
from .reward_pool import RewardProcessPool
from .rewards import group_advantages, is_zero_std, log_group_rewards, source_name
from .scoring import (
    OverlongPenalty,
    completion_rows,
    group_samples,
    group_tokens,
    is_truncated,
    log_completions,
    score_group,
)
from .tools import (
    EnvironmentPool,
    assistant_message,
    environment_tools,
    parse_reply,
    run_tool_calls,
    tool_call_id,
    tool_name,
    tool_schemas,
    with_tool_system_prompt,
)
from .types import Rollout, RolloutGroup, TurnRecord, reconcile_turns
from .usercode import call_environment, is_async
from .window import CompletionSample, MetricWindow

logger = logging.getLogger(__name__)

#: Finish reasons of a turn the sampler ended itself; any other ("abort", "error", none) means the server cut it short.
COMPLETE_FINISHES = frozenset({"stop", "length"})


class TurnAborted(RolloutError):
    """The server kept aborting a turn (``finish_reason`` not stop/length); its group is dropped, never trained."""


class AdapterRetired(RolloutError):
    """The LoRA adapter version a group samples from was unloaded (the trainer moved more than
    ``max_staleness`` versions on) before the group finished: the group is stale and dropped like a stale sample."""


# (group_id, rollout index in the group, turn counter, policy version at the group's start) of the
# request being made: its seed, and the LoRA adapter version it samples from.
_REQUEST = contextvars.ContextVar("rollout_request", default=(0, 0, [0], 0))


def request_seed(base: int, group_id: int, rollout: int, turn: int) -> int:
    """A distinct, reproducible sampler seed per request (31-bit; splitmix-style mixing)."""
    x = (base * 0x9E3779B97F4A7C15 + group_id * 0xBF58476D1CE4E5B9 + rollout * 0x94D049BB133111EB + turn) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return int(x ^ (x >> 32)) & 0x7FFFFFFF


def group_seed_base(base: int, group_id: int) -> int:
    """Seed of rollout 0's first request of a group when ``rollout.batch_group_prompts`` is on (rollout i: base +
    i, so a request with ``n`` choices for rollouts a.. is seeded base + a; ``grpo_core.rollout.coalesce``); below
    2**31 - 2**16 so base + i stays a 31-bit seed."""
    return request_seed(base, group_id, 0, 0) % (2**31 - 2**16)


@dataclass
class LoopRuntime:
    """What the rollout process hands the loop (built by ``grpo_core.rollout.process``).

    Attributes:
        tokenizer: HF tokenizer of the policy (chat template, encode/decode).
        server: the generation replicas as one ``grpo_core.serving.replicas.ReplicaSet`` (a group's requests
            go to one replica by prefix affinity; ``complete``, ``metrics``, ``models``, ``retry_count``).
        model_name: served model name used in requests.
        max_model_len: the server's prompt + completion limit in tokens.
        dataset: prompt rows (HF Dataset, IterableDataset, list of dicts).
        reward_functions, tools: callables; environment_factory: class or name -> class.
        queue: sink of finished groups (``grpo_core.rollout.queue.SampleQueue``).
        allowance: token allowance shared with the Flight server.
        resume: prompts to skip (already trained) and where to start.
        lora_name: LoRA runs: the trainer's adapter name; policy version v >= 1 is served as ``{name}-v{v}``.
        completions: the logging window's completion sample (``tracking.log_completions``), or None.
        max_steps: ``train.max_steps`` (reward functions read it in ``trainer_state``); None where unknown.
    """

    tokenizer: Any
    server: Any
    model_name: str
    max_model_len: int
    dataset: Any
    queue: Any
    allowance: TokenAllowance
    reward_functions: list[Any] = field(default_factory=list)
    tools: list[Any] = field(default_factory=list)
    environment_factory: Any = None
    resume: ResumeState | None = None
    window: MetricWindow = field(default_factory=MetricWindow)
    lora_name: str | None = None
    completions: CompletionSample | None = None
    max_steps: int | None = None


@config_entry("loop_class")
class RolloutLoop:
    """Generates, scores and queues groups. Override the hooks to customise a run."""

    config_class: type[RolloutConfig] = RolloutConfig

    def __init__(self, config: RolloutConfig, runtime: LoopRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.window = runtime.window
        self.executor = ThreadPoolExecutor(
            max_workers=config.max_concurrent_rollouts, thread_name_prefix="rollout-tools"
        )
        # Sync reward functions run in the main thread of worker processes (signal-based timeouts work there).
        self.reward_pool = RewardProcessPool(config.reward_workers) if config.reward_workers else None
        self.cap = ConcurrencyCap(config.max_concurrent_rollouts)
        self.environments = EnvironmentPool(runtime.environment_factory) if runtime.environment_factory else None
        self.generated_tokens = 0
        self.failed_groups = 0
        self.unfinished_rollouts = 0  # rollouts of started groups not yet finished (running or waiting for a slot)
        self.unscored_groups = 0  # groups whose rollouts all finished, waiting for a scoring worker (rollout/score_*)
        self.score_workers = self._score_workers(runtime.reward_functions)
        self.score_slots = asyncio.Semaphore(self.score_workers)  # FIFO: the bounded scoring stage's workers
        self.debug_dump = RolloutDump.from_env(config)  # $GRPO_DEBUG_ROLLOUT_DUMP; None = off
        self.coalescer = TurnCoalescer() if config.batch_group_prompts else None
        buffer = config.overlong_buffer_tokens()  # DAPO's soft overlong punishment, added where rewards are summed
        self.overlong = (
            None
            if buffer is None
            else OverlongPenalty(config.max_completion_length, buffer, config.overlong_penalty_factor)
        )

    def _score_workers(self, reward_functions: list[Any]) -> int:
        """How many groups are scored at once: ``rollout.reward_workers`` when a sync reward function runs in the
        worker processes (they score one call at a time each), else ``rollout.max_concurrent_rollouts`` (the
        rollout's threads; async functions are awaited, with no bound of their own)."""
        sync = any(not is_async(f) for f in reward_functions)
        if self.reward_pool is not None and sync:
            return self.config.reward_workers
        return self.config.max_concurrent_rollouts

    def score_queue_full(self) -> bool:
        """Whether ``rollout.score_queue_maxsize`` finished groups wait for a scoring worker: the driver then starts
        no new group (``rollout/score_block_s``)."""
        return self.unscored_groups >= self.config.score_queue_maxsize

    # ----- hooks ---------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Create resources the other hooks need (runs on the loop's event loop before the first prompt)."""

    async def close(self) -> None:
        """Release what ``setup`` created; runs when the loop stops, failures included."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:  # noqa: ARG002 - a hook
        """Whether to generate for a prompt; a rejected prompt counts as consumed for the epoch."""
        return True

    async def generate_one(
        self,
        prompt: list[dict[str, Any]],
        tools: list[Any],
        group_id: int = 0,  # noqa: ARG002 - a hook's argument, for subclasses
    ) -> Rollout:
        """One rollout: render with the chat template, sample, run tool calls, repeat.

        Stops when a reply calls no tool, hits ``max_completion_length``, the context is
        full, or after ``max_tool_calling_iterations`` tool rounds. A reply whose tool calls run goes back into
        the chat as an assistant message with ``tool_calls`` (ids, names, arguments; :func:`assistant_message`)
        and each result as ``{"role": "tool", "tool_call_id", "name", "content"}``, the structure chat templates
        that validate tool calls require; its ``content`` is the reply without the calls' markup, or the whole
        reply when the template does not render ``tool_calls`` (:meth:`renders_tool_calls`).

        Raises:
            ChatTemplateError: the chat template refused the conversation (the group is dropped and counted).
        """
        schemas = tool_schemas(tools) if tools else None
        by_name = {tool_name(t): t for t in tools}
        messages, completion = list(prompt), []
        turns: list[TurnRecord] = []
        calls = failures = rounds = 0
        exhausted = False
        while True:
            prompt_ids = self.render(messages, schemas)
            if len(prompt_ids) >= self.runtime.max_model_len - 1:
                break
            turn = await self.generate_one_turn(prompt_ids)
            turns.append(turn)
            content, parsed = (
                parse_reply(turn.text, self.tokenizer, turn.output_ids, turn.prompt_ids) if tools else ("", [])
            )
            limit = self.config.max_tool_calling_iterations
            runs_tools = bool(parsed) and turn.finish_reason == "stop" and (limit is None or rounds < limit)
            exhausted = bool(parsed) and turn.finish_reason == "stop" and not runs_tools
            if not runs_tools:  # the last turn: its text as the model wrote it
                reply = {"role": "assistant", "content": turn.text}
                messages.append(reply)
                completion.append(reply)
                break
            for call in parsed:  # the ids the assistant's tool_calls and the tool answers share
                call.id = tool_call_id(calls)
                calls += 1
            # A template that does not render tool_calls would drop the call from the chat: keep it in the text.
            reply = assistant_message(content if self.renders_tool_calls() else turn.text, parsed)
            messages.append(reply)
            completion.append(reply)
            rounds += 1
            tool_messages, failed = await run_tool_calls(
                parsed, by_name, self.executor, self.window, self.config.tool_timeout_s
            )
            self.window.add("tools/parallel_calls_mean", len(parsed))
            failures += failed
            messages.extend(tool_messages)
            completion.extend(tool_messages)
        ids = [t for turn in turns for t in turn.output_ids]
        return Rollout(
            completion=completion,
            completion_ids=ids,
            turns=turns,
            tool_call_count=calls,
            tool_failure_count=failures,
            loop_exhausted=exhausted,
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling turn with the config's sampling settings and a per-request seed.

        A reply the server cut short (``finish_reason`` ``"abort"``, or anything but ``"stop"``/``"length"``:
        e.g. a ``/pause`` without keep mode) is never returned as a finished turn: its tokens and
        log-probs are kept and the continuation (prompt + tokens so far, the remaining token budget) is
        resubmitted, under the newest policy version, up to ``rollout.max_abort_retries`` times; then
        :class:`TurnAborted` is raised and :meth:`run_group` drops the group.

        Raises:
            TurnAborted: the server aborted the turn ``max_abort_retries + 1`` times.
            AdapterRetired: the group's LoRA adapter version was unloaded by the trainer's sync.
        """
        cfg = self.config
        group_id, rollout, counter, version = _REQUEST.get()
        # The group id and policy version are the affinity key: all turns of a group go to one replica, whose
        # prefix cache holds the shared prompt; the router adds the model name (the LoRA adapter version).
        server = self.runtime.server
        budget = max(1, min(cfg.max_completion_length, self.runtime.max_model_len - len(prompt_ids)))
        ids: list[int] = []
        logprobs: list[float] = []
        tops: list[dict[int, float]] | None = [] if cfg.num_sampler_logprobs > 0 else None
        for attempt in range(cfg.max_abort_retries + 1):
            first_request = counter[0] == 0
            seed = None if cfg.seed is None else request_seed(cfg.seed, group_id, rollout, counter[0])
            counter[0] += 1
            sampled_version = version if attempt == 0 else self.runtime.allowance.policy_version
            model = self.served_model(sampled_version)
            prompt = list(prompt_ids) + ids

            # awaited within this iteration, so the loop variables it reads are this iteration's (B023)
            def send(first: int, n: int, seed: int | None = seed) -> Any:  # noqa: ARG001 - the coalescer's call
                return server.complete(
                    prompt,  # noqa: B023
                    affinity_key=(group_id, sampled_version),  # noqa: B023
                    model=model,  # noqa: B023
                    max_tokens=budget - len(ids),  # noqa: B023
                    n=n,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    min_p=cfg.min_p,
                    seed=seed,
                    num_logprobs=cfg.num_sampler_logprobs,
                    # full weights: a replica holding no weights of this version refuses
                    policy_version=None if self.runtime.lora_name else sampled_version,  # noqa: B023
                )

            try:
                if self.coalescer is not None and first_request:  # a group's rollouts open with one prompt
                    base = None if cfg.seed is None else group_seed_base(cfg.seed, group_id)
                    key = (group_id, sampled_version, model, budget, tuple(prompt))
                    out = await self.coalescer.complete(
                        key, rollout, lambda first, n, base=base: send(first, n, None if base is None else base + first)
                    )
                else:
                    (out,) = await send(rollout, 1)
            except ServerRequestError:
                if await self._retired(server, model):  # vLLM: 404 for an unknown model (vllm-h200/README.md)
                    raise AdapterRetired(
                        f"group {group_id}: adapter {model} was unloaded by a newer weight sync "
                        "before the group finished; dropped as stale"
                    ) from None
                raise
            self.generated_tokens += len(out.token_ids)
            ids, logprobs = ids + out.token_ids, logprobs + out.logprobs
            if tops is not None:
                tops += out.top_logprobs or [{} for _ in out.token_ids]
            finish = out.finish_reason if out.finish_reason in COMPLETE_FINISHES or len(ids) < budget else "length"
            if finish in COMPLETE_FINISHES:
                text = out.text if attempt == 0 else self.tokenizer.decode(ids, skip_special_tokens=True)
                return TurnRecord(
                    prompt_ids=list(prompt_ids),
                    output_ids=ids,
                    output_log_probs=logprobs,
                    output_sampler_logprobs=tops,
                    finish_reason=finish,
                    text=text,
                )
            self.window.add("rollout/aborted_turn_count", 1)
            logger.warning(
                "group %d rollout %d: the server ended a turn with finish_reason=%r after %d of %d tokens; "
                "resubmitting the continuation (%d/%d)",
                group_id,
                rollout,
                out.finish_reason,
                len(ids),
                budget,
                attempt + 1,
                cfg.max_abort_retries,
            )
        raise TurnAborted(
            f"group {group_id}: the server aborted a turn {cfg.max_abort_retries + 1} times "
            f"(finish_reason={out.finish_reason!r}); raise rollout.max_abort_retries or find what "
            "aborts requests (a /pause without mode=keep, a restarting server)"
        )

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """``float32[G]`` group-relative advantages, divided by the group's std unless ``rollout.scale_rewards`` is
        ``none``; NaN rewards get 0 and are left out (DESIGN.md §5)."""
        assert group.rewards is not None
        return group_advantages(group.rewards, self.config.scale_rewards)

    # ----- helpers hooks may use ----------------------------------------------------------------

    def source_of(self, row_index: int) -> str | None:
        """The name of the dataset of a mixture (``rollout.datasets``) holding row ``row_index``; None otherwise."""
        source_of = getattr(self.runtime.dataset, "source_of", None)
        return source_of(row_index) if source_of is not None else None

    def served_model(self, policy_version: int) -> str:
        """Model name to sample policy version ``policy_version`` from (the adapter version in LoRA runs).

        A rollout keeps the version its group started with for all its turns; the trainer keeps
        max_staleness + 1 adapter versions loaded (seed manual, LoRA section). A group that outlives its
        version (long or multi-turn rollouts) is stale by then: it is dropped (:class:`AdapterRetired`).
        """
        if self.runtime.lora_name and policy_version >= 1:
            return f"{self.runtime.lora_name}-v{policy_version}"
        return self.runtime.model_name

    async def _retired(self, server: Any, model: str) -> bool:
        """Whether ``model`` is a LoRA version the servers no longer list while they list a newer one."""
        prefix = f"{self.runtime.lora_name}-v"
        if not self.runtime.lora_name or not model.startswith(prefix):
            return False
        listed = {m.get("id", "") for m in await server.models()}
        newer = [int(n[len(prefix) :]) for n in listed if n.startswith(prefix) and n[len(prefix) :].isdigit()]
        return model not in listed and max(newer, default=0) > int(model[len(prefix) :])

    def render(self, messages: list[dict[str, Any]], tool_schemas_: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation through the chat template, with the generation prompt
        (:meth:`render_text`, encoded without special tokens)."""
        return self.tokenizer.encode(self.render_text(messages, tool_schemas_), add_special_tokens=False)

    def renders_tool_calls(self) -> bool:
        """Whether the chat template renders an assistant message's ``tool_calls`` (``tool_calls`` in its source);
        otherwise :meth:`generate_one` keeps a reply's calls in its text as well."""
        return "tool_calls" in (self.tokenizer.chat_template or "")

    def render_text(self, messages: list[dict[str, Any]], tool_schemas_: list[dict[str, Any]] | None = None) -> str:
        """A conversation through the chat template, with the generation prompt, as text.

        When the template ignores ``tools`` (no ``tools`` in its source), the schemas go into
        the system message in the ChatML/Qwen form (``<tools>…</tools>`` + ``<tool_call>`` syntax).

        Raises:
            ChatTemplateError: the template raised (its ``raise_exception`` or another Jinja error).
        """
        template = self.tokenizer.chat_template or ""
        if tool_schemas_ and "tools" not in template:
            messages = with_tool_system_prompt(messages, tool_schemas_)
            tool_schemas_ = None
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tool_schemas_,
                tokenize=False,
                add_generation_prompt=True,
                **self.config.chat_template_kwargs,
            )
        except TemplateError as exc:
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise ChatTemplateError(
                f"the chat template refused a conversation of {len(messages)} messages ({roles}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    # ----- one group ----------------------------------------------------------------------------

    def prompt_too_long(self, row: dict[str, Any]) -> int | None:
        """The rendered token count of a row's prompt when it exceeds ``max_model_len - max_completion_length``
        (the room a full completion needs), else None. Rows whose prompt an environment makes are not judged."""
        if self.environments is not None or not row.get("prompt"):
            return None
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        tools = list(self.runtime.tools)
        length = len(self.render(messages, tool_schemas(tools) if tools else None))
        return length if length > self.runtime.max_model_len - self.config.max_completion_length else None

    async def run_group(self, prompt_index: int, row_index: int, epoch: int, row: dict[str, Any]) -> None:
        """Generate, score and queue the group of one accepted prompt; a prompt too long to train
        (:meth:`prompt_too_long`) is consumed untried and counted in ``rollout/overlong_prompt_count``."""
        source = self.source_of(row_index)
        try:
            length = self.prompt_too_long(row)
        except ChatTemplateError as exc:
            self.runtime.allowance.group_started()  # _drop_failed_group gives it back
            self._drop_failed_group(prompt_index, [exc])
            return
        if length is not None:
            logger.warning(
                "prompt %d (dataset row %d) is %d tokens, more than server.max_model_len (%d) - "
                "rollout.max_completion_length (%d): skipped, counted in rollout/overlong_prompt_count",
                prompt_index,
                row_index,
                length,
                self.runtime.max_model_len,
                self.config.max_completion_length,
            )
            self.window.add("rollout/overlong_prompt_count", 1)
            if source is not None:
                self.window.add(f"rollout/source/{source}/overlong_prompt_count", 1)
            self.runtime.queue.consumed(prompt_index)
            return
        allowance = self.runtime.allowance
        allowance.group_started()
        self.unfinished_rollouts += self.config.num_generations
        started = time.monotonic()
        version, trainer_step = allowance.policy_version, allowance.trainer_step
        results = await asyncio.gather(
            *(self._rollout(prompt_index, i, row, version) for i in range(self.config.num_generations)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            self._give_back([r[2] for r in results if not isinstance(r, BaseException)])
            self._drop_failed_group(prompt_index, failures)
            return
        prompts, rollouts, envs = [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]
        # The bounded scoring stage (seed manual, rollout metrics): the group waits in FIFO order for one of
        # self.score_workers scoring slots; while rollout.score_queue_maxsize groups wait, the driver starts no new
        # group (rollout/score_block_s). Logged: the finished groups waiting that this one finds, and the time from
        # its last rollout's end to the start of its scoring. The group stays in its own task throughout, so a
        # group waiting here is in flight like one generating (its prompt unsettled until it is queued or dropped).
        generated = time.monotonic()
        self.window.add("rollout/score_queue_size", self.unscored_groups)
        self.unscored_groups += 1
        try:
            await self.score_slots.acquire()
        except BaseException:  # cancelled while waiting (the run stops): hand the environments back
            self.unscored_groups -= 1
            self._give_back(envs)
            raise
        self.unscored_groups -= 1
        self.window.add("rollout/score_wait_s", time.monotonic() - generated)
        try:
            sequences = [self._reconcile(r) for r in rollouts]
            group = RolloutGroup(
                prompt_index=prompt_index,
                row_index=row_index,
                epoch=epoch,
                row=row,
                prompts=prompts,
                rollouts=rollouts,
                sequences=sequences,
                policy_version=version,
                started_at=started,
                trainer_step=trainer_step,
                environments=[env for _, env in envs],
                max_steps=self.runtime.max_steps,
                num_train_epochs=self.config.num_epochs,
            )
            if self.debug_dump is not None:
                self.debug_dump.add_group(group)
            await score_group(
                group,
                self.runtime.reward_functions,
                self.executor,
                self.window,
                self.config.reward_timeout_s,
                pool=self.reward_pool,
                weights=self.config.reward_weight_by_name([source_name(f) for f in self.runtime.reward_functions]),
                overlong=self.overlong,
            )
        except UserCodeError as exc:
            if isinstance(exc, UserCodeTimeout):
                envs = []  # a hung reward function may still read them: never hand them to another rollout
            self._drop_failed_group(prompt_index, [exc])
            return
        finally:  # the reward functions have read the environments' state: hand them back
            self.score_slots.release()
            self._give_back(envs)
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float32)
        if advantages.shape != (len(rollouts),):
            raise RolloutError(f"compute_advantages returned shape {advantages.shape}; expected ({len(rollouts)},)")
        dropped = is_zero_std(group.rewards)
        self.window.add("rollout/group_count", 1)
        log_group_rewards(self.window, group, dropped)
        if source is not None:  # a mixture's per-source metrics (grpo_core.rollout.mixture)
            scored = group.rewards[~np.isnan(group.rewards)] if group.rewards is not None else []
            self.window.add(f"rollout/source/{source}/group_count", 1)
            self.window.add_many(f"rollout/source/{source}/reward_mean", list(map(float, scored)))
        log_completions(group, self.window, with_tools=bool(self.runtime.tools or self.environments))
        if self.runtime.completions is not None:
            for row in completion_rows(group, advantages):
                self.runtime.completions.offer(row)
        if self.config.mask_truncated_completions and not dropped:
            self.window.add("rollout/truncated_masked_count", sum(map(is_truncated, group.rollouts)))
        samples = (
            []
            if dropped
            else group_samples(
                group,
                advantages,
                self.config.num_sampler_logprobs > 0,
                mask_truncated=self.config.mask_truncated_completions,
            )
        )
        tokens = group_tokens(
            [s.input_ids for s in samples] if samples else [seq.input_ids for seqs in sequences for seq in seqs]
        )
        if samples:
            self.runtime.queue.put_group(prompt_index, samples, tokens)
        else:
            self.runtime.queue.consumed(prompt_index)
        allowance.group_finished(tokens, queued=bool(samples))
        self.window.add("rollout/queued_tokens_max", allowance.queued_tokens)

    def _give_back(self, envs: list[tuple[Any, Any]]) -> None:
        """Return taken environments ``(name, environment)`` to their pool (None entries: no environment)."""
        for env_name, env in envs:
            if env is not None:
                self.environments.give_back(env_name, env)

    def _drop_failed_group(self, prompt_index: int, failures: list[BaseException]) -> None:
        """Drop a group that failed without fault of the run, its prompt consumed: turns the server kept
        aborting (``rollout/aborted_group_count``), a retired adapter version (``rollout/stale_group_count``),
        user code failing (``rollout/failed_group_count``, charged to ``rollout.max_failed_groups``; a chat template
        that refused a conversation is also counted in ``rollout/template_error_count``).

        Raises:
            RolloutError: more groups failed in user code than ``rollout.max_failed_groups`` (names the last error).
            BaseException: any other failure, re-raised.
        """
        self.runtime.allowance.group_abandoned()
        droppable = (TurnAborted, AdapterRetired, UserCodeError)
        other = next((f for f in failures if not isinstance(f, droppable)), None)
        if other is not None:
            raise other
        user = next((f for f in failures if isinstance(f, UserCodeError)), None)
        retired = next((f for f in failures if isinstance(f, AdapterRetired)), None)
        logger.warning("dropping group %d: %s", prompt_index, user or retired or failures[0])
        if user is not None:
            self.failed_groups += 1
            self.window.add("rollout/failed_group_count", 1)
            if isinstance(user, ChatTemplateError):
                self.window.add("rollout/template_error_count", 1)
            if self.failed_groups > self.config.max_failed_groups:
                raise RolloutError(
                    f"{self.failed_groups} groups failed in user code, more than "
                    f"rollout.max_failed_groups={self.config.max_failed_groups}; the last: {user}. "
                    "Fix the function, or raise rollout.max_failed_groups or the timeouts "
                    "(rollout.reward_timeout_s, rollout.tool_timeout_s)"
                ) from user
        else:
            self.window.add("rollout/stale_group_count" if retired else "rollout/aborted_group_count", 1)
        self.runtime.queue.consumed(prompt_index)

    def _reconcile(self, rollout: Rollout) -> list:
        seqs, stats = reconcile_turns(rollout.turns)
        if stats.transitions:
            self.window.add_many("rollout/fork_frac", [1.0] * stats.forks + [0.0] * (stats.transitions - stats.forks))
            self.window.add_many("rollout/drift_tokens_mean", stats.drift_tokens)
            self.window.add("rollout/drift_tokens_max", max(stats.drift_tokens))
        self.window.add("rollout/samples_per_rollout", len(seqs))
        return seqs

    async def _rollout(
        self, prompt_index: int, index: int, row: dict[str, Any], version: int
    ) -> tuple[list, Rollout, tuple[Any, Any]]:
        """One rollout under a concurrency slot, with its environment (reset, tools, get_reward).

        Returns:
            ``(prompt, rollout, (environment name, environment))``; the environment (None without
            ``environment_factory``) stays taken until the caller gives it back after scoring.
        """
        _REQUEST.set((prompt_index, index, [0], version))
        try:
            await self.cap.acquire()
        except BaseException:
            self.unfinished_rollouts -= 1
            raise
        start = time.monotonic()
        env_name, env = None, None
        try:
            prompt = row.get("prompt") or []
            prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            tools = list(self.runtime.tools)
            if self.environments is not None:
                env_name = self.environments.route(row)
                env = self.environments.take(env_name)
                prompt = await self._reset(env, row, prompt)
                tools += environment_tools(env)
            rollout = await self.generate_one(prompt, tools, prompt_index)
            if env is not None and hasattr(env, "get_reward"):
                rollout.env_reward = (type(env).__name__, await self._env_reward(env))
            self.window.add("rollout/duration_s", time.monotonic() - start)
            return prompt, rollout, (env_name, env)
        except BaseException as exc:
            if env is not None and not isinstance(exc, UserCodeTimeout):  # a hung call may still use it: drop it
                self.environments.give_back(env_name, env)
            raise
        finally:
            self.unfinished_rollouts -= 1
            await self.cap.release()

    async def _reset(self, env: object, row: dict[str, Any], prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
        start = time.perf_counter()
        text = await call_environment(
            env, "reset", kwargs, self.executor, self.window, self.config.tool_timeout_s, "rollout.tool_timeout_s"
        )
        self.window.add("env/reset_s", time.perf_counter() - start)
        if text is None:
            if not prompt:
                raise RolloutError(
                    f"{type(env).__name__}.reset() returned None and the row has no 'prompt' column; "
                    "return the prompt text from reset() or add a 'prompt' column"
                )
            return prompt
        if prompt and prompt[-1].get("role") == "user":
            return [*prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']}\n\n{text}"}]
        return [*prompt, {"role": "user", "content": str(text)}]

    async def _env_reward(self, env: object) -> Any:
        start = time.perf_counter()
        value = await call_environment(
            env, "get_reward", {}, self.executor, self.window, self.config.reward_timeout_s, "rollout.reward_timeout_s"
        )
        self.window.add("env/reward_s", time.perf_counter() - start)
        return value  # checked (None/NaN = does not apply, ±inf = error) with the other sources when scored
