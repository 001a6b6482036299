"""Separation's stage busy time for MFU, from a step record's util/<node> shares."""

from __future__ import annotations

import pytest

from rlhf_async.strategies.utilization import stage_busy


def test_stage_busy_sums_replicas_and_counts_every_trainer_rank():
    roles = {"gen0": "generator", "gen1": "generator", "scorer0": "scorer",
             "trainer": "trainer", "trainer1": "trainer"}
    util = {"util/gen0": 0.5, "util/gen1": 0.25, "util/scorer0": 0.1, "util/trainer": 0.8}
    busy = stage_busy(util, roles, dt=2.0)
    # rank 0 reports for both trainer ranks; an unknown node counts nowhere
    assert busy == pytest.approx({"generate": 1.5, "score": 0.2, "train": 3.2})
    assert stage_busy({"util/gone": 1.0}, roles, 1.0) == {"generate": 0.0, "score": 0.0,
                                                          "train": 0.0}
