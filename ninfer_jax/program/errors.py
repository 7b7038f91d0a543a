"""The Program's error types: refusals before any mutation versus broken invariants."""

from ninfer_jax.errors import NinferError


class ProgramError(NinferError):
    """Base of Program errors."""


class InfeasibleError(ProgramError, ValueError):
    """A request can never run on these pools, even with everything free (numbers in message)."""


class StalePlanError(ProgramError):
    """A ResourcePlan was sealed against an older resource_revision; re-plan it."""


class ResourceError(ProgramError):
    """A resource invariant was broken (double free, over-reservation, ...): fail the Engine."""


class PendingBatchError(ProgramError):
    """A PendingBatch was consumed twice, partially, or out of order: fail the Engine."""


class MissingExecutableError(ProgramError, KeyError):
    """A step was asked for with a key that was not compiled at start-up."""
