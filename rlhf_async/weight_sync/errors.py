"""Typed errors of the weight broadcast: callers catch these, never torch's RuntimeError."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight-sync group could not be built or a transfer failed."""


class WeightSyncTimeout(WeightSyncError):
    """A peer did not show up (or a transfer did not finish) within the group's timeout."""


class WeightSyncPlanError(WeightSyncError, ValueError):
    """A group spec or plan is malformed, or the weights do not fit the target model."""


class WeightSyncBaseMismatch(WeightSyncError):
    """A delta update arrived at a receiver that does not hold its base (or whose bytes
    differ from it): nothing was applied; the group must be rebuilt and a full update sent."""


class WeightSyncSuperseded(WeightSyncError):
    """A join of a group epoch that a newer epoch of the same group replaced before this
    process got to it (or while it waited for its peers): nothing was joined."""
