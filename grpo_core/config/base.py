"""Shared pieces of the run config: the strict base model, user paths, loopback hosts, section views."""

from __future__ import annotations

import logging
import os
import typing
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    SecretStr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
)

from grpo_core.errors import ConfigError
from grpo_core.security.redact import mask_secret_keys

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


def check_gpu_ids(ids: list[int] | None, field: str) -> list[int] | None:
    """``ids`` (a ``gpu_ids`` setting named ``field``) unless an index is negative.

    Raises:
        ValueError: a negative CUDA device index (names the field and the fix).
    """
    negative = [i for i in ids or [] if i < 0]
    if negative:
        raise ValueError(
            f"{field}={ids} holds {negative}: CUDA device indices start at 0 (as nvidia-smi numbers the GPUs); "
            "list indices >= 0"
        )
    return ids


class _Strict(BaseModel):
    """Base of every config model: unknown keys refused, assignments validated, and every float field finite
    (``allow_inf_nan=False``: a NaN or infinite learning rate, temperature, timeout or weight is refused in every
    section, lists and tuples of floats included, instead of one field at a time)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

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
        ``GRPO_RUN_SECRETS`` (:func:`grpo_core.security.redact.secret_values`)."""
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
