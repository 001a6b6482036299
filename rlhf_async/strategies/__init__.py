"""Placement strategies: placement as plain data, one module per strategy (preset, checks,
runner), the registry, the lock-step rank loop two of them share."""
