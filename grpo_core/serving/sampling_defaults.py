"""Server-side sampling defaults, the explicit request fields that override them, and the start-up probe.

A vLLM server fills every sampling field a request leaves out from its *default sampling
parameters*: vLLM's neutral values with ``--generation-config vllm``, but with the default
``--generation-config auto`` the model's ``generation_config.json`` (``temperature``, ``top_k``,
``top_p``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``; vLLM 0.25.1
``ModelConfig.get_diff_sampling_param``), plus ``--override-generation-config``. Qwen models
ship ``top_k``/``top_p`` there, so a request that omits ``top_k`` is sampled from a different
distribution than the trainer assumes (NeMo-RL #3497). grpo-flow therefore

1. starts every server with ``--generation-config vllm``,
2. sends every field of :data:`SAMPLING_FIELDS` in every request (:func:`request_sampling_fields`),
3. checks at start-up that the server samples what the config says (:func:`sampling_problems`):
   the defaults it reports in ``/server_info`` may only touch fields the requests send, and a
   probe compares the sampler's processed log-probs under the run's settings with a neutral
   reference of the same prompt (temperature scales log-prob differences by ``1/T``; top-k
   leaves exactly ``k`` finite candidates).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from grpo_core.config import RolloutConfig

logger = logging.getLogger(__name__)

#: Keys vLLM reads from a model's generation config (``ModelConfig.get_diff_sampling_param``).
GENERATION_CONFIG_KEYS: tuple[str, ...] = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
#: Neutral value of every sampling field (vLLM's ``CompletionRequest._DEFAULT_SAMPLING_PARAMS`` and defaults).
NEUTRAL: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
#: Fields every completion request carries explicitly (besides ``max_tokens``, ``n`` and ``seed``).
SAMPLING_FIELDS: tuple[str, ...] = tuple(NEUTRAL)
#: Fields a server's defaults could set; ``max_tokens`` is always sent as well.
SENT_FIELDS: frozenset[str] = frozenset({*SAMPLING_FIELDS, "max_tokens", "seed"})
#: Probe tolerance on scaled log-prob differences (nats): bf16 logits and batch-order noise stay well below.
PROBE_ATOL = 0.05
PROBE_RTOL = 0.02


def wire_top_k(top_k: int) -> int:
    """The ``top_k`` value to send: ``-1`` for "off" (every vLLM version reads it so; 0 was rejected before v0.8)."""
    return top_k if top_k > 0 else -1


def request_sampling_fields(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> dict[str, float | int]:
    """Every sampling field of a completion request, explicit, so no server default can apply."""
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": wire_top_k(top_k),
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
    }


def generation_config_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets, as vLLM's ``--generation-config auto``
    reads them.

    Returns:
        ``{field: value}`` for the non-default keys of :data:`GENERATION_CONFIG_KEYS` (``max_new_tokens``
        renamed ``max_tokens``); ``{}`` when the folder has no generation config.
    """
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(str(model_dir)).to_diff_dict()
    except OSError:
        return {}
    out = {key: diff[key] for key in GENERATION_CONFIG_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def server_default_sampling(info: dict[str, Any], model_dir: str | Path | None) -> tuple[str, dict[str, Any]]:
    """The generation-config mode and default sampling parameters a server reports in ``/server_info``.

    Args:
        info: ``/server_info`` of the embedded server (``generation_config``, ``default_sampling_params``) or of
            vLLM with ``config_format=json`` (``vllm_config.model_config.generation_config`` and
            ``override_generation_config``).
        model_dir: the served model's folder, to read its ``generation_config.json`` when the mode is ``auto``.

    Returns:
        ``(mode, defaults)``; mode ``"unknown"`` and ``{}`` when the answer has neither shape.
    """
    if "default_sampling_params" in info:
        return str(info.get("generation_config", "unknown")), dict(info["default_sampling_params"])
    model_config = (
        (info.get("vllm_config") or {}).get("model_config") if isinstance(info.get("vllm_config"), dict) else None
    )
    if not isinstance(model_config, dict):
        return "unknown", {}
    mode = str(model_config.get("generation_config", "auto"))
    overrides = model_config.get("override_generation_config") or {}
    if mode == "vllm":
        base: dict[str, Any] = {}
    elif mode == "auto":
        base = generation_config_defaults(model_dir) if model_dir is not None else {}
    else:
        base = generation_config_defaults(mode)
    defaults = {**base, **{k: v for k, v in overrides.items() if k in GENERATION_CONFIG_KEYS}}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return mode, defaults


def default_problems(mode: str, defaults: dict[str, Any], rollout: RolloutConfig) -> list[str]:
    """Problems of a server's sampling defaults: any default on a field the requests do not send.

    A default on a field the requests send is overridden by every request; it is logged, not raised.
    """
    unsent = {k: v for k, v in defaults.items() if k not in SENT_FIELDS}
    differing = {k: v for k, v in defaults.items() if k in SENT_FIELDS and _config_value(k, rollout) != v}
    if differing:
        logger.warning(
            "the server's default sampling parameters (--generation-config %s) differ from the config: "
            "%s; every request sends these fields, so the config's values apply",
            mode,
            ", ".join(f"{k}={v} (config {_config_value(k, rollout)})" for k, v in sorted(differing.items())),
        )
    return [
        f"its default sampling parameters set {k}={v} (--generation-config {mode}), which requests do not "
        "override: --generation-config vllm"
        for k, v in sorted(unsent.items())
    ]


def _config_value(key: str, rollout: RolloutConfig) -> Any:
    if key == "max_tokens":
        return rollout.max_completion_length
    if key == "seed":
        return None
    return getattr(rollout, key, NEUTRAL.get(key))


def probe_problems(
    reference: dict[int, float], probe: dict[int, float], rollout: RolloutConfig, num_logprobs: int
) -> list[str]:
    """Compare the sampler's processed top log-probs of one position under the run's settings and neutral ones.

    Args:
        reference: ``{token_id: logprob}`` at temperature 1 with no candidate filter (processed log-probs
            are then ``log_softmax`` of the raw logits).
        probe: the same position sampled with the config's temperature/top-k/top-p/min-p.
        rollout: the run's sampling settings.
        num_logprobs: top log-probs requested in both (``-9999.0`` marks a token outside the candidate set).

    Returns:
        One message per field the server did not sample as configured, naming the value it used.
    """
    problems = []
    top = dict(sorted(probe.items(), key=lambda item: item[1], reverse=True)[:num_logprobs])
    finite = {t: lp for t, lp in top.items() if lp > -9000.0}
    expected = min(rollout.top_k, num_logprobs) if rollout.top_k > 0 else num_logprobs
    filtered = rollout.top_p < 1.0 or rollout.min_p > 0.0
    if rollout.temperature > 0 and (len(finite) > expected or (len(finite) < expected and not filtered)):
        problems.append(
            f"top_k: {len(finite)} of the top {num_logprobs} tokens are candidates but the config's "
            f"top_k={rollout.top_k} allows {expected}"
        )
    if rollout.temperature <= 0 or not reference:
        return problems
    anchor = max(reference, key=reference.get)
    shared = [t for t in finite if t in reference and t != anchor and anchor in finite]
    ratios = [
        (reference[t] - reference[anchor]) / (finite[t] - finite[anchor])
        for t in shared
        if abs(finite[t] - finite[anchor]) > 1e-6
    ]
    if ratios:
        used = sorted(ratios)[len(ratios) // 2]  # median temperature implied by the scaled differences
        if not math.isclose(used, rollout.temperature, rel_tol=PROBE_RTOL, abs_tol=PROBE_ATOL):
            problems.append(
                f"temperature: the server sampled with temperature ~{used:.3f} but the config says "
                f"{rollout.temperature}"
            )
    return problems


async def sampling_problems(
    client: Any, model: str, rollout: RolloutConfig, model_dir: str | Path | None, max_logprobs: int
) -> list[str]:
    """Everything that makes a server sample differently from ``rollout``; [] when it samples as configured.

    Reads ``/server_info`` (when the server has it) and runs the probe of :func:`probe_problems` on a
    fixed 16-token prompt (one generated token, two requests).
    """
    from grpo_core.errors import ServingError

    problems: list[str] = []
    try:
        info = await client.server_info(config_format="json")
    except ServingError:
        info = {}
    mode, defaults = server_default_sampling(info, model_dir)
    problems += default_problems(mode, defaults, rollout)
    num = max(1, min(max_logprobs, 20))
    prompt = list(range(16, 32))
    (ref,) = await client.complete(
        prompt,
        model=model,
        max_tokens=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=0,
        num_logprobs=num,
        ignore_eos=True,
    )
    (probe,) = await client.complete(
        prompt,
        model=model,
        max_tokens=1,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        min_p=rollout.min_p,
        seed=0,
        num_logprobs=num,
        ignore_eos=True,
    )
    problems += probe_problems((ref.top_logprobs or [{}])[0], (probe.top_logprobs or [{}])[0], rollout, num)
    logger.info(
        "sampling check of %s: generation-config %s, defaults %s, %s",
        model,
        mode,
        json.dumps(defaults),
        "ok" if not problems else "; ".join(problems),
    )
    return problems
