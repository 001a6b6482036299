"""Node process entry: load the spec, open sockets, handshake, run `main(node)`, clean up.

Exit codes: 0 finished or stopped, 1 the node program raised, 2 bad spec or entry point,
3 the coordinator went silent for `orphan_timeout_s` (no orphans after a coordinator crash),
4 fenced: this process is an incarnation the coordinator declared dead (frozen, or cut off,
and replaced meanwhile); it exits at once, writing nothing, its replacement does the work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NoReturn

import structlog
import torch

from rlhf_async.log import configure_logging
from rlhf_async.runtime.beats import COORDINATOR, BeatBoard
from rlhf_async.runtime.cpu import set_cpu_compute
from rlhf_async.runtime.loop import run_loop
from rlhf_async.runtime.node import Node
from rlhf_async.runtime.spec import NodeSpec, SpecError
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.security import Keyring, SecurityError
from rlhf_async.wire.transport import Endpoint, Transport

EXIT_OK, EXIT_FAILED, EXIT_BAD_SPEC, EXIT_ORPHANED, EXIT_FENCED = 0, 1, 2, 3, 4
NodeMain = Callable[[Node], Awaitable[None]]


def resolve_entry(entry: str) -> NodeMain:
    module_name, _, fn_name = entry.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise SpecError(f"entry {entry!r} cannot be loaded: {e}") from None
    if not inspect.iscoroutinefunction(fn):
        raise SpecError(f"entry {entry!r} must be an `async def` function taking a Node")
    return fn  # type: ignore[no-any-return]


async def _control_loop(node: Node, heard: list[float]) -> None:
    # Every message from the coordinator (heartbeat answers included) proves it is alive.
    async for msg in node._control:
        if msg.kind == "fenced":  # replaced: no step, checkpoint or goodbye of ours may follow
            node.log.error("fenced", incarnation=node.spec.incarnation)
            logging.shutdown()
            os._exit(EXIT_FENCED)
        heard[0] = time.monotonic()
        if msg.kind == "command":  # handlers run concurrently: a slow one blocks nothing
            node.transport.spawn(node.handle_command(msg), name=f"command-{msg.id}")


def beat_every(heartbeat_s: float, orphan_timeout_s: float) -> float:
    """Seconds between a node's heartbeats: the coordinator's `heartbeat_s`, and often
    enough that a node asking for an answer (`asks_answer`) hears one before
    `orphan_timeout_s`."""
    return min(heartbeat_s, orphan_timeout_s / 4)


def asks_answer(silent_s: float, orphan_timeout_s: float) -> bool:
    """Whether a heartbeat asks the coordinator to answer: only once it has been silent a
    third of `orphan_timeout_s`. A coordinator that answered every beat spent most of its
    CPU on them at 100+ nodes; whatever else it sends (a command, a reply) proves it alive
    as well."""
    return silent_s > orphan_timeout_s / 3


def _board(node: Node) -> BeatBoard | None:
    """The coordinator's heartbeat board, when the node shares its host (runtime/beats.py)."""
    path = getattr(node.spec, "beats", "")
    if not path:
        return None
    try:
        return BeatBoard.open(path)
    except (OSError, ValueError) as e:  # gone (its coordinator too), or cut short
        node.log.warning("heartbeat_board_unusable", path=path, error=str(e))
        return None


async def _heartbeat_loop(node: Node, heard: list[float], orphaned: asyncio.Event) -> None:
    spec, stalled, board = node.spec, False, _board(node)
    every = beat_every(spec.heartbeat_s, spec.orphan_timeout_s)
    while True:
        if board is not None:  # the coordinator stamps its slot while it lives
            heard[0] = max(heard[0], board.read(COORDINATOR))
        silent = time.monotonic() - heard[0]
        if silent > spec.orphan_timeout_s:
            node.log.error("coordinator_lost", silent_s=round(silent, 1))
            orphaned.set()
            node.request_stop("coordinator lost")
            return
        if late := node.watchdog.overdue():  # hung (a kernel, a collective): let it be dead
            if not stalled:
                node.log.error("operation_overdue", operations={o.what: round(o.late_s, 1)
                                                                for o in late})
            stalled = True
            await asyncio.sleep(every)
            continue
        if board is not None and spec.beat_slot < board.slots:
            board.stamp(spec.beat_slot, time.monotonic())
            await asyncio.sleep(every)
            continue
        meta = {"paused": node.paused, "ask": asks_answer(silent, spec.orphan_timeout_s)}
        beat = Message("heartbeat", source=node.node_id, meta=meta)
        # control queue full: the coordinator is not reading; the check above decides
        with contextlib.suppress(TimeoutError):
            await node._control.send(beat, timeout=every)
        await asyncio.sleep(every)


async def _run_main(node: Node, fn: NodeMain) -> int:
    main_task = asyncio.ensure_future(fn(node))
    stop_task = asyncio.ensure_future(node.wait_stop())
    await asyncio.wait({main_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if not main_task.done():  # stop requested: give main a grace period, then cancel it
        await asyncio.wait({main_task}, timeout=node.spec.stop_grace_s)
        main_task.cancel()
    stop_task.cancel()
    try:
        await main_task
    except asyncio.CancelledError:
        pass
    except Exception:
        node.log.exception("node_program_failed", entry=node.spec.entry)
        return EXIT_FAILED
    return EXIT_OK


async def _hello(node: Node, kind: str, meta: dict[str, object]) -> None:
    try:
        await node._control.send(Message(kind, source=node.node_id, meta=meta),
                                 timeout=node.spec.orphan_timeout_s)
    except TimeoutError:
        raise TimeoutError(f"node {node.node_id}: {kind!r} to the coordinator at "
                           f"{node.spec.control} not accepted within "
                           f"{node.spec.orphan_timeout_s}s") from None


async def serve(spec: NodeSpec) -> int:
    fn = resolve_entry(spec.entry)
    keys = Keyring.load(spec.keys) if spec.keys else None
    async with Transport(max_bytes=spec.max_message_bytes, keys=keys,
                         insecure=spec.insecure) as transport:
        control = transport.channel(
            Endpoint("dealer", spec.control, hwm=1000, identity=spec.peer_id))
        control.linger_ms = 500  # let the goodbye reach the coordinator
        node = Node(spec, transport, control)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, node.request_stop, signal.Signals(sig).name)
        heard, orphaned = [time.monotonic()], asyncio.Event()
        transport.spawn(_control_loop(node, heard), name="control")
        transport.spawn(_heartbeat_loop(node, heard, orphaned), name="heartbeat")
        hello = {"pid": os.getpid(), "role": spec.role, "host": os.uname().nodename}
        try:
            await _hello(node, "register", hello)
            await _hello(node, "ready", hello)
        except TimeoutError as e:
            node.log.error("coordinator_unreachable", error=str(e))
            return EXIT_ORPHANED
        node.log.info("node_ready", pid=os.getpid(), entry=spec.entry)
        rc = await _run_main(node, fn)
        if orphaned.is_set():
            rc = EXIT_ORPHANED
        bye = {"rc": rc, "reason": node.stop_reason or "finished"}
        with contextlib.suppress(TimeoutError):
            await control.send(Message("stop", source=spec.node_id, meta=bye), timeout=0.5)
        node.log.info("node_exit", **bye)
        return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_async.runtime")
    parser.add_argument("--spec", required=True, type=Path, help="node spec JSON file")
    args = parser.parse_args(argv)
    try:
        spec = NodeSpec.read(args.spec)
        if not spec.control:
            raise SpecError(f"node spec {args.spec}: control endpoint is empty")
    except SpecError as e:
        configure_logging()  # the spec (and its log level) could not be read
        structlog.get_logger().error("bad_node_spec", error=str(e))
        return EXIT_BAD_SPEC
    configure_logging(spec.log_level)
    set_cpu_compute(spec.num_threads, spec.flush_denormal)  # before any thread starts
    try:
        return run_loop(serve(spec))
    except (SpecError, SecurityError) as e:
        structlog.get_logger().error("bad_node_spec", node=spec.node_id, error=str(e))
        return EXIT_BAD_SPEC


def leave(rc: int) -> NoReturn:
    """Exit with `rc`. A node still in a torch.distributed group (a rank of a multi-rank
    trainer) leaves without interpreter finalization, where tearing the group down can
    abort the process (engines/process_group.py tells how); any other exits normally."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
