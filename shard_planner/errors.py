"""Errors a user can act on.

Every stage raises a subclass of :class:`UserError` for bad input; the CLI prints its message as one
line (``shard-planner: error: ...``) and exits non-zero. Anything else is a bug and keeps its
traceback (shown with ``--debug``).
"""


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do."""

    exit_code = 2


class ModelFileError(UserError):
    """The model file breaks the contract (see README, "The model file")."""


class PlanError(UserError):
    """A plan file is malformed or does not match the model."""


class ProfileError(UserError):
    """A hardware profile is missing or malformed."""


class InfeasibleError(UserError):
    """No plan in the search space fits the memory budget."""

    exit_code = 3


class RunError(UserError):
    """A launched training run failed (a rank raised, ran out of memory or hung)."""

    exit_code = 4


def first_line(exc: BaseException, empty: str = "(no message)") -> str:
    """The first line of an exception's message (``empty`` when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else empty
