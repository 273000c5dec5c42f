"""What ``grpo train`` prints of Prefect's log: a failure of grpo-flow's own as one line, its traceback in a file.

Prefect logs a failed task or flow run with the exception's traceback (``Task run failed with exception: ...``,
``Encountered exception during execution: ...``) and its state with the exception's whole message
(``Finished in state Failed('... \\n last output: ...')``). For grpo-flow's own errors (:class:`GrpoError` and its
subclasses, whose messages already name the cause, and whose child failures the message summarises) those
tracebacks are frames of the flow and of Prefect's engine, printed once per task and again for the flow: hundreds
of lines above the run's one-line cause. Here the command's console prints such a record as its first line, with
the exception as ``Type: first line of its message``, and no traceback; every record, tracebacks included, goes in
full to the command's log file (:func:`attach`) and, as before, to Prefect's database (its API log handler is
untouched). An error that is not grpo-flow's (a bug, a library's exception) keeps its traceback on the console.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from grpo_core.errors import GrpoError

#: Loggers of Prefect's run engines, whose records carry the run's failure and final state.
ENGINE_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")
#: Where a one-line record says the rest is.
MORE = " (traceback in {log})"
#: The file handlers of the last :func:`attach`.
_ATTACHED: list[logging.FileHandler] = []


def _first_line(text: str) -> str:
    """``text`` up to its first line break, a real one or an escaped ``\\n`` of a repr'd message."""
    return text.split("\n", 1)[0].split("\\n", 1)[0].rstrip()


def _exception_of(record: logging.LogRecord) -> BaseException | None:
    return record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else None


def short_record(record: logging.LogRecord, log_path: Path | None = None) -> logging.LogRecord | None:
    """The one-line copy of ``record`` that the console prints, or None to print ``record`` as it is.

    Shortened: a record carrying a :class:`GrpoError` (``exc_info``), and a run engine's record whose message runs
    over several lines (a Failed state quoting the exception's message). ``record`` itself is left unchanged, so
    the file and API handlers still get the traceback.

    Args:
        record: a record on its way to the console handler.
        log_path: the file holding the full record, named in a shortened line that dropped a traceback (None: not
            named).
    """
    exc = _exception_of(record)
    message = record.getMessage()
    if exc is not None:
        if not isinstance(exc, GrpoError):
            return None
        text = str(exc).strip()
        said = f"{type(exc).__name__}: {_first_line(text) if text else '(no message)'}"
        head = message.replace(repr(exc), said) if repr(exc) in message else message
        line = _first_line(head)
        if said not in line:
            line = f"{line.rstrip(':')}: {said}"
    elif record.name.startswith(ENGINE_LOGGERS) and _first_line(message) != message.rstrip():
        line = _first_line(message)
        if line.count("(") > line.count(")"):  # a state's repr cut inside its message: say so, and close it
            line += " ...)"
    else:
        return None
    short = copy.copy(record)
    more = MORE.format(log=log_path) if exc is not None and log_path is not None else ""
    short.msg, short.args = line + more, None
    short.exc_info, short.exc_text, short.stack_info = None, None, None
    return short


class _ShortConsole:
    """Wraps a console handler's ``emit``: records pass through :func:`short_record` first; once :func:`quiet`
    was called, records below WARNING are left to the file (the temporary server's teardown after the summary)."""

    quiet = False

    def __init__(self, handler: logging.Handler, log_path: Path | None) -> None:
        self.emit, self.log_path = handler.emit, log_path

    def __call__(self, record: logging.LogRecord) -> None:
        if _ShortConsole.quiet and record.levelno < logging.WARNING:
            return
        self.emit(short_record(record, self.log_path) or record)


def quiet() -> None:
    """From now on the consoles print warnings and errors only (the run is over: its last lines are the command's
    own; Prefect's teardown, e.g. ``Stopping temporary server``, still goes to the log file)."""
    _ShortConsole.quiet = True


def _loggers() -> list[logging.Logger]:
    named = (logging.getLogger(n) for n in list(logging.root.manager.loggerDict))
    return [logging.getLogger(), *(lg for lg in named if isinstance(lg, logging.Logger))]


def attach(log_path: Path, console_type: type[logging.Handler]) -> list[logging.FileHandler]:
    """Shorten the failures that every ``console_type`` handler prints, and send every record those handlers get,
    in full and formatted as they format it, to ``log_path`` (made 0600, appended to).

    Call after Prefect configured its logging; a later call replaces the file of the one before. Returns the file
    handlers (they stay until :func:`detach` or the process's end).
    """
    _ShortConsole.quiet = False  # a new command (or a test's next run in the same process) prints again
    detach(_ATTACHED)
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path.touch(mode=0o600, exist_ok=True)
    files: dict[int, logging.FileHandler] = {}
    for logger in _loggers():
        for handler in list(logger.handlers):
            if not isinstance(handler, console_type):
                continue
            if id(handler) not in files:
                files[id(handler)] = logging.FileHandler(log_path, encoding="utf-8")
                files[id(handler)].setFormatter(handler.formatter)
                files[id(handler)].setLevel(handler.level)
                if isinstance(handler.emit, _ShortConsole):
                    handler.emit.log_path = log_path
                else:
                    handler.emit = _ShortConsole(handler, log_path)  # type: ignore[method-assign]
            logger.addHandler(files[id(handler)])
    _ATTACHED[:] = files.values()
    return list(files.values())


def detach(file_handlers: list[logging.FileHandler]) -> None:
    """Remove and close :func:`attach`'s file handlers (the consoles stay short)."""
    for logger in _loggers():
        for handler in file_handlers:
            if handler in logger.handlers:
                logger.removeHandler(handler)
    for handler in list(file_handlers):
        handler.close()
