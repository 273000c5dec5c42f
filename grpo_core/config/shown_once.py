"""Config warnings once per process: a config is validated several times in one process (``grpo validate`` and
``grpo train`` load it, the preflight re-validates the rollout section as the loop class's config, an assignment
re-runs a section's validators, ``grpo resume`` loads its overrides twice), and each validation used to log its
warnings again. The loggers of the config package and of the preflight checks drop a warning whose text they
already showed in this process.
"""

from __future__ import annotations

import logging
import pkgutil
import threading
from collections.abc import Iterable


class OncePerProcess(logging.Filter):
    """A logging filter that lets each distinct WARNING-or-above message through once per process (records below
    WARNING always pass). Attached to a logger, it sees that logger's own records (not its children's)."""

    def __init__(self) -> None:
        super().__init__()
        self._shown: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is shown: below WARNING, or a (level, message) not shown before in this process."""
        if record.levelno < logging.WARNING:
            return True
        key = (record.levelno, record.getMessage())
        with self._lock:
            if key in self._shown:
                return False
            self._shown.add(key)
            return True

    def forget(self) -> None:
        """Show every message again (a test that checks a warning is logged starts from here)."""
        with self._lock:
            self._shown.clear()


#: The one filter of the process: a message shown by one config logger is not shown again by another.
ONCE = OncePerProcess()


def show_once(logger: logging.Logger) -> logging.Logger:
    """``logger`` with :data:`ONCE` attached (once, however often this is called); returns it."""
    if ONCE not in logger.filters:
        logger.addFilter(ONCE)
    return logger


def show_package_once(package: str, path: Iterable[str]) -> None:
    """Attach :data:`ONCE` to the logger of ``package`` and of every module in it (``logging.getLogger(__name__)``
    of each, whether imported yet or not).

    Args:
        package: the package's dotted name (its ``__name__``).
        path: the package's ``__path__``.
    """
    show_once(logging.getLogger(package))
    for module in pkgutil.iter_modules(path):
        show_once(logging.getLogger(f"{package}.{module.name}"))


def forget_shown() -> None:
    """Show every config warning again, as in a fresh process (tests that check a warning call it first)."""
    ONCE.forget()
