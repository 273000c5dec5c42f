"""Opt-in dump of the first finished rollouts of policy version 0, for trainer/sampler log-prob parity.

Set ``GRPO_DEBUG_ROLLOUT_DUMP=<path>`` in the rollout process's environment (the flow passes its
environment on) and the rollout loop appends one JSON line per finished rollout of policy version 0 to
``<path>``, for the first ``GRPO_DEBUG_ROLLOUT_DUMP_COUNT`` (default 64) of them; then it stops writing.
Unset (the default), nothing is read or written: the loop holds ``None`` and skips one ``if``.
``benchmarks/logprob_parity.py --dump <path>`` recomputes the log-probs of the dumped tokens with a
plain Hugging Face forward and with the trainer's own path, to tell a sampler-side mismatch from a
trainer-side one (issue 12: ``sampling/importance_sampling_ratio/mean`` at staleness 0).

Each line (a JSON object):

* ``group_id``, ``prompt_index``, ``rollout`` (position in the group), ``policy_version`` (0);
* ``finish_reasons``: one per turn (``stop``, ``length``; ``abort`` never reaches a finished rollout);
* ``sampling``: ``temperature``, ``top_k``, ``top_p``, ``min_p`` of the run (what the sampler was asked);
* ``prompt_ids``: the first turn's prompt token ids; ``completion_ids``: the rollout's completion ids;
* ``sequences``: the training sequences the rollout becomes (one for a single turn), each with
  ``input_ids`` (``int[T]``, prompt and completion), ``completion_mask`` (``int[T]``, 1 = sampled and
  trained), ``sampler_logprobs`` (``float[T]``, the sampler's log μ in nats of each sampled token,
  0 elsewhere) and ``topk`` (per token a list of ``[id, logprob]`` pairs, or null without top-k).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

#: Environment variable naming the JSON-lines file to append to (unset = no dump).
DUMP_ENV = "GRPO_DEBUG_ROLLOUT_DUMP"
#: Environment variable with the number of rollouts to dump (default :data:`DEFAULT_COUNT`).
COUNT_ENV = "GRPO_DEBUG_ROLLOUT_DUMP_COUNT"
DEFAULT_COUNT = 64


class RolloutDump:
    """Appends the first ``count`` finished policy-version-0 rollouts to ``path`` (see the module docs).

    Args:
        path: the JSON-lines file (appended to; its folder is created).
        count: how many rollouts to write (> 0).
        sampling: the run's sampling fields, copied into every line.
    """

    def __init__(self, path: str | Path, count: int, sampling: dict[str, Any]):
        self.path, self.count, self.sampling = Path(path), count, sampling
        self.written = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, config: Any) -> RolloutDump | None:
        """The dump asked for by ``$GRPO_DEBUG_ROLLOUT_DUMP``, or None when it is unset or empty.

        Args:
            config: the ``RolloutConfig`` (its temperature, top_k, top_p, min_p go into each line).

        Raises:
            ValueError: ``$GRPO_DEBUG_ROLLOUT_DUMP_COUNT`` is not a positive integer.
        """
        path = os.environ.get(DUMP_ENV)
        if not path:
            return None
        raw = os.environ.get(COUNT_ENV, str(DEFAULT_COUNT))
        if not raw.isdigit() or int(raw) <= 0:
            raise ValueError(f"{COUNT_ENV}={raw!r}: give a positive number of rollouts to dump, e.g. 64")
        sampling = {k: getattr(config, k) for k in ("temperature", "top_k", "top_p", "min_p")}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return cls(path, int(raw), sampling)

    def add_group(self, group: Any) -> None:
        """Write the group's rollouts (a :class:`~grpo_core.rollout.types.RolloutGroup` after reconciling)
        while fewer than ``count`` were written and the group was sampled by policy version 0."""
        if group.policy_version != 0 or self.written >= self.count:
            return
        lines = []
        for i, (rollout, seqs) in enumerate(zip(group.rollouts, group.sequences)):
            if self.written + len(lines) >= self.count:
                break
            lines.append(
                json.dumps(
                    {
                        "group_id": group.group_id,
                        "prompt_index": group.prompt_index,
                        "rollout": i,
                        "policy_version": group.policy_version,
                        "finish_reasons": [t.finish_reason for t in rollout.turns],
                        "sampling": self.sampling,
                        "prompt_ids": list(rollout.turns[0].prompt_ids) if rollout.turns else [],
                        "completion_ids": list(rollout.completion_ids),
                        "sequences": [
                            {
                                "input_ids": list(map(int, s.input_ids)),
                                "completion_mask": list(map(int, s.completion_mask)),
                                "sampler_logprobs": list(map(float, s.sampler_logprobs)),
                                "topk": None
                                if s.topk is None
                                else [[[int(k), float(v)] for k, v in entry.items()] for entry in s.topk],
                            }
                            for s in seqs
                        ],
                    }
                )
            )
        with self._lock:
            with open(self.path, "a") as f:
                f.write("".join(line + "\n" for line in lines))
            self.written += len(lines)
