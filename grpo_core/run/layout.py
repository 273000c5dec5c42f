"""The one home of a run folder's names: every file and folder a run writes, and where.

A ``grpo train`` run writes under ``train.output_dir/<flow run id>/`` (the *run folder*); the trainer's own files
(metrics, checkpoints, the trained-prompt log) sit in the trainer's output folder, which the flow sets to that run
folder. Every module that reads or writes one of these names imports it from here, so a name changes in one place
and a reader never guesses another writer's spelling (prime-rl keeps the same in ``utils/pathing.py``).

Layout of a run folder::

    run_config.json            the resolved run config, secrets redacted          RUN_CONFIG
    train_config.json          the trainer's sub-config                            TRAIN_CONFIG
    trainer.pid                the torchrun launcher's pid                         TRAINER_PID
    trainer_inputs.json        the servers' URLs and the rollout's location        TRAINER_INPUTS
    startup.jsonl              the attempt's start-up events (flow, trainer)       STARTUP
    trainer_error.txt          the error that ended a trainer run, a line a rank   TRAINER_ERROR
    train_end.json             written by rank 0 when it stops                     TRAIN_END
    metrics.jsonl              one line per optimizer step                         METRICS
    trained_prompts.jsonl      one line per step: the prompts it completed         TRAINED_PROMPTS
    reward_curve.png           the reward curve of the summary                     REWARD_CURVE
    fingerprint.json           what a resume must match                            FINGERPRINT
    run.lock, run.lock.owner   one trainer per folder                              RUN_LOCK, RUN_LOCK_OWNER
    rollout_config.json        the rollout process's sub-config                    ROLLOUT_CONFIG
    rollout_resume.json        where the rollout process restarts                  ROLLOUT_RESUME
    rollout.location           its Arrow Flight location once it serves            ROLLOUT_LOCATION
    rollout_error.txt          its traceback when the rollout loop failed          ROLLOUT_ERROR
    rollout.log                its output                                          ROLLOUT_LOG
    servers/                   the replicas' and router's logs and port files      SERVERS_DIR
    checkpoints/step-NNNNNNN/  one checkpoint per save                             checkpoint_dir()
    final_model/               the exported model                                  FINAL_MODEL_DIR
    .vllm_lora/, .weights/     adapters and full weights published to servers      ADAPTER_DIR, WEIGHTS_DIR

Beside the run folders, ``train.output_dir/logs/`` (``CLI_LOGS_DIR``) holds one log per ``grpo train`` command, every
record with its traceback (``cli_log``); :func:`run_folders` lists the run folders alone.
"""

from __future__ import annotations

from pathlib import Path

# The flow's files.
RUN_CONFIG = "run_config.json"
TRAIN_CONFIG = "train_config.json"
TRAINER_PID = "trainer.pid"
REWARD_CURVE = "reward_curve.png"
TRAINER_INPUTS = "trainer_inputs.json"
"""The servers' URLs and the rollout's location, for a trainer started before them (``grpo_core.run.startup``)."""
STARTUP = "startup.jsonl"
"""The attempt's start-up events, flow's and trainer's (``grpo_core.run.startup``)."""

# The trainer's files (in its output folder).
METRICS = "metrics.jsonl"
TRAINED_PROMPTS = "trained_prompts.jsonl"
TRAIN_END = "train_end.json"
TRAINER_ERROR = "trainer_error.txt"
FINGERPRINT = "fingerprint.json"
RUN_LOCK = "run.lock"
RUN_LOCK_OWNER = "run.lock.owner"
FINAL_MODEL_DIR = "final_model"
ADAPTER_DIR = ".vllm_lora"
"""Adapters published to servers on this host (``train.adapter_store`` unset)."""
WEIGHTS_DIR = ".weights"
"""Full weights published to the embedded server."""

# The rollout process's files.
ROLLOUT_CONFIG = "rollout_config.json"
ROLLOUT_RESUME = "rollout_resume.json"
ROLLOUT_LOCATION = "rollout.location"
ROLLOUT_ERROR = "rollout_error.txt"
ROLLOUT_LOG = "rollout.log"

# The generation servers' files (``server.log_dir``; the flow sets it to ``<run folder>/servers``).
SERVERS_DIR = "servers"
ROUTER_LOG = "router.log"
ROUTER_PORT = "router.port"

# Checkpoints.
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step-"
CHECKPOINT_STATE = "rollout_state.json"
"""The resume state inside a checkpoint folder (also logged to MLflow under ``resume/``)."""
CHECKPOINT_MANIFEST = "manifest.json"
CHECKPOINT_DCP = "dcp"
"""The tensors of a checkpoint (``torch.distributed.checkpoint``: one shard file per rank and its metadata)."""
CHECKPOINT_DOWNLOAD = ".download"
"""Where a checkpoint fetched from MLflow lands before it is checked and moved into ``checkpoints/``."""
CHECKPOINT_PENDING = "pending_samples.arrow"
"""Samples pulled but not yet trained when the checkpoint was saved (trained first on resume)."""
CHECKPOINT_SCHEDULER = "scheduler.json"
CHECKPOINT_NONTENSOR = "nontensor_state.json"
"""The optimizer's non-tensor state (learning rate, betas, ...) as JSON: nothing in a checkpoint is unpickled."""
CHECKPOINT_TMP_SUFFIX = ".tmp"
"""A checkpoint being written (renamed to its final name once complete)."""
CHECKPOINT_BAD_SUFFIX = ".bad"
"""A checkpoint that failed to load (kept for inspection, skipped by resume)."""
CHECKPOINT_URI = "checkpoint_uri.txt"
"""Where an MLflow run keeps a checkpoint that was too large to upload: its URI."""
STEP_LOGS = (METRICS, TRAINED_PROMPTS)
"""The per-step logs a resume cuts back to its checkpoint's step."""


#: ``train.output_dir/logs/``: the full log of each ``grpo train`` command (the console shows one line per failure).
CLI_LOGS_DIR = "logs"


def cli_log(output_dir: Path | str, stamp: str, pid: int) -> Path:
    """The full log of one ``grpo train`` command: ``output_dir/logs/grpo-train-<stamp>-<pid>.log``."""
    return Path(output_dir) / CLI_LOGS_DIR / f"grpo-train-{stamp}-{pid}.log"


def run_folders(output_dir: Path | str) -> list[Path]:
    """The run folders under ``output_dir`` (those holding a ``run_config.json``), oldest first (modification
    time); the command logs' folder and anything else there are left out."""
    found = [p for p in Path(output_dir).iterdir() if (p / RUN_CONFIG).is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def replica_log(backend: str, replica: int) -> str:
    """File name of a generation replica's log in ``server.log_dir`` (``vllm-replica0.log``)."""
    return f"{backend}-replica{replica}.log"


def replica_port_file(backend: str, replica: int) -> str:
    """File name where a replica that picks its own port writes it (``embedded-replica0.port``)."""
    return f"{backend}-replica{replica}.port"


def checkpoint_dir(output_dir: Path | str, step: int) -> Path:
    """The checkpoint folder of optimizer step ``step`` (``checkpoints/step-0000012``)."""
    return Path(output_dir) / CHECKPOINTS_DIR / f"{CHECKPOINT_PREFIX}{step:07d}"


def checkpoint_rng(rank: int) -> str:
    """File name of rank ``rank``'s RNG state inside a checkpoint folder."""
    return f"rng_rank{rank}.pt"


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint folder name (``step-0000012`` → 12).

    Raises:
        ValueError: ``name`` is not a checkpoint folder name.
    """
    if not name.startswith(CHECKPOINT_PREFIX):
        raise ValueError(f"{name!r} is not a checkpoint folder name ({CHECKPOINT_PREFIX}NNNNNNN)")
    return int(name.removeprefix(CHECKPOINT_PREFIX).lstrip("0") or "0")
