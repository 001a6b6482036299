"""RemoteLauncher: a `Launcher` that asks each host's agent to start node processes.

    hosts = load_hosts("hosts.txt")
    launcher = RemoteLauncher(hosts, keys="keys/", run="job-42")
    Coordinator(run_dir, launcher=launcher, control="tcp://10.0.0.1:7200", keys="keys/")

The host of a node is the one whose devices include the spec's device slot, looked up in
`placement` (node id -> host name) when given, else by device. The coordinator polls often
(every half heartbeat), so `poll` never blocks: it reads answers already in and asks again
at most once a second. A host that stops answering looks alive to `poll`; the coordinator's
heartbeat timeout declares its nodes dead, as for any hung node.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import zmq

from rlhf_async.log import get_logger
from rlhf_async.runtime.hosts import Host
from rlhf_async.runtime.launcher import wait_polling
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.wire.protocol import Message, ProtocolError, decode, encode
from rlhf_async.wire.security import Keyring, SecurityError, is_loopback

log = get_logger(component="remote")
POLL_EVERY_S = 1.0
LAUNCH_FAILED = 255  # exit code of a node its agent could not start


class AgentUnavailable(RuntimeError):
    """An agent did not answer or refused a request."""


class AgentLink:
    """One CURVE DEALER to one agent; blocking `request`, or `send` + `drain` for polling."""

    def __init__(self, host: Host, keyring: Keyring | None, ctx: zmq.Context[Any],
                 insecure: bool = False) -> None:
        self.host = host
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keyring is not None:
            keyring.apply(self.sock, bind=False, address=host.agent)
        elif not (insecure or is_loopback(host.agent)):
            raise SecurityError(f"{host.agent}: an agent beyond loopback needs CURVE keys")
        self.sock.connect(host.agent)
        self.answers: dict[str, Message] = {}

    def send(self, name: str, payload: Any = None) -> str:
        msg = Message("command", source="coordinator", meta={"name": name, "payload": payload})
        try:
            self.sock.send_multipart(encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise AgentUnavailable(f"agent {self.host.name} at {self.host.agent}: "
                                   "send queue full (not reachable?)") from None
        return msg.id

    def drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = decode(frames)
            except ProtocolError as e:
                log.warning("bad agent reply", host=self.host.name, error=str(e))
                continue
            if reply.parent is not None:
                self.answers[reply.parent] = reply

    def result(self, msg_id: str) -> Any:
        reply = self.answers.pop(msg_id)
        if not reply.meta.get("ok"):
            raise AgentUnavailable(f"agent {self.host.name}: {reply.meta.get('error')}")
        return reply.meta.get("result")

    def request(self, name: str, payload: Any = None, timeout: float = 10.0) -> Any:
        msg_id = self.send(name, payload)
        deadline = time.monotonic() + timeout
        while msg_id not in self.answers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentUnavailable(f"agent {self.host.name} at {self.host.agent} did "
                                       f"not answer {name!r} in {timeout}s")
            if self.sock.poll(int(left * 1000) + 1):
                self.drain()
        return self.result(msg_id)

    def close(self) -> None:
        self.sock.close(0)


class RemoteProcess:
    """A node on another host, shaped like Popen."""

    def __init__(self, link: AgentLink, run: str, node: str, pid: int | None) -> None:
        self.link, self.run, self.node = link, run, node
        self.pid: int | None = pid
        self._rc: int | None = None
        self._pending: str | None = None
        self._asked = 0.0

    def _payload(self) -> dict[str, str]:
        return {"run": self.run, "node": self.node}

    def poll(self) -> int | None:
        if self._rc is not None:
            return self._rc
        self.link.drain()
        if self._pending is not None and self._pending in self.link.answers:
            try:
                self._rc = self.link.result(self._pending)
            except AgentUnavailable as e:
                log.warning("poll failed", node=self.node, error=str(e))
            self._pending = None
        now = time.monotonic()
        if self._rc is None and now - self._asked > POLL_EVERY_S:
            self._asked = now
            try:
                self._pending = self.link.send("poll", self._payload())
            except AgentUnavailable:
                self._pending = None
        return self._rc

    async def wait(self, timeout: float | None = None) -> int | None:
        return await wait_polling(self.poll, timeout, 0.1)

    def _signal(self, name: str) -> None:
        try:
            self.link.send(name, self._payload())
        except AgentUnavailable as e:
            log.warning("cannot signal node", node=self.node, signal=name, error=str(e))

    def terminate(self) -> None:
        self._signal("terminate")

    def kill(self) -> None:
        self._signal("kill")


class RemoteLauncher:
    """Launches each node through the agent of the host that holds its device."""

    def __init__(self, hosts: list[Host], *, run: str, keys: str | Path | None = None,
                 placement: dict[str, str] | None = None, insecure: bool = False,
                 launch_timeout: float = 10.0) -> None:
        self.hosts = {h.name: h for h in hosts}
        self.launch_timeout = launch_timeout
        self.run, self.placement = run, placement or {}
        self.ctx: zmq.Context[Any] = zmq.Context()
        keyring = Keyring.load(keys) if keys else None
        self.links = {h.name: AgentLink(h, keyring, self.ctx, insecure) for h in hosts}

    def host_of(self, spec: NodeSpec) -> Host:
        name = self.placement.get(spec.node_id)
        if name is not None:
            return self.hosts[name]
        for h in self.hosts.values():
            if spec.device in h.devices:
                return h
        raise AgentUnavailable(f"node {spec.node_id}: no host has device {spec.device}")

    def launch(self, spec: NodeSpec, run_dir: Path) -> RemoteProcess:
        """Start the node through its host's agent. An agent that refuses or does not
        answer gives a process that already failed (exit code LAUNCH_FAILED), so the
        coordinator handles it like any node death: restart within runtime.restart_limit,
        else stop the run with its checkpoint."""
        host = self.host_of(spec)
        link = self.links[host.name]
        try:
            result = link.request("launch", {"run": self.run, "spec": spec.to_dict()},
                                  timeout=self.launch_timeout)
        except AgentUnavailable as e:
            log.error("remote launch failed", node=spec.node_id, host=host.name, error=str(e))
            failed = RemoteProcess(link, self.run, spec.node_id, None)
            failed._rc = LAUNCH_FAILED
            return failed
        log.info("remote node launched", node=spec.node_id, host=host.name, pid=result["pid"])
        return RemoteProcess(link, self.run, spec.node_id, int(result["pid"]))

    def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(AgentUnavailable):
                link.send("stop_run", {"run": self.run})
            link.close()
        self.ctx.term()
