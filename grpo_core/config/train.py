"""The ``packing``, ``train`` (with ``train.lora``) and ``export`` sections."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from grpo_core.config.base import _Strict, check_gpu_ids
from grpo_core.errors import ConfigError

logger = logging.getLogger(__name__)


class PackingConfig(_Strict):
    """How samples become token-budget rows (docs/algorithms.md, Token-budget batcher)."""

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
    (docs/algorithms.md, Loss); a value above 0 is warned about."""
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

    @field_validator("target_modules")
    @classmethod
    def _check_target_modules(cls, targets: list[str] | str) -> list[str] | str:
        if isinstance(targets, list) and not targets:  # PEFT: NoMatchingPeftModuleError, once the trainer starts
            raise ValueError(
                "train.lora.target_modules is an empty list: no module would get an adapter (PEFT refuses it when "
                "the trainer starts); list module names, e.g. [q_proj, k_proj, v_proj, o_proj], or write all-linear"
            )
        return targets


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

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):  # torch.optim.AdamW refuses them only when the trainer starts
            raise ValueError(
                f"train.adam_betas={list(betas)}: each AdamW beta must lie in [0, 1) (the decay of the gradient's "
                "running mean and of its square); write e.g. [0.9, 0.999]"
            )
        return betas

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids_not_negative(cls, ids: list[int] | None) -> list[int] | None:
        return check_gpu_ids(ids, "train.gpu_ids")

    @model_validator(mode="after")
    def _check_step_counts(self) -> TrainConfig:
        for name in ("weight_sync_steps", "warmup_steps"):
            value = getattr(self, name)
            if value > self.max_steps:
                logger.warning(
                    f"train.{name} ({value}) is above train.max_steps ({self.max_steps}): "
                    + (
                        "the run ends before its first weight sync, so the servers sample the initial weights "
                        "throughout"
                        if name == "weight_sync_steps"
                        else "the learning rate never reaches train.learning_rate (the warmup outlasts the run)"
                    )
                    + f"; lower train.{name} to at most {self.max_steps} or raise train.max_steps"
                )
        return self

    @model_validator(mode="after")
    def _check_sequence_mask(self) -> TrainConfig:
        if self.sequence_mask_min >= self.sequence_mask_max:
            raise ConfigError(
                f"train.sequence_mask_min ({self.sequence_mask_min}) must be below train.sequence_mask_max "
                f"({self.sequence_mask_max}); e.g. 0.999 and 1.001 for sequence_mask: geometric"
            )
        if self.loss_type != "cispo" and self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(
                f"train.epsilon_high ({self.epsilon_high:g}) is below train.epsilon ({self.epsilon:g}): the clipped "
                "surrogate's upper clip would be narrower than its lower one; set train.epsilon_high >= train.epsilon "
                "(e.g. 0.28 with 0.2, DAPO's clip-higher) or leave it unset (= epsilon). An `algorithm` preset fills "
                "only what the config leaves unset (gspo: epsilon 3e-4, epsilon_high 4e-4): set both or neither"
            )
        return self

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
    """CUDA device indices of the trainer's ranks (rank r on gpu_ids[r], set as ``CUDA_VISIBLE_DEVICES``), one per
    rank of ``num_ranks`` (a shorter or longer list is refused), each >= 0; None = the first num_ranks visible
    devices. Disjoint from server.gpu_ids for NCCL weight transfer."""
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
    """AdamW betas (β1, β2), each in [0, 1)."""
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
    overlap_micro_batches: bool = True
    """Train each micro-batch as soon as its rows are packed, while the step's later rows are still pulled and
    packed (the loss stays exact: each backward runs with a provisional divisor and the accumulated gradients are
    rescaled once the step's trained tokens are known, before clipping). False: pull the whole step first. A
    mixture-of-experts policy with ``router_aux_loss_coef`` > 0 always pulls the whole step first (its router loss
    is weighted by the step's micro-batch count, a second scale one rescale cannot fix)."""
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
    """Clipped surrogate: upper width; None = epsilon. Above epsilon = DAPO's clip-higher (DAPO uses 0.28); below
    epsilon is refused (``grpo``, ``gspo``)."""
    loss_type: Literal["grpo", "cispo", "gspo"] = "grpo"
    """``grpo``: the score-centred gradient or the clipped surrogate, as ``score_centering`` says; ``cispo``: the
    clipped IS weight of CISPO (MiniMax-M1, 2025), sg(clip(π/μ, 1 − epsilon, 1 + epsilon_high))·A·log π;
    ``gspo``: the clipped surrogate on one ratio per sequence, exp(mean of log π − log μ) (GSPO, Zheng et al.
    2025). Both need ``score_centering: false`` (docs/algorithms.md)."""
    tis_cap: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Truncated importance sampling (TIS, Yao et al. 2025): each kept token's loss is weighted by
    min(1, C/r), r = π/μ, so its importance weight is min(r, C) instead of r; None = off (the weight is r, as the
    masked range [``clip_min``, ``clip_max``] leaves it). E.g. 2.0 (docs/algorithms.md)."""
    sequence_mask: Literal["none", "sequence", "geometric"] = "none"
    """Off-policy mask of whole sequences (docs/algorithms.md): ``sequence`` leaves out a sample whose sequence
    ratio Π_t r_t lies outside [``sequence_mask_min``, ``sequence_mask_max``]; ``geometric`` one whose geometric
    mean ratio exp(mean_t log r_t) does; ``none`` = off. Applied on top of the token range."""
    sequence_mask_min: float = Field(default=0.5, gt=0, allow_inf_nan=False)
    """Lowest sequence (or geometric mean) ratio kept by ``sequence_mask`` (geometric: e.g. 0.999)."""
    sequence_mask_max: float = Field(default=2.0, gt=0, allow_inf_nan=False)
    """Highest sequence (or geometric mean) ratio kept by ``sequence_mask`` (geometric: e.g. 1.001)."""
    kl_coef: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """β of a KL penalty to a reference policy, β·KL(π‖π_ref) per trained token with the k3 estimator
    π_ref/π − log(π_ref/π) − 1 (DeepSeekMath, Shao et al. 2024, eq. 4); logged as ``kl``. 0 = off. The reference is
    the base model with ``train.lora`` (its adapter disabled: no extra memory), else a frozen copy of the initial
    weights (one more copy of the model's weights in ``dtype``, sharded like the policy, and one more forward per
    micro-batch)."""
    router_aux_loss_coef: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Weight of a mixture-of-experts model's load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4-6,
    as transformers' ``load_balancing_loss_func``) over each row's forwarded tokens, added to the loss and logged as
    ``aux_loss`` before the weight. None = the model config's ``router_aux_loss_coef`` (0 for a dense model);
    0 = off. A nonzero value for a dense model is refused."""
    logprob_chunk_size: int | None = Field(default=None, ge=1)
    """Loss terms per chunk of the fused log-prob head (extra memory about chunk × vocabulary × 6 bytes);
    None = 4096 on CUDA, 1024 on CPU."""
    length_buckets: int = Field(default=4, ge=1)
    """With compiled layers (and on CUDA): rows are padded to one of this many lengths up to the token budget
    (static shapes). The top length (every full row) is compiled before the first step, a smaller one when a row
    first needs it (a step's last, partial row; logged with its seconds, ``perf/compile_s``); more lengths pad
    less and compile more often."""
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
    inputs_path: Path | None = None
    """Set by the flow, which starts the trainer before the servers are healthy: rank 0 builds and compiles, then
    waits here for the servers' URLs and the rollout's location (``trainer_inputs.json``, ``grpo_core.run.startup``)
    instead of reading ``--server-url`` and ``rollout_location``."""
    inputs_timeout_s: float = Field(default=1860.0, gt=0)
    """Set by the flow with ``inputs_path``: how long rank 0 waits for that file (every start attempt of the servers,
    ``server.startup_timeout_s`` × (``server.start_retries`` + 1), the rollout's start and a minute); the flow stops
    the trainer earlier when a server fails to start."""


#: Units of ``export.max_shard_size`` and their bytes, as huggingface_hub's ``parse_size_to_int`` (which
#: ``save_pretrained`` and ``save_torch_state_dict`` call) takes them: decimal, case-insensitive, no ``GiB``.
SHARD_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def shard_size_bytes(size: str) -> int:
    """The bytes of an ``export.max_shard_size`` such as ``"5GB"`` or ``"500 mb"``, read as huggingface_hub's
    ``parse_size_to_int`` reads it (a number, then one of :data:`SHARD_SIZE_UNITS`).

    Raises:
        ValueError: not a positive finite number followed by TB, GB, MB or KB (names the field and an example).
    """
    text = size.strip()
    unit = text[-2:].upper()
    try:
        value = float(text[:-2].strip()) if unit in SHARD_SIZE_UNITS else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or int(value * SHARD_SIZE_UNITS[unit]) <= 0:
        raise ValueError(
            f"export.max_shard_size={size!r} is not a size: write a positive number and one of the units "
            f"{', '.join(SHARD_SIZE_UNITS)} (decimal; e.g. '5GB' or '500MB')"
        )
    return int(value * SHARD_SIZE_UNITS[unit])


class ExportConfig(_Strict):
    """The trained model at the end of a run: a ``from_pretrained`` folder, its model card, and a Hub push."""

    max_shard_size: str = "5GB"
    """Largest safetensors shard of the exported model (``save_pretrained(max_shard_size=…)``): a number and a
    decimal unit, ``TB``, ``GB``, ``MB`` or ``KB`` (``5GB``, ``500MB``); larger models get several shards and a
    ``model.safetensors.index.json``."""
    push_to_hub: bool = False
    """Upload the exported folder and its model card to the Hugging Face Hub at the end of the run
    (needs ``export.hub_model_id`` and a token: ``HF_TOKEN`` or ``hf auth login``)."""
    hub_model_id: str | None = None
    """Hub repository to push to, ``user-or-org/name`` (created when missing)."""
    hub_private_repo: bool | None = None
    """Create the Hub repository private; None = the Hub's default (public unless the org says otherwise)."""
    hub_revision: str | None = None
    """Branch of the Hub repository to commit to; None = ``main``."""

    @field_validator("max_shard_size")
    @classmethod
    def _check_shard_size(cls, size: str) -> str:
        shard_size_bytes(size)
        return size

    @model_validator(mode="after")
    def _check_hub(self) -> ExportConfig:
        if self.push_to_hub and not self.hub_model_id:
            raise ConfigError(
                "export.push_to_hub needs export.hub_model_id ('user-or-org/name'); set it or "
                "set export.push_to_hub: false"
            )
        return self
