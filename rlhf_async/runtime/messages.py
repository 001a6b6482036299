"""Typed control messages: msgspec Structs carried in a control message's meta.

A control message (wire kind "command" or "event") carries `{"name": TAG, "payload": ...}`
in its meta; a typed message is a `Msg` subclass with `tag=TAG`, and its payload is the
Struct's fields (plus the tag). Decoding validates every field (types, unknown and missing
fields) and turns a mismatch into one `MessageError` naming the message and the field, so
a bad payload from a peer is counted and answered, never a crash.

A `Command[R]` is a request whose reply is an `R`: `Coordinator.call(node, cmd)` returns
the decoded `R`, and `Handlers.add(cmd_type, fn)` serves it on the other side. Every node
answers the built-in commands below (`Pause`, `Resume`, `Stop`, `Status`, `Readdress`,
`Peers`).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec

R = TypeVar("R")
C = TypeVar("C", bound="Msg")


class MessageError(ValueError):
    """A payload that is not the message its name says."""


class Refused(ValueError):
    """A command its handler will not do, for the reason given (a request that cannot be
    met, not a failure): answered as an error, logged as a warning without a traceback."""


class Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A control message; subclasses with `tag=...` are sent, those without are replies
    (and fields of messages)."""


class Command(Msg, Generic[R], frozen=True):
    """A request whose reply is an R."""


def tag(cls: type[Msg] | Msg) -> str:
    """The wire name of a message type (or of a message)."""
    cls = cls if isinstance(cls, type) else type(cls)
    name = cls.__struct_config__.tag
    if not isinstance(name, str):
        raise TypeError(f"{cls.__name__} has no tag: it cannot be sent on its own")
    return name


def to_payload(msg: Any) -> Any:
    """A message (or reply) as msgpack-able builtins."""
    return msgspec.to_builtins(msg)


def from_payload(cls: type[C], payload: Any) -> C:
    """The `cls` behind `payload` (None: no fields given); MessageError when it is not."""
    try:
        return msgspec.convert({} if payload is None else payload, cls)
    except msgspec.ValidationError as e:
        raise MessageError(f"{tag(cls)}: {e}") from None


def reply_type(cls: type[Command[R]]) -> Any:
    """The R of a `Command[R]` subclass, for decoding its replies."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Command:
                return typing.get_args(base)[0]
    raise TypeError(f"{cls.__name__} is not a Command[reply type]")


def decode_reply(cmd: Command[R], result: Any) -> R:
    try:
        return typing.cast(R, msgspec.convert(result, reply_type(type(cmd))))
    except msgspec.ValidationError as e:
        raise MessageError(f"reply to {tag(cmd)}: {e}") from None


Handler = Callable[[Any], Any]


class Handlers:
    """Commands this side answers: the command's type -> handler(command) -> reply."""

    def __init__(self, log: Any) -> None:
        self.log = log  # a structlog logger: failures are logged where they happen
        self._by_tag: dict[str, tuple[type[Msg], Handler]] = {}

    def add(self, cls: type[Command[R]], handler: Callable[[Any], R | Awaitable[R]]) -> None:
        name = tag(cls)
        if name in self._by_tag:
            raise ValueError(f"command {name!r} has a handler already")
        self._by_tag[name] = (cls, handler)

    @property
    def names(self) -> list[str]:
        return sorted(self._by_tag)

    async def answer(self, name: Any, payload: Any) -> dict[str, Any]:
        """The reply meta for command `name`: {"ok": True, "result": ...} or {"ok": False,
        "error": ...}; a handler's exception becomes the error, never escapes."""
        entry = self._by_tag.get(name) if isinstance(name, str) else None
        if entry is None:
            return {"ok": False, "error": f"unknown command {name!r}; known: {self.names}"}
        cls, handler = entry
        try:
            command = from_payload(cls, payload)
        except MessageError as e:
            self.log.warning("bad_command", command=name, error=str(e))
            return {"ok": False, "error": f"MessageError: {e}"}
        try:
            result = handler(command)
            if inspect.isawaitable(result):
                result = await result
            return {"ok": True, "result": to_payload(result)}
        except Refused as e:
            self.log.warning("command_refused", command=name, reason=str(e))
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        except Exception as e:  # a failing handler must not kill the node or coordinator
            self.log.exception("command_failed", command=name)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}


# ---- built-in commands: every node answers these; the coordinator answers Status, Stop ---

class Paused(Msg, frozen=True):
    paused: bool


class Stopping(Msg, frozen=True):
    stopping: bool = True


class Pause(Command[Paused], frozen=True, tag="pause"):
    pass


class Resume(Command[Paused], frozen=True, tag="resume"):
    pass


class Stop(Command[Stopping], frozen=True, tag="stop"):
    reason: str = "stop"


class Status(Command[dict[str, Any]], frozen=True, tag="status"):
    pass


class Readdress(Command[dict[str, list[str]]], frozen=True, tag="readdress"):
    """Peers bound at the old addresses (keys) now listen at the new ones; the reply
    names what each data channel left."""

    moved: dict[str, str]


class Peers(Command[list[str]], frozen=True, tag="peers"):
    """The node's connecting data channel `channel` now sends to (or takes from) exactly
    `addresses` (its job was scaled: a peer started or retired); replied with the
    addresses it left."""

    channel: str
    addresses: list[str]
