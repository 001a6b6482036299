"""Typed control messages: every event and command round-trips through the wire's
msgpack; a payload that does not match its record is one EventError naming the field."""

import typing

import msgpack
import pytest

from rlhf_async.control.client import NodeEvent
from rlhf_async.pipeline import protocol as E
from rlhf_async.runtime.messages import (
    Command,
    MessageError,
    Msg,
    decode_reply,
    from_payload,
    tag,
    to_payload,
)
from rlhf_async.weight_sync import GroupSpec

SPEC = GroupSpec("gloo", "127.0.0.1", 29500, 3, peers=("trainer", "gen0", "gen1"))
COMMANDS = [E.WeightSyncPrepare, E.WeightSyncConnect, E.UpdateWeights, E.TrainGroupPrepare,
            E.TrainGroupConnect, E.Republish]


def _example(cls: type) -> Msg:
    values = {int: 3, float: 0.5, str: "x", bool: True}
    kwargs = {}
    for name, tp in typing.get_type_hints(cls).items():
        text = str(tp)
        kwargs[name] = (
            SPEC if tp is GroupSpec else
            E.WeightSync(0.5, 10) if tp is E.WeightSync else
            {"loss": 1.0} if "dict[str, float]" in text else
            {"1": 2} if "dict[str, int]" in text else
            {"version": 1} if text.startswith("dict") else
            [1, 2] if text.startswith("list") else
            next(v for t, v in values.items() if tp is t or text.startswith(t.__name__)))
    return cls(**kwargs)


@pytest.mark.parametrize("cls", [*E.EVENTS.values(), *COMMANDS], ids=tag)
def test_every_record_round_trips(cls):
    record = _example(cls)
    wire = msgpack.unpackb(msgpack.packb(to_payload(record)))  # what a peer receives
    assert from_payload(cls, wire) == record
    if cls in E.EVENTS.values():
        assert E.decode_event(NodeEvent("n", tag(cls), wire)) == record


def test_mismatched_payloads_name_what_is_wrong():
    good = to_payload(E.Generated(0, 1, 2, 3, 0.1, 0.2))

    def decode(kind, payload):
        return E.decode_event(NodeEvent("gen0", kind, payload))
    with pytest.raises(E.EventError, match="generated: Object missing required field `idle_s`"):
        decode("generated", {k: v for k, v in good.items() if k != "idle_s"})
    with pytest.raises(E.EventError, match="unknown field `extra`"):
        decode("generated", {**good, "extra": 1})
    with pytest.raises(E.EventError, match=r"generated: Expected `int`, got `str` - at `\$.step`"):
        decode("generated", {**good, "step": "0"})
    with pytest.raises(E.EventError, match=r"Expected `int`, got `bool` - at `\$.version`"):
        decode("generated", {**good, "version": True})  # a bool is not a version
    with pytest.raises(E.EventError, match="unknown event kind 'gnerated'"):
        decode("gnerated", good)
    with pytest.raises(E.EventError, match="trained: Expected `object`, got `array`"):
        decode("trained", [1, 2])
    trained = to_payload(_example(E.Trained))
    with pytest.raises(E.EventError, match=r"at `\$.sample_ids\[1\]`"):
        decode("trained", {**trained, "sample_ids": [1, "2"]})
    with pytest.raises(E.EventError, match="Invalid value 'scored' - at `\\$.type`"):
        decode("generated", {**good, "type": "scored"})  # the tag says another record
    assert decode("loaded", None) == E.Loaded()  # defaults: a generator's payload
    with pytest.raises(MessageError, match="invalid weight-sync group spec: backend 'mpi'"):
        from_payload(E.WeightSyncPrepare, {"spec": {**to_payload(SPEC), "backend": "mpi"}})


def test_a_reply_is_decoded_into_its_commands_reply_type():
    assert decode_reply(E.WeightSyncPrepare(SPEC), to_payload(SPEC)) == SPEC
    assert decode_reply(E.TrainGroupConnect("h", 1, 0, 2, 5.0),
                        {"rank": 0, "world": 2, "pid": 7}) == E.Joined(0, 2, 7)
    with pytest.raises(MessageError, match="reply to train_group_prepare: Expected `int`"):
        decode_reply(E.TrainGroupPrepare(), "4242")
    assert all(issubclass(c, Command) for c in COMMANDS)
