"""The ``model`` and ``server`` sections: the policy model and the generation servers."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from grpo_core.config.base import (
    REMOVED_SERVER_FIELDS,
    _changed,
    _refuse_removed,
    _ServerKey,
    _Strict,
    _warn_unused,
    check_gpu_ids,
    default_cache_dir,
    url_port,
)
from grpo_core.errors import ConfigError
from grpo_core.security.redact import split_secret_flags


class ModelConfig(_Strict):
    """Which policy model to serve and train, and how to load it."""

    name: str = "smollm2-135m-instruct"
    """Registry name (``smollm2-135m-instruct``, ``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen3.5``,
    ``tiny-qwen3-moe``, ``random-qwen3-0.6b``), a local HF folder path, or a Hugging Face Hub id (``Qwen/Qwen3.5-2B``;
    downloaded into the Hub cache)."""
    revision: str | None = None
    """Hub ids only: branch, tag or commit to download (None = ``main``)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight/compute dtype; ``auto`` = float32 on CPU, bfloat16 on CUDA."""
    cache_dir: Path | None = None
    """Folder for converted/generated model folders; None = ``default_cache_dir()``."""
    seed: int = Field(default=0, ge=0)
    """Seed of the random initialisation of the ``tiny-*`` registry models."""

    def resolved_cache_dir(self) -> Path:
        """The cache folder actually used (``cache_dir`` or the default)."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()


#: Server settings that only the servers the flow starts read (ignored with ``server.urls``).
SERVER_LAUNCH_FIELDS = (
    "backend",
    "port",
    "tensor_parallel_size",
    "gpu_ids",
    "max_num_seqs",
    "kv_cache_size_tokens",
    "api_server_count",
    "gpu_memory_utilization",
    "enforce_eager",
    "log_engine_stats",
    "embedded_num_threads",
    "max_pause_s",
    "extra_args",
)


#: Server settings only the embedded server reads; only vLLM reads; only a servers' deployment reads.
EMBEDDED_ONLY_FIELDS = ("embedded_num_threads",)


VLLM_ONLY_FIELDS = (
    "tensor_parallel_size",
    "api_server_count",
    "gpu_memory_utilization",
    "enforce_eager",
    "log_engine_stats",
    "extra_args",
)


DEPLOYMENT_ONLY_FIELDS = ("advertise_host", "lifeline_timeout_s")


def check_server_urls(urls: list[str], field: str = "server.urls") -> list[str]:
    """The replicas' base URLs without trailing slashes, each a distinct server.

    Args:
        urls: ``http(s)://host[:port][/prefix]`` strings, one per replica.
        field: how the caller names them in errors (``server.urls``, the router's ``--url``).

    Raises:
        ValueError: a URL that is not an http(s) base URL (no host, a bad port, a query or fragment, the OpenAI path
            ``/v1`` that the client adds itself), or one replica listed twice (compared without case in the scheme
            and host, with default ports and trailing slashes dropped): requests and control calls would reach it
            twice (a LoRA load fanned out twice, its load counted twice).
    """
    seen: dict[tuple[str, str, int, str], str] = {}
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if (
            not re.fullmatch(r"https?://[^/\s?#]+(/\S*)?", url, re.IGNORECASE)
            or not parts.hostname
            or port == -1
            or parts.query
            or parts.fragment
            or "?" in url
            or "#" in url
        ):
            raise ValueError(f"{field}: {url!r} is not an http(s) base URL; write e.g. 'http://gpu-1:8000'")
        path = parts.path.rstrip("/")
        if path.lower().endswith("/v1"):
            base = url.rstrip("/")[:-3].rstrip("/")
            raise ValueError(
                f"{field}: {url!r} ends in /v1, which the client adds to every request; write the "
                f"server's base URL {base!r}"
            )
        if parts.username is not None or parts.password is not None:
            shown = url.replace(parts.netloc, parts.netloc.rsplit("@", 1)[1])
            raise ValueError(
                f"{field}: a URL of {shown!r} carries a user name or password, which would be saved "
                "with the run's config; give the servers' bearer token as server.api_key (a secret) "
                "or GRPO_SERVER_API_KEY instead"
            )
        scheme = parts.scheme.lower()
        key = (scheme, parts.hostname.lower(), url_port(parts), path)
        if key in seen:
            raise ValueError(f"{field} lists one server twice ({seen[key]!r} and {url!r}): give each replica once")
        seen[key] = url
    return [u.rstrip("/") for u in urls]


class ServerConfig(_ServerKey):
    """The generation server(s): real vLLM on GPUs, or the embedded server."""

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        return _refuse_removed(data, "server", REMOVED_SERVER_FIELDS)

    backend: Literal["auto", "vllm", "embedded"] = "auto"
    """``auto`` = vLLM when importable with a CUDA device, else the embedded server."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback unless the trainer runs on another host."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port of replica 0; replica i uses port + i. 0 = a free port chosen at start."""
    num_replicas: int = Field(default=1, ge=1)
    """Number of server replicas the flow (or ``deployment``) starts (data parallel), each on its own GPUs; with
    ``urls`` each URL is a replica (leave it unset; a value other than the number of URLs is refused)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per replica (vLLM ``--tensor-parallel-size``)."""
    gpu_ids: list[int] | None = None
    """CUDA device indices of the replicas, ``tensor_parallel_size`` consecutive entries per replica (replica i
    takes entries ``i*tp .. (i+1)*tp-1``); None = 0 .. num_replicas*tensor_parallel_size-1. A GPU listed again
    for another replica holds both (each takes ``gpu_memory_utilization`` of it, e.g. ``[0, 0]`` with 0.2; such
    replicas start together, each with the KV cache ``kv_cache_size_tokens`` sizes, or one after another for a
    hybrid model, whose KV cache vLLM sizes by profiling free memory). A shorter or longer list is refused."""
    max_model_len: int = Field(default=4096, ge=16)
    """Longest prompt + completion a request may hold, in tokens (``--max-model-len``)."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences decoded in one batch (``--max-num-seqs``)."""
    kv_cache_size_tokens: int | None = Field(default=None, ge=16)
    """KV-cache capacity of each replica in tokens. Embedded server: None = ``max_num_seqs * max_model_len``.
    vLLM: given, or None while replicas share a GPU, each replica gets ``--kv-cache-memory-bytes`` for this many
    tokens (None = ``max_num_seqs * max_model_len``, held to the replica's ``gpu_memory_utilization`` share of its
    GPU less its weights; bytes from the model's layers, KV heads and head size), so
    replicas sharing a GPU start together instead of one after another (vLLM otherwise sizes its cache from the
    memory free while it profiles); None with one replica per GPU = vLLM's own sizing from
    ``gpu_memory_utilization``. A hybrid model (linear-attention layers) is left to vLLM's sizing."""
    api_server_count: int = Field(default=1, ge=1)
    """vLLM API server processes (``--api-server-count``). Only 1 for servers the run starts: the run's guard
    (``grpo_core.serving.guard``) keeps a replica's fence and policy version in its process, and several API
    server processes would each hold their own (a sync's fence-lowering call reaches one of them). For more
    front-end capacity start more replicas (``num_replicas``)."""
    max_logprobs: int = Field(default=20, ge=0)
    """Most log-probs per token a request may ask for (``--max-logprobs``)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use (``--gpu-memory-utilization``)."""
    enforce_eager: bool = False
    """vLLM ``--enforce-eager`` (no CUDA graphs; faster start, slower decode)."""
    log_engine_stats: bool = False
    """vLLM's periodic stats line in each replica's log ("Engine 000: Avg prompt throughput ...", every
    ``VLLM_LOG_STATS_INTERVAL`` seconds, 10 by default). False = not logged (``VLLM_LOG_STATS_INTERVAL`` set to a
    day, unless the environment sets it): the counters behind it still run, since ``/metrics``, which the rollout
    reads for KV-cache use and running requests, needs them (``--disable-log-stats`` would empty it)."""
    weight_transfer_backend: Literal["nccl", "ipc"] | None = "nccl"
    """vLLM ``--weight-transfer-config`` backend for full-weight sync; None = no weight transfer."""
    max_loras: int | None = Field(default=None, ge=1)
    """Adapters resident at once (``--max-loras``) when the trainer trains a LoRA adapter (``train.lora.enabled``,
    which also turns on ``--enable-lora``, with ``--max-lora-rank`` from ``train.lora.r``); None =
    rollout.max_staleness + 2."""
    served_model_name: str | None = None
    """Name the base model is served under; None = model.name."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds to wait for ``/health`` after launching a replica."""
    start_retries: int = Field(default=1, ge=0)
    """Retries of the flow's ``provision_servers`` task after a replica exited during start-up or missed
    ``startup_timeout_s`` (config errors are never retried)."""
    embedded_num_threads: int = Field(default=0, ge=0)
    """Embedded server only: torch CPU threads per replica; 0 = torch's default (all cores)."""
    max_pause_s: float = Field(default=300.0, ge=0)
    """Seconds a server the run started stays paused (``POST /pause``) without a resume before it resumes
    itself and logs it; 0 = no limit. Longer than the slowest weight sync."""
    log_dir: Path = Path("runs/servers")
    """Folder for the replicas' log files."""
    extra_args: list[str | SecretStr] = Field(default_factory=list)
    """Extra ``vllm serve`` arguments, appended verbatim. The value of a flag ending in ``key``, ``token``,
    ``password`` or ``secret`` (``--api-key``, ``--hf-token``) is secret: shown as ``**********`` in logs, MLflow
    params and saved configs (``--api-key`` reaches vLLM as ``VLLM_API_KEY``, ``--hf-token`` as ``HF_TOKEN``)."""

    @field_validator("extra_args")
    @classmethod
    def _secret_flag_values(cls, args: list[str | SecretStr]) -> list[str | SecretStr]:
        return split_secret_flags(args)

    urls: list[str] = Field(default_factory=list)
    """External generation servers (``http://host:port``, one per replica) started elsewhere; when set the flow
    starts no server and routes over these (the trainer asks each server what it is). The launch settings
    (``SERVER_LAUNCH_FIELDS``: ``backend``, ``port``, ``gpu_ids``, ...) have no effect then and are warned about;
    ``num_replicas`` other than the number of URLs is refused."""
    api_key: SecretStr | None = None
    """Bearer token of external servers, sent as ``Authorization: Bearer`` on every request and control call;
    None = the ``GRPO_SERVER_API_KEY`` environment variable, else the run's control key (``GRPO_CONTROL_KEY``, or
    derived from ``GRPO_RUN_TOKEN``: the key the servers the flow starts check; they take this key as their control
    key instead when it, or the variable, is set). A secret: masked in saved configs, logs and MLflow."""
    route_imbalance: int = Field(default=8, ge=0)
    """Requests in flight a group's replica may hold beyond the least loaded one before the group's requests
    spill to the least loaded (prefix-affinity routing over several replicas)."""
    control_retry_s: float = Field(default=0.5, gt=0)
    """Seconds between retries of a control call (pause/resume, adapter load/unload, weight update) on a replica
    that failed it, e.g. while shared storage has not yet shown it the adapter files."""
    control_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a control call keeps retrying on a replica before the fan-out fails and the replicas that took
    it are rolled back."""
    deployment: str | None = None
    """Prefect deployment (``flow/deployment``) that starts the replicas in its own flow run on another work pool,
    e.g. ``grpo-servers/gpu`` (``grpo deploy`` registers it on ``work_pool``): the train flow runs it, waits up to
    ``startup_timeout_s`` for the replicas' URLs (an artifact of that flow run), routes over them and cancels the
    run when it ends, so GPU hosts run only Prefect workers. None = the flow starts the replicas itself (or uses
    ``urls``). The launch settings (``backend``, ``num_replicas``, ``port``, ...) apply on the server's host."""
    work_pool: str = "grpo-gpu"
    """Prefect work pool of the servers' deployment (``grpo deploy`` registers ``grpo-servers/gpu`` there and starts
    a process worker for it); on several hosts each GPU host runs ``prefect worker start --pool grpo-gpu``."""
    advertise_host: str | None = None
    """Host name in the URLs a servers' flow run publishes (``deployment``); None = ``host``, or this host's name
    when ``host`` binds every interface (``0.0.0.0``, ``::``). Must be reachable from the trainer's host."""
    lifeline_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a servers' flow run (``deployment``) keeps its replicas after the train flow run stopped beating
    (it beats every quarter of this; a train flow run that ends, fails or crashes is seen at the next beat)."""
    router_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the OpenAI-compatible router (``python -m grpo_core.serving.router``) the flow starts in front
    of the replicas for outside clients (evaluation, a single-endpoint trainer); 0 = a free port; None = none."""

    @model_validator(mode="after")
    def _check_unused_settings(self) -> ServerConfig:
        if self.urls and self.num_replicas not in (1, len(self.urls)):  # 1: the default (a saved config holds it)
            raise ConfigError(
                f"server.num_replicas ({self.num_replicas}) applies to servers the flow starts, but "
                f"server.urls lists {len(self.urls)} running server(s): with server.urls list every "
                "replica's URL and delete server.num_replicas"
            )
        if self.api_server_count > 1 and not self.urls:
            raise ConfigError(
                f"server.api_server_count ({self.api_server_count}) > 1: the run's guard keeps each "
                "replica's fence and policy version in its API server process, and several processes "
                "would disagree (a weight sync reaches one of them); set it to 1 and raise "
                "server.num_replicas for more front-end capacity"
            )
        _warn_unused({f"server.{name}": why for name, why in self.unused_settings().items()})
        return self

    def unused_settings(self) -> dict[str, str]:
        """Settings off their defaults that nothing reads with the rest of this section: field name -> why (launch
        settings with ``urls``, embedded-only ones on vLLM and vLLM-only ones on the embedded server,
        ``deployment``-only ones without it). A default is never reported, so a saved config (every field
        written) reports what its source did."""
        given, unused = _changed(self), {}
        if self.urls:
            why = "server.urls names servers started elsewhere; their own launch flags apply"
            unused.update({name: why for name in SERVER_LAUNCH_FIELDS if name in given})
        elif self.backend == "vllm":
            unused.update(
                {
                    name: "embedded server only; server.backend is 'vllm'"
                    for name in EMBEDDED_ONLY_FIELDS
                    if name in given
                }
            )
        elif self.backend == "embedded":
            unused.update(
                {name: "vLLM only; server.backend is 'embedded'" for name in VLLM_ONLY_FIELDS if name in given}
            )
        if not self.deployment:
            unused.update({name: "server.deployment only" for name in DEPLOYMENT_ONLY_FIELDS if name in given})
        if (len(self.urls) or self.num_replicas) == 1 and "route_imbalance" in given:
            unused["route_imbalance"] = "one replica, nothing to route between; with server.num_replicas > 1 only"
        return unused

    def starts_here(self) -> bool:
        """Whether the flow's host starts the replicas itself (neither ``urls`` nor ``deployment`` is set): only then
        does this host need what the launch settings (``backend``, ``num_replicas``, ``gpu_ids``, ...) ask for."""
        return not self.urls and not self.deployment

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids_not_negative(cls, ids: list[int] | None) -> list[int] | None:
        return check_gpu_ids(ids, "server.gpu_ids")

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        return check_server_urls(urls)

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, key: SecretStr | None) -> SecretStr | None:
        from grpo_core.security.auth import token_problem

        problem = None if key is None else token_problem(key.get_secret_value())
        if problem is not None:  # "" would turn authentication off, a space would break every request
            raise ValueError(
                f"server.api_key: {problem}; unset it (then GRPO_SERVER_API_KEY, else the run's token "
                "is sent) or give the servers' key"
            )
        return key

    @field_validator("deployment")
    @classmethod
    def _check_deployment(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
            raise ValueError(f"server.deployment: {name!r} is not 'flow/deployment'; write e.g. 'grpo-servers/gpu'")
        return name
