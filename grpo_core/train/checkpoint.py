"""Checkpoints and exact resume (DESIGN.md §5, resume).

A checkpoint folder ``<output_dir>/checkpoints/step-{N}`` holds the model and
optimizer tensors (``torch.distributed.checkpoint``, sharded), their other values (the optimizer's
learning rate, betas, ...: ``nontensor_state.json``), the scheduler (``scheduler.json``),
each rank's RNG state, ``pending_samples.arrow`` (samples pulled but not yet
trained: restored into the batcher on resume, so their prompts are neither
regenerated nor lost) and ``rollout_state.json`` (:class:`ResumeState`). It is
written to ``step-{N}.tmp``, every file and folder fsynced, and renamed when
complete (the parent folder fsynced too), so a crash mid-save leaves the previous
checkpoint as the latest. A LoRA checkpoint holds the adapter and its optimizer
state only (``ignore_frozen_params``): the frozen base model comes from ``model``.

Restoring never unpickles code: ``manifest.json`` holds the SHA-256 digest of every file and is checked
before anything is read (``grpo_core.train.manifest``; it finds damage, not forgery); non-tensor state is
JSON (``grpo_core.train.plain_state``) and DCP loads tensors only, with a planner that refuses a checkpoint
listing any pickled bytes item (DCP would read one with ``torch.load(weights_only=False)``); the RNG state
loads with ``weights_only=True``; DCP's pickled metadata is read by a restricted unpickler.

:func:`latest_checkpoint` returns the newest checkpoint that passes :func:`verify` (manifest
included); a damaged newer one is skipped with a warning (the previous one is used). One that
passes but still fails to load is renamed ``step-{N}.bad`` by :func:`load` (the
next attempt falls back). ``train.save_total_limit`` keeps the newest N
(:func:`rotate`).
"""

from __future__ import annotations

import errno
import json
import logging
import re
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import torch
import torch.distributed as dist

from grpo_core.errors import CheckpointError, DiskFullError
from grpo_core.packing import read_samples_ipc, write_samples_ipc
from grpo_core.run import layout
from grpo_core.run.durable import fsync_dir, fsync_tree, read_jsonl, rewrite_jsonl
from grpo_core.train.manifest import safe_reader, verify_manifest, write_manifest
from grpo_core.train.plain_state import from_json, refuse_bytes_items, restore, split, tensor_only_planner, to_json
from grpo_core.transport.types import ResumeState

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions


logger = logging.getLogger(__name__)

STATE_FILE = layout.CHECKPOINT_STATE
PENDING_FILE = layout.CHECKPOINT_PENDING
SCHEDULER_FILE = layout.CHECKPOINT_SCHEDULER
NONTENSOR_FILE = layout.CHECKPOINT_NONTENSOR
_NAME = re.compile(re.escape(layout.CHECKPOINT_PREFIX) + r"(\d+)")


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
    return layout.checkpoint_dir(output_dir, step)


def checkpoints(output_dir: Path) -> list[Path]:
    """Published checkpoint folders ``step-N`` (not ``.tmp``, not ``.bad``), oldest first."""
    root = Path(output_dir) / layout.CHECKPOINTS_DIR
    found = [p for p in root.glob(layout.CHECKPOINT_PREFIX + "*") if _NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: layout.checkpoint_step(p.name))


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded (None when it looks complete).

    Checks without loading tensors: every file matches the SHA-256 manifest (:func:`verify_manifest`),
    ``rollout_state.json`` parses, the ``dcp`` metadata reads (restricted unpickler) and every shard file it
    names is there and as long as its entries need, it lists no pickled bytes item, the scheduler and the
    non-tensor state parse as JSON and rank 0's RNG state is there.
    """
    path = Path(path)
    try:
        verify_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    try:
        read_state(path)
    except (OSError, ValueError, TypeError) as exc:
        return f"{STATE_FILE}: {type(exc).__name__}: {exc}"
    try:
        metadata = safe_reader(path / layout.CHECKPOINT_DCP).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to read the metadata means a damaged checkpoint
        return f"dcp/.metadata: {type(exc).__name__}: {exc}"
    try:
        refuse_bytes_items(metadata, "dcp/.metadata")
        for name in (SCHEDULER_FILE, NONTENSOR_FILE):
            from_json((path / name).read_text(), name)
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    needed: dict[str, int] = {}  # shard file -> bytes its entries reach
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name:
            needed[name] = max(needed.get(name, 0), int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0)))
    for name, size in sorted(needed.items()):
        shard = path / layout.CHECKPOINT_DCP / name
        if not shard.is_file() or shard.stat().st_size < size:
            return f"dcp/{name} is missing or shorter than its {size} bytes"
    for name in (layout.checkpoint_rng(0),):
        if not (path / name).is_file():
            return f"{name} is missing"
    return None


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint that passes :func:`verify`, or None; a damaged newer one is skipped with a warning."""
    for path in reversed(checkpoints(output_dir)):
        problem = verify(path)
        if problem is None:
            return path
        logger.warning("checkpoint %s is damaged (%s); falling back to the previous one", path, problem)
    return None


def rotate(output_dir: Path, keep: int | None, protect: Path | Iterable[Path] | None = None) -> list[Path]:
    """Delete the oldest checkpoints so that ``keep`` remain (``train.save_total_limit``); returns those deleted.

    ``protect`` (the checkpoint just written, or several: e.g. those still being uploaded) is never deleted, so more
    than ``keep`` may remain until a later call. Damaged (``.bad``) and unfinished (``.tmp``) folders older than the
    oldest kept checkpoint go too.
    """
    if keep is None:
        return []
    kept = {Path(protect).resolve()} if isinstance(protect, (str, Path)) else {Path(p).resolve() for p in protect or ()}
    found = checkpoints(output_dir)
    drop = [p for p in found[: max(len(found) - keep, 0)] if p.resolve() not in kept]
    if found[-keep:]:
        oldest_kept = int(found[-keep:][0].name[5:])
        root = Path(output_dir) / layout.CHECKPOINTS_DIR
        bad = root.glob(f"{layout.CHECKPOINT_PREFIX}*{layout.CHECKPOINT_BAD_SUFFIX}")
        drop += [p for p in bad if layout.checkpoint_step(p.name.split(".")[0]) < oldest_kept]
    for path in drop:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("checkpoint %s deleted (train.save_total_limit=%d)", path, keep)
    if drop:
        fsync_dir(Path(output_dir) / layout.CHECKPOINTS_DIR)
    return drop


def _state_dict_options(model: torch.nn.Module) -> StateDictOptions:
    """A LoRA policy's checkpoint holds only its trainable parameters (the adapter) and their optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, options: StateDictOptions) -> dict:
    """``{"model", "optim"}`` state dicts; with ``ignore_frozen_params`` no frozen tensor is left.

    torch's ``ignore_frozen_params`` misses a frozen tensor reachable under a second name (a tied ``lm_head``
    sharing the input embedding): every name of every frozen parameter is dropped here.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if options.ignore_frozen_params:
        frozen = {
            _WRAPPERS.sub("", name) for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
        }
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    return {"model": model_sd, "optim": optim_sd}


def save(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: ResumeState,
    pending: pa.RecordBatch | None,
    rank: int,
    extra: dict[str, str] | None = None,
) -> None:
    """Write a checkpoint collectively (every rank calls it); rank 0 publishes it by rename.

    ``extra`` (rank 0): more text files of the checkpoint, name -> content (e.g. ``fingerprint.json``). Rank 0 first
    removes every ``step-*.tmp`` folder an earlier save left (a killed or failed one), and removes this save's own
    when it fails, so a partial checkpoint never keeps the disk full.

    Raises:
        DiskFullError: a write found no space left (``ENOSPC``) or the quota spent (``EDQUOT``), on this or, through
            DCP, another rank, or failed while the folder holds less free space than this rank's tensors (torch's
            zip writer loses the ``ENOSPC``: :func:`_no_room`); not retried, since a retry meets the same full disk.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it

    tensors, values = split(_state_dicts(model, optimizer, _state_dict_options(model)))
    plain = {NONTENSOR_FILE: to_json(values), SCHEDULER_FILE: to_json(scheduler.state_dict())}  # every rank: fail alike
    tmp = path.with_name(path.name + layout.CHECKPOINT_TMP_SUFFIX)
    if rank == 0:
        for stale in (
            path.parent.glob(f"{layout.CHECKPOINT_PREFIX}*{layout.CHECKPOINT_TMP_SUFFIX}")
            if path.parent.is_dir()
            else []
        ):
            logger.warning("removing %s, left by a checkpoint save that did not finish", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        _write(tmp, tensors, plain, state, pending, rank, extra)
    except (Exception, CheckpointException) as exc:
        full = _disk_full(exc) or _no_room(exc, path.parent, tensors)  # before the partial checkpoint is removed
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise DiskFullError(
                f"no space left for checkpoint step {state.step} in {path.parent} ({full}); the partial checkpoint "
                "was removed: free space on that disk (or lower train.save_total_limit), then resume"
            ) from exc
        raise
    dist.barrier()
    if rank == 0:
        write_manifest(tmp)  # every rank's files are written and closed
        fsync_tree(tmp)  # make them (and the manifest) durable before the rename publishes them
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        fsync_dir(path.parent)
        logger.info("checkpoint step %d saved to %s", state.step, path)
    dist.barrier()


def _write(
    tmp: Path,
    tensors: dict[str, torch.Tensor],
    plain: dict[str, str],
    state: ResumeState,
    pending: pa.RecordBatch | None,
    rank: int,
    extra: dict[str, str] | None,
) -> None:
    """Every file of a checkpoint into ``tmp``: this rank's DCP shard and RNG state; rank 0 the rest."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=str(tmp / layout.CHECKPOINT_DCP))  # tensors only: DCP pickles nothing
    torch.save(
        {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        tmp / layout.checkpoint_rng(rank),
    )
    if rank == 0:
        for name, text in plain.items():
            (tmp / name).write_text(text)
        if pending is not None and pending.num_rows:
            write_samples_ipc(tmp / PENDING_FILE, pending)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)


def _no_room(exc: BaseException, folder: Path, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why a failed write was a full disk although no ``ENOSPC`` reached Python, or None.

    torch's zip writer (``torch.save``, DCP's item files) writes through C++ streams that drop the error of a write
    to a full disk: the save then fails with ``RuntimeError: ... unexpected pos 704 vs 598`` (seen on a full
    tmpfs). So a failed save whose folder has fewer bytes free than this rank's tensors take is a full disk.
    """
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    if free >= needed:
        return None
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
    for failure in failures.values() if isinstance(failures, dict) else []:
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            exc = failure[0]
            break
    said = str(exc).strip().splitlines()
    return (
        f"{free} bytes free there, fewer than this rank's {needed} bytes of tensors; the write failed with "
        f"{type(exc).__name__}: {said[0] if said else '(no message)'}"
    )


def _disk_full(exc: BaseException) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` error behind ``exc``: itself, its causes and contexts, and every rank's failure
    that DCP's ``CheckpointException`` wraps; None when there is none."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
        todo += [e.__cause__, e.__context__]
    return None


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
) -> tuple[ResumeState, pa.RecordBatch | None]:
    """Restore a checkpoint into live objects (collective); returns the resume state and pending samples.

    Raises:
        CheckpointError: the checkpoint passed :func:`verify` but failed to load on some rank (a file changed
            since, DCP metadata naming code, ...); it is renamed
            ``step-N.bad`` (rank 0), so the next attempt falls back to the previous checkpoint.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it

    try:
        return _load(path, model, optimizer, scheduler, rank)
    except (Exception, CheckpointException) as exc:
        if rank == 0 and path.is_dir():
            path.rename(path.with_name(path.name + layout.CHECKPOINT_BAD_SUFFIX))
            fsync_dir(path.parent)
        cause = _first_failure(exc)
        raise CheckpointError(
            f"checkpoint {path} failed to load ({type(cause).__name__}: {cause}); it was renamed "
            f"{path.name}.bad, so the next attempt resumes from the previous checkpoint"
        ) from exc


def _first_failure(exc: BaseException) -> BaseException:
    """The error of the first failed rank of DCP's ``CheckpointException`` (which wraps them), else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else exc
    return exc


def _load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
) -> tuple[ResumeState, pa.RecordBatch | None]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    verify_manifest(path)  # before anything is read
    values = from_json((path / NONTENSOR_FILE).read_text(), NONTENSOR_FILE)
    scheduler_state = from_json((path / SCHEDULER_FILE).read_text(), SCHEDULER_FILE)
    options = _state_dict_options(model)
    sd = _state_dicts(model, optimizer, options)
    tensors, _ = split(sd)
    reader = safe_reader(path / layout.CHECKPOINT_DCP)
    dcp.load(tensors, storage_reader=reader, planner=tensor_only_planner())  # fills sd in place
    restore(sd, values, NONTENSOR_FILE)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    scheduler.load_state_dict(scheduler_state)
    rng_file = path / layout.checkpoint_rng(rank)
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


STEP_LOGS = layout.STEP_LOGS


def truncate_step_logs(output_dir: Path, step: int) -> None:
    """Drop records of steps after ``step`` from the run's JSON-lines logs (rewritten atomically).

    A resumed run replays the steps after its checkpoint; their records from the crashed attempt would
    otherwise appear twice. A torn last line (a writer killed mid-append) is dropped with a warning.
    """
    for name in STEP_LOGS:
        path = Path(output_dir) / name
        if path.exists():
            rewrite_jsonl(path, [r for r in read_jsonl(path) if r["step"] <= step])
