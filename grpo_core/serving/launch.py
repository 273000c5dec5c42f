"""Provisioning of generation servers: ``vllm serve`` command lines, launch, health, checks, teardown.

``provision(config)`` starts ``server.num_replicas`` replicas, each on its GPUs (several may share one)
(``CUDA_VISIBLE_DEVICES``), in its own process group, logging to a file under
``server.log_dir``; waits for ``/health``; checks each running server against the
training config; and returns handles whose ``stop()`` sends SIGTERM, then SIGKILL.
When ``server.backend`` is ``auto`` and vLLM is not importable or no CUDA device is
visible, the same call starts the embedded server (``python -m grpo_core.serving.embedded``)
instead, and says so in the log.

vLLM flags and environment (seed manual, "vLLM server" and LoRA sections; vLLM 0.25.1 on the
H200, ``shared/vllm-h200/README.md``): ``VLLM_SERVER_DEV_MODE=1`` with
``--weight-transfer-config`` exposes the weight-sync and pause endpoints;
``--logprobs-mode processed_logprobs`` returns the sampler's log-probs; ``--generation-config vllm``
keeps the model's ``generation_config.json`` from changing sampling fields (requests send every
field anyway, and ``check_server`` verifies what the server samples); the IPC weight-transfer
backend needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickled CUDA IPC handles); LoRA needs
``--enable-lora``, ``--max-lora-rank`` from vLLM's allowed set (>= r), ``--max-loras`` >=
max_staleness + 2 and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; top-k/top-p/min-p need
``--return-sampling-mask --enable-scale-out`` (vLLM >= 0.28, older servers reject them). Replicas that share a
GPU get ``--kv-cache-memory-bytes`` computed from the model's shape (:func:`kv_cache_memory_bytes`) and start
together; four engines on one GPU trained 2x the tokens per second of one (docs/benchmarks.md, "Engines per GPU").

Every replica requires a key of the run (``grpo_core.security.auth``) on every route but ``/health``: its
control key (``GRPO_CONTROL_KEY``, derived from the run's token; the only key it is given, in its environment) on
every route, the inference key derived from that on the generation routes only; vLLM through ``--middleware
grpo_core.serving.guard.RunGuardMiddleware`` (its own ``--api-key`` check covers ``/v1/*`` only and takes one key,
so it is left off), the embedded server through the same middleware. ``wait_healthy`` accepts a
replica only when it reports its launch's nonce, so a run never adopts another server on its port.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from grpo_core.config import VLLM_LORA_RANKS, RunConfig
from grpo_core.errors import ConfigError, PortInUseError, ServerStartError, ServingError
from grpo_core.run import lifeline
from grpo_core.run.children import free_port, log_tail, start_child, stop_child
from grpo_core.run.layout import replica_log, replica_port_file
from grpo_core.security.auth import (
    CONTROL_KEY_ENV,
    NONCE_ENV,
    ROLE_CONTROL,
    check_port_free,
    derive_key,
    ensure_run_token,
    identity_problem,
    new_challenge,
    without_keys,
)
from grpo_core.security.redact import redact_argv, reveal
from grpo_core.serving.guard import ADAPTER_DIR_ENV, MAX_PAUSE_ENV, WEIGHTS_DIR_ENV
from grpo_core.serving.protocol import FENCE_HEADER, HEALTH_PATH, IDENTITY_PATH
from grpo_core.serving.sampling_defaults import sampling_problems

logger = logging.getLogger(__name__)

GUARD_MIDDLEWARE = "grpo_core.serving.guard.RunGuardMiddleware"


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one replica: argv (a secret flag's value as ``SecretStr``, revealed only for the process
    itself), extra environment, where it will listen and log.

    Neither ``argv`` nor ``env`` holds the run's token (``launch`` adds it to the child's environment only),
    so a spec may be logged.
    """

    argv: list
    env: dict[str, str]
    backend: str
    replica: int
    host: str
    port: int
    log_path: Path
    port_file: Path | None = None
    nonce: str = ""
    """This launch's nonce (``GRPO_RUN_NONCE``): the server reports it, so ``wait_healthy`` accepts only it."""
    tls: bool = False
    """Whether it serves HTTPS (the run's ``tls`` section): its URL is ``https://``."""
    ca_file: str | None = None
    """PEM CA its certificate is verified against (``tls.ca_file``); None = the system's CAs."""


@dataclass
class ServerHandle:
    """A launched replica. ``url`` is known once healthy (the embedded server may pick its port)."""

    spec: LaunchSpec
    process: subprocess.Popen
    url: str = ""
    _log: object = field(default=None, repr=False)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the replica and every process it started (:func:`grpo_core.run.children.stop_child`: SIGTERM, then
        SIGKILL after ``timeout_s`` seconds), then close its log."""
        stop_child(self.process, timeout_s, name=f"{self.spec.backend} replica {self.spec.replica}")
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]


def max_lora_rank_for(rank: int) -> int:
    """Smallest rank in vLLM's allowed ``--max-lora-rank`` set that is >= ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(
        f"train.lora.r={rank} exceeds vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}; lower train.lora.r"
    )


def replica_gpus(config: RunConfig, replica: int) -> list[int]:
    """CUDA device indices of ``replica``: entries ``replica*tp .. (replica+1)*tp-1`` of ``server.gpu_ids`` (or
    of 0..N-1); a GPU listed for two replicas holds both."""
    server = config.server
    tp = server.tensor_parallel_size
    gpus = server.gpu_ids if server.gpu_ids is not None else list(range(server.num_replicas * tp))
    return list(gpus)[replica * tp : (replica + 1) * tp]


def shares_gpu(config: RunConfig, replica: int) -> bool:
    """Whether ``replica`` is on a GPU an earlier replica also uses and must start after that one is up: vLLM
    sizes its KV cache from the memory free while it profiles, which a neighbour's start would change. Not when
    the KV cache size is given (:func:`fixed_kv_cache`) or computed (:func:`kv_cache_memory_bytes`): then no
    replica profiles, and replicas sharing a GPU start together."""
    earlier = {g for r in range(replica) for g in replica_gpus(config, r)}
    if not earlier & set(replica_gpus(config, replica)):
        return False
    return not fixed_kv_cache(config) and kv_cache_memory_bytes(config) is None


def fixed_kv_cache(config: RunConfig) -> bool:
    """Whether ``server.extra_args`` gives vLLM its KV cache size (``--kv-cache-memory-bytes``)."""
    return any(str(a).split("=", 1)[0] == "--kv-cache-memory-bytes" for a in config.server.extra_args or [])


def rank_gpus(config: RunConfig) -> set[int]:
    """CUDA device indices of this host's trainer ranks (``train.gpu_ids``, else 0 .. num_ranks-1)."""
    train = config.train
    return set(train.gpu_ids[: train.num_ranks] if train.gpu_ids is not None else range(train.num_ranks))


def gpu_shared(config: RunConfig) -> bool:
    """Whether a replica's GPU holds another replica (``server.gpu_ids``) or, when the servers start beside the
    trainer on a GPU host, a trainer rank: vLLM's profiling of free memory would see their allocations as its own."""
    gpus = [g for r in range(config.server.num_replicas) for g in set(replica_gpus(config, r))]
    if len(gpus) != len(set(gpus)):
        return True
    beside_trainer = config.train.device != "cpu" and not config.server.deployment
    return beside_trainer and bool(set(gpus) & rank_gpus(config))


#: vLLM allocates its KV cache in blocks of this many tokens (``--block-size``'s default on CUDA).
VLLM_BLOCK_TOKENS = 16

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int | None:
    """Bytes of KV cache one token takes in vLLM, from the model's ``config.json`` (its ``text_config`` for a
    vision-language checkpoint): 2 (keys and values) x layers x KV heads x head size x the dtype's bytes
    (``dtype`` ``auto``: the checkpoint's own dtype, else 2).

    Returns:
        The bytes, or None where that formula is not vLLM's: a hybrid model (``layer_types`` with linear-attention
        or other non-attention layers keeps per-sequence states sized its own way), an MLA model
        (``kv_lora_rank``), or a config without the fields.
    """
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    if cfg.get("kv_lora_rank") or any(
        t not in ("full_attention", "sliding_attention") for t in cfg.get("layer_types") or []
    ):
        return None
    try:
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    if dtype == "auto":
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


#: GPU memory a vLLM replica needs beyond its weights and KV cache (CUDA context, CUDA graphs, activations), in bytes,
#: when the launch sizes its KV cache from ``gpu_memory_utilization`` (:func:`kv_cache_memory_bytes`).
REPLICA_HEADROOM_BYTES = 2 * 2**30


@functools.lru_cache(maxsize=64)
def gpu_memory_bytes(gpu: int) -> int | None:
    """Total memory of GPU ``gpu`` in bytes, from ``nvidia-smi`` (its index, as the replicas' ``server.gpu_ids``);
    None where ``nvidia-smi`` is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", str(gpu)],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return int(float(out.strip().splitlines()[0])) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _weights_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def kv_cache_memory_bytes(config: RunConfig) -> int | None:
    """The ``--kv-cache-memory-bytes`` each vLLM replica is given: room for ``server.kv_cache_size_tokens`` tokens
    (None = ``max_num_seqs * max_model_len``, every sequence at full length), rounded up to whole blocks of
    :data:`VLLM_BLOCK_TOKENS`, at :func:`kv_bytes_per_token`. It is computed when ``kv_cache_size_tokens`` is set or
    a GPU is shared (:func:`gpu_shared`: replicas then start together, each with its share, instead of one after
    another, and none profiles free memory while the trainer, started beside them, loads and compiles); None when
    neither holds, when ``server.extra_args`` gives the size itself, or when the model's KV size per token is not
    known (a hybrid: vLLM sizes it from ``gpu_memory_utilization``, and replicas sharing a GPU start in turn).

    With ``kv_cache_size_tokens`` unset, the size is also held to the replica's share of its GPU:
    ``gpu_memory_utilization`` x the smallest of its GPUs (:func:`gpu_memory_bytes`; not capped where unknown) less
    its weights and :data:`REPLICA_HEADROOM_BYTES`. Under tensor parallelism every figure is per GPU (vLLM's size is
    per GPU; the KV heads and weights are split).

    Raises:
        ConfigError: that share cannot hold one sequence of ``server.max_model_len`` tokens (names the fields).
    """
    from grpo_core.models import resolve_model_dir

    server = config.server
    if fixed_kv_cache(config) or (server.kv_cache_size_tokens is None and not gpu_shared(config)):
        return None
    model_dir = resolve_model_dir(config.model)
    per_token = kv_bytes_per_token(model_dir, config.model.dtype)
    if per_token is None:
        return None
    per_token = -(-per_token // server.tensor_parallel_size)  # vLLM's size is per GPU: TP splits the KV heads
    tokens = server.kv_cache_size_tokens or server.max_num_seqs * server.max_model_len
    blocks = -(-tokens // VLLM_BLOCK_TOKENS)
    wanted = blocks * VLLM_BLOCK_TOKENS * per_token
    if server.kv_cache_size_tokens is not None:
        return wanted
    totals = [gpu_memory_bytes(g) for r in range(server.num_replicas) for g in replica_gpus(config, r)]
    if not totals or any(t is None for t in totals):
        return wanted
    share = int(server.gpu_memory_utilization * min(t for t in totals if t is not None))
    budget = share - _weights_bytes(model_dir) // server.tensor_parallel_size - REPLICA_HEADROOM_BYTES
    if budget < server.max_model_len * per_token:
        raise ConfigError(
            f"replicas sharing a GPU: server.gpu_memory_utilization={server.gpu_memory_utilization} of it "
            f"({share / 2**30:.1f} GiB) leaves no room for the KV cache of one sequence of server.max_model_len="
            f"{server.max_model_len} tokens beside the model's weights; raise gpu_memory_utilization, or set "
            "server.kv_cache_size_tokens"
        )
    if wanted > budget:
        logger.warning(
            "the KV cache of every sequence at full length (%d tokens, %.1f GiB a GPU) exceeds a replica's share of "
            "its GPU (server.gpu_memory_utilization): each replica gets %.1f GiB (%d tokens); vLLM preempts beyond it",
            tokens,
            wanted / 2**30,
            budget / 2**30,
            budget // per_token,
        )
        return budget // (VLLM_BLOCK_TOKENS * per_token) * VLLM_BLOCK_TOKENS * per_token
    return wanted


def vllm_available() -> bool:
    """Whether ``vllm`` is importable and a CUDA device is visible."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def choose_backend(config: RunConfig) -> str:
    """``vllm`` or ``embedded`` for ``server.backend`` (``auto`` falls back to embedded, logged).

    Raises:
        ConfigError: ``server.backend`` is ``vllm`` but vLLM is not installed (no retry could fix that).
    """
    if config.server.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "server.backend is 'vllm' and this host starts the replicas (no server.urls or "
            "server.deployment), but vllm is not installed here: run it on a GPU host with vLLM "
            "(pip install vllm), point server.urls / server.deployment at GPU hosts that serve the "
            "replicas, or set server.backend to 'auto' or 'embedded' (CPU)"
        )
    if config.server.backend != "auto":
        return config.server.backend
    if vllm_available():
        return "vllm"
    logger.warning(
        "vLLM is not importable or no CUDA device is visible: starting the EMBEDDED server "
        "(grpo_core.serving.embedded, transformers) instead of vLLM"
    )
    return "embedded"


#: ``VLLM_LOG_STATS_INTERVAL`` when ``server.log_engine_stats`` is off: a day between vLLM's stats lines (0 or less
#: means vLLM's default of 10 s, so "never" is written as a long interval).
ENGINE_STATS_QUIET_S = 86_400


def vllm_command(config: RunConfig, replica: int = 0, port: int | None = None) -> LaunchSpec:
    """The ``vllm serve`` command line and environment of one replica.

    Args:
        config: the run config (``model``, ``server``, ``rollout``).
        replica: replica index; it gets GPUs ``replica_gpus(config, replica)``.
        port: port to listen on; default ``server.port + replica``.

    Raises:
        ConfigError: ``server.extra_args`` carries a vLLM flag this worker's allow-list does not admit
            (``grpo_core.security.allowlist.check_vllm_args``).
    """
    from grpo_core.models import resolve_model_dir
    from grpo_core.security.allowlist import check_vllm_args

    server, rollout = config.server, config.rollout
    if port is None:
        port = server.port + replica if server.port else free_port(server.host)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(resolve_model_dir(config.model)),
        "--host",
        server.host,
        "--port",
        str(port),
        "--served-model-name",
        config.served_model_name(),
        "--max-model-len",
        str(server.max_model_len),
        "--dtype",
        config.model.dtype,
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        str(server.max_logprobs),
        "--generation-config",
        "vllm",
        "--max-num-seqs",
        str(server.max_num_seqs),
        "--gpu-memory-utilization",
        str(server.gpu_memory_utilization),
        "--api-server-count",
        str(server.api_server_count),
    ]
    # Our guard (bearer token on every route but /health, nonce, pause limit, adapter folder): vLLM's own
    # --api-key check covers /v1/* only, not the dev-mode routes (/pause, /update_weights, ...).
    argv += ["--middleware", GUARD_MIDDLEWARE]
    # Keep idle connections 60 s (vLLM's default is 5 s, the same as httpx's pool expiry: a request on a
    # connection vLLM was closing failed with ReadError); the client expires them after 2 s anyway.
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, replica_gpus(config, replica))),
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60",
        **guard_env(config),
    }
    if not server.log_engine_stats and not os.environ.get("VLLM_LOG_STATS_INTERVAL"):
        env["VLLM_LOG_STATS_INTERVAL"] = str(ENGINE_STATS_QUIET_S)  # no stats line; /metrics still counts
    if not os.environ.get("VLLM_CACHE_ROOT"):  # vLLM's compile cache, kept between runs (a value the user set wins)
        env["VLLM_CACHE_ROOT"] = str(config.model.resolved_cache_dir() / "vllm")
    if server.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(server.tensor_parallel_size)]
    if server.enforce_eager:
        argv.append("--enforce-eager")
    if server.weight_transfer_backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": server.weight_transfer_backend})]
        if server.weight_transfer_backend == "ipc":  # the IPC engine posts pickled CUDA IPC handles
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if config.serves_lora():
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(max_lora_rank_for(config.train.lora.r)),
            "--max-loras",
            str(config.max_loras()),
        ]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if rollout.uses_candidate_filter():
        argv += ["--return-sampling-mask", "--enable-scale-out"]
    kv_bytes = kv_cache_memory_bytes(config)
    if kv_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
    # this worker's allow-list: a servers' flow run takes its config as a parameter too
    check_vllm_args(server.extra_args)
    extra, secret_env = secret_flags_to_env(server.extra_args)
    argv += extra
    env.update(secret_env)
    log_path = server.log_dir / replica_log("vllm", replica)
    argv += tls_flags(config)
    return LaunchSpec(
        argv,
        env,
        "vllm",
        replica,
        server.host,
        port,
        log_path,
        nonce=env[NONCE_ENV],
        tls=config.tls.enabled,
        ca_file=config.tls.client_ca(),
    )


def tls_flags(config: RunConfig) -> list[str]:
    """``--ssl-certfile``/``--ssl-keyfile`` of the run's ``tls`` section (``vllm serve``'s flags, which the embedded
    server and the router take too); empty when TLS is off."""
    tls = config.tls
    if tls.cert_file is None or tls.key_file is None:
        return []
    return ["--ssl-certfile", str(tls.cert_file), "--ssl-keyfile", str(tls.key_file)]


#: Secret ``vllm serve`` flags vLLM also reads from the environment: passed that way, they stay out of the process
#: list (``ps``) and out of the ``non-default args`` line vLLM logs at start.
SECRET_FLAG_ENV = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}


def secret_flags_to_env(args: list) -> tuple[list, dict[str, str]]:
    """``server.extra_args`` split into the argv part and the environment of :data:`SECRET_FLAG_ENV` flags.

    Returns:
        ``(argv, env)``: argv keeps other secret flags' values as ``SecretStr`` (revealed at launch, shown
        redacted in logs); env holds the moved values in plain text.
    """
    from pydantic import SecretStr

    argv, env, i = [], {}, 0
    while i < len(args):
        arg = args[i]
        value = args[i + 1] if i + 1 < len(args) else None
        if isinstance(arg, str) and arg in SECRET_FLAG_ENV and isinstance(value, SecretStr):
            env[SECRET_FLAG_ENV[arg]] = value.get_secret_value()
            i += 2
            continue
        argv.append(arg)
        i += 1
    return argv, env


def embedded_command(config: RunConfig, replica: int = 0) -> LaunchSpec:
    """The ``python -m grpo_core.serving.embedded`` command line of one replica."""
    server, model = config.server, config.model
    port = server.port + replica if server.port else 0
    port_file = server.log_dir / replica_port_file("embedded", replica)
    argv = [
        sys.executable,
        "-m",
        "grpo_core.serving.embedded",
        "--model",
        model.name,
        "--dtype",
        model.dtype,
        "--model-seed",
        str(model.seed),
        "--host",
        server.host,
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        "--served-model-name",
        config.served_model_name(),
        "--max-model-len",
        str(server.max_model_len),
        "--max-num-seqs",
        str(server.max_num_seqs),
        "--max-logprobs",
        str(server.max_logprobs),
        "--max-loras",
        str(config.max_loras()),
        "--max-lora-rank",
        str(max_lora_rank_for(config.train.lora.r)),
        "--num-threads",
        str(server.embedded_num_threads),
        "--generation-config",
        "vllm",
        "--max-pause-s",
        str(server.max_pause_s),
        "--adapter-dir",
        config.served_adapter_root(),
        "--weights-dir",
        str(config.weights_dir()),
    ]
    if model.cache_dir is not None:
        argv += ["--cache-dir", str(model.cache_dir)]
    if model.revision is not None:
        argv += ["--revision", model.revision]
    if server.kv_cache_size_tokens:
        argv += ["--kv-cache-size-tokens", str(server.kv_cache_size_tokens)]
    env = {"HF_HUB_OFFLINE": "1", **guard_env(config)}
    if server.gpu_ids is not None or server.num_replicas > 1:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, replica_gpus(config, replica)))
    log_path = server.log_dir / replica_log("embedded", replica)
    argv += tls_flags(config)
    return LaunchSpec(
        argv,
        env,
        "embedded",
        replica,
        server.host,
        port,
        log_path,
        port_file,
        nonce=env[NONCE_ENV],
        tls=config.tls.enabled,
        ca_file=config.tls.client_ca(),
    )


def guard_env(config: RunConfig) -> dict[str, str]:
    """Environment of one launch read by ``grpo_core.serving.guard``: a fresh nonce, the pause limit and the run's
    adapter and weights folders (the token is added by ``launch``, never stored in a spec)."""
    return {
        NONCE_ENV: secrets.token_hex(16),
        MAX_PAUSE_ENV: str(config.server.max_pause_s),
        ADAPTER_DIR_ENV: config.served_adapter_root(),
        WEIGHTS_DIR_ENV: str(config.weights_dir().resolve()),
    }


def launch(spec: LaunchSpec, token: str) -> ServerHandle:
    """Start one replica in its own process group, stdout/stderr to ``spec.log_path``; it dies with this process
    (``grpo_core.run.lifeline``: the embedded server watches it; vLLM dies with the launching thread).

    Args:
        spec: what to start.
        token: the server's control key (``grpo_core.security.auth``: derived from the run's token, or
            ``server.api_key``), given to the child in its environment only (``GRPO_CONTROL_KEY``; its guard derives
            the inference key from it), never on its command line. The child gets neither the run's token nor
            another role's key (nor ``VLLM_API_KEY``: vLLM's own ``/v1`` check takes one key, the guard checks
            both roles on every route).
    """
    try:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if spec.port_file is not None:
            spec.port_file.unlink(missing_ok=True)
        log = open(spec.log_path, "ab")  # noqa: SIM115 - closed by ServerHandle.stop
    except OSError as exc:
        raise ServingError(
            f"{spec.backend} replica {spec.replica}: cannot write its log {spec.log_path} "
            f"(server.log_dir): {exc.strerror or exc}"
        ) from None
    logger.info(
        "starting %s replica %d: %s (log %s)", spec.backend, spec.replica, redact_argv(spec.argv), spec.log_path
    )
    # The control key wins over a user's --api-key (whose value moved to VLLM_API_KEY in spec.env): the guard
    # checks it on every route, the inference key on the generation routes.
    env = {**without_keys(os.environ), **spec.env, CONTROL_KEY_ENV: token, **lifeline.owner_env()}
    env.pop("VLLM_API_KEY", None)
    # The embedded server watches its owner (grpo_core.run.lifeline); vLLM is not ours: it dies with this thread.
    process = start_child(
        reveal(spec.argv),
        stdout=log,
        env=env,
        preexec_fn=lifeline.die_with_parent if spec.backend == "vllm" else None,
    )
    return ServerHandle(spec, process, _log=log)


def wait_healthy(handle: ServerHandle, timeout_s: float, token: str, fenced_ok: bool = False) -> str:
    """Wait until the replica we started answers; returns its base URL.

    Accepted only when our process is alive, ``/health`` answers 200 (or, with ``fenced_ok``, the guard's fence
    503: a replica restarted on a port its clients know, which a request for a later policy version reached before
    this poll, is loaded and only out of routing until the next weight sync; :func:`relaunch`), and its answer to
    a fresh challenge on the unauthenticated ``GET /grpo/identity`` (``grpo_core.security.auth.identity_problem``) holds
    this launch's nonce and an HMAC of the challenge under ``token``: a server of another run (other token), of
    an earlier launch (other nonce) or without the route on the same port is never adopted, never sent the token,
    and no weights are ever pushed to it.

    Args:
        handle: the launched replica.
        timeout_s: seconds to wait (``server.startup_timeout_s``).
        token: the run's bearer token.
        fenced_ok: adopt a fenced replica (no generation request follows: a start that checks the server with
            one, :func:`provision`, waits for the fence to drop instead).

    Raises:
        PortInUseError: another server answers on the replica's port (the replica is stopped).
        ServerStartError: the process exited, or ``timeout_s`` passed (the replica is stopped);
            the message holds the log's tail.
    """
    from grpo_core.serving.limits import client_ssl_context

    spec, deadline = handle.spec, time.monotonic() + timeout_s
    verify = client_ssl_context(spec.ca_file)  # https only: the certificate must chain to tls.ca_file
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise ServerStartError(
                f"{spec.backend} replica {spec.replica} exited with code {handle.process.returncode}; "
                f"log {spec.log_path}:\n{log_tail(spec.log_path)}"
            )
        port = spec.port
        if spec.port_file is not None and spec.port_file.is_file() and spec.port_file.read_text().strip():
            port = int(spec.port_file.read_text())
        if port:
            # a TLS certificate names hosts, not the wildcard bound: a replica on every interface is checked on
            # loopback (the certificate names 127.0.0.1 too; others reach it by its advertised name)
            host = "127.0.0.1" if spec.tls and spec.host in ("0.0.0.0", "") else spec.host
            url = f"{'https' if spec.tls else 'http'}://{host}:{port}"
            try:
                health = httpx.get(url + HEALTH_PATH, timeout=2.0, verify=verify)
                # 503 from the guard's fence: loaded, only out of routing (a restarted replica a request for a
                # later policy version reached first); its nonce still tells whether it is ours
                healthy = health.status_code == 200 or (
                    fenced_ok and health.status_code == 503 and health.headers.get(FENCE_HEADER) == "up"
                )
                challenge = new_challenge()
                answer = (
                    httpx.get(url + IDENTITY_PATH, params={"challenge": challenge}, timeout=5.0, verify=verify)
                    if healthy
                    else None
                )
            except httpx.HTTPError:
                answer = None
            if answer is not None:
                problem = identity_problem(answer.status_code, _json(answer), token, spec.nonce, challenge)
                if problem is None:
                    handle.url = url
                    return url
                handle.stop()
                raise PortInUseError(
                    f"{spec.backend} replica {spec.replica}: {url} is answered by a server this "
                    f"launch did not start ({problem}); the run will not use it. Stop that server "
                    "or set server.port to a free port (0 = pick one)"
                )
        time.sleep(0.5)
    handle.stop()
    raise ServerStartError(
        f"{spec.backend} replica {spec.replica} not healthy after {timeout_s:.0f} s "
        f"(server.startup_timeout_s); log {spec.log_path}:\n{log_tail(spec.log_path)}"
    )


def _json(answer: httpx.Response) -> object:
    """An answer's JSON body, or None when it is not JSON."""
    try:
        return answer.json()
    except ValueError:
        return None


async def check_server(url: str, config: RunConfig, token: str | None = None) -> None:
    """Check a running server against the config; raise naming the flags to restart it with.

    Checks ``/v1/models`` (served name, ``max_model_len`` >= server.max_model_len), that the server
    samples what ``rollout`` says (its default sampling parameters and a probe,
    ``grpo_core.serving.sampling_defaults.sampling_problems``) and, with LoRA, the adapter slots and
    rank reported by ``/server_info`` (vLLM dev mode).

    Raises:
        ServingError: a mismatch; the message names the ``vllm serve`` flags to restart with.
    """
    from grpo_core.serving.client import GenerationClient

    problems: list[str] = []
    async with GenerationClient(
        url, max_connections=2, timeout_s=30.0, max_retries=2, api_key=token, ca_file=config.tls.client_ca()
    ) as client:
        cards = {card["id"]: card for card in await client.models()}
        name = config.served_model_name()
        card = cards.get(name)
        if card is None:
            problems.append(f"it serves {sorted(cards)} but the config asks for {name!r}: --served-model-name {name}")
        elif (card.get("max_model_len") or 0) < config.server.max_model_len:
            problems.append(
                f"max_model_len is {card.get('max_model_len')}: --max-model-len {config.server.max_model_len}"
            )
        if card is not None:
            problems += await sampling_problems(
                client, name, config.rollout, _model_dir(config), config.server.max_logprobs
            )
        if config.serves_lora():
            problems += _lora_problems(json.dumps(await _server_info(client)), config)
    if problems:
        raise ServingError(f"the server at {url} does not match the config; restart it with " + "; ".join(problems))


def _model_dir(config: RunConfig) -> Path | None:
    from grpo_core.models import resolve_model_dir

    try:
        return resolve_model_dir(config.model)
    except ConfigError:  # a remote server's model that is not on this host
        return None


async def _server_info(client: object) -> dict:
    try:
        return await client.server_info()  # type: ignore[attr-defined]
    except ServingError:
        return {}


def _lora_problems(info_text: str, config: RunConfig) -> list[str]:
    want_rank, want_loras = max_lora_rank_for(config.train.lora.r), config.max_loras()
    flags = f"--enable-lora --max-lora-rank {want_rank} --max-loras {want_loras} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
    rank = re.search(r"max_lora_rank\W+(\d+)", info_text)
    loras = re.search(r"max_loras\W+(\d+)", info_text)
    if rank is None or loras is None:
        logger.warning("could not read LoRA slots/rank from /server_info; if LoRA sync fails, restart with %s", flags)
        return []
    if int(rank.group(1)) < want_rank or int(loras.group(1)) < want_loras:
        return [f"LoRA rank {rank.group(1)} / slots {loras.group(1)} are too small: {flags}"]
    return []


def check_gpu_layout(config: RunConfig) -> None:
    """Check where vLLM and the trainer sit against the full-weight transfer backend.

    NCCL refuses two ranks on one device, so ``nccl`` needs the trainer's GPUs disjoint from
    every replica's; vLLM's IPC engine looks up the handle of its own GPU, so ``ipc`` needs each
    replica's GPUs among the trainer's. LoRA runs sync adapters through files and need neither.

    Raises:
        ConfigError: the layout cannot work; the message names the fields and the fix.
    """
    server, train = config.server, config.train
    if train.lora.enabled or server.weight_transfer_backend is None or server.deployment:
        return  # (server.deployment: the replicas' flow run may run on another host, whose GPUs are not the trainer's)
    trainer = rank_gpus(config)
    replicas = {g for r in range(server.num_replicas) for g in replica_gpus(config, r)}
    if server.weight_transfer_backend == "nccl" and trainer & replicas:
        raise ConfigError(
            f"server.weight_transfer_backend 'nccl' needs the trainer and vLLM on different GPUs, but "
            f"train.gpu_ids {sorted(trainer)} and server.gpu_ids {sorted(replicas)} share "
            f"{sorted(trainer & replicas)}: use 'ipc' to share one GPU, or disjoint gpu_ids"
        )
    if server.weight_transfer_backend == "ipc" and not replicas <= trainer:
        raise ConfigError(
            f"server.weight_transfer_backend 'ipc' needs every vLLM GPU among the trainer's, but "
            f"server.gpu_ids {sorted(replicas)} are not all in train.gpu_ids {sorted(trainer)}: use "
            "'nccl' for separate GPUs, or put vLLM on the trainer's GPU"
        )


def provision(config: RunConfig, token: str | None = None, control_key: str | None = None) -> list[ServerHandle]:
    """Start, health-check and verify ``server.num_replicas`` replicas; returns their handles.

    On any failure the replicas already started are stopped before the error propagates.

    Args:
        config: the run config.
        token: the run's bearer token; default ``GRPO_RUN_TOKEN``, generated (and set in this process's
            environment, for the clients and children of this process) when missing. The replicas get the control
            key derived from it (``grpo_core.security.auth.derive_key``), never the token; they take
            ``server.api_key`` (else ``$GRPO_SERVER_API_KEY``) as their control key instead when set, as that is
            what every client of the run sends (``ServerConfig.resolved_api_key``; a key left in the shell from a
            run on external servers would otherwise get every request refused with 401).
        control_key: the control key itself, when this process holds no run token (the servers' flow run of
            ``server.deployment``); ``server.api_key`` still wins.

    Raises:
        ConfigError: vLLM's GPUs and the trainer's do not suit the weight transfer (``check_gpu_layout``).
        PortInUseError: a fixed port (``server.port`` + replica) is taken, or another server answers there.
    """
    token = config.server.resolved_api_key() or control_key or derive_key(token or ensure_run_token(), ROLE_CONTROL)
    backend = choose_backend(config)
    if backend == "vllm":
        check_gpu_layout(config)
    specs = [
        vllm_command(config, i) if backend == "vllm" else embedded_command(config, i)
        for i in range(config.server.num_replicas)
    ]
    for spec in specs:
        if config.server.port:
            check_port_free(
                spec.host,
                spec.port,
                "server.port"
                if not spec.replica
                else f"server.port (replica {spec.replica} listens on server.port + {spec.replica})",
            )
    kv_bytes = kv_cache_memory_bytes(config) if backend == "vllm" else None
    if kv_bytes is not None:
        logger.info(
            "each vLLM replica gets a KV cache of %.2f GiB a GPU; replicas sharing a GPU start together",
            kv_bytes / 2**30,
        )
    handles: list[ServerHandle] = []
    ready: set[int] = set()
    try:
        # replicas on GPUs of their own start together; one sharing a GPU waits until the earlier ones are up
        for i, spec in enumerate(specs):
            if shares_gpu(config, i):
                _wait_all_healthy(handles, ready, config, token, backend)
            handles.append(launch(spec, token))
        _wait_all_healthy(handles, ready, config, token, backend)
    except BaseException:
        teardown(handles)
        raise
    return handles


def _wait_all_healthy(
    handles: list[ServerHandle], ready: set[int], config: RunConfig, token: str, backend: str
) -> None:
    """Wait until every handle not in ``ready`` (indices) is healthy and verified; adds them to ``ready``."""
    for i, handle in enumerate(handles):
        if i in ready:
            continue
        wait_healthy(handle, config.server.startup_timeout_s, token)
        asyncio.run(check_server(handle.url, config, token))
        ready.add(i)
        logger.info("%s replica %d healthy at %s", backend, handle.spec.replica, handle.url)


def relaunch(handle: ServerHandle, token: str) -> ServerHandle:
    """Start a replica whose process exited again, on the port it served (its URL stays valid, so a router that
    routed around it re-admits it once ``/health`` answers): the same argv with that port and a fresh nonce. Returns
    at once, with ``url`` already set; :func:`wait_healthy` (``fenced_ok=True``) tells when it serves.

    It comes back with the base weights: in a full-weight run its guard (:mod:`grpo_core.serving.guard`) refuses
    the first request tagged with a later policy version and fences itself (503 on ``/health`` and generation
    requests); the rollout reports it and the trainer syncs its current weights, which lowers the fence, so no
    token of the base weights is tagged with a later version. A LoRA run needs neither: the adapter versions it
    samples are loaded by the next sync.

    Call it from the thread that keeps the replicas (vLLM dies with the thread that launched it).

    Raises:
        ServingError: its log cannot be written (nothing started).
    """
    import dataclasses

    port = int(handle.url.rsplit(":", 1)[1])
    argv = list(handle.spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    nonce = secrets.token_hex(16)
    spec = dataclasses.replace(
        handle.spec, argv=argv, port=port, port_file=None, nonce=nonce, env={**handle.spec.env, NONCE_ENV: nonce}
    )
    handle.stop()  # closes its log file
    new = launch(spec, token)
    new.url = handle.url
    return new


def teardown(handles: list[ServerHandle]) -> None:
    """Stop every replica (SIGTERM, then SIGKILL)."""
    for handle in handles:
        handle.stop()
