"""Simulated devices (`placement.device = "sim"`): the generation engine (`engine.py`) and
the training backend (`train.py`) that stand for GPUs by the cost model's time, the spec
a node activates (`spec.py`), scoring's time (`score_s`), and metrics in simulated seconds
(`metrics.py`). docs/howto/twin.md."""

from rlhf_async.engines.sim.spec import SimSpec, active, current, simulate

__all__ = ["SimSpec", "active", "current", "simulate"]
