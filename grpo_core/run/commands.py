"""The command lines and resources of a run's trainer: the torchrun command of each trainer host, and the GPU slots a
run holds (no Prefect here; ``flows/grpo_train.py`` calls these)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_core.config import RunConfig
from grpo_core.run import layout


def local_trainer_command(config_path: Path | str, num_ranks: int, server_urls: Sequence[str] = ()) -> list[str]:
    """The trainer's command on one host: ``python -m grpo_core.train.launch --nproc-per-node N -m grpo_core.train
    --config FILE [--server-url URL ...]`` (torchrun with its stores on loopback only). The one launch of the trainer
    on one host: the flow's (:func:`trainer_command` with ``train.nnodes`` 1), the tests'
    (``tests/support/trainer_helpers.torchrun``) and the trainer benchmark's (``benchmarks/trainer/ranks.py``).

    Args:
        config_path: the trainer's config file (YAML, or a sub-config's JSON).
        num_ranks: ranks on this host (``--nproc-per-node``).
        server_urls: generation servers the trainer syncs (``--server-url``); none = those its config names.

    Returns:
        The command, ``sys.executable`` first.
    """
    launch = [sys.executable, "-m", "grpo_core.train.launch", "--nproc-per-node", str(num_ranks)]
    return launch + _trainer_args(config_path, server_urls)


def _trainer_args(config_path: Path | str, server_urls: Sequence[str]) -> list[str]:
    """What torchrun runs on each rank: ``-m grpo_core.train --config FILE [--server-url URL ...]``."""
    return ["-m", "grpo_core.train", "--config", str(config_path)] + [
        arg for url in server_urls for arg in ("--server-url", url)
    ]


def trainer_command(cfg: RunConfig, config_path: Path, server_urls: list[str], node_rank: int = 0) -> list[str]:
    """The torchrun command of trainer host ``node_rank`` (the flow runs node 0; with ``train.nnodes`` > 1 every
    other trainer host runs this command with its own ``node_rank`` and a copy of ``config_path``).

    One host: ``grpo_core.train.launch`` (torchrun with its stores on loopback only). Several: torchrun's static
    rendezvous at ``train.rdzv_endpoint`` (node 0 hosts the store and holds global rank 0, the rank that pulls
    samples, syncs the servers and writes checkpoints); that store must be reachable from the other trainer hosts.

    Raises:
        ValueError: ``node_rank`` outside ``0 .. train.nnodes - 1``.
    """
    tc = cfg.train
    if not 0 <= node_rank < tc.nnodes:
        raise ValueError(
            f"node_rank={node_rank} is not a trainer host of train.nnodes={tc.nnodes} (0 to "
            f"{tc.nnodes - 1}); raise train.nnodes to add a host"
        )
    if tc.nnodes == 1:
        return local_trainer_command(config_path, tc.num_ranks, server_urls)
    assert tc.rdzv_endpoint is not None  # the config refuses train.nnodes > 1 without it
    host, _, port = tc.rdzv_endpoint.rpartition(":")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(tc.num_ranks),
        "--nnodes",
        str(tc.nnodes),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        host or tc.rdzv_endpoint,
        "--master-port",
        port or "29400",
        "--rdzv-conf",
        f"timeout={tc.rdzv_timeout_s}",
    ]
    return cmd + _trainer_args(config_path, server_urls)


def run_slots(config: RunConfig) -> int:
    """Slots of ``flow.concurrency_limit`` a run holds: ``flow.concurrency_slots``, else the GPUs it uses (the
    servers' and the trainer's, counted once; 1 for a run on CPU)."""
    if config.flow.concurrency_slots is not None:
        return config.flow.concurrency_slots
    if not config.server.starts_here():  # the servers run elsewhere: only the trainer's ranks here
        return config.train.num_ranks
    from grpo_core.serving.launch import choose_backend, replica_gpus

    if choose_backend(config) != "vllm":
        return 1
    servers = {g for replica in range(config.server.num_replicas) for g in replica_gpus(config, replica)}
    ranks = config.train.gpu_ids[: config.train.num_ranks] if config.train.gpu_ids else range(config.train.num_ranks)
    return len(servers | set(ranks))


#: Seconds the flow waits for the rollout process to serve (``rollout`` task), after the servers are healthy.
LOCATION_TIMEOUT_S = 600.0


def compile_cache_env(cfg: RunConfig, on_gpu: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Where the trainer's ranks keep their compile caches between runs: ``TORCHINDUCTOR_CACHE_DIR`` (and
    ``TRITON_CACHE_DIR`` on a GPU) under ``<cache folder>/compile/`` (``model.cache_dir``, else
    ``GRPO_FLOW_CACHE_DIR``, else the user's cache folder), so a second run of the same shapes loads its kernels
    instead of compiling them. A variable the user set (in ``environ``, default this process's) is kept."""
    import os

    seen: Mapping[str, str] = os.environ if environ is None else environ
    root = cfg.model.resolved_cache_dir() / "compile"
    want = {"TORCHINDUCTOR_CACHE_DIR": root / "inductor"}
    if on_gpu:
        want["TRITON_CACHE_DIR"] = root / "triton"
    return {key: str(path) for key, path in want.items() if not seen.get(key)}


def trainer_launch(run_dir: str, log: Any) -> tuple[list[str], dict]:
    """Write the trainer's sub-config to the run folder and return its torchrun command and environment.

    The trainer starts before the servers are healthy (``grpo_core.run.startup``): its sub-config names
    ``train.inputs_path`` (``<run_dir>/trainer_inputs.json``), where the flow writes the servers' URLs and the rollout
    process's Arrow Flight location once both are up; it builds and compiles meanwhile. Its compile caches persist in
    the cache folder (:func:`compile_cache_env`).

    Args:
        run_dir: the run folder (:func:`grpo_core.run.prepare.prepare_run`).
        log: where the lines for the user go (with ``train.nnodes`` > 1: the command the other hosts run).

    Returns:
        ``(argv, env)``: the secrets travel in ``env`` (``GRPO_RUN_SECRETS``), never in the files or the argv.

    Raises:
        ConfigError: with ``train.nnodes`` > 1, ``train.rdzv_endpoint``'s host is not this host.
    """
    from grpo_core.run.prepare import run_child_env, run_config
    from grpo_core.run.startup import inputs_timeout_s
    from grpo_core.security.redact import secret_values, write_private

    root = Path(run_dir)
    cfg = run_config(run_dir)
    cfg.train.inputs_path = root / layout.TRAINER_INPUTS
    cfg.train.inputs_timeout_s = inputs_timeout_s(
        cfg.server.startup_timeout_s, cfg.server.start_retries, LOCATION_TIMEOUT_S
    )
    (root / layout.TRAINER_ERROR).unlink(missing_ok=True)
    config_path, sub = root / layout.TRAIN_CONFIG, cfg.trainer_process()  # the trainer reads only its sub-config
    write_private(config_path, sub.model_dump_json(indent=1))  # secrets redacted; they travel in the environment
    cmd = trainer_command(cfg, config_path, [])  # rank 0 reads the servers' URLs from train.inputs_path
    if cfg.train.nnodes > 1:  # torchrun says nothing while it waits for the other hosts
        from grpo_core.run.preflight import check_rendezvous_host

        check_rendezvous_host(cfg)
        log.info(
            "trainer host 0 of %d: waiting up to %d s (train.rdzv_timeout_s) at %s for trainer hosts 1..%d; on "
            "each run %s with its --node-rank and a copy of %s (docs/across-hosts.md)",
            cfg.train.nnodes,
            cfg.train.rdzv_timeout_s,
            cfg.train.rdzv_endpoint,
            cfg.train.nnodes - 1,
            " ".join(trainer_command(cfg, Path(layout.TRAIN_CONFIG), [], node_rank=1)[1:]),
            config_path,
        )
    env = {**run_child_env(run_dir, secret_values(sub)), **compile_cache_env(cfg, on_gpu=cfg.train.device != "cpu")}
    if cfg.train.gpu_ids is not None:  # e.g. vLLM on GPU 0, the trainer on GPU 1 (NCCL weight transfer)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.train.gpu_ids[: cfg.train.num_ranks]))
    return cmd, env
