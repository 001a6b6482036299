"""Hand-worked cases for the staleness policy (steps and versions count from 0)."""

from __future__ import annotations

import json

import msgpack
import pytest

from rlhf_async.rl.staleness import StalenessPolicy

# required_version for steps 0..9, worked by hand: max(0, floor(s / N) - k)
REQUIRED = {
    (0, 1): [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    (1, 1): [0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
    (2, 1): [0, 0, 0, 1, 2, 3, 4, 5, 6, 7],
    (0, 2): [0, 0, 1, 1, 2, 2, 3, 3, 4, 4],
    (1, 2): [0, 0, 0, 0, 1, 1, 2, 2, 3, 3],
    (2, 2): [0, 0, 0, 0, 0, 0, 1, 1, 2, 2],
}


@pytest.mark.parametrize(("k", "n"), sorted(REQUIRED))
def test_required_version_table(k: int, n: int) -> None:
    policy = StalenessPolicy(max_staleness=k, publish_every=n)
    assert [policy.required_version(s) for s in range(10)] == REQUIRED[(k, n)]


@pytest.mark.parametrize(("k", "n"), sorted(REQUIRED))
def test_dispatch_limit_agrees_with_can_dispatch(k: int, n: int) -> None:
    policy = StalenessPolicy(k, n)
    for v in range(4):
        allowed = [s for s in range(40) if policy.can_dispatch(s, v)]
        assert allowed == list(range(policy.dispatch_limit(v)))


def test_synchronous_k0_n1() -> None:
    p = StalenessPolicy(0, 1)
    assert p.can_dispatch(0, 0)
    assert not p.can_dispatch(1, 0)  # batch 1 needs the weights after step 0
    assert p.can_dispatch(1, 1)
    assert p.dispatch_limit(0) == 1
    assert p.admit(3, 3)
    assert not p.admit(3, 2)
    assert (p.admitted, p.dropped, p.histogram) == (1, 1, {0: 1})


def test_k1_n1_one_batch_ahead() -> None:
    p = StalenessPolicy(1, 1)
    assert p.can_dispatch(1, 0)  # batch 1 overlaps training of batch 0
    assert not p.can_dispatch(2, 0)
    assert p.dispatch_limit(0) == 2
    assert p.admit(5, 5) and p.admit(5, 4)
    assert not p.admit(5, 3)
    assert (p.admitted, p.dropped, p.histogram) == (2, 1, {0: 1, 1: 1})


def test_k0_n2_publish_every_two_steps() -> None:
    p = StalenessPolicy(0, 2)
    assert p.can_dispatch(1, 0) and not p.can_dispatch(2, 0)
    assert p.dispatch_limit(1) == 4
    assert p.admit(3, 1)
    assert not p.admit(3, 0)
    assert p.histogram == {0: 1}


def test_k2_n2() -> None:
    p = StalenessPolicy(2, 2)
    assert p.dispatch_limit(0) == 6
    assert p.can_dispatch(5, 0) and not p.can_dispatch(6, 0)
    assert p.admit(7, 3) and p.admit(7, 2) and p.admit(7, 1)  # sync version of step 7 is 3
    assert not p.admit(7, 0)
    assert p.histogram == {0: 1, 1: 1, 2: 1}
    assert (p.admitted, p.dropped) == (3, 1)


def test_version_from_future_is_rejected_and_counted() -> None:
    p = StalenessPolicy(1, 2)
    assert not p.admit(3, 2)  # version 2 appears only after 4 optimizer steps
    assert (p.admitted, p.dropped, p.rejected_future) == (0, 0, 1)


def test_metrics() -> None:
    p = StalenessPolicy(1, 1)
    p.admit(4, 4)
    p.admit(4, 3)
    p.admit(4, 3)
    p.admit(4, 0)
    m = p.metrics()
    assert m["staleness/admitted"] == 3.0 == m["staleness/admitted_total"]
    assert m["staleness/dropped"] == 1.0 == m["staleness/dropped_total"]
    assert m["staleness/mean"] == pytest.approx(2 / 3)
    assert m["staleness/hist/1"] == 2.0
    # the next step's record counts that step alone; the totals go on
    p.admit(5, 5)
    m = p.metrics()
    assert (m["staleness/admitted"], m["staleness/dropped"]) == (1.0, 0.0)
    assert m["staleness/mean"] == 0.0 and m["staleness/hist/0"] == 1.0
    assert "staleness/hist/1" not in m
    assert (m["staleness/admitted_total"], m["staleness/dropped_total"]) == (4.0, 1.0)
    assert m["staleness/mean_total"] == pytest.approx(2 / 4)
    assert p.metrics()["staleness/admitted"] == 0.0 and "staleness/mean" not in p.metrics()


def test_state_roundtrip_through_json_and_msgpack() -> None:
    p = StalenessPolicy(2, 1)
    for v in (5, 4, 4, 3, 1):
        p.admit(5, v)
    state = p.state_dict()
    for restored_state in (json.loads(json.dumps(state)), msgpack.unpackb(msgpack.packb(state))):
        q = StalenessPolicy(2, 1)
        q.load_state_dict(restored_state)
        assert q.state_dict() == state
        assert q.histogram == {0: 1, 1: 2, 2: 1}


@pytest.mark.parametrize(
    "state",
    [
        None,
        {},
        {"format": 99},
        {"format": 1, "admitted": 1},
        {"format": 1, "admitted": -1, "dropped": 0, "rejected_future": 0, "histogram": []},
        {"format": 1, "admitted": 0, "dropped": 0, "rejected_future": 0, "histogram": [[1]]},
    ],
)
def test_bad_state_is_one_clear_error(state: object) -> None:
    with pytest.raises(ValueError, match="staleness state"):
        StalenessPolicy(0, 1).load_state_dict(state)  # type: ignore[arg-type]


@pytest.mark.parametrize(("k", "n"), [(-1, 1), (0, 0), (1.5, 1), (True, 1)])
def test_bad_settings(k: object, n: object) -> None:
    with pytest.raises(ValueError, match="max_staleness|publish_every"):
        StalenessPolicy(k, n)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    p = StalenessPolicy(0, 1)
    with pytest.raises(ValueError, match="step"):
        p.required_version(-1)
    with pytest.raises(ValueError, match="rollout_version"):
        p.admit(0, -2)
