"""A scale request parsed and planned against the processes running now: what starts on
which free device, what retires, and every refusal as one clear message."""

from __future__ import annotations

import pytest

from rlhf_async.control.reshape import ReshapeError, Scale, parse_scale, plan_reshape

# trainer on 0, one generator on 1, one scorer on 2, of 5 devices: 3 and 4 are free
RUNNING = {"trainer": ("trainer", (0,)), "gen0": ("generator", (1,)),
           "scorer0": ("scorer", (2,))}


def test_parse_takes_both_keys():
    assert parse_scale(["generators=3", "scorers=2"]) == Scale(generators=3, scorers=2)
    assert parse_scale(["scorers = 1".replace(" ", "")]) == Scale(scorers=1)


@pytest.mark.parametrize(("args", "message"), [
    (["workers=2"], "unknown key 'workers'; accepted: generators, scorers"),
    (["generators"], "'generators': expected KEY=N"),
    (["generators=two"], "generators='two': expected a whole number"),
    (["generators=1", "generators=2"], "generators given twice"),
    (["generators=0"], "generators=0: a count must be at least 1"),
    (["scorers=-1"], "scorers=-1: a count must be at least 1"),
    ([], "nothing to scale"),
])
def test_parse_refuses_with_one_message(args, message):
    with pytest.raises(ReshapeError, match="^" + message.replace("(", r"\(")):
        parse_scale(args)


def test_parse_lists_every_problem_at_once():
    with pytest.raises(ReshapeError) as e:
        parse_scale(["gens=2", "scorers=x"])
    assert "unknown key 'gens'" in str(e.value) and "scorers='x'" in str(e.value)


def test_scale_up_takes_the_lowest_free_devices_and_next_ids():
    plan = plan_reshape(RUNNING, 5, {"generator": 3})
    assert plan.add == {"gen1": ("generator", (3,)), "gen2": ("generator", (4,))}
    assert plan.remove == () and plan.counts == {"generator": 3}


def test_scale_down_retires_the_newest_first():
    running = {**RUNNING, "gen1": ("generator", (3,)), "gen2": ("generator", (4,))}
    plan = plan_reshape(running, 5, {"generator": 1})
    assert plan.remove == ("gen2", "gen1") and plan.add == {}


def test_unchanged_counts_are_an_empty_plan():
    assert plan_reshape(RUNNING, 5, {"generator": 1, "scorer": 1}).empty


def test_devices_freed_by_a_retirement_are_free_for_a_start():
    # 3 devices, all busy: retiring the second scorer makes room for a second generator
    running = {"trainer": ("trainer", (0,)), "gen0": ("generator", (1,)),
               "scorer0": ("scorer", (1,)), "scorer1": ("scorer", (2,))}
    with pytest.raises(ReshapeError, match=r"only \[\] are free"):
        plan_reshape(running, 3, {"generator": 2})
    plan = plan_reshape(running, 3, {"generator": 2, "scorer": 1})
    assert plan.remove == ("scorer1",) and plan.add == {"gen1": ("generator", (2,))}


def test_too_few_free_devices_names_what_is_free_and_needed():
    with pytest.raises(ReshapeError) as e:
        plan_reshape(RUNNING, 4, {"generator": 3, "scorer": 2}, device_word="GPU")
    msg = str(e.value)
    assert "not enough free GPUs" in msg and "placement.devices = 4" in msg
    assert "only [3] are free" in msg and "in use: [0, 1, 2]" in msg


def test_a_tensor_parallel_generator_takes_its_width_in_devices():
    plan = plan_reshape(RUNNING, 7, {"generator": 2}, {"generator": 2})
    assert plan.add == {"gen1": ("generator", (3, 4))}
    with pytest.raises(ReshapeError, match="generators=2 needs 1 more process.es. of 2 device"):
        plan_reshape(RUNNING, 4, {"generator": 2}, {"generator": 2})
