"""Typed commands without processes: a `Handlers` table answers what a node or the
coordinator receives; a bad payload or a failing handler is an error reply, never a raise."""

import asyncio

import pytest
import structlog

from rlhf_async.runtime.messages import (
    Command,
    Handlers,
    MessageError,
    Msg,
    Paused,
    Readdress,
    Status,
    decode_reply,
    from_payload,
    reply_type,
    tag,
    to_payload,
)


class Added(Msg, frozen=True):
    total: int


class Add(Command[Added], frozen=True, tag="add"):
    a: int
    b: int = 0


def answer(handlers: Handlers, name: object, payload: object) -> dict:
    return asyncio.run(handlers.answer(name, payload))


def test_a_command_is_answered_with_its_typed_reply_as_builtins():
    handlers = Handlers(structlog.get_logger())
    handlers.add(Add, lambda cmd: Added(cmd.a + cmd.b))

    async def slow(cmd: Status) -> dict:
        await asyncio.sleep(0)
        return {"ok": 1}
    handlers.add(Status, slow)
    assert answer(handlers, "add", to_payload(Add(2, 3))) == {"ok": True, "result": {"total": 5}}
    assert answer(handlers, "add", {"a": 4}) == {"ok": True, "result": {"total": 4}}
    assert answer(handlers, "status", None) == {"ok": True, "result": {"ok": 1}}
    assert decode_reply(Add(1), {"total": 5}) == Added(5)
    with pytest.raises(ValueError, match="'add' has a handler already"):
        handlers.add(Add, lambda cmd: Added(0))


def test_bad_payloads_unknown_commands_and_failing_handlers_are_error_replies():
    handlers = Handlers(structlog.get_logger())
    handlers.add(Add, lambda cmd: Added(cmd.a // cmd.b))
    assert answer(handlers, "add", {"a": "1"}) == {
        "ok": False, "error": "MessageError: add: Expected `int`, got `str` - at `$.a`"}
    assert answer(handlers, "add", {"a": 1, "c": 2})["error"] == \
        "MessageError: add: Object contains unknown field `c`"
    assert answer(handlers, "add", {"a": 1, "b": 0})["error"] == \
        "ZeroDivisionError: integer division or modulo by zero"
    assert answer(handlers, "sub", {}) == {"ok": False,
                                           "error": "unknown command 'sub'; known: ['add']"}
    assert answer(handlers, 7, {})["ok"] is False  # a name that is not even a string


def test_tags_reply_types_and_decoding_errors():
    assert (tag(Add), tag(Add(1)), tag(Readdress)) == ("add", "add", "readdress")
    assert reply_type(Add) is Added and reply_type(Readdress) == dict[str, list[str]]
    with pytest.raises(TypeError, match="Paused has no tag"):
        tag(Paused)
    assert to_payload(Paused(True)) == {"paused": True}  # replies carry no tag
    with pytest.raises(MessageError, match=r"readdress: Expected `object`, got `array`"):
        from_payload(Readdress, {"moved": ["a"]})
    with pytest.raises(MessageError, match="reply to add: Object missing required field"):
        decode_reply(Add(1), {})


def test_a_refusal_is_an_error_reply_logged_without_a_traceback():
    from rlhf_async.runtime.messages import Refused

    handlers = Handlers(structlog.get_logger())

    def refuse(cmd: Add) -> Added:
        raise Refused(f"a = {cmd.a}: only even numbers")
    handlers.add(Add, refuse)
    with structlog.testing.capture_logs() as logs:
        reply = answer(handlers, "add", {"a": 3})
    assert reply == {"ok": False, "error": "Refused: a = 3: only even numbers"}
    assert [(e["event"], e["log_level"]) for e in logs] == [("command_refused", "warning")]
    assert "exc_info" not in logs[0]
