"""The FSDP2 GRPO trainer loop (DESIGN.md §3, §5, §7).

Every rank runs :class:`Trainer`; rank 0 also owns the :class:`Planner` (data),
the metrics sink, weight-sync traffic and checkpoint metadata. One step:
``collect_step`` (rank 0 plans, every rank receives its rows) →
``forward_backward`` per micro-batch → ``optimizer_step`` → ``sync_weights``
(every ``weight_sync_steps``) → ``log_step`` → ``save`` (every ``save_steps``); at the end a
last ``save`` and ``export`` (the Hugging Face folder ``final_model/``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from grpo_core.config import RunConfig
from grpo_core.errors import NothingToTrainError
from grpo_core.metrics import MetricsSink, MetricWindow
from grpo_core.report import write_train_end
from grpo_core.models import resolve_model_dir
from grpo_core.transport import ResumeState, SampleSource

from . import checkpoint
from .attention import FlexTreeMasks
from .distributed import ROW, STOP, World, all_reduce, broadcast_header, scatter_rows
from .loss import LossSettings, grpo_loss
from .planner import PlannedStep, Planner
from .policy import build_policy, compile_layers, shard
from .rows import length_buckets, to_tensors
from .export import export_final_model
from .weight_sync import NoWeightSync, WeightSync, full_state_dict

logger = logging.getLogger(__name__)

#: bf16 dense peak FLOP/s per device, for MFU (vendor datasheets).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def lr_lambda(kind: str, warmup: int, total: int):
    """LR multiplier per step: linear warmup, then constant / linear / cosine decay to 0 at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - frac if kind == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
    return f


class Trainer:
    """See module docs. ``source`` and ``sink`` are used on rank 0 only."""

    def __init__(self, cfg: RunConfig, world: World, source: SampleSource | None = None,
                 weight_sync: WeightSync | None = None, sink: MetricsSink | None = None):
        self.cfg, self.world, self.sink = cfg, world, sink
        tc = cfg.train
        self.weight_sync = weight_sync or NoWeightSync()
        self.output_dir = Path(tc.output_dir)
        torch.manual_seed(tc.seed + world.rank)
        dtype = getattr(torch, tc.dtype)
        self.policy = build_policy(str(resolve_model_dir(cfg.model)), cfg.model, dtype=dtype, device=world.device,
                                   lora=tc.lora, gradient_checkpointing=tc.gradient_checkpointing,
                                   temperature=cfg.rollout.temperature, chunk_size=tc.logprob_chunk_size,
                                   max_len=cfg.token_budget())
        on_cuda = world.device.type == "cuda"
        if tc.compile if tc.compile is not None else on_cuda:
            compile_layers(self.policy)
        shard(self.policy, tc.mixed_precision if tc.mixed_precision is not None else on_cuda)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=tc.learning_rate, betas=tc.adam_betas,
                                           weight_decay=tc.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tc.lr_scheduler, tc.warmup_steps, tc.max_steps))
        self.loss_settings = LossSettings(tc.clip_min, tc.clip_max, tc.score_centering, tc.epsilon, tc.epsilon_high)
        self.token_budget = cfg.token_budget()
        self.flex = FlexTreeMasks(world.device) if world.device.type == "cuda" else None
        self.buckets = length_buckets(self.token_budget, tc.length_buckets)
        self.window = MetricWindow()
        self.step, self.policy_version = 0, 0
        tracker, pending = self._resume()
        self.planner = None
        if world.is_main:
            assert source is not None, "rank 0 needs a sample source"
            self.source = source
            ro = cfg.rollout
            hints = {"max_staleness": ro.max_staleness, "temperature": ro.temperature,
                     "num_generations": ro.num_generations, "max_completion_length": ro.max_completion_length}
            self.planner = Planner(source, world.world_size, self.token_budget, cfg.packing.backend, tracker, pending,
                                   flush_after_s=tc.flush_partial_after_s,
                                   max_untrainable_groups=tc.max_untrainable_groups, hints=hints)
        self.skipped_nonfinite_steps, self._nonfinite_in_a_row = 0, 0

    # -- resume --------------------------------------------------------------------------
    def _resume(self) -> tuple[checkpoint.PromptTracker, object]:
        path = checkpoint.latest_checkpoint(self.output_dir)
        if path is None:
            return checkpoint.PromptTracker(), None
        state, pending = checkpoint.load(path, self.policy, self.optimizer, self.scheduler, self.world.rank)
        self.step, self.policy_version = state.step, state.policy_version
        return checkpoint.PromptTracker(state), pending

    def resume_state(self) -> ResumeState:
        """Where the rollout side should start (rank 0)."""
        return self.planner.tracker.state(self.step, self.policy_version)

    # -- one step ------------------------------------------------------------------------
    def collect_step(self) -> tuple[list, PlannedStep | None]:
        """Rank 0 plans the step; every rank gets its row of each micro-batch ([] = stop)."""
        planned = None
        if self.world.is_main:
            planned = self.planner.next_step(self.cfg.train.gradient_accumulation_steps, self.policy_version)
        n = broadcast_header(self.world, [ROW if planned else STOP, len(planned.micro_batches) if planned else 0])
        if n[0] == STOP:
            return [], None
        rows = [scatter_rows(self.world, mb if planned else None) for mb in (planned.micro_batches if planned
                                                                              else [None] * n[1])]
        return rows, planned

    def _tensors(self, row):
        if self.flex is None:
            return to_tensors(row, self.world.device)
        length = self.flex.bucket(max(row.num_forwarded, 1), self.buckets)
        rt = to_tensors(row, self.world.device, length)
        rt.tree_mask = self.flex.build(rt.tree_mask.subtree_end, length)
        return rt

    def forward_backward(self, row, num_micro_batches: int) -> dict[str, float]:
        """One micro-batch on this rank: log-probs, loss, backward; returns local sums for metrics."""
        rt = self._tensors(row)
        n_global = all_reduce([rt.num_terms], self.world)[0]
        normaliser = max(n_global, 1) * num_micro_batches / self.world.world_size
        out = self.policy.logprobs(rt)
        loss, st = grpo_loss(out.logprobs, rt.sampler_logprob, rt.advantage, normaliser, self.loss_settings,
                             out.topk_logprobs, rt.topk_logprobs)
        loss.backward()
        sums = {"loss": loss.item(),
                "terms": rt.num_terms, "entropy": out.entropy.sum().item(), "ratio": st["ratio"].sum().item(),
                "logp_diff": st["logp_diff"].sum().item(), "masked": st["masked"].sum().item(),
                "clipped_low": st["clipped_low"].sum().item(), "clipped_high": st["clipped_high"].sum().item(),
                "sampler_mass": st["sampler_mass"].sum().item() if "sampler_mass" in st else 0.0}
        extremes = {"ratio_max": st["ratio"].max().item() if rt.num_terms else 0.0,
                    "ratio_min_neg": -st["ratio"].min().item() if rt.num_terms else -math.inf,
                    "logp_diff_max": st["logp_diff"].max().item() if rt.num_terms else 0.0}
        version = self.policy_version
        staleness = (version - rt.policy_version).float() if rt.policy_version.numel() else torch.zeros(0)
        # Tokens sampled by the weights being trained (staleness 0): their mean ratio measures the
        # trainer/sampler mismatch alone (seed manual: 1 +- 0.001 when both compute the same policy).
        fresh = staleness.to(rt.sample_index.device)[rt.sample_index] == 0 if rt.num_terms else torch.zeros(0, dtype=torch.bool)
        sums["ratio_fresh"] = st["ratio"][fresh].sum().item() if rt.num_terms else 0.0
        sums["terms_fresh"] = float(fresh.sum().item()) if rt.num_terms else 0.0
        sums["staleness"] = staleness.sum().item()
        sums["samples"] = float(staleness.numel())
        extremes["staleness_max"] = staleness.max().item() if staleness.numel() else 0.0
        return {**sums, **extremes}

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
            logger.warning("step %d: gradient norm is %s; the update is skipped (no sync, no checkpoint)",
                           self.step + 1, norm)
            if self._nonfinite_in_a_row >= tc.max_nonfinite_steps:
                raise FloatingPointError(
                    f"{self._nonfinite_in_a_row} steps in a row had a non-finite gradient norm "
                    f"(train.max_nonfinite_steps={tc.max_nonfinite_steps}); the weights were left as they were. "
                    "Check the rewards and sampler log-probs of the samples, or lower train.learning_rate")
            return {"grad_norm": norm, "learning_rate": lr, "skipped": 1.0}
        self._nonfinite_in_a_row = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "learning_rate": lr}

    def run(self) -> ResumeState | None:
        """Train until ``max_steps`` or the end of the samples; returns the final resume state (rank 0).

        Rank 0 writes ``<output_dir>/train_end.json`` (``grpo_core.report.TRAIN_END``): the steps
        done, ``train.max_steps``, and why it stopped early (None when it did not).

        Raises:
            NothingToTrainError: (rank 0) the samples ended before the run's first step, or too many
                groups in a row were untrainable (``Planner``); the message names the counts and keys.
        """
        tc = self.cfg.train
        if self.policy_version > 0:  # resumed: servers may be fresh, give them the checkpoint's policy
            self.weight_sync.sync(self.policy, self.policy_version, self.world.rank)
        while self.step < tc.max_steps:
            if not self.train_step():
                break
        stopped_early = None
        if self.step < tc.max_steps and self.world.is_main:
            ro = self.cfg.rollout
            source = (f"train.samples_path={tc.samples_path}" if tc.samples_path is not None else
                      f"the prompt dataset, rollout.num_epochs={ro.num_epochs}")
            stopped_early = self.planner.explain(
                f"the samples ended after step {self.step} of train.max_steps={tc.max_steps} ({source})",
                fixes=["set rollout.max_steps to cycle the dataset until the trainer stops, raise "
                       "rollout.num_epochs, or use a larger dataset (rollout.dataset_size for reasoning_gym)"])
            if self.step == 0:  # a resumed run whose samples are all trained ends like any short run
                raise NothingToTrainError(stopped_early)
        self.save()
        self.export()
        if self.world.is_main:
            write_train_end(self.output_dir, self.step, tc.max_steps, stopped_early,
                            self.skipped_nonfinite_steps)
        return self.resume_state() if self.world.is_main else None

    def export(self) -> Path | None:
        """Write the trained model (or LoRA adapter) to ``<output_dir>/final_model`` with ``save_pretrained``
        (collective: every rank gathers, rank 0 writes); returns the folder on rank 0."""
        state_dict = full_state_dict(self.policy)
        return export_final_model(self.policy, self.cfg, state_dict if self.world.is_main else None)

    def train_step(self) -> bool:
        """One optimizer step; False when there was nothing left to train."""
        t0 = time.perf_counter()
        rows, planned = self.collect_step()
        if not rows:
            return False
        t1 = time.perf_counter()
        local = [self.forward_backward(r, len(rows)) for r in rows]
        t2 = time.perf_counter()
        opt = self.optimizer_step()
        skipped = bool(opt.pop("skipped", 0.0))
        t3 = time.perf_counter()
        self.step += 1
        if self.world.is_main:
            self._record_trained(planned)
        sync = {}
        if self.step % self.cfg.train.weight_sync_steps == 0 and not skipped:
            self.policy_version += 1
            sync = self.weight_sync.sync(self.policy, self.policy_version, self.world.rank)
            sync["perf/weight_sync_s"] = time.perf_counter() - t3
        self.log_step(local, planned, opt, sync, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t0)
        if self.step % self.cfg.train.save_steps == 0 and not skipped:
            self.save()
        return True

    def _record_trained(self, planned: PlannedStep) -> None:
        """Mark the step's samples trained and append the prompts it completed to ``trained_prompts.jsonl``."""
        before = len(self.planner.tracker.trained)
        self.planner.step_trained(planned)
        done = self.planner.tracker.trained[before:]
        with (self.output_dir / "trained_prompts.jsonl").open("a") as f:
            f.write(json.dumps({"step": self.step, "prompt_indices": done}) + "\n")

    # -- metrics -------------------------------------------------------------------------
    def log_step(self, local: list[dict], planned: PlannedStep | None, opt: dict, sync: dict,
                 collect_s: float, fwd_bwd_s: float, optimizer_s: float, step_s: float) -> None:
        """Reduce per-rank sums, add rank 0's batch stats, and flush a window every ``logging_steps``."""
        keys = ["loss", "terms", "entropy", "ratio", "logp_diff", "masked", "clipped_low", "clipped_high",
                "sampler_mass", "staleness", "samples", "ratio_fresh", "terms_fresh"]
        sums = dict(zip(keys, all_reduce([sum(d[k] for d in local) for k in keys], self.world)))
        mkeys = ["ratio_max", "ratio_min_neg", "logp_diff_max", "staleness_max"]
        maxes = dict(zip(mkeys, all_reduce([max(d[k] for d in local) for k in mkeys], self.world, op="max")))
        if not self.world.is_main:
            return
        n = max(sums["terms"], 1)
        w = self.window
        w.update({"loss": sums["loss"] / self.world.world_size, "entropy": sums["entropy"] / n,
                  "sampling/importance_sampling_ratio/mean": sums["ratio"] / n,
                  "sampling/importance_sampling_ratio/max": maxes["ratio_max"],
                  "sampling/importance_sampling_ratio/min": -maxes["ratio_min_neg"],
                  "sampling/sampling_logp_difference/mean": sums["logp_diff"] / n,
                  "sampling/sampling_logp_difference/max": maxes["logp_diff_max"],
                  "sampling/masked_mean": sums["masked"] / n,
                  "clip_ratio/low_mean": sums["clipped_low"] / n, "clip_ratio/high_mean": sums["clipped_high"] / n,
                  "clip_ratio/region_mean": (sums["clipped_low"] + sums["clipped_high"]) / n,
                  "sample/staleness_mean": sums["staleness"] / max(sums["samples"], 1),
                  "sample/staleness_max": maxes["staleness_max"], "policy_version": self.policy_version,
                  "perf/step_s": step_s, "perf/fwd_bwd_s": fwd_bwd_s, "perf/optimizer_s": optimizer_s,
                  "perf/rollout_wait_s": planned.rollout_wait_s, **opt, **planned.stats, **sync})
        if sums["terms_fresh"] > 0:
            w.add("sampling/importance_sampling_ratio/staleness0_mean", sums["ratio_fresh"] / sums["terms_fresh"])
        if self.cfg.train.score_centering:
            w.add("sampling/sampler_mass", sums["sampler_mass"] / n)
        w.rate("perf/tokens_per_s", planned.stats["batch/forwarded_tokens_per_step"], step_s)
        w.rate("perf/trained_tokens_per_s", planned.stats["batch/trained_tokens_per_step"], step_s)
        self._mfu(planned.stats["batch/forwarded_tokens_per_step"], fwd_bwd_s)
        self.source.report(self.policy_version, int(planned.stats["batch/raw_tokens_per_step"]))
        if self.step % self.cfg.train.logging_steps == 0:
            w.add("batch/dropped_oversize_count", self.planner.dropped_oversize_count)
            w.add("train/skipped_nonfinite_steps", self.skipped_nonfinite_steps)  # running total of the run
            w.update(self.source.metrics())
            metrics = w.flush()
            logger.info("step %d: loss %.4f, %.0f tokens/s", self.step, metrics.get("loss", float("nan")),
                        metrics.get("perf/tokens_per_s", 0.0))
            if self.sink is not None:
                self.sink.log(self.step, metrics)
            self._log_completions()

    def _log_completions(self) -> None:
        """Hand the window's completion sample (from the rollout) to the sink's table (``tracking.log_completions``)."""
        log_table = getattr(self.sink, "log_completions", None)
        pull = getattr(self.source, "completions", None)
        if self.cfg.tracking.log_completions and log_table is not None and pull is not None:
            log_table(self.step, pull())

    def _mfu(self, forwarded_tokens: float, fwd_bwd_s: float) -> None:
        if self.world.device.type != "cuda" or fwd_bwd_s <= 0:
            return
        name = torch.cuda.get_device_name(self.world.device)
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
        if peak is None:
            return
        n_params = sum(p.numel() for p in self.policy.parameters())  # DTensor numel is the global size
        flops = 6 * n_params * forwarded_tokens  # dense matmuls, forward + backward; attention left out
        self.window.add("perf/fwd_bwd_mfu", flops / fwd_bwd_s / (peak * self.world.world_size))

    # -- checkpoints ---------------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint (collective) with the resume state and pending samples."""
        last = checkpoint.latest_checkpoint(self.output_dir)
        if last is not None and checkpoint.read_state(last).step == self.step:
            return
        state = self.resume_state() if self.world.is_main else None
        pending = self.planner.pending_samples() if self.world.is_main else None
        path = checkpoint.checkpoint_dir(self.output_dir, self.step)
        checkpoint.save(path, self.policy, self.optimizer, self.scheduler, state, pending, self.world.rank)
        on_checkpoint = getattr(self.sink, "on_checkpoint", None)  # e.g. MLflow artifacts (grpo_core.tracking)
        if self.world.is_main and on_checkpoint is not None:
            on_checkpoint(path, self.step)
