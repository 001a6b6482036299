"""`rlhf-async agent`: one per host of a multi-host run; starts node processes on request.

The agent binds a ROUTER on tcp://ADDRESS:PORT. With a keys directory (`rlhf-async keys
DIR`, the same directory copied to every host) the socket is a CURVE server that admits
only the authorised client keys: anyone else's handshake fails before a message reaches
the agent. Without keys the agent refuses to bind beyond loopback (unless --insecure).

Requests are `command` messages (meta: name, payload), answered by a `reply` (meta: ok,
result | error):

    hello                                  -> {version, host, devices, pid}
    launch    {run, spec}                  -> {pid}   (spec: NodeSpec.to_dict())
    poll      {run, node}                  -> exit code or None
    terminate {run, node} / kill {run, node}
    stop_run  {run}                        -> nodes signalled

Nodes run under WORK_DIR/RUN with LocalLauncher (logs in WORK_DIR/RUN/logs/NODE.log); the
spec's keys field is replaced by this host's keys directory.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlhf_async import __version__
from rlhf_async.log import get_logger
from rlhf_async.runtime.launcher import LocalLauncher, LocalProcess
from rlhf_async.runtime.spec import NodeSpec, SpecError
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.security import Keyring
from rlhf_async.wire.transport import Endpoint, Transport

log = get_logger(component="agent")
_RUN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def local_devices() -> list[str]:
    """Devices this host can give to nodes: every CUDA device and one cpu slot per core."""
    import torch

    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return cuda + [f"cpu:{i}" for i in range(os.cpu_count() or 1)]


class AgentError(ValueError):
    """A request the agent refuses; the reply carries the message."""


class Agent:
    def __init__(self, bind: str, work_dir: str | Path, *, keys: str | Path | None = None,
                 insecure: bool = False) -> None:
        self.bind, self.work_dir = bind, Path(work_dir).resolve()
        self.keys_dir = str(Path(keys).resolve()) if keys else ""
        self.keyring = Keyring.load(keys) if keys else None
        self.insecure = insecure
        self.launcher = LocalLauncher()
        self.procs: dict[tuple[str, str], LocalProcess] = {}
        self.devices = local_devices()

    async def serve(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        async with Transport(keys=self.keyring, insecure=self.insecure) as transport:
            chan = transport.channel(Endpoint("router", self.bind, bind=True, hwm=256))
            log.info("agent serving", bind=self.bind, curve=self.keyring is not None,
                     devices=self.devices, work_dir=str(self.work_dir))
            while not stop.is_set():
                try:
                    peer, msg = await chan.recv_from(timeout=0.5)
                except TimeoutError:
                    continue
                if msg.kind != "command":
                    continue
                try:
                    meta = {"ok": True, "result": self.handle(msg.meta.get("name"),
                                                              msg.meta.get("payload"))}
                except (AgentError, SpecError, OSError) as e:
                    meta = {"ok": False, "error": str(e)}
                await chan.send(Message("reply", meta=meta, parent=msg.id, source="agent"),
                                to=peer, timeout=5.0)
        self.stop_all(signal.SIGTERM)
        return 0

    def handle(self, name: Any, payload: Any) -> Any:
        payload = payload if isinstance(payload, dict) else {}
        if name == "hello":
            return {"version": __version__, "host": socket.gethostname(),
                    "devices": self.devices, "pid": os.getpid()}
        if name == "launch":
            return self._launch(self._run(payload), payload.get("spec"))
        if name == "stop_run":
            run = self._run(payload)
            mine = [p for (r, _), p in self.procs.items() if r == run]
            for p in mine:
                p.terminate()
            return len(mine)
        if name in ("poll", "terminate", "kill"):
            key = (self._run(payload), str(payload.get("node")))
            proc = self.procs.get(key)
            if proc is None:
                raise AgentError(f"no node {key[1]!r} in run {key[0]!r} on this host")
            if name == "poll":
                return proc.poll()
            proc.terminate() if name == "terminate" else proc.kill()
            return None
        raise AgentError(f"unknown request {name!r}; accepted: hello, launch, poll, "
                         "terminate, kill, stop_run")

    def _run(self, payload: dict[str, Any]) -> str:
        run = payload.get("run")
        if not isinstance(run, str) or not _RUN.match(run):
            raise AgentError(f"run name {run!r} must match {_RUN.pattern}")
        return run

    def _launch(self, run: str, raw: Any) -> dict[str, Any]:
        spec = NodeSpec.from_dict(raw)
        if spec.device not in self.devices:
            raise AgentError(f"device {spec.device!r} is not on this host (it has "
                             f"{', '.join(self.devices)})")
        old = self.procs.get((run, spec.node_id))
        if old is not None and old.poll() is None:
            old.kill()  # a restart replaces the hung copy
        proc = self.launcher.launch(replace(spec, keys=self.keys_dir or spec.keys),
                                    self.work_dir / run)
        self.procs[(run, spec.node_id)] = proc
        log.info("node launched", run=run, node=spec.node_id, pid=proc.pid)
        return {"pid": proc.pid}

    def stop_all(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate() if sig == signal.SIGTERM else proc.kill()
