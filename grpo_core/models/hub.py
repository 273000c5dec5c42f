"""Hugging Face Hub side of the exported model: the model card and ``push_to_hub``.

The trainer writes ``final_model/`` with ``save_pretrained`` (``grpo_core.train.export``); at the end
of the run :func:`write_model_card` adds ``README.md`` (metadata for the Hub: base model, dataset,
tags, library; then the run's rewards, reward functions, steps, reward curve and config) and, with
``export.push_to_hub``, :func:`push_to_hub` uploads the folder with ``huggingface_hub``.
:func:`check_push` runs in the flow's ``prepare`` (and ``grpo validate``) so a missing token or
repository id fails before any server starts.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from grpo_core.config import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.run.layout import REWARD_CURVE as CURVE

logger = logging.getLogger(__name__)

CARD = "README.md"


def check_push(cfg: RunConfig) -> None:
    """Fail early when ``export.push_to_hub`` cannot work: no repository id, a malformed one, or no token.

    Raises:
        ConfigError: naming the field (or the token source) and the fix.
    """
    export = cfg.export
    if not export.push_to_hub:
        return
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not export.hub_model_id:
        raise ConfigError("export.push_to_hub needs export.hub_model_id ('user-or-org/name')")
    try:
        validate_repo_id(export.hub_model_id)
    except HFValidationError as exc:
        raise ConfigError(f"export.hub_model_id={export.hub_model_id!r} is not a Hub repository id: {exc}") from None
    if not get_token():
        raise ConfigError(
            "export.push_to_hub needs a Hugging Face token with write access: set HF_TOKEN "
            "(or run `hf auth login`), or set export.push_to_hub: false"
        )


def _base_model(cfg: RunConfig) -> str | None:
    """The base model's Hub id for the card metadata: ``model.name`` when it is not a local folder."""
    name = cfg.model.name
    return None if Path(name).expanduser().exists() else name


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def write_model_card(
    cfg: RunConfig, model_dir: Path, summary: dict[str, Any], reward_curve: Path | None, adapter: bool
) -> Path:
    """Write ``README.md`` (Hub model card) into the exported folder; copy the reward curve beside it.

    Args:
        cfg: the run config (base model, dataset, reward functions, the config block).
        model_dir: the exported folder (``final_model/``).
        summary: the run summary (``steps``, ``reward_first5``, ``reward_last5``, throughputs, MLflow run id).
        reward_curve: PNG of reward per step, or None.
        adapter: the folder holds a LoRA adapter (``library_name: peft``) rather than a full model.

    Returns:
        The card's path.
    """
    from huggingface_hub import ModelCard, ModelCardData

    base = _base_model(cfg)
    dataset = cfg.rollout.dataset
    data = ModelCardData(
        base_model=base,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=["grpo", "grpo-flow", "reinforcement-learning", *(["lora"] if adapter else [])],
        datasets=[dataset.split(":", 1)[1]] if dataset and dataset.startswith("reasoning_gym:") else None,
    )
    rewards = [*cfg.rollout.reward_functions] or ["the dataset's own verifier"]
    lines = [
        f"# {cfg.export.hub_model_id or model_dir.name}",
        "",
        f"{'A LoRA adapter for' if adapter else 'A fine-tune of'} `{cfg.model.name}` trained with asynchronous "
        "GRPO (Group Relative Policy Optimization) with grpo-flow on "
        f"`{dataset or 'prompts made by the environment'}`.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| optimizer steps | {_fmt(summary.get('steps'))} |",
        f"| reward, first 5 steps | {_fmt(summary.get('reward_first5'))} |",
        f"| reward, last 5 steps | {_fmt(summary.get('reward_last5'))} |",
        f"| rollouts per prompt (G) | {cfg.rollout.num_generations} |",
        f"| learning rate | {cfg.train.learning_rate} |",
        f"| reward functions | {', '.join(f'`{r}`' for r in rewards)} |",
        f"| MLflow run | {summary.get('mlflow_run_id') or '-'} |",
        "",
    ]
    if reward_curve is not None and Path(reward_curve).is_file():
        shutil.copy2(reward_curve, model_dir / CURVE)
        lines += ["## Reward curve", "", f"![reward per step]({CURVE})", ""]
    usage = (
        "from peft import AutoPeftModelForCausalLM\nmodel = AutoPeftModelForCausalLM.from_pretrained(PATH)"
        if adapter
        else "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(PATH)"
    )
    lines += [
        "## Use",
        "",
        "```python",
        usage,
        "```",
        "",
        "## Run config",
        "",
        "```yaml",
        yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip(),
        "```",
        "",
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
    path = model_dir / CARD
    card.save(path)
    return path


def push_to_hub(cfg: RunConfig, model_dir: Path) -> str:
    """Upload the exported folder (weights, tokenizer, card) to ``export.hub_model_id``; returns the commit URL.

    The repository is created when missing (``export.hub_private_repo``); the commit goes to
    ``export.hub_revision`` (default ``main``).
    """
    from huggingface_hub import HfApi

    export = cfg.export
    api = HfApi()
    api.create_repo(export.hub_model_id, private=export.hub_private_repo, exist_ok=True)
    if export.hub_revision:
        api.create_branch(export.hub_model_id, branch=export.hub_revision, exist_ok=True)
    info = api.upload_folder(
        repo_id=export.hub_model_id,
        folder_path=str(model_dir),
        revision=export.hub_revision,
        commit_message="grpo-flow: end of training",
    )
    logger.info("pushed %s to the Hub: %s", model_dir, info.commit_url)
    return str(info.commit_url)
