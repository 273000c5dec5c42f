"""Typed run config: one pydantic root model, one sub-model per process.

``RunConfig`` is what a YAML/TOML file or the Prefect parameter form parses into. Each
process receives only its sub-config (``model``, ``server``, ``rollout``; the packing
sub-model is added beside them). Every model forbids unknown keys so a typo is an error,
and the cross-field checks name the fields involved and the fix.

Only pydantic and the standard library are imported here (STYLE.md, module boundaries).
"""

from __future__ import annotations

import logging
import os
import re
import typing
import urllib.parse
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    create_model,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from grpo_core.errors import ConfigError
from grpo_core.redact import MASK, SecretUrl, mask_secret_keys, redact_url, secret_fields, split_secret_flags
from grpo_core.run.layout import ADAPTER_DIR, WEIGHTS_DIR

logger = logging.getLogger(__name__)

#: Environment variable holding external servers' bearer token when ``server.api_key`` is unset (a process started
#: by hand, e.g. the router; the flow hands ``server.api_key`` to its processes in ``GRPO_RUN_SECRETS``).
SERVER_API_KEY_ENV = "GRPO_SERVER_API_KEY"

# vLLM's accepted ``--max-lora-rank`` values (vllm/config/lora.py, ``MaxLoRARanks``).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def default_cache_dir() -> Path:
    """Where converted model folders are cached when ``model.cache_dir`` is unset.

    Returns:
        ``$GRPO_FLOW_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/grpo-flow``, else
        ``~/.cache/grpo-flow``.
    """
    if os.environ.get("GRPO_FLOW_CACHE_DIR"):
        return Path(os.environ["GRPO_FLOW_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "grpo-flow"


def _number_field(annotation: Any) -> bool:
    """Whether a field's type takes numbers (int or float, alone, in a union or as list items) but no bool."""
    leaves, todo = set(), [annotation]
    while todo:
        t = todo.pop()
        args = typing.get_args(t)
        leaves.add(t) if not args else todo.extend(args)
    return bool not in leaves and bool(leaves & {int, float})


def _changed(model: BaseModel) -> set[str]:
    """The fields of ``model`` whose values differ from their defaults (what a config set, even a saved config that
    writes every field)."""
    fields = type(model).model_fields
    return {name for name in fields if getattr(model, name) != fields[name].get_default(call_default_factory=True)}


def _warn_unused(unused: dict[str, str]) -> None:
    """Log one warning per cause for settings that have no effect (``{field path: why}``)."""
    by_cause: dict[str, list[str]] = {}
    for path, why in unused.items():
        by_cause.setdefault(why, []).append(path)
    for why, paths in by_cause.items():
        logger.warning("%s: no effect (%s); delete %s", ", ".join(paths), why, "it" if len(paths) == 1 else "them")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic takes ``true`` as 1 for an int or float field (``train.max_steps: true`` trained 1 step):
        a bool, alone or in a list, is refused where a number is expected."""
        items = value if isinstance(value, list | tuple) else [value]
        field = cls.model_fields.get(info.field_name or "")  # always set for a field validator
        if any(isinstance(v, bool) for v in items) and field is not None and _number_field(field.annotation):
            if isinstance(value, bool):
                raise ValueError(f"{str(value).lower()} is a boolean, not a number; write a number")
            raise ValueError("holds a boolean (true/false) where a number goes; write numbers")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _expand_user_paths(cls, value: Any) -> Any:
        """Every path a user writes means the same to ``grpo validate`` and to the run: ``~`` and ``$VARS``
        expanded here, once (:func:`user_path`); a relative path stays relative to the working folder."""
        return user_path(value) if isinstance(value, Path) else value

    @model_serializer(mode="wrap")
    def _mask_secret_keys(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Every JSON form of a config (``model_dump(mode="json")``, ``model_dump_json``: MLflow params and
        artifacts, run config files, Prefect parameters, the model card) shows the values under a secret key of a
        dict-valued field (``rollout.dataset_kwargs.api_key``) as ``**********`` (:func:`mask_secret_keys`); the
        Python form keeps them for the code that reads them, and the run's processes get them in
        ``GRPO_RUN_SECRETS`` (:func:`grpo_core.redact.secret_values`)."""
        data = handler(self)
        if info.mode_is_json() and isinstance(data, dict):
            for name in type(self).model_fields:
                if name in data and isinstance(getattr(self, name, None), dict | list | tuple):
                    data[name] = mask_secret_keys(data[name])
        return data

    def __repr_args__(self) -> Any:
        """``repr``/``str`` mask secret dict keys as the JSON forms do."""
        for name, value in super().__repr_args__():
            yield name, mask_secret_keys(value) if isinstance(value, dict) else value


def user_path(path: str | Path) -> Path:
    """A path as the user meant it: ``~`` / ``~user`` and environment variables (``$HOME``, ``${RUNS}``) expanded;
    relative paths are left relative (to the working folder of whoever reads them); an unset variable is left as
    written (``$UNSET/x``), so the path still names it."""
    return Path(os.path.expandvars(os.fspath(path))).expanduser()


#: Host names of this machine's loopback interface, as a URL may spell them.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def url_port(parts: urllib.parse.SplitResult) -> int:
    """The port a split http(s) URL reaches: its own, else the scheme's default (443 for https, 80 for http).

    Raises:
        ValueError: the URL's port is not a number in 0-65535.
    """
    return parts.port or (443 if parts.scheme.lower() == "https" else 80)


def _check_fixed_ports(cfg: RunConfig) -> None:
    """Refuse two of the run's listeners on one fixed port of the flow's host: the replicas it starts
    (``server.port`` + i) or those of ``server.urls`` on loopback, the router (``server.router_port``) and the rollout's
    Flight server
    (``rollout.flight_port``); the later one would fail to start after the others (0 = a free port, never shared).

    Raises:
        ConfigError: naming both settings and the port.
    """
    server, taken = cfg.server, {}
    if server.starts_here() and server.port:
        taken.update(
            {
                server.port + i: "server.port" if i == 0 else f"server.port + {i} (replica {i})"
                for i in range(server.num_replicas)
            }
        )
    for i, url in enumerate(server.urls):  # a replica on this host
        parts = urllib.parse.urlsplit(url)
        if parts.hostname in LOOPBACK_HOSTS:
            taken[url_port(parts)] = f"the port of server.urls[{i}]"
    for port, name in ((server.router_port, "server.router_port"), (cfg.rollout.flight_port, "rollout.flight_port")):
        if not port:
            continue
        if port in taken:
            raise ConfigError(
                f"{name} ({port}) is also {taken[port]}: two of the run's listeners cannot share a "
                f"port; choose another {name} (0 = a free one)"
            )
        taken[port] = name


def _view(owner: type[_Strict], names: tuple[str, ...], base: type[_Strict], doc: str) -> type[_Strict]:
    """A model holding only the fields ``names`` of the section ``owner`` (their types, bounds, defaults and
    docstrings taken from the owner, so each field is defined once): what a process reads of a section it does
    not own. ``base`` carries the owner's methods over those fields."""
    fields: dict[str, Any] = {name: (owner.model_fields[name].annotation, owner.model_fields[name]) for name in names}
    return create_model(
        f"{owner.__name__.removesuffix('Config')}View", __base__=base, __doc__=doc, __module__=__name__, **fields
    )


class _ServerKey(_Strict):
    """The servers' bearer token (``api_key``), resolved the same way by every process that talks to them."""

    if TYPE_CHECKING:  # the field of the subclass or view (not declared here: pydantic would make it a field)
        api_key: SecretStr | None

    def resolved_api_key(self) -> str | None:
        """The bearer token: ``api_key``, else ``$GRPO_SERVER_API_KEY``, else None."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(SERVER_API_KEY_ENV) or None


class _CandidateFilter(_Strict):
    """Whether the sampler's settings shrink its candidate set (``top_k``, ``top_p``, ``min_p``)."""

    if TYPE_CHECKING:  # the fields of the subclass or view
        top_k: int
        top_p: float
        min_p: float

    def uses_candidate_filter(self) -> bool:
        """Whether top-k/top-p/min-p shrink the sampler's candidate set."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


#: Fields that moved to one owner: ``section.field`` -> why, and what to set instead.
REMOVED_SERVER_FIELDS = {
    "enable_lora": "train.lora.enabled owns it: the servers serve LoRA adapters (--enable-lora) exactly when the "
    "trainer trains one; delete server.enable_lora and set train.lora.enabled",
    "lora_rank": "train.lora.r owns it: the servers' --max-lora-rank is the smallest vLLM value >= train.lora.r; "
    "delete server.lora_rank and set train.lora.r",
}
REMOVED_ROLLOUT_FIELDS = {
    "max_steps": "train.max_steps owns the run's length (the trainer stops the run there); delete rollout.max_steps "
    "and, to cycle the dataset until then, set rollout.num_epochs: null",
}


def _refuse_removed(data: Any, section: str, removed: dict[str, str]) -> Any:
    """Raise a ConfigError naming the first removed field set in a section's input (see ``REMOVED_*_FIELDS``)."""
    if isinstance(data, dict):
        for name, fix in removed.items():
            if name in data:
                raise ConfigError(f"{section}.{name} was removed: {fix}")
    return data


class ModelConfig(_Strict):
    """Which policy model to serve and train, and how to load it."""

    name: str = "smollm2-135m-instruct"
    """Registry name (``smollm2-135m-instruct``, ``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen3.5``,
    ``random-qwen3-0.6b``), a local HF folder path, or a Hugging Face Hub id (``Qwen/Qwen3.5-2B``;
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
    "embedded_num_threads",
    "max_pause_s",
    "extra_args",
)
#: Server settings only the embedded server reads; only vLLM reads; only a servers' deployment reads.
EMBEDDED_ONLY_FIELDS = ("kv_cache_size_tokens", "embedded_num_threads")
VLLM_ONLY_FIELDS = ("tensor_parallel_size", "api_server_count", "gpu_memory_utilization", "enforce_eager", "extra_args")
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
    replicas start one after another, as vLLM's memory profiling needs). A shorter or longer list is refused."""
    max_model_len: int = Field(default=4096, ge=16)
    """Longest prompt + completion a request may hold, in tokens (``--max-model-len``)."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences decoded in one batch (``--max-num-seqs``)."""
    kv_cache_size_tokens: int | None = Field(default=None, ge=16)
    """Embedded server only: KV-cache capacity in tokens; None = max_num_seqs * max_model_len."""
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
    None = the ``GRPO_SERVER_API_KEY`` environment variable, else the run's own token (``GRPO_RUN_TOKEN``, which
    the servers the flow starts check; they check this key instead when it, or the variable, is set). A secret:
    masked in saved configs, logs and MLflow."""
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

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        return check_server_urls(urls)

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, key: SecretStr | None) -> SecretStr | None:
        from grpo_core.auth import token_problem

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


class RolloutConfig(_CandidateFilter):
    """The rollout process: sampling settings, dataset, rewards, tools/environments, pace and transport.

    The ``module:name`` fields (``dataset``, ``reward_functions``, ``tools``, ``environment_factory``,
    ``loop_class``) resolve only inside the allow-list ``GRPO_ALLOWED_MODULES`` (``grpo_core.allowlist``)."""

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        return _refuse_removed(data, "rollout", REMOVED_ROLLOUT_FIELDS)

    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature; 0 = greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass kept; 1.0 = off. Below 1 needs top_k > 0."""
    top_k: int = Field(default=0, ge=0)
    """Candidates kept per step; 0 = off."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Drop tokens below min_p times the top probability; 0 = off."""
    max_completion_length: int = Field(default=2048, ge=1)
    """Most tokens generated per turn (the request's ``max_tokens``)."""
    num_sampler_logprobs: int = Field(default=8, ge=0)
    """Top log-probs requested per generated token (score centering); 0 = none."""
    max_staleness: int = Field(default=4, ge=0)
    """Most policy versions a sample may lag the trainer before it is dropped."""
    max_concurrent_rollouts: int = Field(default=512, ge=1)
    """Most rollouts in flight at once (also the HTTP connection pool size)."""
    batch_group_prompts: bool = False
    """Send the first requests of a group's rollouts that start together as one request with ``n`` choices
    instead of ``n`` requests (``grpo_core.rollout.coalesce``): on a small model vLLM's API server spends its CPU
    mostly per request. Each rollout keeps its own seed either way; the router then sees one request per group
    (``router/affinity_hit_frac`` counts requests, so it falls towards 0)."""
    server_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds a single request to the server may take before it is retried."""
    max_retries: int = Field(default=5, ge=0)
    """Retries of a request after connection errors, timeouts and 5xx answers."""
    max_abort_retries: int = Field(default=3, ge=0)
    """Times a turn the server cut short (``finish_reason: abort``) is resubmitted as its continuation before
    its group is dropped (counted in ``rollout/aborted_group_count``); aborted tokens are never trained as a
    finished turn."""
    reward_timeout_s: float | None = Field(default=300.0, gt=0)
    """Seconds one reward function call, or one environment ``get_reward()``, may take; past it the group fails
    (counted in ``rewards/<name>/timeout_count``, charged to ``max_failed_groups``). None = no limit."""
    tool_timeout_s: float | None = Field(default=120.0, gt=0)
    """Seconds one tool call, or one environment ``reset()``, may take. A timed-out tool call answers the model
    with an error message (``tools/<name>/timeout_count``); a timed-out ``reset()`` fails its group. None = no
    limit. A timed-out sync call keeps its worker thread until it returns (Python cannot stop a thread)."""
    max_failed_groups: int = Field(default=10, ge=0)
    """Groups that may fail in user code (a reward function, ``env.reset``/``get_reward`` raising or timing out)
    before the run fails naming the last error; each failed group's prompt counts as consumed and is counted in
    ``rollout/failed_group_count``. 0 = the first failure fails the run. A misconfigured function (wrong
    signature, wrong return type or length) fails the run at once."""
    num_generations: int = Field(default=8, ge=2)
    """G: rollouts per prompt (one group); advantages are normalised inside it."""
    scale_rewards: Literal["group", "none"] = "group"
    """Advantages A = r − mean of the group, divided by the group's reward std (``group``, GRPO) or not
    (``none``, Dr. GRPO, Liu et al. 2025)."""
    mask_truncated_completions: bool = False
    """Leave out of the loss the rollouts whose last turn hit ``max_completion_length``
    (``finish_reason: length``; DAPO's overlong filtering, Yu et al. 2025, §3.4); they still count in their
    group's mean and std. Counted in ``rollout/truncated_masked_count``."""
    dataset: str | None = None
    """``reasoning_gym:TASK``, ``json:PATH`` (JSON lines) or ``module:callable`` giving a Dataset; None = the
    environment's ``reset()`` makes each prompt (``rollout.environment_factory``)."""
    dataset_size: int = Field(default=1000, ge=1)
    """Prompts of a ``reasoning_gym:`` dataset, or of an epoch when an environment's reset() makes the prompts."""
    dataset_seed: int = Field(default=0, ge=0)
    """Seed of a generated (``reasoning_gym:``) dataset."""
    dataset_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a ``module:callable`` dataset, or the task config of a ``reasoning_gym:`` one."""
    shuffle: bool = True
    """Visit the prompts in a seeded random order, a new one each epoch (the same for a given ``shuffle_seed`` and
    epoch, so a resume continues it exactly); false = the dataset's order. A streaming (iterable) dataset is read
    in its order."""
    shuffle_seed: int = Field(default=0, ge=0)
    """Seed of the prompt order (``shuffle``)."""
    reward_functions: list[str] = Field(default_factory=list)
    """Reward functions as ``module:name``; rewards of all sources are summed."""
    tools: list[str] = Field(default_factory=list)
    """Tool functions as ``module:name`` (typed, Google docstrings), shown to the model through the chat template."""
    environment_factory: str | dict[str, str] | None = None
    """Environment class ``module:Class``, or name -> class routed by the dataset's ``environment`` column."""
    loop_class: str = "grpo_core.rollout.loop:RolloutLoop"
    """Rollout loop class ``module:Class`` (a ``RolloutLoop`` subclass with overridden hooks)."""
    loop_options: dict[str, Any] = Field(default_factory=dict)
    """Extra fields of the loop class's own config subclass (its ``config_class``)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of ``tokenizer.apply_chat_template`` (e.g. ``enable_thinking``)."""
    response_template: str | dict[str, Any] | None = None
    """How tool calls are read from a reply (transformers' ``parse_response``): a built-in name (``hermes``,
    ``mistral``, ``llama3``) or a response-template dict; None = the tokenizer's own ``response_template``, else
    the Hermes ``<tool_call>`` regex."""
    max_tool_calling_iterations: int | None = Field(default=None, ge=0)
    """Most tool-calling turns per rollout; None = until the model stops calling tools."""
    num_epochs: int | None = Field(default=1, ge=1)
    """Passes over the prompt dataset (a rejected prompt counts as consumed); None = cycle the dataset until the
    trainer stops the run at ``train.max_steps`` (the one owner of the run's length)."""
    seed: int = Field(default=0, ge=0)
    """Base of the per-request sampler seeds (each rollout of a group gets its own seed)."""
    first_step_tokens: int = Field(default=8192, ge=1)
    """Raw sample tokens a step is assumed to consume before the first report (~ budget x ranks x accumulation)."""
    concurrency_poll_s: float = Field(default=5.0, gt=0)
    """Seconds between ``/metrics`` polls of the adaptive concurrency cap."""
    rollout_worker_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds without a heartbeat from the rollout process before the trainer fails the run."""
    flight_host: str = "127.0.0.1"
    """Interface the rollout process's Arrow Flight server binds; loopback unless the trainer is on another host."""
    flight_port: int = Field(default=0, ge=0, le=65535)
    """Port of the Flight server; 0 = a free port, reported at start."""

    @model_validator(mode="after")
    def _check_rollout_fields(self) -> RolloutConfig:
        if self.temperature == 0 and self.num_generations > 1:
            logger.warning(
                "rollout.temperature=0 makes the %d rollouts of a group identical: every group has zero "
                "reward std and is dropped; raise rollout.temperature",
                self.num_generations,
            )
        if isinstance(self.environment_factory, dict) and not self.environment_factory:
            raise ConfigError("rollout.environment_factory is an empty dict; name at least one environment or set None")
        for name in [*self.reward_functions, *self.tools, self.loop_class]:
            if ":" not in name:
                raise ConfigError(f"rollout: {name!r} must be 'module:attribute' (e.g. 'my_rewards:accuracy')")
        if self.max_tool_calling_iterations is not None and not self.tools and self.environment_factory is None:
            logger.warning(
                "rollout.max_tool_calling_iterations has no effect without rollout.tools or rollout.environment_factory"
            )
        return self


class PackingConfig(_Strict):
    """How samples become token-budget rows (DESIGN.md §5, token-budget batcher)."""

    backend: str = "rust"
    """Packer backend name: ``rust`` (packer_rs), ``python`` (reference) or a ``grpo_core.packers`` entry point."""
    token_budget: int | None = Field(default=None, ge=16)
    """Most forwarded (unique) tokens, and trained tokens, per row; None = server.max_model_len."""


class LoraConfig(_Strict):
    """PEFT LoRA adapter trained instead of the full weights."""

    enabled: bool = False
    """Train a LoRA adapter (and sync only the adapter to the servers)."""
    r: int = Field(default=16, ge=1, le=512)
    """Adapter rank."""
    alpha: float = Field(default=32.0, gt=0)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Ignored: the trainer turns every dropout off, the adapter's included, so its log-probs are the sampler's
    (DESIGN.md §5); a value above 0 is warned about."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Module names to adapt, or ``all-linear`` (every linear layer of the language model but the output
    projection; a VLM's vision tower is never loaded by the trainer, so never adapted)."""
    name: str = Field(default="policy", min_length=1, max_length=64)
    """Adapter name on the servers; version N is served as ``{name}-v{N}`` (also a folder name:
    letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit)."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or ".." in name:
            raise ValueError(
                f"train.lora.name={name!r} must be a plain name (letters, digits, '.', '_', '-', "
                "starting with a letter or digit; no path separator, no '..'): it names the adapter "
                "folders under train.output_dir; e.g. 'policy'"
            )
        return name


class TrainConfig(_Strict):
    """The FSDP2 trainer (torchrun, one process per rank)."""

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing_bools(cls, v: Any) -> Any:
        return {True: "full", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("selective_checkpointing")
    @classmethod
    def _selective_positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"train.selective_checkpointing must be 'op' or an integer >= 1, got {v}")
        return v

    @field_validator("adapter_store", "adapter_store_served_as")
    @classmethod
    def _not_blank(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and not v.strip():  # "" would be the current folder on each host, not unset
            raise ValueError(f"train.{info.field_name} is empty; unset it (null) or give a folder or fsspec URL")
        return v

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, v: str | None) -> str | None:
        match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9_.-]*):(\d{1,5})", v) if v is not None else None
        if v is not None and (match is None or not 0 < int(match.group(2)) <= 65535):
            raise ValueError(
                f"train.rdzv_endpoint: {v!r} is not 'host:port' (no scheme, a port 1-65535); write e.g. "
                "'trainer-0:29400'"
            )
        return v

    output_dir: Path = Path("runs/train")
    """Folder for checkpoints, metrics and synced weights."""
    num_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks per trainer host (torchrun --nproc-per-node); the world is nnodes x num_ranks."""
    nnodes: int = Field(default=1, ge=1)
    """Trainer hosts (torchrun ``--nnodes``); above 1 the flow's torchrun is node 0 and waits at
    ``rdzv_endpoint`` for the others, started by hand or a deployment with the same command (docs/across-hosts.md)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of torchrun's c10d rendezvous when ``nnodes`` > 1 (on the flow's host, reachable from every
    trainer host; e.g. ``trainer-0:29400``)."""
    rdzv_timeout_s: int = Field(default=900, ge=1)
    """Seconds each trainer host waits at ``rdzv_endpoint`` for the others (``nnodes`` > 1; torchrun's static
    rendezvous ``--rdzv-conf timeout``); then its torchrun fails saying how many hosts joined."""
    shared_folder_wait_s: float = Field(default=30.0, ge=0)
    """Seconds each rank looks for the probe file rank 0 writes in ``output_dir`` before the run stops, naming the
    ranks that do not see it (``nnodes`` > 1: an NFS client may cache a missing name that long)."""
    adapter_store: str | None = None
    """Where LoRA adapter versions are published for the servers: a folder every server host mounts, or an fsspec
    URL (``s3://bucket/run``); None = ``<output_dir>/.vllm_lora`` (servers on this host)."""
    adapter_store_served_as: str | None = None
    """How the servers reach ``adapter_store`` (e.g. the bucket's mount point ``/mnt/adapters``); None = the same
    path or URL."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` = CUDA when available (NCCL), else CPU (gloo)."""
    gpu_ids: list[int] | None = None
    """CUDA device indices of the trainer's ranks (rank r on gpu_ids[r], set as ``CUDA_VISIBLE_DEVICES``);
    None = the first num_ranks visible devices. Disjoint from server.gpu_ids for NCCL weight transfer."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Master weight dtype."""
    mixed_precision: bool | None = None
    """bf16 compute with fp32 gradient reduction (FSDP2 MixedPrecisionPolicy); None = on for CUDA only."""
    fp32_logits: bool = False
    """Keep the lm_head's logits in fp32. Off (default), logits computed in bf16 are rounded to bf16 before the
    softmax, as vLLM 0.25.1 and the embedded server compute them, so trainer and sampler log-probs of the same
    weights agree; turn it on only when the server's head runs in fp32 too (a vLLM started with
    ``--hf-overrides '{"head_dtype": "float32"}'``, where its version supports it for generation)."""
    gradient_checkpointing: Literal["none", "selective", "full"] = "none"
    """Activation checkpointing per decoder layer (torchtitan's policies): ``none`` keeps every activation,
    ``full`` recomputes each layer in backward, ``selective`` per ``selective_checkpointing``. ``true`` /
    ``false`` mean ``full`` / ``none``."""
    selective_checkpointing: Literal["op"] | int = Field(default="op")
    """With ``gradient_checkpointing: selective``: ``op`` keeps attention and every other matmul output in each
    layer and recomputes the rest; an integer n fully checkpoints every n-th layer (n >= 1)."""
    fsdp_reshard_after_forward: Literal["auto", "always", "never"] = "auto"
    """FSDP2: free each layer's gathered parameters after its forward (``always``) or keep them for backward
    (``never``: more memory, fewer all-gathers); ``auto`` keeps them on CUDA when a bf16 copy of the model
    takes under a tenth of the device's memory."""
    fsdp_prefetch: int = Field(default=1, ge=0)
    """FSDP2: layers whose parameter all-gather each layer issues ahead, in forward and backward (0 = implicit)."""
    compile: bool | None = None
    """``torch.compile`` each decoder layer (static shapes) and, on CUDA, the log-prob head; None = on for CUDA
    only."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend of the decoder layers (``inductor``; ``aot_eager`` compiles without a C++
    toolchain, for debugging)."""
    learning_rate: float = Field(default=1e-6, gt=0, allow_inf_nan=False)
    """Peak AdamW learning rate."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup (to 0 at max_steps for linear/cosine)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(default=1.0, ge=0)
    """Gradient clipping by global norm; 0 = off."""
    max_nonfinite_steps: int = Field(default=10, ge=1)
    """Steps in a row whose gradient norm is NaN/inf (each skipped: no update, sync or save) after which the run
    fails."""
    max_untrainable_groups: int = Field(default=256, ge=1)
    """Groups in a row without a trainable sample (all rewards equal, stale, longer than the token budget)
    after which the run fails, naming the cause."""
    max_steps: int = Field(default=100, ge=1)
    """Optimizer steps to train."""
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step."""
    loss_normalization: Literal["step_tokens", "micro_batch"] = "step_tokens"
    """What the loss sum is divided by: ``step_tokens`` = the trained tokens of the whole optimizer step (every
    micro-batch, every rank), so the gradient does not depend on how the step was split into micro-batches;
    ``micro_batch`` = each micro-batch by its own trained tokens, the micro-batches averaged (the rule before
    2026-12: a token of a short micro-batch weighs more)."""
    clip_min: float = Field(default=0.5, gt=0)
    """Masked importance sampling: lowest ratio π/μ kept."""
    clip_max: float = Field(default=5.0, gt=0)
    """Masked importance sampling: highest ratio π/μ kept."""
    score_centering: bool = True
    """Score-centred gradient (needs rollout.num_sampler_logprobs > 0) instead of the clipped surrogate."""
    epsilon: float = Field(default=0.2, gt=0)
    """Clipped surrogate: lower trust-region width."""
    epsilon_high: float | None = Field(default=None, gt=0)
    """Clipped surrogate: upper width; None = epsilon. Above epsilon = DAPO's clip-higher (DAPO uses 0.28)."""
    loss_type: Literal["grpo", "cispo", "gspo"] = "grpo"
    """``grpo``: the score-centred gradient or the clipped surrogate, as ``score_centering`` says; ``cispo``: the
    clipped IS weight of CISPO (MiniMax-M1, 2025), sg(clip(π/μ, 1 − epsilon, 1 + epsilon_high))·A·log π;
    ``gspo``: the clipped surrogate on one ratio per sequence, exp(mean of log π − log μ) (GSPO, Zheng et al.
    2025). Both need ``score_centering: false`` (docs/algorithms.md)."""
    logprob_chunk_size: int | None = Field(default=None, ge=1)
    """Loss terms per chunk of the fused log-prob head (extra memory about chunk × vocabulary × 6 bytes);
    None = 4096 on CUDA, 1024 on CPU."""
    length_buckets: int = Field(default=4, ge=1)
    """With compiled layers (and on CUDA): rows are padded to one of this many lengths up to the token budget
    (static shapes); each length is compiled before the first step."""
    weight_sync_steps: int = Field(default=1, ge=1)
    """Optimizer steps between weight syncs to the servers (each sync = one policy version)."""
    save_steps: int = Field(default=50, ge=1)
    """Optimizer steps between checkpoints."""
    save_total_limit: int | None = Field(default=None, ge=1)
    """Checkpoints kept in ``<output_dir>/checkpoints`` (the oldest are deleted after each save); None keeps all."""
    run_lock_timeout_s: float = Field(default=30.0, ge=0)
    """Seconds a trainer waits for the run folder's lock held by another process (an orphaned trainer of a
    killed attempt) before it fails naming the holder's pid."""
    logging_steps: int = Field(default=1, ge=1)
    """Optimizer steps per metrics window."""
    seed: int = 0
    """Seed of the trainer's RNGs."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA options."""
    flush_partial_after_s: float = Field(default=10.0, gt=0)
    """Seconds without new samples after which the trainer trains the partly filled micro-batch instead of
    waiting (a rollout held back by its token allowance cannot fill it)."""
    samples_path: Path | None = None
    """Train from this Sample-schema Arrow IPC file instead of a rollout process (offline runs, tests)."""
    rollout_location: str | None = None
    """Arrow Flight location of the rollout process (``grpc://host:port``); set by the flow."""


class ExportConfig(_Strict):
    """The trained model at the end of a run: a ``from_pretrained`` folder, its model card, and a Hub push."""

    max_shard_size: str = "5GB"
    """Largest safetensors shard of the exported model (``save_pretrained(max_shard_size=…)``); larger models get
    several shards and a ``model.safetensors.index.json``."""
    push_to_hub: bool = False
    """Upload the exported folder and its model card to the Hugging Face Hub at the end of the run
    (needs ``export.hub_model_id`` and a token: ``HF_TOKEN`` or ``hf auth login``)."""
    hub_model_id: str | None = None
    """Hub repository to push to, ``user-or-org/name`` (created when missing)."""
    hub_private_repo: bool | None = None
    """Create the Hub repository private; None = the Hub's default (public unless the org says otherwise)."""
    hub_revision: str | None = None
    """Branch of the Hub repository to commit to; None = ``main``."""

    @model_validator(mode="after")
    def _check_hub(self) -> ExportConfig:
        if self.push_to_hub and not self.hub_model_id:
            raise ConfigError(
                "export.push_to_hub needs export.hub_model_id ('user-or-org/name'); set it or "
                "set export.push_to_hub: false"
            )
        return self


class TrackingConfig(_Strict):
    """MLflow tracking of a run (``grpo_core.tracking``): metrics, params, checkpoints, resume state."""

    enabled: bool = True
    """Log the run to MLflow; off = metrics only in ``metrics.jsonl``."""
    dir: Path = Path("runs/mlflow")
    """Folder of the embedded store: ``mlflow.db`` (SQLite) and ``artifacts/``."""
    tracking_uri: SecretUrl | None = None
    """MLflow tracking URI (``http://host:5000``, a database URL); None = SQLite file ``<dir>/mlflow.db``. A
    password in it (``https://user:password@host``) is secret: shown as ``**********`` in logs, params and files
    (or leave it out and set ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``)."""
    artifact_location: SecretUrl | None = None
    """Artifact root of a new experiment; None = ``<dir>/artifacts`` (the server's default with a tracking server).
    A password in it is secret like ``tracking_uri``'s."""
    experiment_name: str = "grpo-flow"
    """MLflow experiment the run is logged under."""
    run_id: str | None = None
    """MLflow run to log into; set by the flow for the trainer process (leave unset)."""
    checkpoint_artifact_max_mib: float = Field(default=256.0, ge=0)
    """Checkpoints up to this size (MiB) are copied as artifacts; larger ones are logged as a URI (their path)."""
    log_model: bool = True
    """At the end, log the exported model (or LoRA adapter) folder as the run's ``model`` artifact
    (``from_pretrained`` on the downloaded folder loads it)."""
    registered_model_name: str | None = None
    """Model registry name the final model (or adapter) is registered under as a new version; None = not
    registered."""
    registered_model_alias: str = "candidate"
    """Alias moved to each newly registered version (promote a version by moving another alias, e.g.
    ``champion``, to it)."""
    log_system_metrics: bool = True
    """Log the trainer's system metrics (CPU, memory, disk, network; GPU utilisation and memory when an NVIDIA
    GPU is visible) as ``system/*`` metrics of the run."""
    system_metrics_interval_s: float = Field(default=10.0, ge=1.0)
    """Seconds between system metric samples."""
    log_completions: bool = False
    """Log a sample of prompts, completions, rewards and advantages of each logging window as an MLflow table
    (``completions/step_NNNNNNN.json``)."""
    num_completions_to_print: int | None = Field(default=16, ge=1)
    """Rows of each window's completion table (a uniform sample of the window's scored completions);
    None = every completion of the window."""
    completion_max_chars: int = Field(default=2000, ge=16)
    """Longest prompt or completion text kept in a table cell (longer ones are cut, marked with ``…``)."""
    ui_url: str | None = None
    """Base URL of the MLflow UI that links point to; None = ``tracking_uri`` when it is an http(s) server, else
    ``http://127.0.0.1:5000`` (what ``grpo ui --mlflow`` serves)."""

    @field_validator("dir")
    @classmethod
    def _check_dir(cls, folder: Path) -> Path:
        shown = folder.expanduser().resolve()
        if "?" in str(shown) or "%" in str(shown):  # SQLAlchemy cuts the URL at '?' and decodes '%XX'
            raise ValueError(
                f"tracking.dir: {shown} holds a '?' or '%', which the SQLite URL MLflow opens "
                "(sqlite:///<dir>/mlflow.db) cannot carry; choose a folder without them"
            )
        return folder

    @field_serializer("tracking_uri", "artifact_location", when_used="json")
    def _shown_url(self, url: SecretUrl | None) -> str | None:
        return None if url is None else str(url)

    def resolved_tracking_uri(self) -> str:
        """The tracking URI actually used (``tracking_uri`` or the SQLite file under ``dir``), with its
        credentials: for MLflow only; show :meth:`shown_tracking_uri`."""
        if self.tracking_uri is not None:
            return self.tracking_uri.get_secret_value()
        return f"sqlite:///{self.dir.resolve() / 'mlflow.db'}"

    def shown_tracking_uri(self) -> str:
        """The tracking URI for logs and messages (a password shown as ``**********``)."""
        return redact_url(self.resolved_tracking_uri())

    def resolved_ui_url(self) -> str:
        """Base URL of the MLflow UI (``ui_url``, the http tracking server without its credentials, or the local
        ``grpo ui --mlflow``)."""
        if self.ui_url:
            return self.ui_url.rstrip("/")
        uri = self.tracking_uri.get_secret_value() if self.tracking_uri is not None else ""
        if uri.startswith(("http://", "https://")):
            return redact_url(uri, keep_user=False).rstrip("/")
        return "http://127.0.0.1:5000"

    def resolved_artifact_location(self) -> str | None:
        """Artifact root for a new experiment (None = the tracking server decides), with its credentials."""
        if self.artifact_location is not None:
            return self.artifact_location.get_secret_value()
        return None if self.tracking_uri else str(self.dir.resolve() / "artifacts")


class FlowConfig(_Strict):
    """Scheduling of a run by the Prefect flow ``grpo-train``."""

    concurrency_limit: str | None = "gpu"
    """Prefect global concurrency limit the run holds slots of from provisioning to the end of training (``grpo
    deploy`` creates ``gpu`` with one slot per GPU); a limit missing on the server is not waited for; None = none."""
    concurrency_slots: int | None = Field(default=None, ge=1)
    """Slots the run holds; None = the GPUs it uses with vLLM (the servers' and the trainer's, counted once), or 1
    on the embedded server."""


class RolloutProcessConfig(_Strict):
    """What the rollout process reads: its own section, and the few values it needs from other sections, each
    taken from its one owner by :meth:`RunConfig.rollout_process` (the process never sees the whole run config)."""

    model: ModelConfig
    """The policy model (the rollout process loads its tokenizer)."""
    rollout: RolloutConfig
    """The rollout section."""
    server: ServerConfig
    """The server section: the rollout routes its requests over the replicas (``route_imbalance``,
    ``control_retry_s``, ``api_key``)."""
    served_model_name: str
    """Name the base model answers to on the servers (``server.served_model_name`` or ``model.name``)."""
    max_model_len: int = Field(ge=16)
    """``server.max_model_len``: the context length when the server does not report its own."""
    adapter_name: str | None = None
    """``train.lora.name`` when the trainer trains a LoRA adapter (``train.lora.enabled``; version N is served as
    ``{name}-v{N}``), else None (the base model is sampled)."""
    log_completions: bool = False
    """``tracking.log_completions``: keep a sample of each window's completions for the trainer to log."""
    num_completions_to_print: int | None = Field(default=16, ge=1)
    """``tracking.num_completions_to_print``: rows of each window's completion sample; None = all."""


def _refuse_masked(config: BaseModel) -> None:
    """Raise a ConfigError naming the first secret of ``config`` that holds the mask of a saved config."""
    for path, secret in secret_fields(config):
        if MASK in secret.get_secret_value():
            raise ConfigError(
                f"{path} holds a redacted value ({MASK!r}: a config grpo-flow saved or logged "
                f"keeps no secret); set the real value, e.g. --set {path.split('.')[0]}."
                f"{'.'.join(path.split('.')[1:2])}=..., or, off the command line (a trainer host "
                f'started by hand), export GRPO_RUN_SECRETS=\'{{"{path}": "..."}}\''
            )


def _check_trainer_fields(config: Any) -> None:
    """Cross-field checks of what the trainer reads (``config.train``, ``config.rollout.num_sampler_logprobs``):
    run on the run config and on the trainer's sub-config alike.

    Raises:
        ConfigError: naming the fields and the fix.
    """
    train = config.train
    if train.clip_min >= train.clip_max:
        raise ConfigError(f"train.clip_min ({train.clip_min}) must be below train.clip_max ({train.clip_max})")
    if train.loss_type != "grpo" and train.score_centering:
        raise ConfigError(
            f"train.loss_type: {train.loss_type} replaces the score-centred gradient: set train.score_centering: false"
        )
    if train.score_centering and config.rollout.num_sampler_logprobs == 0:
        raise ConfigError(
            "train.score_centering needs the sampler's top log-probs: set rollout.num_sampler_logprobs > 0 "
            "(e.g. 8) or train.score_centering: false"
        )
    if train.nnodes > 1 and not train.rdzv_endpoint:
        raise ConfigError(
            f"train.nnodes={train.nnodes} needs train.rdzv_endpoint ('host:port' on the flow's host, "
            "reachable from every trainer host, e.g. 'trainer-0:29400')"
        )
    if train.nnodes > 1 and not train.output_dir.is_absolute():
        logger.warning(
            "train.output_dir=%s is relative: each trainer host resolves it against its own working "
            "folder (train.nnodes=%d); give the shared folder's absolute path",
            train.output_dir,
            train.nnodes,
        )
    if train.nnodes > 1 and train.rdzv_endpoint.rpartition(":")[0].strip("[]").lower() in LOOPBACK_HOSTS:
        logger.warning(
            "train.rdzv_endpoint=%s is a loopback address: only trainer hosts on this machine can join "
            "(train.nnodes=%d); give the host name the other trainer hosts reach",
            train.rdzv_endpoint,
            train.nnodes,
        )
    if train.gpu_ids is not None and len(set(train.gpu_ids)) < train.num_ranks:
        raise ConfigError(
            f"train.gpu_ids lists {len(set(train.gpu_ids))} distinct GPUs but train.num_ranks is "
            f"{train.num_ranks}; list one GPU per rank or lower train.num_ranks"
        )


#: What the trainer reads of sections it does not own, under the owners' field names (see ``TrainerProcessConfig``).
TRAINER_ROLLOUT_FIELDS = (
    "max_staleness",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "num_generations",
    "max_completion_length",
    "num_sampler_logprobs",
    "num_epochs",
    "rollout_worker_timeout_s",
    "dataset",
    "dataset_size",
    "dataset_seed",
    "dataset_kwargs",
    "shuffle",
    "shuffle_seed",
)
TRAINER_SERVER_FIELDS = (
    "api_key",
    "route_imbalance",
    "control_retry_s",
    "control_timeout_s",
    "weight_transfer_backend",
)
TRAINER_PACKING_FIELDS = ("backend",)
TRAINER_EXPORT_FIELDS = ("max_shard_size",)

if TYPE_CHECKING:  # each view has a subset of its owner's fields, made at runtime (create_model)
    TrainerRolloutView = RolloutConfig
    TrainerServerView = ServerConfig
    TrainerPackingView = PackingConfig
    TrainerExportView = ExportConfig
else:
    TrainerRolloutView = _view(
        RolloutConfig,
        TRAINER_ROLLOUT_FIELDS,
        _CandidateFilter,
        "The rollout settings the trainer reads (``rollout.*``, owned by the rollout section): staleness, the "
        "sampler's settings (the log-prob head matches them), the group size, and what identifies the dataset (the "
        "checkpoint's fingerprint).",
    )
    TrainerServerView = _view(
        ServerConfig,
        TRAINER_SERVER_FIELDS,
        _ServerKey,
        "The server settings the trainer's weight sync reads (``server.*``): the bearer token, the control fan-out's "
        "retries and the vLLM weight-transfer backend.",
    )
    TrainerPackingView = _view(
        PackingConfig,
        TRAINER_PACKING_FIELDS,
        _Strict,
        "The packer backend the trainer's planner uses (``packing.backend``).",
    )
    TrainerExportView = _view(
        ExportConfig,
        TRAINER_EXPORT_FIELDS,
        _Strict,
        "The export setting the trainer's final ``save_pretrained`` reads (``export.max_shard_size``).",
    )


class TrainerProcessConfig(_Strict):
    """What the trainer (every torchrun rank) reads: its own section, and the few values it needs from other
    sections, each taken from its one owner by :meth:`RunConfig.trainer_process` (the trainer never sees the whole
    run config). Borrowed values keep their owners' paths (``rollout.max_staleness``, ``server.api_key``), so errors,
    ``--set`` overrides, secrets and the checkpoint fingerprint name the field a user sets. The flow writes it as
    ``train_config.json``."""

    process: Literal["trainer"] = "trainer"
    """Marks a trainer sub-config file (``python -m grpo_core.train --config`` also takes a whole run config)."""
    model: ModelConfig
    """The policy model."""
    train: TrainConfig
    """The trainer's section."""
    tracking: TrackingConfig
    """MLflow tracking (the trainer logs metrics, checkpoints and the final model)."""
    rollout: TrainerRolloutView
    """The rollout settings the trainer reads."""
    server: TrainerServerView
    """The server settings the weight sync reads."""
    packing: TrainerPackingView
    """The packer backend."""
    export: TrainerExportView
    """The shard size of the exported model."""
    token_budget: int = Field(ge=16)
    """Row token budget: ``packing.token_budget``, else ``server.max_model_len`` (:meth:`RunConfig.token_budget`)."""

    @model_validator(mode="after")
    def _check_cross_fields(self) -> TrainerProcessConfig:
        _refuse_masked(self)
        _check_trainer_fields(self)
        return self


#: Tracking settings only an MLflow-tracked run reads (``tracking.enabled``).
TRACKING_ONLY_FIELDS = (
    "registered_model_name",
    "registered_model_alias",
    "log_model",
    "log_completions",
    "log_system_metrics",
    "system_metrics_interval_s",
    "checkpoint_artifact_max_mib",
)


#: ``algorithm`` presets: the fields each sets, by section (docs/algorithms.md gives the papers).
ALGORITHM_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {},
    "dapo": {
        "train": {"score_centering": False, "loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.28},
        "rollout": {"scale_rewards": "group", "mask_truncated_completions": True},
    },
    "dr_grpo": {
        "train": {"score_centering": False, "loss_type": "grpo"},
        "rollout": {"scale_rewards": "none"},
    },
    "gspo": {
        "train": {"score_centering": False, "loss_type": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4},
    },
    "cispo": {
        "train": {
            "score_centering": False,
            "loss_type": "cispo",
            "epsilon": 1.0,
            "epsilon_high": 5.0,
            "clip_max": 10.0,
        },
    },
}


def apply_algorithm_preset(data: Any) -> Any:
    """A run config's input with its ``algorithm`` preset's fields filled in where the input leaves them unset.

    Args:
        data: the raw run config (a dict; anything else is returned as it is for pydantic to refuse).

    Returns:
        A copy of ``data`` whose sections hold the preset's values for the fields they did not set.

    Raises:
        ConfigError: an unknown preset name (lists the valid ones).
    """
    if not isinstance(data, dict):
        return data
    name = data.get("algorithm", "grpo")
    if name not in ALGORITHM_PRESETS:
        raise ConfigError(f"algorithm: {name!r} is not a preset; choose one of {', '.join(ALGORITHM_PRESETS)}")
    data = dict(data)
    for section, values in ALGORITHM_PRESETS[name].items():
        given = data.get(section)
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        if given is None:
            given = {}
        if not isinstance(given, dict):
            continue  # pydantic refuses it, naming the section
        data[section] = {**values, **given}
    return data


class RunConfig(_Strict):
    """Root config of one grpo-flow run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Generation server(s)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout sampling settings and limits."""
    packing: PackingConfig = Field(default_factory=PackingConfig)
    """Packing of samples into rows."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The trainer."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow tracking."""
    export: ExportConfig = Field(default_factory=ExportConfig)
    """The exported model (Hugging Face folder, model card, Hub push)."""
    flow: FlowConfig = Field(default_factory=FlowConfig)
    """How the Prefect flow schedules the run."""
    resume_from: str | None = None
    """MLflow run id whose latest checkpoint this run starts from (a new run continuing an old one)."""
    algorithm: str = "grpo"
    """Named preset of the loss and advantage settings (:data:`ALGORITHM_PRESETS`, docs/algorithms.md): ``grpo``
    (the defaults), ``dapo``, ``dr_grpo``, ``gspo``, ``cispo``. It fills in only the fields the config leaves unset;
    a field set in the config or by an override wins."""

    @model_validator(mode="before")
    @classmethod
    def _apply_algorithm_preset(cls, data: Any) -> Any:
        return apply_algorithm_preset(data)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        _refuse_masked(self)
        _check_trainer_fields(self)
        server, rollout = self.server, self.rollout
        if rollout.max_completion_length >= server.max_model_len:
            raise ConfigError(
                f"rollout.max_completion_length ({rollout.max_completion_length}) must be below "
                f"server.max_model_len ({server.max_model_len}) to leave room for the prompt; "
                "raise server.max_model_len or lower rollout.max_completion_length"
            )
        if rollout.top_p < 1.0 and rollout.top_k == 0:
            raise ConfigError(
                "rollout.top_p < 1 needs rollout.top_k > 0 (vLLM bounds the candidate set by top_k); "
                "set rollout.top_k, e.g. 512"
            )
        if rollout.num_sampler_logprobs > server.max_logprobs:
            raise ConfigError(
                f"rollout.num_sampler_logprobs ({rollout.num_sampler_logprobs}) exceeds "
                f"server.max_logprobs ({server.max_logprobs}); raise server.max_logprobs"
            )
        if self.train.lora.enabled and server.max_loras is not None and server.max_loras < rollout.max_staleness + 2:
            raise ConfigError(
                f"server.max_loras ({server.max_loras}) must be >= rollout.max_staleness + 2 "
                f"({rollout.max_staleness + 2}): the trainer keeps max_staleness + 1 versions and loads the "
                "next before unloading the oldest; raise server.max_loras or leave it unset"
            )
        if self.packing.token_budget is not None and self.packing.token_budget < server.max_model_len:
            logger.warning(
                "packing.token_budget (%d) < server.max_model_len (%d): samples longer than the budget are dropped",
                self.packing.token_budget,
                server.max_model_len,
            )
        if server.deployment and server.urls:
            raise ConfigError(
                f"server.deployment ({server.deployment!r}) starts the replicas and server.urls names "
                "replicas already running; set one of them"
            )
        needed = server.num_replicas * server.tensor_parallel_size
        if server.gpu_ids is not None and len(server.gpu_ids) < needed:
            raise ConfigError(
                f"server.gpu_ids lists {len(server.gpu_ids)} GPUs but server.num_replicas * "
                f"server.tensor_parallel_size = {needed} (one entry per replica GPU; a GPU may be listed again "
                "to hold another replica): list more GPUs or lower num_replicas"
            )
        if server.gpu_ids is not None and len(server.gpu_ids) > needed and not server.urls:  # urls: warned unused
            raise ConfigError(
                f"server.gpu_ids lists {len(server.gpu_ids)} GPUs but server.num_replicas * "
                f"server.tensor_parallel_size = {needed}: the last {len(server.gpu_ids) - needed} would hold no "
                f"replica; list {needed}, or raise server.num_replicas to use them"
            )
        _check_fixed_ports(self)
        if server.gpu_ids is not None:
            tp = server.tensor_parallel_size
            for replica in range(server.num_replicas):
                own = server.gpu_ids[replica * tp : (replica + 1) * tp]
                if len(set(own)) < len(own):
                    raise ConfigError(
                        f"server.gpu_ids gives replica {replica} the GPUs {own}: the "
                        f"tensor_parallel_size ({tp}) GPUs of one replica must differ"
                    )
            sharing = max(Counter(server.gpu_ids[:needed]).values())  # replicas on the busiest GPU
            if sharing > 1 and server.gpu_memory_utilization * sharing > 0.95:
                raise ConfigError(
                    f"server.gpu_ids puts {sharing} replicas on one GPU, "
                    f"each taking server.gpu_memory_utilization ({server.gpu_memory_utilization}) of it: lower "
                    "gpu_memory_utilization so that they fit together"
                )
        _warn_unused(self.unused_settings())
        return self

    def unused_settings(self) -> dict[str, str]:
        """Settings off their defaults that nothing reads with the rest of the run config: field path -> why
        (``server.*`` ones: :meth:`ServerConfig.unused_settings`). Warned about at validation."""
        rollout, train, unused = self.rollout, self.train, {}
        generated = (rollout.dataset or "").startswith("reasoning_gym:")
        if not generated and "dataset_seed" in _changed(rollout):
            unused["rollout.dataset_seed"] = "reasoning_gym: datasets only"
        if rollout.dataset is not None and not generated and "dataset_size" in _changed(rollout):
            unused["rollout.dataset_size"] = "reasoning_gym: datasets, or an environment's epoch without a dataset"
        if not rollout.shuffle and "shuffle_seed" in _changed(rollout):
            unused["rollout.shuffle_seed"] = "rollout.shuffle is false"
        if (rollout.dataset or "").startswith("json:") and rollout.dataset_kwargs:
            unused["rollout.dataset_kwargs"] = "reasoning_gym: and module:callable datasets only"
        if train.gradient_checkpointing != "selective" and "selective_checkpointing" in _changed(train):
            unused["train.selective_checkpointing"] = "with train.gradient_checkpointing: selective only"
        if train.nnodes == 1 and train.rdzv_endpoint:
            unused["train.rdzv_endpoint"] = "with train.nnodes > 1 only"
        if train.nnodes == 1 and "rdzv_timeout_s" in _changed(train):
            unused["train.rdzv_timeout_s"] = "with train.nnodes > 1 only"
        if train.nnodes == 1 and "shared_folder_wait_s" in _changed(train):
            unused["train.shared_folder_wait_s"] = "with train.nnodes > 1 only"
        if train.lora.enabled and train.lora.dropout > 0:
            unused["train.lora.dropout"] = "the trainer's forward has no dropout, its log-probs must be the sampler's"
        if not train.lora.enabled:
            why = "train.lora.enabled is false"
            unused.update({f"train.lora.{name}": why for name in sorted(_changed(train.lora))})
            unused.update(
                {f"train.{name}": why for name in ("adapter_store", "adapter_store_served_as") if getattr(train, name)}
            )
        if not self.export.push_to_hub:
            unused.update(
                {
                    f"export.{name}": "export.push_to_hub is false"
                    for name in ("hub_private_repo", "hub_revision")
                    if name in _changed(self.export)
                }
            )
        if not self.tracking.enabled:
            unused.update(
                {
                    f"tracking.{name}": "tracking.enabled is false"
                    for name in TRACKING_ONLY_FIELDS
                    if name in _changed(self.tracking)
                }
            )
        if self.flow.concurrency_limit is None and self.flow.concurrency_slots is not None:
            unused["flow.concurrency_slots"] = "flow.concurrency_limit is None"
        return unused

    def token_budget(self) -> int:
        """Row token budget actually used: ``packing.token_budget`` or ``server.max_model_len``."""
        return self.packing.token_budget or self.server.max_model_len

    def served_model_name(self) -> str:
        """Name the base model answers to in ``"model"`` fields."""
        return self.server.served_model_name or self.model.name

    def rollout_process(self) -> RolloutProcessConfig:
        """The rollout process's sub-config (its section plus the values it reads from their owners)."""
        lora, tracking = self.train.lora, self.tracking
        return RolloutProcessConfig(
            model=self.model,
            rollout=self.rollout,
            server=self.server,
            served_model_name=self.served_model_name(),
            max_model_len=self.server.max_model_len,
            adapter_name=lora.name if lora.enabled else None,
            log_completions=tracking.log_completions,
            num_completions_to_print=tracking.num_completions_to_print,
        )

    def trainer_process(self) -> TrainerProcessConfig:
        """The trainer's sub-config (its section plus the values it reads from their owners)."""

        def pick(section: BaseModel, names: tuple[str, ...]) -> Any:  # a dict pydantic validates into the view
            return {name: getattr(section, name) for name in names}

        return TrainerProcessConfig(
            model=self.model,
            train=self.train,
            tracking=self.tracking,
            rollout=pick(self.rollout, TRAINER_ROLLOUT_FIELDS),
            server=pick(self.server, TRAINER_SERVER_FIELDS),
            packing=pick(self.packing, TRAINER_PACKING_FIELDS),
            export=pick(self.export, TRAINER_EXPORT_FIELDS),
            token_budget=self.token_budget(),
        )

    def serves_lora(self) -> bool:
        """Whether the servers load LoRA adapters at run time (``--enable-lora``): exactly when the trainer trains
        one (``train.lora.enabled``, the owner)."""
        return self.train.lora.enabled

    def max_loras(self) -> int:
        """Adapters the server keeps resident: ``server.max_loras`` or max_staleness + 2."""
        return self.server.max_loras or self.rollout.max_staleness + 2

    def adapter_dir(self) -> Path:
        """The run's LoRA adapter folder (``<train.output_dir>/.vllm_lora``): the only one its servers load from."""
        return self.train.output_dir / ADAPTER_DIR

    def served_adapter_root(self) -> str:
        """Where the servers load LoRA adapters from (the only place their guard allows):
        ``train.adapter_store_served_as``, else ``train.adapter_store``, else :meth:`adapter_dir` (absolute)."""
        tc = self.train
        return tc.adapter_store_served_as or tc.adapter_store or str(self.adapter_dir().resolve())

    def weights_dir(self) -> Path:
        """The run's full-weight folder (``<train.output_dir>/.weights``): the only one its servers read from."""
        return self.train.output_dir / WEIGHTS_DIR


def _set_dotted(data: dict, key: str, value: object) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
    node[parts[-1]] = value


def _yaml_where(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last silently).

    Raises:
        yaml.YAMLError: malformed YAML, or a duplicate key (its ``problem_mark`` is the second key's line).
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: explicit keys may override it
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {key!r} is given twice (first on line {seen[key]}); keep one",
                        key_node.start_mark,
                    )
                if isinstance(key, typing.Hashable):
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    duplicate = next((k for k in keys if keys.count(k) > 1), None)
    if duplicate is not None:
        raise ValueError(f"the key {duplicate!r} is given twice in one object; keep one")
    return dict(pairs)


def _parse(path: Path, text: str) -> Any:
    """The data of a config file by its suffix (``.toml``, ``.json``, else YAML).

    Raises:
        ConfigError: the text does not parse (names the file, the format, line and column).
    """
    import json
    import tomllib

    import yaml

    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_json_keys)
        return _yaml_load(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_where(e)}") from None
    except ValueError as e:  # a duplicate key of a JSON object
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None


def _read_config(path: str | Path) -> dict:
    """The mapping of a config file (YAML, JSON or TOML by suffix).

    Raises:
        ConfigError: unreadable, not UTF-8, empty, unparsable or a key given twice (names the line), or not a
            mapping.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config file {p}: {e.strerror}; check the --config path") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    data = _parse(p, text) if text.strip() else None
    if data is None:
        raise ConfigError(
            f"config file {p} is empty (or holds only comments); give it the run's sections, e.g. "
            "configs/tiny.yaml, or leave out --config to use the defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _section_model(kind: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model of the section at ``loc`` (field names; list indices and union tags are stepped over), or None."""
    model: Any = kind
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            continue
        model = next(
            (
                t
                for t in (fields[part].annotation, *getattr(fields[part].annotation, "__args__", ()))
                if isinstance(t, type) and issubclass(t, BaseModel)
            ),
            None,
        )
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _field_path(kind: type[BaseModel], loc: tuple) -> str:
    """``loc`` as the dotted path a user writes: field names and list indices (``extra_args[2]``), without
    pydantic's union-member tags (``list[str]``, ``literal['all-linear']``)."""
    path, model = "", kind
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif model is not None:  # a section: ``part`` is one of its fields (past a leaf field: a union tag)
            path += f".{part}" if path else str(part)
            model = _section_model(model, (part,))
    return path


def _error_lines(kind: type[BaseModel], errors: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per field of a pydantic ValidationError: ``path: message``. An unknown key gets the section's
    closest field names; a ConfigError from a cross-field check is its own message (it names its fields); the
    failed members of a union are joined on one line."""
    from grpo_core.errors import did_you_mean

    lines: dict[str, list[str]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            lines.setdefault(str(cause), [])
            continue
        path = _field_path(kind, loc)
        if err["type"] == "extra_forbidden":
            section = _section_model(kind, loc[:-1])
            names = section.model_fields if section is not None else ()
            prefix = f"{_field_path(kind, loc[:-1])}." if loc[:-1] else ""
            path = f"{prefix}{loc[-1]}"
            msg = "unknown key" + did_you_mean(str(loc[-1]), names, prefix)
        elif err["type"] == "value_error" and cause is not None:
            msg = str(cause)
            if path and msg.startswith(path):  # the validator's message names the field already
                lines.setdefault(msg, [])
                continue
        elif err["type"] == "list_type" and isinstance(err.get("input"), str | int | float):  # one value, no list
            msg = f"{err['msg']}; write [{err['input']}] for one item"
        else:
            msg = err["msg"]
        if msg not in lines.setdefault(path or "config", []):
            lines[path or "config"].append(msg)
    return [
        f"{path}: {', or '.join(msgs)} (got {_shown(errors, path, kind)})"
        if len(msgs) > 1
        else f"{path}: {msgs[0]}"
        if msgs
        else path
        for path, msgs in lines.items()
    ]


def _shown(errors: Sequence[Mapping[str, Any]], path: str, kind: type[BaseModel]) -> str:
    """The input at ``path`` of the first error there, for a union's joined line."""
    for err in errors:
        if _field_path(kind, tuple(err["loc"])) == path:
            return repr(err.get("input"))[:80]
    return "?"


def _validate(
    kind: type[_Strict], data: dict, overrides: list[str] | None, secrets: dict[str, str] | None, hint: str = ""
) -> Any:
    """``kind`` validated from ``data`` after ``secrets`` and ``key.sub=value`` overrides (see :func:`load_config`)."""
    import yaml
    from pydantic import ValidationError

    if secrets:
        from grpo_core.redact import apply_secrets

        try:
            apply_secrets(data, secrets)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, value = item.split("=", 1)
        if not key.strip():
            raise ConfigError(
                f"override {item!r}: the key before '=' is empty; write key.sub=value, e.g. train.max_steps=5"
            )
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(
                f"override {item!r}: the key {key!r} has an empty part; write section.field=value, "
                "e.g. train.max_steps=5"
            )
        try:
            parsed = _yaml_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {item!r}: the value is not a YAML scalar or list ({_yaml_where(e)}); "
                "quote it, e.g. key='text: with colon'"
            ) from None
        _set_dotted(data, key.strip(), parsed)
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        lines = _error_lines(kind, e.errors())
        extra = hint if any(err["type"] == "extra_forbidden" for err in e.errors()) else ""
        what = "trainer sub-config" if kind is TrainerProcessConfig else "run config"
        raise ConfigError(f"invalid {what}:\n  " + "\n  ".join(lines) + extra) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, secrets: dict[str, str] | None = None
) -> RunConfig:
    """Read a run config from YAML, JSON or TOML, apply ``key.sub=value`` overrides, validate.

    Override values are parsed as YAML scalars (``train.max_steps=5``, ``train.lora.enabled=true``).
    ``secrets`` (``{field path: value}``, what a run's processes get in ``GRPO_RUN_SECRETS``) replace the
    redacted secrets of a config file grpo-flow wrote, before the overrides.

    Raises:
        ConfigError: unreadable or unparsable file (names the line), bad override, or a validation
            error (naming the field).
    """
    return _validate(RunConfig, _read_config(path) if path is not None else {}, overrides, secrets)


def load_trainer_config(
    path: str | Path, overrides: list[str] | None = None, secrets: dict[str, str] | None = None
) -> TrainerProcessConfig:
    """The trainer's sub-config from a config file: a trainer sub-config (the flow's ``train_config.json``,
    ``"process": "trainer"``) as it is, or a whole run config turned into one (:meth:`RunConfig.trainer_process`).

    Overrides and secrets use the fields' paths in the file (``train.max_steps=5``, ``server.api_key``; a sub-config
    holds only what the trainer reads).

    Raises:
        ConfigError: as :func:`load_config`; a sub-config override of a field the trainer does not read says so.
    """
    data = _read_config(path)
    if data.get("process") == "trainer":
        return _validate(
            TrainerProcessConfig,
            data,
            overrides,
            secrets,
            hint=f"\n{path} is a trainer sub-config: it holds only the fields the trainer reads "
            "(TrainerProcessConfig); set other fields in the run config it was made from",
        )
    return _validate(RunConfig, data, overrides, secrets).trainer_process()
