"""Checkpoints and exact resume (DESIGN.md §5, resume).

A checkpoint folder ``<output_dir>/checkpoints/step-{N}`` holds the model and
optimizer state (``torch.distributed.checkpoint``, sharded), the scheduler,
each rank's RNG state, ``pending_samples.arrow`` (samples pulled but not yet
trained: restored into the batcher on resume, so their prompts are neither
regenerated nor lost) and ``rollout_state.json`` (:class:`ResumeState`). It is
written to ``step-{N}.tmp`` and renamed when complete, so a crash mid-save
leaves the previous checkpoint as the latest.

Restoring never unpickles code (``grpo_core.train.manifest``): ``manifest.json`` holds the SHA-256
digest of every file and is checked before anything is read; RNG state and scheduler are loaded
with ``weights_only=True``; DCP's pickled metadata is read by a restricted unpickler.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed as dist

from grpo_core.packing import read_samples_ipc, write_samples_ipc
from grpo_core.train.manifest import safe_reader, verify_manifest, write_manifest
from grpo_core.transport.types import ResumeState

logger = logging.getLogger(__name__)

STATE_FILE = "rollout_state.json"
PENDING_FILE = "pending_samples.arrow"


class PromptTracker:
    """Which prompts are fully trained: the watermark and the trained set above it.

    A prompt is done when every sample of its group has been trained, or it was
    consumed without samples, or (at save time) its remaining samples are saved
    as pending samples.
    """

    def __init__(self, resume: ResumeState | None = None):
        resume = resume or ResumeState()
        self.watermark = resume.first_untrained_prompt_index
        self.done_above: set[int] = set(resume.trained_above)
        self.outstanding: Counter[int] = Counter()
        self.trained: list[int] = []  # prompt indices completed in this process, in order

    def received(self, prompt_indices: list[int]) -> None:
        """Samples of these prompts (one entry per sample) entered the trainer."""
        self.outstanding.update(prompt_indices)

    def trained_samples(self, prompt_indices: list[int]) -> None:
        """These samples (one entry per sample) were used by an optimizer step."""
        for p in prompt_indices:
            self.outstanding[p] -= 1
            if self.outstanding[p] == 0:
                del self.outstanding[p]
                self._done(p)

    def consumed(self, prompt_indices: list[int]) -> None:
        """Prompts finished without any trainable sample."""
        for p in prompt_indices:
            self._done(p)

    def _done(self, p: int) -> None:
        self.trained.append(p)
        self.done_above.add(p)
        while self.watermark in self.done_above:
            self.done_above.discard(self.watermark)
            self.watermark += 1

    def state(self, step: int, policy_version: int, epoch: int = 0) -> ResumeState:
        """The resume state, counting prompts with outstanding samples as done (they are saved as pending)."""
        done = set(self.done_above) | set(self.outstanding)
        watermark = self.watermark
        while watermark in done:
            done.discard(watermark)
            watermark += 1
        return ResumeState(policy_version, step, watermark, sorted(done), epoch)


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    """Folder of the checkpoint after optimizer step ``step``."""
    return Path(output_dir) / "checkpoints" / f"step-{step:07d}"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = Path(output_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if not p.name.endswith(".tmp") and (p / STATE_FILE).exists())
    return done[-1] if done else None


def save(path: Path, model, optimizer, scheduler, state: ResumeState, pending: pa.RecordBatch | None,
         rank: int) -> None:
    """Write a checkpoint collectively (every rank calls it); rank 0 publishes it by rename."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if pending is not None and pending.num_rows:
            write_samples_ipc(tmp / PENDING_FILE, pending)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    dist.barrier()
    if rank == 0:
        write_manifest(tmp)  # every rank's files are written and closed
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        logger.info("checkpoint step %d saved to %s", state.step, path)
    dist.barrier()


def load(path: Path, model, optimizer, scheduler, rank: int) -> tuple[ResumeState, pa.RecordBatch | None]:
    """Restore a checkpoint into live objects; returns the resume state and pending samples.

    Raises:
        CheckpointError: a file is missing, changed or not in the checkpoint's manifest (checked before
            anything is read), or the DCP metadata names code.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    verify_manifest(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, storage_reader=safe_reader(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)  # tensors and plain containers
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    state = read_state(path)
    pending = read_samples_ipc(path / PENDING_FILE) if (path / PENDING_FILE).exists() else None
    logger.info("resumed from %s at step %d (policy version %d)", path, state.step, state.policy_version)
    return state, pending


def read_state(path: Path) -> ResumeState:
    """The ``rollout_state.json`` of a checkpoint folder."""
    return ResumeState(**json.loads((Path(path) / STATE_FILE).read_text()))


STEP_LOGS = ("metrics.jsonl", "trained_prompts.jsonl")


def truncate_step_logs(output_dir: Path, step: int) -> None:
    """Drop records of steps after ``step`` from the run's JSON-lines logs.

    A resumed run replays the steps after its checkpoint; their records from
    the crashed attempt would otherwise appear twice.
    """
    for name in STEP_LOGS:
        path = Path(output_dir) / name
        if not path.exists():
            continue
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
