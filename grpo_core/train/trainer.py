"""The FSDP2 GRPO trainer loop (DESIGN.md §3, §5, §7).

Every rank runs :class:`Trainer`; rank 0 also owns the :class:`Planner` (data),
the metrics sink, weight-sync traffic and checkpoint metadata. Before the first
step (also after a resume) the top length bucket is compiled (:meth:`Trainer.warmup`), a smaller one when a row first
needs it; a trainer the flow starts before the servers are healthy compiles before its sample source and weight sync
are up (``grpo_core.run.startup``).
One step: ``collect_step`` (rank 0 plans, every rank receives its rows over the CPU
control group) → ``forward_backward`` per micro-batch (the fused log-prob head) →
``optimizer_step`` → ``sync_weights`` (every ``weight_sync_steps``) → ``save`` (every
``save_steps``); at the end a last ``save`` and ``export`` (the Hugging Face folder
``final_model/``). The step's statistics stay on the device and are logged during the
next step (:mod:`grpo_core.train.step_stats`), so the device keeps working while the
host plans, hands off rows and logs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_core.config import TrainerProcessConfig
from grpo_core.errors import NothingToTrainError
from grpo_core.models import resolve_model_dir
from grpo_core.run import startup
from grpo_core.run.durable import JsonlAppender
from grpo_core.run.layout import TRAINED_PROMPTS
from grpo_core.tracking.metrics import MetricsSink, MetricWindow
from grpo_core.tracking.report import write_train_end
from grpo_core.transport.types import ResumeState, SampleSource

from . import checkpoint
from .attention import FlexTreeMasks
from .distributed import RESYNC, ROW, STOP, World, broadcast_header, scatter_rows
from .eval_log import EvalLog
from .export import export_final_model
from .fingerprint import FINGERPRINT_FILE, fingerprint_text
from .loss import LossSettings, loss_normalisers, overlap_rescale, provisional_normaliser
from .parallelize import apply_layer_wrappers, resolve_reshard_after_forward, shard
from .planner import PlannedStep, Planner
from .policy import build_policy
from .rows import bucket_length, length_buckets, synthetic_row, to_tensors
from .step_stats import Clock, finite_or_nan, max_sample_tokens, per_sample_fractions, reduce_step
from .weight_sync import NoWeightSync, WeightSync, full_state_dict

if TYPE_CHECKING:
    from grpo_core.packing import PackedRow

    from .logprobs import HeadLoss
    from .rows import RowTensors


logger = logging.getLogger(__name__)

#: bf16 dense peak FLOP/s per device, for MFU (vendor datasheets).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (a new one after warm-up = a stall)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier per step: linear warmup, then constant / linear / cosine decay to 0 at ``total``."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - frac if kind == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return f


def rotate_checkpoints(output_dir: Path, keep: int | None, saved: Path | None, sink: object) -> list[Path]:
    """Keep the newest ``keep`` checkpoints (``train.save_total_limit``), never deleting ``saved`` (just written) nor
    a checkpoint the sink still holds (``held_checkpoints()``: an MLflow upload queued or running, or the folder
    the run's latest-checkpoint tag names); those go at a later call. Returns the folders deleted."""
    held = getattr(sink, "held_checkpoints", None)
    protect = {saved} if saved is not None else set()
    return checkpoint.rotate(output_dir, keep, protect=protect | (held() if held is not None else set()))


#: a header code of overlapped steps (:meth:`Trainer.stream_step`): ``[MICRO, 1, terms]``, one micro-batch (its rows
#: follow; ``terms``: its loss terms summed over ranks); the step then ends with ``[ROW, n, terms…]`` and no rows
MICRO = 16
assert MICRO not in (ROW, STOP, RESYNC)


def step_header(
    planned: PlannedStep | None, servers_behind: list[str], resynced_version: int, policy_version: int
) -> list[int] | None:
    """Rank 0's header for the other ranks (``grpo_core.train.distributed``) after a plan: ``[ROW, n, terms…]`` (a
    step of ``n`` micro-batches), ``[RESYNC, 0]`` (push the weights again: the rollout reports replicas behind
    ``policy_version``, e.g. restarted with the base weights, and none was pushed again at this version yet),
    ``[STOP, 0]`` (all trained), or None (pull again: replicas are still behind after a sync at this version, and
    their guard lets them rejoin once the sync reached them)."""
    if planned:
        terms = [sum(r.num_trained for r in mb) for mb in planned.micro_batches]
        return [ROW, len(terms), *terms]
    if servers_behind:
        return [RESYNC, 0] if resynced_version != policy_version else None
    return [STOP, 0]


class Trainer:
    """See module docs. ``cfg``: the trainer's sub-config (``RunConfig.trainer_process()``); ``source`` and ``sink``
    are used on rank 0 only."""

    def __init__(
        self,
        cfg: TrainerProcessConfig,
        world: World,
        source: SampleSource | None = None,
        weight_sync: WeightSync | None = None,
        sink: MetricsSink | None = None,
    ):
        self.cfg, self.world, self.sink = cfg, world, sink
        tc = cfg.train
        self.weight_sync = weight_sync or NoWeightSync()
        self.output_dir = Path(tc.output_dir)
        # a trainer the flow started before its servers records its start-up (grpo_core.run.startup)
        self._timeline = world.is_main and tc.inputs_path is not None
        self._started = startup.events(self.output_dir).get("command_start") if self._timeline else None
        if self._started is None:  # not started by the flow: count from the command, else from here
            self._started = startup.command_start()
        self._mark("trainer_start")
        torch.manual_seed(tc.seed + world.rank)
        on_cuda = world.device.type == "cuda"
        self.compiled = tc.compile if tc.compile is not None else on_cuda
        self.policy = self._build_policy(on_cuda)
        # The KL reference (train.kl_coef > 0): with LoRA the base model (the adapter disabled, no memory); else a
        # frozen copy of the initial weights, loaded and sharded like the policy (one more copy of the weights).
        self.reference: torch.nn.Module | None = None
        if tc.kl_coef > 0 and not tc.lora.enabled:
            self.reference = self._build_policy(on_cuda).requires_grad_(False)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=tc.learning_rate, betas=tc.adam_betas, weight_decay=tc.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tc.lr_scheduler, tc.warmup_steps, tc.max_steps)
        )
        self.loss_settings = LossSettings(
            tc.clip_min,
            tc.clip_max,
            tc.score_centering,
            tc.epsilon,
            tc.epsilon_high,
            tc.loss_type,
            tc.tis_cap,
            tc.sequence_mask,
            tc.sequence_mask_min,
            tc.sequence_mask_max,
            tc.kl_coef,
        )
        self.token_budget = cfg.token_budget
        self.flex = FlexTreeMasks(world.device) if on_cuda else None
        # static shapes for compiled layers and FlexAttention: rows are padded to a few lengths
        multiple = self.flex.block_size if self.flex is not None else 16
        self.buckets = (
            length_buckets(self.token_budget, tc.length_buckets, multiple) if self.compiled or on_cuda else None
        )
        self.clock = Clock(world.device)
        self.window = MetricWindow()
        self.pending: tuple | None = None  # (stats, planned, host-side values) of the step not yet logged
        self.last_end = None  # clock mark at the end of the previous step
        self.warmup_s: float | None = None
        self._warm = False  # the warm-up ran (the top bucket compiled)
        self._compiled_lengths: set[int] = set()  # the length buckets compiled in this process
        self.compile_s = 0.0  # seconds compiling buckets on their first use during the current step
        self.first_step_s: float | None = None  # command start → this process's first optimizer step (logged once)
        self.graphs = 0  # compiled graphs seen so far (see compiled_graphs)
        self.step, self.policy_version = 0, 0
        self._resynced_version = -1  # the policy version last pushed again for replicas behind it (collect_step)
        self._saved: Path | None = None  # the checkpoint of the current step, once written or loaded
        tracker, pending = self._resume()
        self._mark("policy_built")
        self.planner = None
        if world.is_main:
            assert source is not None, "rank 0 needs a sample source"
            self.source = source
            ro = cfg.rollout
            hints = {
                "max_staleness": ro.max_staleness,
                "temperature": ro.temperature,
                "num_generations": ro.num_generations,
                "max_completion_length": ro.max_completion_length,
            }
            self.planner = Planner(
                source,
                world.world_size,
                self.token_budget,
                cfg.packing.backend,
                tracker,
                pending,
                flush_after_s=tc.flush_partial_after_s,
                max_untrainable_groups=tc.max_untrainable_groups,
                hints=hints,
                # bounded where samples are trained; a file of samples is replayed whatever its versions
                max_staleness=ro.max_staleness if tc.samples_path is None else None,
            )
        #: each micro-batch trained as soon as its rows are packed (``train.overlap_micro_batches``); an MoE policy
        #: whose router loss is weighted by the step's micro-batch count keeps the whole-step path
        self.overlap = tc.overlap_micro_batches and getattr(self.policy, "router_aux_loss_coef", 0.0) == 0
        #: rank 0's order of events of overlapped steps, oldest first: the planner's (``("pull", samples)``,
        #: ``("micro_batch", i)``) and ``("backward", i)`` when micro-batch ``i``'s backward starts (tests read it)
        self.events: deque[tuple[str, int]] = self.planner.events if self.planner is not None else deque(maxlen=256)
        if world.is_main and tc.overlap_micro_batches and not self.overlap:  # asked for, turned off: say so
            logger.warning(
                "train.overlap_micro_batches has no effect: the mixture-of-experts router loss "
                "(train.router_aux_loss_coef %g) is weighted by the step's micro-batch count, so each step is pulled "
                "whole before it trains; set train.overlap_micro_batches: false, or train.router_aux_loss_coef: 0",
                getattr(self.policy, "router_aux_loss_coef", 0.0),
            )
        elif world.is_main:
            logger.info(
                "micro-batches %s (train.overlap_micro_batches=%s)",
                "train as soon as packed" if self.overlap else "train once the whole step is pulled",
                tc.overlap_micro_batches,
            )
        self.skipped_nonfinite_steps, self._nonfinite_in_a_row = 0, 0
        self._trained_log: JsonlAppender | None = None  # trained_prompts.jsonl (rank 0)
        ev = cfg.eval  # held-out evaluations of the rollout, logged at the steps they evaluated (rank 0)
        self.eval_log = EvalLog(
            sink, ev.every_steps, tc.max_steps if ev.at_end else None, ev.final_timeout_s, self.step
        )

    def _build_policy(self, on_cuda: bool) -> torch.nn.Module:
        """Load, checkpoint/compile each layer, shard (torchtitan's order; :mod:`grpo_core.train.parallelize`)."""
        cfg, tc = self.cfg, self.cfg.train
        policy = build_policy(
            str(resolve_model_dir(cfg.model)),
            cfg.model,
            dtype=getattr(torch, tc.dtype),
            device=self.world.device,
            lora=tc.lora,
            temperature=cfg.rollout.temperature,
            chunk_size=tc.logprob_chunk_size or (4096 if on_cuda else 1024),
            max_len=cfg.token_budget,
            fp32_logits=tc.fp32_logits,
            router_aux_loss_coef=tc.router_aux_loss_coef,
        )
        apply_layer_wrappers(
            policy, tc.gradient_checkpointing, tc.selective_checkpointing, self.compiled, tc.compile_backend
        )
        policy.compile_head = self.compiled and on_cuda  # the head's kernels are only worth compiling on GPUs
        reshard = resolve_reshard_after_forward(tc.fsdp_reshard_after_forward, policy, self.world.device)
        logger.info("FSDP2: reshard_after_forward=%s, prefetch=%d", reshard, tc.fsdp_prefetch)
        return shard(
            policy, tc.mixed_precision if tc.mixed_precision is not None else on_cuda, reshard, tc.fsdp_prefetch
        )

    # -- resume --------------------------------------------------------------------------
    def _resume(self) -> tuple[checkpoint.PromptTracker, object]:
        path = checkpoint.latest_checkpoint(self.output_dir)
        self.num_tokens = 0  # the run's forwarded tokens so far (``num_tokens``; rank 0 counts, a resume continues)
        if path is None:
            return checkpoint.PromptTracker(), None
        state, pending = checkpoint.load(path, self.policy, self.optimizer, self.scheduler, self.world.rank)
        self.step, self.policy_version, self._saved = state.step, state.policy_version, path
        self.num_tokens = state.num_tokens
        self._apply_optimizer_config()
        return checkpoint.PromptTracker(state), pending

    def _apply_optimizer_config(self) -> None:
        """After a resume, the config's learning rate, betas and weight decay win over the optimizer state.

        The scheduler keeps its position (steps done) and recomputes the learning rate from
        ``train.learning_rate`` with the config's schedule; each value that changed is logged (rank 0).
        """
        tc = self.cfg.train
        want = {"lr": tc.learning_rate, "betas": tuple(tc.adam_betas), "weight_decay": tc.weight_decay}
        changed = set()
        for group in self.optimizer.param_groups:
            for key, value in want.items():
                old = group.get("initial_lr" if key == "lr" else key)
                if (tuple(old) if key == "betas" else old) != value:
                    changed.add(f"{key} {old} -> {value}")
                group["initial_lr" if key == "lr" else key] = value
        self.scheduler.base_lrs = [tc.learning_rate] * len(self.optimizer.param_groups)
        self.scheduler.lr_lambdas = [lr_lambda(tc.lr_scheduler, tc.warmup_steps, tc.max_steps)] * len(
            self.optimizer.param_groups
        )
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = tc.learning_rate * factor
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]  # noqa: SLF001 - get_last_lr
        if changed and self.world.is_main:
            logger.warning(
                "resume: the config changed the optimizer settings of the checkpoint (applied): %s",
                ", ".join(sorted(changed)),
            )

    def resume_state(self) -> ResumeState:
        """Where the rollout side should start, and the run's ``num_tokens`` so far (rank 0)."""
        return dataclasses.replace(
            self.planner.tracker.state(self.step, self.policy_version), num_tokens=int(self.num_tokens)
        )

    def _mark(self, event: str) -> None:
        """Record a start-up event (rank 0 of a trainer the flow started; ``grpo_core.run.startup``)."""
        if self._timeline:
            startup.mark(self.output_dir, event, "trainer")

    def _first_step_done(self) -> None:
        """Seconds from the command's start to this process's first optimizer step (the device synced), logged with
        that step as ``perf/time_to_first_step_s`` (rank 0)."""
        started, self._started = self._started, None
        if started is None:
            return
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        now = time.time()
        if self.world.is_main:
            self.first_step_s = now - started
        if self._timeline:
            startup.mark(self.output_dir, "first_step", "trainer", now)

    # -- warm-up -------------------------------------------------------------------------
    def warmup(self) -> float:
        """Compile the top length bucket before the first step (also after a resume); returns seconds.

        Rows are packed up to the token budget, so every full row pads to the top bucket; a smaller bucket is met
        only by a step's last, partial row, and some never are (a run whose samples are all long, a budget that
        a few samples fill). Those are compiled when a row first needs one (:meth:`_compile_on_first_use`), so a
        run compiles the shapes it uses and no other. With the log-prob head compiled (CUDA) the top bucket's
        forward also runs with a second number of loss terms and with one (compilers specialise sizes 0 and 1,
        then make the terms dimension dynamic), so the head is warm for every row. Each shape gets one
        forward/backward of a synthetic row (:func:`~grpo_core.train.rows.synthetic_row`) on every rank; the
        gradients are discarded; parameters, optimizer and RNG state are untouched.
        """
        if self._warm:  # done already (a trainer started before its servers compiles while they start)
            return 0.0
        self._warm = True
        if not self.compiled or not self.buckets:
            return 0.0
        top = self.buckets[-1]
        shapes = [(top, top - 1)]
        if self.policy.compile_head and top > 4:
            shapes += [(top, top // 2), (top, 1)]
        self.warmup_s = self._compile_shapes(shapes)
        self._compiled_lengths.add(top)
        self.graphs = compiled_graphs()
        later = [b for b in self.buckets if b != top]
        logger.info(
            "compiled length bucket %d (the top: full rows) in %.1f s; %s compile when a row first needs them",
            top,
            self.warmup_s,
            f"buckets {later}" if later else "no other bucket",
        )
        self._mark("compiled")
        return self.warmup_s

    def _compile_shapes(self, shapes: list[tuple[int, int]]) -> float:
        """One forward/backward of a synthetic row per ``(length, loss terms)`` (collective: every rank runs the
        same shapes in the same order, FSDP2 gathering and reducing inside them); returns seconds.

        Safe between the micro-batches of a step: the synthetic loss is multiplied by 0 (the gradients it adds are
        zeros) and a parameter that had no gradient before has none after, so the step's update is unchanged.
        """
        t0 = time.perf_counter()
        rollout = self.cfg.rollout
        vocab = self.policy.base().get_output_embeddings().weight.shape[0]
        params = [p for p in self.policy.parameters() if p.requires_grad]
        had_grad = [p.grad is not None for p in params]
        for length, num_terms in shapes:
            rt = synthetic_row(
                length,
                num_terms,
                vocab,
                self.world.device,
                rollout.num_sampler_logprobs,
                rollout.uses_candidate_filter(),
            )
            if self.flex is not None:
                rt.tree_mask = self.flex.build(rt.tree_mask.subtree_end, length)
            loss = self.policy.grpo_loss(rt, self.loss_settings, float(num_terms), self.reference_logprobs(rt)).loss
            (loss * 0.0).backward()
        for p, had in zip(params, had_grad):
            if not had:
                p.grad = None
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        return time.perf_counter() - t0

    def _compile_on_first_use(self, length: int) -> None:
        """Compile the length buckets that this micro-batch's rows meet for the first time, on every rank.

        Ranks' rows differ in length, yet a compile runs a forward/backward (FSDP2 collectives): the ranks agree
        on the buckets first (the maximum over ranks of each bucket's "needed" flag, over the CPU control group,
        while some bucket is not compiled yet), then every rank compiles the same buckets in ascending order.
        Every rank calls this once per micro-batch (:meth:`_tensors`), so the agreement itself stays in step.
        Each bucket is compiled once per process and logged with its seconds; they add up in
        ``perf/compile_s`` of the step, and their graphs are not counted in ``perf/recompile_count``.
        """
        if not self.compiled or self.buckets is None or len(self._compiled_lengths) == len(self.buckets):
            return
        need = torch.tensor([b == length and b not in self._compiled_lengths for b in self.buckets], dtype=torch.int64)
        if self.world.world_size > 1:
            torch.distributed.all_reduce(need, torch.distributed.ReduceOp.MAX, group=self.world.control)
        graphs = compiled_graphs()
        for b, needed in zip(self.buckets, need.tolist()):
            if needed:
                seconds = self._compile_shapes([(b, b - 1)])
                self._compiled_lengths.add(b)
                self.compile_s += seconds
                logger.info(
                    "compiled length bucket %d on its first use, at step %d, in %.1f s", b, self.step + 1, seconds
                )
        self.graphs += compiled_graphs() - graphs

    # -- one step ------------------------------------------------------------------------
    def sync_servers(self, why: str) -> None:
        """Push the current weights (``policy_version``) to every generation server outside a step, then tell the
        rollout (collective: every rank calls it). Run when a resumed trainer starts (fresh servers hold the base
        weights) and when the rollout reports replicas behind the policy version (restarted by their owner; their
        guard refuses requests for a later version until a sync reaches them, ``grpo_core.serving.guard``)."""
        logger.info("syncing policy version %d to the generation servers (%s)", self.policy_version, why)
        self.weight_sync.sync(self.policy, self.policy_version, self.world.rank)
        if self.world.is_main:  # the rollout of a full-weight run waits for this before it samples
            self.source.synced(self.policy_version)

    def collect_step(self) -> tuple[list, list[int], PlannedStep | None]:
        """Rank 0 plans the step; every rank gets its row of each micro-batch ([] = stop) and the
        micro-batches' loss terms summed over ranks (for :meth:`loss_normalisers`). Replicas the rollout reports
        behind the policy version are synced first (:meth:`sync_servers`, at most once per policy version)."""
        gas = self.cfg.train.gradient_accumulation_steps
        while True:
            planned, header = None, None
            if self.world.is_main:
                planned = self.planner.next_step(gas, self.policy_version)
                header = step_header(planned, self.planner.servers_behind, self._resynced_version, self.policy_version)
                if header is None:
                    continue
            n = broadcast_header(self.world, header, size=2 + gas)
            if n[0] != RESYNC:
                break
            self._resynced_version = self.policy_version
            self.sync_servers(
                "replicas behind it: " + ", ".join(self.planner.servers_behind)
                if self.world.is_main
                else "replicas behind it"
            )
        if n[0] == STOP:
            return [], [], None
        mbs = planned.micro_batches if planned else [None] * n[1]
        return [scatter_rows(self.world, mb) for mb in mbs], n[2 : 2 + n[1]], planned

    def stream_step(self) -> tuple[list[dict], PlannedStep | None, float, dict] | None:
        """Collect and train one step, each micro-batch as soon as rank 0's planner has packed it
        (``train.overlap_micro_batches``; :meth:`~grpo_core.train.planner.Planner.stream_step`), while the step's
        later rows are still pulled and packed.

        The loss is that of :meth:`collect_step` then :meth:`forward_backward` with :meth:`loss_normalisers`: each
        micro-batch is backpropagated with a provisional divisor
        (:func:`~grpo_core.train.loss.provisional_normaliser`, known from its own and the step's first
        micro-batch's loss terms), and once the step is complete (``[ROW, n, terms…]``, every rank the same terms)
        the accumulated gradients are multiplied by provisional ÷ final (:func:`~grpo_core.train.loss.overlap_rescale`;
        gradients are linear in the loss). FSDP2 reduce-scatters each micro-batch's gradients in its backward, so
        the factor, the same on every rank, scales each rank's shard of the reduced gradient, before clipping and
        the optimizer step; the micro-batches' ``loss`` statistics are rescaled alike. Replicas reported behind the
        policy version are synced as in :meth:`collect_step` (mid-step: the weights are not stepped yet).

        Returns:
            None when there was nothing left to train; else per micro-batch statistics
            (:meth:`forward_backward`), the planned step (rank 0; None elsewhere), the seconds spent collecting
            (pulls, packing, hand-off, syncs of replicas behind) and the clock marks ``fb`` (before the first
            forward), ``fb_end`` (after the gradients' rescale) and ``fb_spans`` (each micro-batch's forward and
            backward, summed into ``perf/fwd_bwd_s``: the pulls between them are collection).
        """
        tc = self.cfg.train
        gas, ws = tc.gradient_accumulation_steps, self.world.world_size
        stream = self.planner.stream_step(gas, self.policy_version) if self.world.is_main else None
        local: list[dict] = []
        provisional: list[float] = []
        planned, collect_s, marks, first = None, 0.0, {}, 0
        while True:
            t0 = time.perf_counter()
            header, mb = None, None
            if stream is not None:
                try:
                    mb = next(stream)
                except StopIteration as end:
                    planned = end.value
                    header = step_header(planned, [], self._resynced_version, self.policy_version)
                else:
                    if mb is not None:
                        header = [MICRO, 1, sum(r.num_trained for r in mb)]
                    else:  # replicas behind: push the weights again once per version, else pull on
                        header = step_header(
                            None, self.planner.servers_behind, self._resynced_version, self.policy_version
                        )
                        if header is None:
                            collect_s += time.perf_counter() - t0
                            continue
            n = broadcast_header(self.world, header, size=2 + gas)
            if n[0] == RESYNC:
                self._resynced_version = self.policy_version
                self.sync_servers(
                    "replicas behind it: " + ", ".join(self.planner.servers_behind)
                    if self.world.is_main
                    else "replicas behind it"
                )
                collect_s += time.perf_counter() - t0
                continue
            if n[0] != MICRO:
                collect_s += time.perf_counter() - t0
                break
            rt = self._tensors(scatter_rows(self.world, mb))
            collect_s += time.perf_counter() - t0
            if not local:
                marks["fb"], first = self.clock.mark(), n[2]
            divisor = provisional_normaliser(n[2], first, gas, ws, tc.loss_normalization)
            provisional.append(divisor)
            self.events.append(("backward", len(local)))
            fb_start = marks["fb"] if not local else self.clock.mark()
            local.append(self.forward_backward(rt, divisor, gas))
            marks.setdefault("fb_spans", []).append((fb_start, self.clock.mark()))
        if n[0] == STOP:
            if local:
                raise RuntimeError(f"rank 0 stopped a step after {len(local)} of its micro-batches were trained")
            return None
        terms = n[2 : 2 + n[1]]
        if len(terms) != len(local):
            raise RuntimeError(f"rank 0 ended a step of {len(terms)} micro-batches after {len(local)} were trained")
        scale = overlap_rescale(provisional, self.loss_normalisers(terms))
        with torch.no_grad():
            for p in self.policy.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        for d in local:
            d["loss"] = d["loss"].detach() * scale
        marks["fb_end"] = self.clock.mark()
        return local, planned, collect_s, marks

    def _tensors(self, row: PackedRow) -> RowTensors:
        """A row on the device, padded to its length bucket (the FlexAttention mask comes later:
        :meth:`forward_backward`)."""
        if self.buckets is None:
            return to_tensors(row, self.world.device)
        length = bucket_length(max(row.num_forwarded, 1), self.buckets)
        self._compile_on_first_use(length)
        return to_tensors(row, self.world.device, length)

    def loss_normalisers(self, terms: list[int]) -> list[float]:
        """Each micro-batch's loss divisor on this rank from the step's loss terms per micro-batch summed over ranks
        (:meth:`collect_step`), by ``train.loss_normalization`` (:func:`~grpo_core.train.loss.loss_normalisers`):
        by default the trained tokens of the whole step, known to every rank before the first backward."""
        return loss_normalisers(terms, self.world.world_size, self.cfg.train.loss_normalization)

    def row_loss(self, rt: RowTensors, normaliser: float, num_micro_batches: int = 1) -> HeadLoss:
        """Forward one row of a micro-batch through the fused head: its :class:`~grpo_core.train.logprobs.HeadLoss`
        (loss ready for backward, per-term log-probs and statistics), as training computes it. ``normaliser``: the
        micro-batch's entry of :meth:`loss_normalisers`. A mixture-of-experts policy adds its routers'
        load-balancing loss weighted by ``train.router_aux_loss_coef ÷ num_micro_batches`` (so the step's gradient is
        that of the coefficient × the mean over its rows, FSDP2 averaging the ranks, as transformers' Trainer
        weighs a model's ``aux_loss`` under gradient accumulation).

        On CUDA the row's FlexAttention mask is built here, just before its forward: every row of a
        length bucket shares one ``subtree_end`` buffer (:class:`~grpo_core.train.attention.FlexTreeMasks`),
        so masks built for all micro-batches up front would give every earlier row of the bucket the
        tree of the last one. Run the backward before the next row's ``row_loss``.
        """
        if self.flex is not None and rt.tree_mask.block_mask is None:
            rt.tree_mask = self.flex.build(rt.tree_mask.subtree_end, rt.tree_mask.length)
        return self.policy.grpo_loss(
            rt, self.loss_settings, normaliser, self.reference_logprobs(rt), aux_scale=1.0 / num_micro_batches
        )

    def reference_logprobs(self, rt: RowTensors) -> torch.Tensor | None:
        """``float32[M]``: the KL reference policy's log-probs of the row's trained tokens (no gradient), computed
        as the policy's (temperature, sampling masks); None when ``train.kl_coef`` is 0.

        The reference is the base model with the LoRA adapter disabled, or the frozen copy of the initial weights
        of a full fine-tuning run.
        """
        if self.cfg.train.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return self.reference.logprobs(rt).logprobs.detach()
            with self.policy.adapter_disabled():
                return self.policy.logprobs(rt).logprobs.detach()

    def forward_backward(self, rt: RowTensors, normaliser: float, num_micro_batches: int = 1) -> dict:
        """One micro-batch on this rank: fused head loss (:meth:`row_loss`), backward; returns its statistics as
        device tensors."""
        fwd_start = self.clock.mark()
        res = self.row_loss(rt, normaliser, num_micro_batches)
        fwd_end = self.clock.mark()
        res.loss.backward()
        st, n = res.stats, rt.num_terms
        staleness = (self.policy_version - rt.policy_version).float()
        low_frac, high_frac = per_sample_fractions(rt.sample_index, staleness.numel(), st) if n else (None, None)
        out = {
            "loss": res.loss,
            "terms": n,
            "entropy": res.logprobs.entropy.sum(),
            "sampler_mass": st["sampler_mass"].sum() if "sampler_mass" in st else 0.0,
            "kl": st["kl"].sum() if "kl" in st else 0.0,
            "staleness": staleness.sum(),
            "samples": staleness.numel(),
            "staleness_max": staleness.max() if staleness.numel() else 0.0,
            "ratio_max": st["ratio"].max() if n else 0.0,
            "ratio_min_neg": -st["ratio"].min() if n else -math.inf,
            "logp_diff_max": st["logp_diff"].max() if n else 0.0,
            # per completion: the share of its trained tokens clipped below / above the trust region
            "clip_low_min_neg": -low_frac.min() if n else -math.inf,
            "clip_high_max": high_frac.max() if n else -math.inf,
            "fwd_marks": (fwd_start, fwd_end),  # read by flush_log (perf/fwd_s), not reduced
        }
        # the router load-balancing loss before its weight (MoE), over the rows that forwarded tokens
        aux_rows = "aux_loss" in st and rt.num_forwarded != 0
        out["aux_loss"] = st["aux_loss"] if aux_rows else 0.0
        out["aux_rows"] = float(aux_rows)
        for k in ("ratio", "logp_diff", "masked", "clipped_low", "clipped_high"):
            out[k] = st[k].sum()
        # Tokens sampled by the weights being trained (staleness 0): their mean ratio measures the
        # trainer/sampler mismatch alone (seed manual: 1 +- 0.001 when both compute the same policy).
        fresh = staleness[rt.sample_index] == 0 if n else None
        out["ratio_fresh"] = torch.where(fresh, st["ratio"], 0.0).sum() if n else 0.0
        out["terms_fresh"] = fresh.sum() if n else 0.0
        return out

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule; returns lr and the pre-clip gradient norm.

        A step whose global gradient norm is NaN or inf changes nothing (no optimizer or scheduler
        step; the gradients are dropped) and is counted in ``train/skipped_nonfinite_steps``; the
        norm is the same on every rank (a reduction over all shards), so every rank skips together.
        The caller neither syncs nor saves after a skipped step.

        Raises:
            FloatingPointError: ``train.max_nonfinite_steps`` steps in a row were skipped.
        """
        tc = self.cfg.train
        params = [p for p in self.policy.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm if tc.max_grad_norm > 0 else float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        lr = self.scheduler.get_last_lr()[0]
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_nonfinite_steps += 1
            self._nonfinite_in_a_row += 1
            logger.warning(
                "step %d: gradient norm is %s; the update is skipped (no sync, no checkpoint)", self.step + 1, norm
            )
            if self._nonfinite_in_a_row >= tc.max_nonfinite_steps:
                raise FloatingPointError(
                    f"{self._nonfinite_in_a_row} steps in a row had a non-finite gradient norm "
                    f"(train.max_nonfinite_steps={tc.max_nonfinite_steps}); the weights were left as they were. "
                    "Check the rewards and sampler log-probs of the samples, or lower train.learning_rate"
                )
            return {"grad_norm": norm, "learning_rate": lr, "skipped": 1.0}
        self._nonfinite_in_a_row = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "learning_rate": lr}

    def run(self) -> ResumeState | None:
        """Train until ``max_steps`` or the end of the samples; returns the final resume state (rank 0).

        Rank 0 writes ``<output_dir>/train_end.json`` (``grpo_core.tracking.report.TRAIN_END``): the steps
        done, ``train.max_steps``, and why it stopped early (None when it did not).

        Raises:
            NothingToTrainError: (rank 0) the samples ended before the run's first step, or too many
                groups in a row were untrainable (``Planner``); the message names the counts and keys.
        """
        tc = self.cfg.train
        if self.policy_version > 0:  # resumed: servers may be fresh, give them the checkpoint's policy
            self.sync_servers("resumed")
        self.warmup()
        while self.step < tc.max_steps:
            if not self.train_step():
                break
        self.flush_log()
        if self.cfg.eval.dataset is not None and self.world.is_main:  # before explain() drains the rollout window
            self.eval_log.wait(self.source.metrics, self.step)
        stopped_early = None
        if self.step < tc.max_steps and self.world.is_main:
            ro = self.cfg.rollout
            source = (
                f"train.samples_path={tc.samples_path}"
                if tc.samples_path is not None
                else f"the prompt dataset, rollout.num_epochs={ro.num_epochs}"
            )
            stopped_early = self.planner.explain(
                f"the samples ended after step {self.step} of train.max_steps={tc.max_steps} ({source})",
                fixes=[
                    "set rollout.num_epochs: null to cycle the dataset until the trainer stops, raise "
                    "rollout.num_epochs, or use a larger dataset (rollout.dataset_size for reasoning_gym)"
                ],
            )
            if self.step == 0:  # a resumed run whose samples are all trained ends like any short run
                raise NothingToTrainError(stopped_early)
        self.save()
        self.export()
        if self._trained_log is not None:
            self._trained_log.close()
        if self.world.is_main:
            write_train_end(self.output_dir, self.step, tc.max_steps, stopped_early, self.skipped_nonfinite_steps)
        return self.resume_state() if self.world.is_main else None

    def export(self) -> Path | None:
        """Write the trained model (or LoRA adapter) to ``<output_dir>/final_model`` with ``save_pretrained``
        (collective: every rank gathers, rank 0 writes); returns the folder on rank 0."""
        state_dict = full_state_dict(self.policy)
        return export_final_model(self.policy, self.cfg, state_dict if self.world.is_main else None)

    def train_step(self) -> bool:
        """One optimizer step; False when there was nothing left to train."""
        t0 = time.perf_counter()
        start = self.last_end if self.last_end is not None else self.clock.mark()
        if self.overlap:
            streamed = self.stream_step()
            if streamed is None:
                return False
            local, planned, collect_s, fb_marks = streamed
            marks = {"start": start, **fb_marks}
        else:
            rows, terms, planned = self.collect_step()
            if not rows:
                return False
            tensors = [self._tensors(r) for r in rows]
            collect_s = time.perf_counter() - t0
            marks = {"start": start, "fb": self.clock.mark()}
            local = [
                self.forward_backward(rt, norm, len(tensors)) for rt, norm in zip(tensors, self.loss_normalisers(terms))
            ]
            marks["fb_end"] = self.clock.mark()
        marks["fwd"] = [d.pop("fwd_marks") for d in local]
        self.flush_log()  # the previous step's values are ready; this step's work is queued
        opt = self.optimizer_step()
        skipped = bool(opt.pop("skipped", 0.0))
        self._first_step_done()  # this process's first optimizer step: the time from the command's start
        marks["end"] = self.last_end = self.clock.mark()
        self.step += 1
        if self.world.is_main:
            self._record_trained(planned)
        sync = {}
        if self.step % self.cfg.train.weight_sync_steps == 0 and not skipped:
            t3 = time.perf_counter()
            self.policy_version += 1
            sync = self.weight_sync.sync(self.policy, self.policy_version, self.world.rank)
            sync["perf/weight_sync_s"] = time.perf_counter() - t3
        if self.world.is_main:
            self.source.report(
                self.policy_version, int(planned.stats["batch/raw_tokens_per_step"]), self.planner.held_tokens()
            )
        stats = reduce_step(local, opt.pop("grad_norm"), self.world.device)
        stats.marks = marks
        if self.compiled:  # graphs compiled during this step other than buckets met for the first time (0)
            graphs, self.graphs = self.graphs, compiled_graphs()
            opt["perf/recompile_count"] = self.graphs - graphs
            if self.compile_s > 0:
                opt["perf/compile_s"], self.compile_s = self.compile_s, 0.0
        self.pending = (self.step, stats, planned, {**opt, **sync}, collect_s, self._pad_frac(planned))
        if self.step % self.cfg.train.save_steps == 0 and not skipped:
            self.flush_log()
            self.save()
            self.last_end = None  # the next step's time starts after the checkpoint
        return True

    def _pad_frac(self, planned: PlannedStep | None) -> float:
        """Padding added to bring the step's rows to their bucket lengths ÷ padded positions (rank 0)."""
        if planned is None or self.buckets is None:
            return 0.0
        rows = [max(r.num_forwarded, 1) for mb in planned.micro_batches for r in mb]
        padded = [bucket_length(n, self.buckets) for n in rows]
        return 1.0 - sum(rows) / sum(padded)

    def _record_trained(self, planned: PlannedStep) -> None:
        """Mark the step's samples trained and append the prompts it completed to ``trained_prompts.jsonl``."""
        before = len(self.planner.tracker.trained)
        self.planner.step_trained(planned)
        done = self.planner.tracker.trained[before:]
        if self._trained_log is None:
            self._trained_log = JsonlAppender(self.output_dir / TRAINED_PROMPTS)
        self._trained_log.write({"step": self.step, "prompt_indices": done})

    # -- metrics -------------------------------------------------------------------------
    def flush_log(self) -> None:
        """Log the step whose statistics are still pending (every rank reads them; rank 0 logs)."""
        if self.pending is None:
            return
        step, stats, planned, host, collect_s, pad_frac = self.pending
        self.pending = None
        values = stats.values()
        if self.world.is_main:
            m = stats.marks
            times = {
                "perf/step_s": self.clock.seconds(m["start"], m["end"]),
                # overlapped: the micro-batches' own spans, not the pulls between them
                "perf/fwd_bwd_s": sum(self.clock.seconds(a, b) for a, b in m["fb_spans"])
                if "fb_spans" in m
                else self.clock.seconds(m["fb"], m["fb_end"]),
                "perf/fwd_s": sum(self.clock.seconds(a, b) for a, b in m["fwd"]),
                "perf/optimizer_s": self.clock.seconds(m["fb_end"], m["end"]),
                "perf/collect_s": collect_s,
            }
            self.log_step(step, values, planned, {**host, **times, "batch/pad_frac": pad_frac})

    def log_step(self, step: int, v: dict[str, float], planned: PlannedStep, extra: dict) -> None:
        """Add one step's reduced statistics to the window; flush it every ``logging_steps`` (rank 0)."""
        n = max(v["terms"], 1)
        w = self.window
        w.update(
            {
                "loss": v["loss"] / self.world.world_size,
                "entropy": v["entropy"] / n,
                "sampling/importance_sampling_ratio/mean": v["ratio"] / n,
                "sampling/importance_sampling_ratio/max": v["ratio_max"],
                "sampling/importance_sampling_ratio/min": -v["ratio_min_neg"],
                "sampling/sampling_logp_difference/mean": v["logp_diff"] / n,
                "sampling/sampling_logp_difference/max": v["logp_diff_max"],
                "sampling/masked_mean": v["masked"] / n,
                "clip_ratio/low_mean": v["clipped_low"] / n,
                "clip_ratio/high_mean": v["clipped_high"] / n,
                "clip_ratio/region_mean": (v["clipped_low"] + v["clipped_high"]) / n,
                "clip_ratio/low_min": finite_or_nan(-v["clip_low_min_neg"]),  # NaN (no trained token): not logged
                "clip_ratio/high_max": finite_or_nan(v["clip_high_max"]),
                "sample/staleness_mean": v["staleness"] / max(v["samples"], 1),
                "sample/staleness_max": v["staleness_max"],
                "policy_version": self.policy_version,
                "grad_norm": v["grad_norm"],
                "perf/rollout_wait_s": planned.rollout_wait_s,
                **planned.stats,
                **extra,
            }
        )
        if self.warmup_s is not None:  # reported once, with the first step after it
            w.add("perf/compile_warmup_s", self.warmup_s)
            self.warmup_s = None
        if self.first_step_s is not None:  # once: the command's start to the first optimizer step (grpo_core.run)
            w.add("perf/time_to_first_step_s", self.first_step_s)
            self.first_step_s = None
        if v["terms_fresh"] > 0:  # weighted by tokens over the window; the count lets a run-level figure do the same
            w.rate("sampling/importance_sampling_ratio/staleness0_mean", v["ratio_fresh"], v["terms_fresh"])
            w.add("sampling/importance_sampling_ratio/staleness0_token_count", v["terms_fresh"])
        if self.cfg.train.score_centering:
            w.add("sampling/sampler_mass", v["sampler_mass"] / n)
        if v["aux_rows"] > 0:  # MoE with train.router_aux_loss_coef > 0: the rows' mean load-balancing loss
            w.add("aux_loss", v["aux_loss"] / v["aux_rows"])
        if self.cfg.train.kl_coef > 0:  # mean k3 estimate of KL(π‖π_ref) over the step's kept trained tokens
            w.add("kl", v["kl"] / n)
        step_s, fwd_bwd_s = extra["perf/step_s"], extra["perf/fwd_bwd_s"]
        forwarded, trained = (
            planned.stats["batch/forwarded_tokens_per_step"],
            planned.stats["batch/trained_tokens_per_step"],
        )
        self.num_tokens += int(forwarded)  # the manual's running total: every token sent, a shared prefix once
        w.rate("perf/tokens_per_s", forwarded, step_s)
        w.rate("perf/trained_tokens_per_s", trained, step_s)
        w.rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)  # the manual's names of the two above
        w.rate("perf/wall_clock_trained_tokens_per_s", trained, step_s)
        w.rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, fwd_bwd_s)
        # per sample (averaged over the window's samples): its own tokens, before the packing shares a prefix
        samples = planned.stats["batch/samples_per_step"]
        w.rate("sample/forwarded_tokens_mean", planned.stats["batch/raw_tokens_per_step"], samples)
        w.rate("sample/trained_tokens_mean", trained, samples)
        w.add("sample/forwarded_tokens_max", max_sample_tokens(planned))
        self._mfu(forwarded, fwd_bwd_s, step_s)
        if step % self.cfg.train.logging_steps == 0:
            w.add("batch/dropped_oversize_count", self.planner.dropped_oversize_count)
            # stale at step assembly; the source adds those it dropped when pulled (the same name, summed)
            w.add("sample/dropped_stale_count", self.planner.take_dropped_stale_count())
            w.add("train/skipped_nonfinite_steps", self.skipped_nonfinite_steps)  # running total of the run
            w.add("num_tokens", self.num_tokens)  # running total, the checkpoint's count included after a resume
            w.update(self.eval_log.split(self.source.metrics()))  # evaluations are logged at their own step
            metrics = w.flush()
            logger.info(
                "step %d: loss %.4f, %.0f tokens/s",
                step,
                metrics.get("loss", float("nan")),
                metrics.get("perf/tokens_per_s", 0.0),
            )
            if self.sink is not None:
                self.sink.log(step, metrics)
            self._log_completions(step)

    def _log_completions(self, step: int) -> None:
        """Hand the window's completion sample (from the rollout) to the sink's table (``tracking.log_completions``)."""
        log_table = getattr(self.sink, "log_completions", None)
        pull = getattr(self.source, "completions", None)
        if self.cfg.tracking.log_completions and log_table is not None and pull is not None:
            log_table(step, pull())

    def _mfu(self, forwarded_tokens: float, fwd_bwd_s: float, step_s: float) -> None:
        """perf/fwd_bwd_mfu and perf/wall_clock_mfu: model FLOPs of the step's forwarded tokens per second of
        forward + backward, and of the whole step, ÷ the devices' peak (logged only on a GPU in ``PEAK_FLOPS``)."""
        if self.world.device.type != "cuda" or fwd_bwd_s <= 0:
            return
        name = torch.cuda.get_device_name(self.world.device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        if peak is None:
            return
        n_params = sum(p.numel() for p in self.policy.parameters())  # DTensor numel is the global size
        flops = 6 * n_params * forwarded_tokens  # dense matmuls, forward + backward; attention left out
        self.window.add("perf/fwd_bwd_mfu", flops / fwd_bwd_s / (peak * self.world.world_size))
        if step_s > 0:
            self.window.add("perf/wall_clock_mfu", flops / step_s / (peak * self.world.world_size))

    # -- checkpoints ---------------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint (collective) with the resume state, pending samples and the run's fingerprint; then keep
        the newest ``train.save_total_limit``."""
        path = checkpoint.checkpoint_dir(self.output_dir, self.step)
        if path == self._saved:
            return
        state = self.resume_state() if self.world.is_main else None
        pending = self.planner.pending_samples() if self.world.is_main else None
        extra = {FINGERPRINT_FILE: fingerprint_text(self.cfg)} if self.world.is_main else None
        checkpoint.save(path, self.policy, self.optimizer, self.scheduler, state, pending, self.world.rank, extra)
        self._saved = path
        on_checkpoint = getattr(self.sink, "on_checkpoint", None)  # e.g. MLflow artifacts (grpo_core.tracking)
        if self.world.is_main and on_checkpoint is not None:
            on_checkpoint(path, self.step)
        if self.world.is_main:
            rotate_checkpoints(self.output_dir, self.cfg.train.save_total_limit, path, self.sink)
