"""Error hierarchy of grpo-flow.

Every error caused by bad input or config is a ``ValueError`` subclass, so callers
(and Prefect retry settings) can tell bad input, which no retry fixes, from
transient failures. Messages name the offending field and say how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable


class GrpoError(Exception):
    """Base class of every error grpo-flow raises on purpose."""


class ConfigError(GrpoError, ValueError):
    """A config value is invalid, or two values contradict each other."""


class PackingError(GrpoError, ValueError):
    """A sample or packing request is malformed (lengths, dtypes, budget, Arrow schema).

    Both packing backends raise it with the same structure (the Rust core's ``PackError``, packer_rs/src/error.rs).

    Attributes:
        kind: the ``PackError`` variant (``LengthMismatch``, ``EmptySample``, ``NoTrainedToken``,
            ``FirstTokenTrained``, ``BadMask``, ``BadTokenLists``, ``BadBudget``, ``BadRanks``, ``DoesNotFit``,
            ``Schema``, ``Ipc``), or ``BadInput`` for a Python value of the wrong type.
        field: the offending sample field, Sample-schema column or argument (None for an IPC file error).
        sample_id: the offending sample's id, or None when the error is not about one sample.
    """

    def __init__(
        self, message: str, *, kind: str = "BadInput", field: str | None = None, sample_id: int | None = None
    ) -> None:
        super().__init__(message)
        self.kind, self.field, self.sample_id = kind, field, sample_id


class ServingError(GrpoError):
    """A generation server could not be started, reached or used."""


class ServerStartError(ServingError):
    """A server replica exited during start-up or did not answer ``/health`` in time.

    Often transient (a port still held by a process that is exiting, a slow model download,
    a GPU not yet released): the flow's ``provision_servers`` task retries on this error only
    (``server.start_retries``), never on config errors.
    """


class PortInUseError(ServerStartError):
    """A port a listener of the run should bind is held by another process, or another server answers there.

    The run never attaches to a server it did not start; the message names the config field and the fix.
    """


class TransportError(GrpoError):
    """Samples could not be moved between the rollout and trainer processes."""


class ServerRequestError(ServingError, ValueError):
    """The generation server refused a request (HTTP 4xx): bad input that no retry fixes.

    Attributes:
        status: the HTTP status code (0 when raised without one).
        error_type: vLLM's ``error.type`` (e.g. ``BadRequestError``, ``NotFoundError``).
    """

    def __init__(self, message: str, status: int = 0, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type

    @classmethod
    def from_response(cls, url: str, status: int, body: str) -> ServerRequestError:
        """Build from an error answer; reads vLLM's ``{"error": {"message", "type", ...}}`` body."""
        import json

        message, error_type = body[:500], None
        try:
            error = json.loads(body).get("error") or {}
            message, error_type = error.get("message", message), error.get("type")
        except (ValueError, AttributeError):
            pass
        return cls(f"{url} answered {status}: {message}", status, error_type)


class ServerUnavailableError(ServingError):
    """The generation server did not answer (connection errors, timeouts, 5xx) within the retry budget."""


class ReplicaBehindError(ServerUnavailableError):
    """A replica refused a generation request for a policy version it does not hold: no weight sync of the run
    reached it since its process started (a restart; ``grpo_core.serving.guard``, 503 ``PolicyVersionBehind``).
    Not retried on that replica: it serves again once the trainer syncs its weights to it."""


class NothingToTrainError(GrpoError, ValueError):
    """The run cannot form an optimizer step: every group came back untrainable, or the samples ran out.

    Bad input for the run as configured (no retry fixes it); the message gives the counts by cause and
    the config keys to change.
    """


class RolloutError(GrpoError):
    """The rollout loop cannot go on: a reward function raised or returned the wrong shape, or an epoch rejected
    every prompt."""


class UserCodeError(RolloutError):
    """User code failed on one group: a reward function or an environment's ``reset``/``get_reward`` raised,
    timed out (``rollout.reward_timeout_s``, ``rollout.tool_timeout_s``) or returned a non-finite reward.

    The group is dropped and charged to ``rollout.max_failed_groups``; a misconfigured function (wrong
    signature, wrong return type or length) raises plain :class:`RolloutError` instead and fails the run at once.
    """


class UserCodeTimeout(UserCodeError):
    """A call into user code took longer than its ``rollout.*_timeout_s``; it may still run in its thread."""


class ChatTemplateError(UserCodeError):
    """The model's chat template refused a conversation (its ``raise_exception``, or any Jinja error), e.g. a
    template that validates tool-call structure. The rollout drops the group, counts it in
    ``rollout/template_error_count`` and charges it to ``rollout.max_failed_groups``, so a template failing every
    group still ends the run naming the error."""


class CheckpointError(GrpoError):
    """A checkpoint cannot be used: it cannot be fetched, is incomplete, or failed to load (the message names
    the run, the checkpoint and why)."""


class DiskFullError(GrpoError):
    """A write found its device full (``ENOSPC``) or the user's quota spent (``EDQUOT``); the message names the
    path. A retry meets the same full disk until space is freed, so it is not retried."""


class RunLockedError(GrpoError):
    """Another process holds the run folder's lock (the message names its pid)."""


class RunChildError(GrpoError, RuntimeError):
    """A child process of the run failed.

    Attributes:
        causes: the class names of the exceptions that ended it, as it recorded them (empty when it recorded none:
            killed, or died without a traceback); they decide whether a retry may cure the failure
            (``grpo_core.run.retry.retry_can_cure``).
    """

    def __init__(self, message: str, causes: list[str] | None = None) -> None:
        super().__init__(message)
        self.causes = list(causes or [])


class TrainerError(RunChildError):
    """The trainer process failed; the message holds the tail of its output."""


class RolloutProcessError(RunChildError):
    """The rollout process failed to start or exited with an error; the message holds its log's tail."""


class ChildDiedError(GrpoError, RuntimeError):
    """A child of the run (the rollout process, a generation server replica, the router) exited on its own, so
    the run stopped the trainer; the message names the child, its exit code and its log's tail."""


#: Errors that an attempt meets again on a retry: the same config, data and code fail the same way (bad input:
#: every ``ValueError``, ConfigError, NothingToTrainError and pydantic's ValidationError among them; user code
#: that raises or times out; a checkpoint that cannot be used; a full disk), and programming errors. Everything else (a
#: process killed, a server or the network gone, a transport timeout, a held run lock) a retry may cure.
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    RolloutError,
    CheckpointError,
    DiskFullError,
    TypeError,
    AttributeError,
    ImportError,
    NameError,
    SyntaxError,
    KeyError,
    IndexError,
    AssertionError,
    NotImplementedError,
    ZeroDivisionError,
)


def _names(cls: type) -> set[str]:
    return {cls.__name__} | {n for sub in cls.__subclasses__() for n in _names(sub)}


def is_deterministic(exc: BaseException | str) -> bool:
    """Whether a retry would meet ``exc`` again (see :data:`DETERMINISTIC_ERRORS`).

    Args:
        exc: an exception, or the class name of one raised in a child process (``ConfigError``, or qualified
            ``grpo_core.errors.ConfigError``), as the trainer's error file and the rollout's traceback record it.
    """
    if isinstance(exc, str):
        name = exc.rsplit(".", 1)[-1]
        return any(name in _names(cls) for cls in DETERMINISTIC_ERRORS)
    return isinstance(exc, DETERMINISTIC_ERRORS)


def did_you_mean(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean PREFIX+a or PREFIX+b?"`` for the choices closest to a misspelt ``name`` (difflib's
    ratio >= 0.6, at most 3, best first), or ``""`` when none is close.

    Args:
        name: what the user wrote (a field or task name).
        choices: the valid names.
        prefix: put before each suggestion, e.g. ``"train."`` for a field of the train section.
    """
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
