"""Typed errors of the weight broadcast: callers catch these, never torch's RuntimeError."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight-sync group could not be built or a transfer failed."""


class WeightSyncTimeout(WeightSyncError):
    """A peer did not show up (or a transfer did not finish) within the group's timeout."""


class WeightSyncPlanError(WeightSyncError, ValueError):
    """A group spec or plan is malformed, or the weights do not fit the target model."""
