"""The HTTP protocol of the generation servers, in one place: vLLM's OpenAI-compatible routes and the dev-mode
control routes the run calls, what grpo-flow adds beyond vLLM (its routes, headers and error types), and the wire
shapes of the embedded server (requests, responses, errors).

Every server the run talks to speaks it (vLLM with ``grpo_core.serving.guard``, the embedded server, the router);
the client, the guard, the router, the embedded server, the launcher and the trainer's weight sync import the
names from here rather than spelling them.

Field names and error bodies follow what a real vLLM 0.25.1 answered on the H200
(``shared/vllm-h200/README.md``): token-id prompts, ``return_token_ids``,
``return_tokens_as_token_ids`` (top log-prob keys ``"token_id:N"``), errors as
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

    from grpo_core.serving.embedded.engine import Sequence

# vLLM's routes (OpenAI-compatible, plus the dev-mode ones of VLLM_SERVER_DEV_MODE=1 and runtime LoRA updating)
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODELS_PATH = "/v1/models"
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
IS_PAUSED_PATH = "/is_paused"
SERVER_INFO_PATH = "/server_info"
WORLD_SIZE_PATH = "/get_world_size"
INIT_WEIGHT_TRANSFER_PATH = "/init_weight_transfer_engine"
START_WEIGHT_UPDATE_PATH = "/start_weight_update"
UPDATE_WEIGHTS_PATH = "/update_weights"
FINISH_WEIGHT_UPDATE_PATH = "/finish_weight_update"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"

#: Generation routes (routed by affinity; the stale fence answers 503 on them).
GENERATION_PATHS = (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH)
#: Routes that pause a server (a pause the guard caps at ``max_pause_s``).
PAUSE_PATHS = frozenset({PAUSE_PATH, START_WEIGHT_UPDATE_PATH})
#: Control routes a router fans out to every replica, all or nothing.
CONTROL_PATHS = (
    PAUSE_PATH,
    RESUME_PATH,
    LOAD_LORA_PATH,
    UNLOAD_LORA_PATH,
    INIT_WEIGHT_TRANSFER_PATH,
    START_WEIGHT_UPDATE_PATH,
    UPDATE_WEIGHTS_PATH,
    FINISH_WEIGHT_UPDATE_PATH,
    RESET_PREFIX_CACHE_PATH,
)
#: Control routes that load files a replica may not see yet on shared storage (their 400s are retried).
READS_STORAGE_PATHS = (LOAD_LORA_PATH, UPDATE_WEIGHTS_PATH)
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
#: Routes the inference key opens (``grpo_core.security.auth.ROLE_INFERENCE``): generation and what a generating
#: client reads about the model; every other authenticated route (control, ``/metrics``, ``/grpo/*``, vLLM's
#: dev-mode reads) needs the control key, and the inference key gets 403 there.
INFERENCE_PATHS = frozenset({*GENERATION_PATHS, MODELS_PATH, TOKENIZE_PATH, DETOKENIZE_PATH})


def role_refusal(path: str) -> str:
    """The message of the 403 an inference key gets on ``path`` (a route outside :data:`INFERENCE_PATHS`)."""
    return (
        f"Forbidden: {path} needs the control key (GRPO_CONTROL_KEY, role control); the key given is the inference "
        f"key (GRPO_INFERENCE_KEY, role inference), which opens only {', '.join(sorted(INFERENCE_PATHS))}"
    )


#: HTTP paths answered without a token (they reveal nothing but liveness).
OPEN_PATHS = frozenset({HEALTH_PATH})

# grpo-flow's routes, headers and error types beyond vLLM's (grpo_core.serving.guard serves them on every replica)
NONCE_PATH = "/grpo/run_nonce"
"""Authenticated route of the generation servers answering ``{"nonce": ...}``."""
IDENTITY_PATH = "/grpo/identity"
"""Unauthenticated route of the run's HTTP listeners answering a challenge
(:func:`grpo_core.security.auth.identity_answer`)."""
STALE_PATH = "/grpo/stale"
"""Route raising (``{"stale": true, "reason"}``) or lowering (``{"stale": false, "version"}``) a replica's fence."""
#: Request header naming the policy version the client samples for (full-weight runs; ``grpo_core.serving.guard``).
POLICY_VERSION_HEADER = "X-GRPO-Policy-Version"
#: Header of every 503 the fence answers (value ``up``): the replica is loaded and ours, only out of routing, so a
#: launcher waiting for it to come up (``grpo_core.serving.launch.wait_healthy``) need not wait for the next sync.
FENCE_HEADER = "X-GRPO-Fence"
#: Request header of the router's affinity key (e.g. a group id); without it the prompt's prefix is the key.
AFFINITY_HEADER = "X-Affinity-Key"
#: Error ``type`` of the 503 a replica behind the run's policy version answers.
BEHIND_ERROR_TYPE = "PolicyVersionBehind"

LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf log-probs to this value in JSON answers


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (the subset the rollout uses; unknown keys are ignored like vLLM)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    n: int = Field(default=1, ge=1, le=128)
    # None = the server's default sampling parameter (vLLM: its neutral value with --generation-config vllm,
    # the model's generation_config.json with auto); top_k -1 and 0 both mean "off".
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    stream: bool = False
    echo: bool = False


class LoadLoraRequest(BaseModel):
    """Body of ``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    """Body of ``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None


class StartWeightUpdateRequest(BaseModel):
    """Body of ``POST /start_weight_update`` (vLLM's shape; only checkpoint format is supported)."""

    is_checkpoint_format: bool = True


class UpdateWeightsRequest(BaseModel):
    """Body of ``POST /update_weights``: ``{"update_info": {"path": DIR}}`` for the embedded server."""

    update_info: dict[str, Any]


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}`` (``code`` is the HTTP status)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, status: int, *, type_: str | None = None, param: str | None = None) -> JSONResponse:
    """A vLLM-shaped error answer (:func:`error_body`; the type defaults by status as vLLM's do)."""
    from fastapi.responses import JSONResponse

    default_type = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse(error_body(message, status, type_ or default_type, param), status_code=status)


def _logprobs_block(seq: Sequence, as_ids: bool, decode: Any) -> dict[str, Any]:
    def key(token: int) -> str:
        return f"token_id:{token}" if as_ids else decode(token)

    tokens = [key(t) for t in seq.output_ids]
    top: list[dict[str, float]] = []
    for token, logprob, alternatives in zip(seq.output_ids, seq.logprobs, seq.top_logprobs, strict=True):
        entry = {key(t): max(lp, LOGPROB_FLOOR) for t, lp in alternatives}
        entry.setdefault(key(token), max(logprob, LOGPROB_FLOOR))
        top.append(entry)
    offsets, pos = [], 0
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in seq.logprobs],
        "tokens": tokens,
        "top_logprobs": top,
    }


def completion_response(
    request: CompletionRequest, model: str, seqs: list[Sequence], decode: Any, decode_text: Any
) -> dict[str, Any]:
    """Build vLLM's ``text_completion`` answer; ``seqs`` are ordered prompt-major, then by choice.

    Args:
        request: the parsed request.
        model: the ``model`` name to echo.
        seqs: finished sequences, ``n`` per prompt.
        decode: token id -> token string (for logprob keys when not ``return_tokens_as_token_ids``).
        decode_text: list of ids -> text (special tokens skipped).
    """
    choices = []
    for index, seq in enumerate(seqs):
        choices.append(
            {
                "index": index,
                "text": decode_text(seq.output_ids),
                "logprobs": _logprobs_block(seq, request.return_tokens_as_token_ids, decode)
                if request.logprobs is not None
                else None,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.output_ids[-1]
                if seq.finish_reason == "stop" and seq.output_ids and seq.output_ids[-1] in seq.stop_token_ids
                else None,
                "token_ids": list(seq.output_ids) if request.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": list(seq.prompt_ids) if request.return_token_ids else None,
            }
        )
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs[:: request.n])
    completion_tokens = sum(len(s.output_ids) for s in seqs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        },
    }
