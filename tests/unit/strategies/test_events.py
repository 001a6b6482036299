"""Typed control messages: every event and command round-trips; a payload that does not
match its record is one EventError naming the field."""

import dataclasses

import pytest

from rlhf_async.strategies.separation import events as E


def _example(cls: type) -> object:
    values = {int: 3, float: 0.5, str: "x", bool: True}
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp = str(f.type)
        kwargs[f.name] = (
            {"loss": 1.0} if tp.startswith("dict[str, float]") else
            {"1": 2} if tp.startswith("dict[str, int]") else
            {"version": 1} if tp.startswith("dict") else
            [1, 2] if tp.startswith("list") else
            next(v for t, v in values.items() if tp.startswith(t.__name__)))
    return cls(**kwargs)


@pytest.mark.parametrize("cls", [*E.EVENTS.values(), *E.COMMANDS.values()])
def test_every_record_round_trips(cls):
    record = _example(cls)
    decode = E.decode_event if cls.kind in E.EVENTS else E.decode_command
    assert decode(cls.kind, E.encode(record)) == record


def test_mismatched_payloads_name_what_is_wrong():
    good = E.encode(E.Generated(0, 1, 2, 3, 0.1, 0.2))
    with pytest.raises(E.EventError, match=r"generated: missing field\(s\) \['idle_s'\]"):
        E.decode_event("generated", {k: v for k, v in good.items() if k != "idle_s"})
    with pytest.raises(E.EventError, match=r"unknown field\(s\) \['extra'\]"):
        E.decode_event("generated", {**good, "extra": 1})
    with pytest.raises(E.EventError, match="generated.step: expected <class 'int'>"):
        E.decode_event("generated", {**good, "step": "0"})
    with pytest.raises(E.EventError, match="generated.version: expected"):
        E.decode_event("generated", {**good, "version": True})  # a bool is not a version
    with pytest.raises(E.EventError, match="unknown event kind 'gnerated'"):
        E.decode_event("gnerated", good)
    with pytest.raises(E.EventError, match="payload must be a mapping"):
        E.decode_event("trained", [1, 2])
    trained = E.encode(E.Trained(0, {"loss": 1.0}, [1], 0, 0, 0.0, 0, 0.0, 0.0))
    with pytest.raises(E.EventError, match="trained.sample_ids"):
        E.decode_event("trained", {**trained, "sample_ids": [1, "2"]})
    assert E.decode_event("loaded", None) == E.Loaded()  # defaults: a generator's payload
