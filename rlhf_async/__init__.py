"""rlhf-async: RLHF training with strategy-based placement and an async actor pipeline."""

__version__ = "0.1.0"
