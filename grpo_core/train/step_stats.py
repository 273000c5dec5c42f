"""Per-step training statistics kept on the device and read one step late.

``forward_backward`` leaves its per-micro-batch sums and extremes as device tensors
(no ``.item()``). At the end of a step they are reduced across ranks (one sum and one
max all-reduce, queued on the device), copied into pinned host memory and an event is
recorded; the host reads them during the next step, after that step's work is queued.
So the device never idles while the host waits for a value, logs or plans the next
step (the rank-0 row hand-off runs on a CPU process group, see ``distributed``).

Times come from the same timeline: CUDA events on GPUs, ``perf_counter`` on CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

#: Per-rank sums reduced with SUM (``terms`` and ``samples`` are counts).
SUM_KEYS = (
    "loss",
    "terms",
    "entropy",
    "ratio",
    "logp_diff",
    "masked",
    "clipped_low",
    "clipped_high",
    "sampler_mass",
    "kl",
    "staleness",
    "samples",
    "ratio_fresh",
    "terms_fresh",
    "aux_loss",
    "aux_rows",
)
#: Per-rank extremes reduced with MAX (minima travel negated); ``grad_norm`` is already global.
MAX_KEYS = (
    "ratio_max",
    "ratio_min_neg",
    "logp_diff_max",
    "staleness_max",
    "clip_low_min_neg",
    "clip_high_max",
    "grad_norm",
)


def per_sample_fractions(sample_index: Tensor, num_samples: int, stats: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Per completion of a row, the share of its trained tokens clipped below and above the trust region.

    The seed manual's ``clip_ratio/low_min`` is the smallest of the first over the step's completions,
    ``clip_ratio/high_max`` the largest of the second.

    Args:
        sample_index: ``int64[M]`` the sample of each loss term (``RowTensors.sample_index``).
        num_samples: samples in the row.
        stats: the loss statistics (``grpo_core.train.loss``), with ``clipped_low`` and ``clipped_high``:
            ``float[M]``, 1.0 where the term's ratio is outside the region on that side.

    Returns:
        ``(low, high)``: ``float64[k]`` each, one entry per sample with at least one trained token (``k >= 1``
        whenever ``M >= 1``).
    """
    index = sample_index.long()
    ones = torch.ones(index.shape, dtype=torch.float64, device=index.device)
    terms = torch.zeros(num_samples, dtype=torch.float64, device=index.device).index_add_(0, index, ones)
    trained = terms > 0
    out = []
    for key in ("clipped_low", "clipped_high"):
        clipped = torch.zeros_like(terms).index_add_(0, index, stats[key].detach().to(torch.float64))
        out.append((clipped / terms.clamp(min=1))[trained])
    return out[0], out[1]


def max_sample_tokens(planned: object) -> float:
    """The longest sample of a planned step in tokens (prompt + completion, before the packing shares a prefix).

    Args:
        planned: a ``PlannedStep``: ``micro_batches``, each a list of ``PackedRow`` whose ``samples`` batch has
            a ``num_tokens`` column.
    """
    lengths = [n for mb in planned.micro_batches for row in mb for n in row.samples.column("num_tokens").to_pylist()]
    return float(max(lengths, default=0))


def finite_or_nan(value: float) -> float:
    """``value``, or NaN when it is ±inf (an extreme over no element; the metric window skips NaN)."""
    return value if math.isfinite(value) else math.nan


class Clock:
    """Timestamps on the device's timeline: CUDA events, or ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        """A timestamp now (in stream order on CUDA)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        """Seconds between two marks; ``end`` must have completed (see :meth:`PendingStats.values`)."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def _scalar(v: Tensor | float, device: torch.device) -> Tensor:
    if isinstance(v, Tensor):
        return v.detach().to(torch.float64)
    return torch.full((), float(v), dtype=torch.float64, device=device)


@dataclass
class PendingStats:
    """Reduced statistics of one step, on their way to the host."""

    host: Tensor
    event: object | None
    marks: dict = field(default_factory=dict)

    def values(self) -> dict[str, float]:
        """Wait for the copy (only for it: later work keeps running) and return ``{key: value}``."""
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(SUM_KEYS + MAX_KEYS, self.host.tolist()))


def reduce_step(local: list[dict], grad_norm: Tensor | float, device: torch.device) -> PendingStats:
    """Sum/max the micro-batches' statistics over micro-batches and ranks, without waiting for them.

    Args:
        local: per micro-batch, ``{key: 0-d tensor or number}`` for every key of
            ``SUM_KEYS`` and ``MAX_KEYS`` but ``grad_norm``.
        grad_norm: the step's global gradient norm (0-d tensor or number).
        device: this rank's device (the process group's communication device).
    """
    sums = torch.stack([torch.stack([_scalar(d[k], device) for d in local]).sum() for k in SUM_KEYS])
    maxes = torch.stack(
        [torch.stack([_scalar(d[k], device) for d in local]).max() for k in MAX_KEYS[:-1]]
        + [_scalar(grad_norm, device)]
    )
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    sums, maxes = sums.to(comm), maxes.to(comm)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    flat = torch.cat([sums, maxes])
    if flat.device.type != "cuda":
        return PendingStats(flat, None)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingStats(host, event)
