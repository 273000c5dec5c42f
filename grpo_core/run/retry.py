"""Which failures of a run a retry may cure, and the errors a failed child is reported with (no Prefect here).

A failure is classified by its root cause however it was wrapped: a child process records the class names of the
exceptions that ended it (the trainer in ``trainer_error.txt``, one line a rank; the rollout process in its
traceback file), and those names decide (``grpo_core.errors.is_deterministic``).
"""

from __future__ import annotations

import re
from pathlib import Path

from grpo_core.errors import RolloutProcessError, TrainerError, is_deterministic
from grpo_core.run import layout


def retry_can_cure(exc: BaseException) -> bool:
    """Whether a retry of the run may cure ``exc``.

    No when it is deterministic (``grpo_core.errors.is_deterministic``: bad config, a resume refused, nothing to
    train, user code that raises, ...) or a child process recorded such an error as its cause, or when an exception
    it was raised from (``raise ... from``, its ``__cause__`` chain) is; yes for the rest: a process killed, a server
    or the network gone, a timeout, a held run lock. (An exception merely handled nearby, ``__context__``, is not a
    cause.)
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        causes = getattr(current, "causes", None)
        if causes and any(is_deterministic(name) for name in causes):
            return False
        if not causes and is_deterministic(current):
            return False
        current = current.__cause__
    return True


def raise_if_rollout_failed(error_file: Path, log_file: Path, how: object) -> None:
    """Raise :class:`RolloutProcessError` when the rollout process reported its own failure in ``error_file``.

    Args:
        error_file: the rollout process's traceback file (``rollout_error.txt``; absent: no failure recorded).
        log_file: its log, named in the message.
        how: how the process ended, for the message (an exit code, or the error that ended the wait).

    Raises:
        RolloutProcessError: with the traceback's last line as the cause and its exception class in ``causes``.
    """
    if not error_file.is_file():
        return
    lines = [line for line in error_file.read_text(errors="replace").splitlines() if line.strip()]
    cause = lines[-1] if lines else "no traceback"
    causes = [m.group(1)] if (m := re.match(r"([\w.]+)(?::|$)", cause)) else []  # `module.Type: message`
    raise RolloutProcessError(
        f"rollout process failed ({how}): {cause}; traceback in {error_file}, log {log_file}", causes
    )


def rollout_failed(run_dir: str | Path, trainer_error: BaseException) -> None:
    """Raise the rollout process's own failure, when it recorded one in the run folder, in place of the trainer's
    (which then only saw its sample stream break: a transport error a retry would seem to cure).

    Raises:
        RolloutProcessError: the root cause, with the rollout's recorded exception class in ``causes``; the
            trainer's error, its symptom, is its ``__context__`` (shown above it in a traceback, not as its cause).
    """
    root = Path(run_dir)
    try:
        raise_if_rollout_failed(root / layout.ROLLOUT_ERROR, root / layout.ROLLOUT_LOG, "the trainer stopped")
    except RolloutProcessError as exc:
        exc.__context__ = trainer_error
        raise


def trainer_failed(code: int, recorded: str, tail: str) -> TrainerError:
    """The error a trainer run that exited with ``code`` is reported with.

    Args:
        code: torchrun's exit code (negative: the signal that killed it).
        recorded: what the ranks wrote to ``trainer_error.txt`` (``rank R: Type: message`` a line; '' if none).
        tail: the last lines of torchrun's output.
    """
    causes = re.findall(r"^rank \d+: ([\w.]+):", recorded, flags=re.M)
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    killed = re.search(r"Signal \d+ \((SIG\w+)\) received by PID (\d+)", tail)  # torchrun's summary of a rank
    if killed and not recorded:
        how += f" (a rank, pid {killed.group(2)}, was killed by {killed.group(1)})"
    elif not recorded:
        last = _last_exception_line(tail)
        if last:
            recorded = f"{last} (the last exception in its output)"
    return TrainerError(f"trainer {how}" + (f": {recorded}" if recorded else "") + f"\nlast output:\n{tail}", causes)


def _last_exception_line(output: str) -> str | None:
    """The last ``SomeError: message`` line of a traceback in ``output`` (a rank's lines keep torchrun's ``: ``
    prefix; torch's own ``[enforce fail at file:line]`` location is dropped), or None."""
    found = None
    for line in output.splitlines():
        match = re.match(r"^[\s:]*([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$", line)
        if match:
            text = re.sub(r"^\s*(\[enforce fail at [^\]]*\])?[\s.:]*", "", match.group(2)).strip()
            found = f"{match.group(1).rsplit('.', 1)[-1]}: {text}" if text else match.group(1)
    return found


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
