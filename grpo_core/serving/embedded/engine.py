"""Batched decode engine of the embedded server: continuous batching over a padded KV cache
(and per-sequence convolution + recurrent states for the linear-attention layers of hybrids).

One background thread owns the model. Each step it either admits waiting sequences and
prefills them together (left-padded), merging their KV cache into the running batch, or
runs one decode step for every running sequence at once. Finished sequences leave the
batch after any step, so new requests join without waiting for the others (continuous
batching, as vLLM's scheduler does, on a Hugging Face ``DynamicCache``).

Admission reserves ``len(prompt) + max_tokens`` tokens of the KV-cache budget per
sequence, so sequences are never preempted. Sampling per row follows vLLM
(``grpo_core.serving.embedded.sampling``). LoRA rows run in the same batch as base rows through
PEFT's mixed-adapter forward (``adapter_names=``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from grpo_core.serving.embedded.cache import BatchCache, left_pad, new_cache
from grpo_core.serving.embedded.sampling import RowSampling, sample_tokens

logger = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed-adapter batch
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")  # vLLM's ``PauseMode`` (vllm/v1/engine/__init__.py)


@dataclass
class Sequence:
    """One sampled continuation (one ``choice``) and its results.

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: most tokens to generate.
        temperature, top_k, top_p, min_p: sampling parameters (0 temperature = greedy; top_k 0 = off).
        seed: per-sequence seed, or None for the engine's global generator.
        stop_token_ids: ids that end the sequence (kept in ``output_ids``), besides EOS.
        ignore_eos: keep going after EOS.
        num_logprobs: top log-probs to record per generated token; None = no log-probs.
        adapter: LoRA adapter name, or None for the base model.
        output_ids: generated ids (filled by the engine).
        logprobs: processed log-prob of each generated token, float (filled by the engine).
        top_logprobs: per generated token, ``[(token_id, logprob), ...]`` best first.
        finish_reason: ``"stop"`` or ``"length"`` once done; ``"abort"`` when a pause in abort mode or a
            client that went away ended it early (its tokens so far are kept).
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    num_logprobs: int | None = None
    adapter: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    generator: torch.Generator | None = field(default=None, repr=False)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, repr=False)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens held in the KV cache, in tokens."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class _Batch:
    """The running batch: B rows, their decode state (:class:`BatchCache`), mask ``[B, T]`` (1 = real token)."""

    rows: list[Sequence]
    kv: BatchCache
    mask: torch.Tensor
    next_ids: torch.Tensor  # [B] int64: last sampled token, not yet in the cache

    def merge(self, other: _Batch) -> _Batch:
        """Join two batches, left-padding the shorter attention cache and mask to the longer one."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        mask = torch.cat([left_pad(self.mask, length, 1), left_pad(other.mask, length, 1)])
        return _Batch(self.rows + other.rows, self.kv.merge(other.kv), mask, torch.cat([self.next_ids, other.next_ids]))

    def select(self, keep: list[int]) -> _Batch:
        """Keep rows ``keep`` and drop leading cache columns that are padding in every row."""
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        start = int(mask.any(dim=0).long().argmax()) if mask.numel() else 0
        return _Batch([self.rows[i] for i in keep], self.kv.select(index, start), mask[:, start:], self.next_ids[index])


class Engine:
    """Owns the model and runs the batched decode loop in a background thread.

    Args:
        model: causal LM (or a PEFT wrapper of one) in eval mode.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        max_model_len: most prompt + generated tokens per sequence.
        max_num_seqs: most sequences in the running batch.
        kv_cache_size_tokens: KV-cache budget in tokens shared by all running sequences.
        pad_token_id: id written into padded prompt positions (masked out).
    """

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: set[int],
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_size_tokens: int,
        pad_token_id: int = 0,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_size_tokens = kv_cache_size_tokens
        self.pad_token_id = pad_token_id
        self.use_adapters = False  # set by the adapter manager once PEFT wraps the model
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._waiting: deque[Sequence] = deque()
        self._batch: _Batch | None = None
        self._paused = False
        self._draining = False  # pause(mode="wait") in progress: admit nothing, finish the running batch
        self._stopping = False
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="grpo-engine", daemon=True)

    # ---- control (any thread) ----
    def start(self) -> None:
        """Start the decode thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the decode thread after its current step."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences; each one's ``future`` resolves to itself when done."""
        with self._cond:
            self._waiting.extend(seqs)
            self._cond.notify_all()

    def adapters_in_use(self) -> set[str]:
        """LoRA adapter names of the waiting and running sequences (exact under :meth:`exclusive`)."""
        with self._cond:
            rows = list(self._waiting) + (list(self._batch.rows) if self._batch else [])
        return {seq.adapter for seq in rows if seq.adapter is not None}

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop sequences whose client went away: waiting ones now, running ones after the current step."""
        with self._cond:
            for seq in seqs:
                seq.aborted = True
            self._waiting = deque(s for s in self._waiting if not s.aborted)
        for seq in seqs:
            seq.finish_reason = seq.finish_reason or "abort"

    @property
    def paused(self) -> bool:
        """Whether decoding is paused (requests are accepted and wait)."""
        return self._paused

    def pause(self, mode: PauseMode = "abort") -> int:
        """Stop scheduling steps, handling in-flight sequences as vLLM's ``pause_generation(mode)`` does.

        Args:
            mode: ``"abort"`` ends every waiting and running sequence now with ``finish_reason``
                ``"abort"`` and the tokens generated so far (vLLM's default); ``"wait"`` admits
                nothing new and returns once the running batch has finished; ``"keep"`` freezes
                running and waiting sequences where they are until :meth:`resume`.

        Returns:
            Number of sequences aborted (0 for ``wait`` and ``keep``).

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "wait":
            with self._cond:
                self._draining = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._batch is None or self._stopping)
        with self._cond:
            self._paused, self._draining = True, False
        with self._step_lock:  # the step in progress (if any) has finished
            return self._abort_all() if mode == "abort" else 0

    def _abort_all(self) -> int:
        """End every waiting and running sequence with ``finish_reason="abort"`` (caller holds the step lock)."""
        with self._cond:
            seqs = list(self._waiting) + (list(self._batch.rows) if self._batch else [])
            self._waiting.clear()
            self._batch = None
        for seq in seqs:
            seq.aborted = True
            seq.finish_reason = seq.finish_reason or "abort"
            if not seq.future.done():
                seq.future.set_result(seq)
        if seqs:
            logger.info("pause: aborted %d in-flight sequences", len(seqs))
        return len(seqs)

    def resume(self) -> None:
        """Continue decoding: waiting and frozen sequences proceed."""
        with self._cond:
            self._paused = self._draining = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model between steps (for weight and adapter changes)."""
        with self._step_lock:
            yield

    def stats(self) -> dict[str, float]:
        """Scheduler gauges: running/waiting sequences and KV-cache usage (fraction 0-1)."""
        with self._cond:
            rows = list(self._batch.rows) if self._batch else []
            waiting = len(self._waiting)
        used = sum(seq.num_tokens for seq in rows)
        return {"running": len(rows), "waiting": waiting, "kv_usage": used / self.kv_cache_size_tokens}

    # ---- decode thread ----
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            with self._step_lock:
                if self._paused:
                    continue
                try:
                    self._step()
                except Exception as exc:  # a failed step fails its sequences, never the server
                    logger.exception("decode step failed; failing %d running sequences", self._num_rows())
                    self._fail_all(exc)

    def _has_work(self) -> bool:
        """Whether a step should run now (caller holds ``_cond``)."""
        if self._paused:
            return False
        return self._batch is not None or (bool(self._waiting) and not self._draining)

    def _num_rows(self) -> int:
        return len(self._batch.rows) if self._batch else 0

    def _admit(self) -> list[Sequence]:
        reserved = sum(len(s.prompt_ids) + s.max_tokens for s in (self._batch.rows if self._batch else []))
        admitted: list[Sequence] = []
        with self._cond:
            while self._waiting and not self._draining and self._num_rows() + len(admitted) < self.max_num_seqs:
                need = len(self._waiting[0].prompt_ids) + self._waiting[0].max_tokens
                if reserved + need > self.kv_cache_size_tokens and (admitted or self._batch):
                    break
                reserved += need
                admitted.append(self._waiting.popleft())
        return admitted

    @torch.inference_mode()
    def _step(self) -> None:
        admitted = self._admit()
        if admitted:
            try:
                new = self._prefill(admitted)
            except Exception as exc:
                for seq in admitted:
                    seq.future.set_exception(exc)
                raise
            with self._cond:
                self._batch = new if self._batch is None else self._batch.merge(new)
        elif self._batch is not None:
            self._decode()
        self._retire_finished()

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        kv: BatchCache | None,
        rows: list[Sequence],
    ) -> tuple[torch.Tensor, BatchCache]:
        cache = kv.to_dynamic_cache(self.model.config) if kv else new_cache(self.model.config)
        kwargs: dict[str, Any] = {}
        if self.use_adapters:
            kwargs["adapter_names"] = [seq.adapter or BASE_ADAPTER for seq in rows]
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[:, -1], BatchCache.from_dynamic_cache(out.past_key_values)

    def _prefill(self, seqs: list[Sequence]) -> _Batch:
        length = max(len(s.prompt_ids) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, length - len(seq.prompt_ids) :] = torch.tensor(seq.prompt_ids)
            mask[i, length - len(seq.prompt_ids) :] = 1
            if seq.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, kv = self._forward(ids, mask, positions, None, seqs)
        self.num_prompt_tokens += sum(len(s.prompt_ids) for s in seqs)
        next_ids = self._sample(logits, seqs)
        return _Batch(list(seqs), kv, mask, next_ids)

    def _decode(self) -> None:
        batch = self._batch
        assert batch is not None
        positions = batch.mask.sum(dim=-1, keepdim=True)
        mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        logits, kv = self._forward(batch.next_ids[:, None], mask, positions, batch.kv, batch.rows)
        next_ids = self._sample(logits, batch.rows)
        with self._cond:
            self._batch = _Batch(batch.rows, kv, mask, next_ids)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
        """Sample a token per row, record it with its log-probs; returns ``[B]`` int64 ids."""
        dev = logits.device
        params = RowSampling(
            temperature=torch.tensor([s.temperature for s in rows], dtype=torch.float32, device=dev),
            top_k=torch.tensor([s.top_k for s in rows], dtype=torch.long, device=dev),
            top_p=torch.tensor([s.top_p for s in rows], dtype=torch.float32, device=dev),
            min_p=torch.tensor([s.min_p for s in rows], dtype=torch.float32, device=dev),
            generators=[s.generator for s in rows],
        )
        tokens, logprobs = sample_tokens(logits, params)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        k_max = max((s.num_logprobs or 0) for s in rows)
        top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
        top_vals = top_vals.tolist() if k_max else None
        top_ids = top_ids.tolist() if k_max else None
        for i, (seq, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            seq.output_ids.append(token)
            if seq.num_logprobs is not None:
                seq.logprobs.append(chosen[i])
                k = seq.num_logprobs
                seq.top_logprobs.append(list(zip(top_ids[i][:k], top_vals[i][:k])) if k else [])
            self._check_finished(seq, token)
        self.num_generation_tokens += len(rows)
        return tokens

    def _check_finished(self, seq: Sequence, token: int) -> None:
        if token in seq.stop_token_ids or (token in self.eos_token_ids and not seq.ignore_eos):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _retire_finished(self) -> None:
        batch = self._batch
        if batch is None:
            return
        done = [seq.finish_reason is not None or seq.aborted for seq in batch.rows]
        if not any(done):
            return
        keep = [i for i, finished in enumerate(done) if not finished]
        with self._cond:
            self._batch = batch.select(keep) if keep else None
            self._cond.notify_all()  # pause(mode="wait") waits for an empty batch
        for seq, finished in zip(batch.rows, done, strict=True):
            if finished and not seq.future.done():
                seq.future.set_result(seq)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            rows = self._batch.rows if self._batch else []
            self._batch = None
            self._cond.notify_all()
        for seq in rows:
            if not seq.future.done():
                seq.future.set_exception(exc)
