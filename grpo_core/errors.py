"""Error hierarchy of grpo-flow.

Every error caused by bad input or config is a ``ValueError`` subclass, so callers
(and Prefect retry settings) can tell bad input, which no retry fixes, from
transient failures. Messages name the offending field and say how to fix it.
"""


class GrpoError(Exception):
    """Base class of every error grpo-flow raises on purpose."""


class ConfigError(GrpoError, ValueError):
    """A config value is invalid, or two values contradict each other."""


class PackingError(GrpoError, ValueError):
    """A sample or packing request is malformed (lengths, dtypes, budget)."""


class ServingError(GrpoError):
    """A generation server could not be started, reached or used."""


class TransportError(GrpoError):
    """Samples could not be moved between the rollout and trainer processes."""
