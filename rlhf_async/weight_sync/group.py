"""A standalone broadcast group built from a TCPStore, outside torch's global state.

Why not `torch.distributed.init_process_group`/`new_group`: trainer and generators are
independent OS processes that may already own a default group (DDP among trainer ranks,
tensor parallelism inside a generator). The weight-sync group has to exist beside those,
be torn down and rebuilt when a generator restarts, and never touch the global registry.
So we build the backend object directly (`ProcessGroupGloo` / `ProcessGroupNCCL` over a
`PrefixStore`), the way inference engines' stateless groups do; each epoch gets its own store prefix
so a rebuilt group never reads keys of the dead one.

Before creating the backend every rank writes a "joined" key and waits for all the others
with a deadline. That turns "gloo hangs then fails somewhere in connectFullMesh" into a
`WeightSyncTimeout` naming exactly which ranks never came.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupGloo, ProcessGroupNCCL

from rlhf_async.weight_sync.errors import (
    WeightSyncError,
    WeightSyncSuperseded,
    WeightSyncTimeout,
)
from rlhf_async.weight_sync.spec import GroupSpec

# A lazy proxy: picks up configure_logging() even when called after this import.
log = structlog.get_logger(component="weight_sync")

_POLL_S = 0.02
_MESH_FLOOR_S = 5.0


def mesh_timeout_s(spec: GroupSpec) -> float:
    """How long gloo may take to connect the full mesh, once every rank has joined: a
    quarter of the group's timeout, at least 5 s (never more than the whole). Only
    handshakes are left then, so this need not cover a transfer; it bounds a failed
    mesh, which gloo waits out a peer at a time (a member killed in it held every other
    for 5x the timeout: 150 s at 30 s). Transfers keep the whole timeout."""
    return min(spec.timeout_s, max(_MESH_FLOOR_S, spec.timeout_s / 4))


# the newest epoch of each group (its store's address and its name) this process was asked
# to join: a join of an older one gives up (joins.py says why)
_newest: dict[tuple[str, int, str], int] = {}


def _key(spec: GroupSpec) -> tuple[str, int, str]:
    return spec.master_addr, spec.master_port, spec.name


def ask_epoch(spec: GroupSpec) -> None:
    """Note that this process is asked to join `spec`'s epoch of its group."""
    key = _key(spec)
    _newest[key] = max(_newest.get(key, spec.epoch), spec.epoch)


def _superseded(spec: GroupSpec, rank: int) -> str | None:
    """Why `rank` leaves `spec`'s epoch, when a newer one of its group was asked."""
    newest = _newest.get(_key(spec), spec.epoch)
    if newest > spec.epoch:
        return (f"{spec.describe(rank)} left weight-sync group '{spec.group_name}': epoch "
                f"{newest} of '{spec.name}' was asked since")
    return None


def check_current(spec: GroupSpec, rank: int) -> None:
    """Raise `WeightSyncSuperseded` when a newer epoch of `spec`'s group was asked."""
    if (why := _superseded(spec, rank)) is not None:
        raise WeightSyncSuperseded(why)


def is_loopback(spec: GroupSpec) -> bool:
    """Every rank reaches the sender on this machine's loopback (a single-host run)."""
    if spec.master_addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(spec.master_addr).is_loopback
    except ValueError:  # a host name: others may reach it over the network
        return False


def _loopback_listener(host: str, port: int) -> int:
    """A socket listening on the loopback address `host` only (127.0.0.1 for localhost;
    any of 127/8, ::1), as a file descriptor for the store to own: TCPStore alone listens
    on every interface whatever address it is given."""
    host = "127.0.0.1" if host == "localhost" else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def _gloo_devices(spec: GroupSpec) -> list[Any]:
    """Loopback for a single-host group; else GLOO_SOCKET_IFNAME's interfaces when set (as
    torch's own constructor does; clusters and the multi-host test name theirs), else the
    address the host name resolves to."""
    from torch.distributed import ProcessGroupGloo

    if is_loopback(spec):
        return [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [ProcessGroupGloo.create_device(interface=n) for n in names]
    return [ProcessGroupGloo.create_default_device()]


def open_store(spec: GroupSpec, *, is_master: bool, who: str) -> TCPStore:
    """The TCPStore of the rendezvous: hosted by the sender, joined by receivers. A
    loopback `master_addr` (single-host runs) keeps it off the machine's other interfaces;
    otherwise it listens on all of them, for receivers on other hosts."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    listen_fd = None
    try:
        if is_master and is_loopback(spec):
            listen_fd = _loopback_listener(spec.master_addr, spec.master_port)
        store = TCPStore(spec.master_addr, spec.master_port, None, is_master, timeout,
                         wait_for_workers=False, master_listen_fd=listen_fd)
        listen_fd = None  # the store owns it now
        return store
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError: RuntimeError
        if listen_fd is not None:
            os.close(listen_fd)
        if is_master:
            raise WeightSyncError(
                f"{who} could not host the weight-sync store on "
                f"{spec.master_addr}:{spec.master_port}: {_first_line(exc)}"
            ) from None
        raise WeightSyncTimeout(
            f"{who} could not reach the weight-sync store of {spec.describe(0)} at "
            f"{spec.master_addr}:{spec.master_port} within {spec.timeout_s:g} s "
            f"(group '{spec.group_name}'): {_first_line(exc)}"
        ) from None


class BroadcastGroup:
    """One epoch of a weight-sync group: rank 0 broadcasts, everyone else receives."""

    def __init__(self, store: TCPStore, spec: GroupSpec, rank: int, device: torch.device) -> None:
        if not 0 <= rank < spec.world_size:
            raise WeightSyncError(f"rank {rank} outside world_size {spec.world_size}")
        self.spec, self.rank, self.device = spec, rank, device
        self.timeout = datetime.timedelta(seconds=spec.timeout_s)
        prefix = PrefixStore(f"weight_sync/{spec.group_name}/", store)
        self._join(prefix)
        # Any: torch's stubs for c10d backends do not declare their collectives.
        self._pg: Any = self._make_backend(prefix)
        self._opts = BroadcastOptions()
        self._opts.rootRank = 0
        self._opts.rootTensor = 0
        self._opts.timeout = self.timeout  # the backend's own is the mesh's (shorter)
        log.info(
            "weight_sync_group_ready",
            group=spec.group_name,
            rank=rank,
            world_size=spec.world_size,
            backend=spec.backend,
            store=f"{spec.master_addr}:{spec.master_port}",
        )

    def _join(self, store: PrefixStore) -> None:
        """Every rank joined: the group forms; one left (a newer epoch asked of it, or its
        timeout passed with ranks missing): it is abandoned. Every member reads the same
        outcome, set once (compare-and-set on the store), so none goes on into a mesh that
        another has left (it would wait out the mesh's timeout there)."""
        spec = self.spec
        check_current(spec, self.rank)  # before announcing itself: nothing to undo
        store.set(f"joined/{self.rank}", spec.describe(self.rank))
        deadline = time.monotonic() + spec.timeout_s
        pending = [r for r in range(spec.world_size) if r != self.rank]
        while True:
            pending = [r for r in pending if not store.check([f"joined/{r}"])]
            why = _superseded(spec, self.rank) if pending else None
            cls: type[WeightSyncError] = WeightSyncSuperseded
            if pending and why is None and time.monotonic() > deadline:
                cls = WeightSyncTimeout
                missing = ", ".join(spec.describe(r) for r in pending)
                verb = "did" if len(pending) == 1 else "do"
                why = (f"{missing} {verb} not join weight-sync group '{spec.group_name}' "
                       f"within {spec.timeout_s:g} s (waiting: {spec.describe(self.rank)})")
            if not pending or why is not None or store.check(["outcome"]):
                wanted = "formed" if not pending else f"abandoned: {why or ''}"
                outcome = store.compare_set("outcome", "", wanted).decode()
                if outcome == "formed":
                    return
                reason = outcome.removeprefix("abandoned: ")
                if why is not None and reason == why:  # this rank's own reason
                    raise cls(why)
                raise WeightSyncTimeout(f"weight-sync group '{spec.group_name}' was abandoned "
                                        f"before {spec.describe(self.rank)} could form it: "
                                        f"{reason}")
            time.sleep(_POLL_S)

    def _make_backend(self, store: PrefixStore) -> ProcessGroupGloo | ProcessGroupNCCL:
        spec = self.spec
        try:
            if spec.backend == "nccl":
                from torch.distributed import ProcessGroupNCCL

                torch.cuda.set_device(self.device)
                opts = ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                return ProcessGroupNCCL(store, self.rank, spec.world_size, opts)
            from torch.distributed import ProcessGroupGloo

            gloo: Any = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
            gloo._timeout = datetime.timedelta(seconds=mesh_timeout_s(spec))
            # by default gloo listens on the address the host name resolves to (a LAN one
            # on most machines); a single-host group stays on loopback
            gloo._devices = _gloo_devices(spec)
            return ProcessGroupGloo(store, self.rank, spec.world_size, gloo)
        except (RuntimeError, ImportError) as exc:
            raise WeightSyncError(
                f"{spec.describe(self.rank)} could not build the {spec.backend} backend of "
                f"weight-sync group '{spec.group_name}': {_first_line(exc)}"
            ) from None

    def broadcast(self, buf: torch.Tensor) -> torch.distributed.Work:
        """Start broadcasting `buf` (contiguous, on `device`) from rank 0; returns the handle."""
        if self._pg is None:
            raise WeightSyncError(f"weight-sync group '{self.spec.group_name}' is closed")
        return self._pg.broadcast([buf], self._opts)

    def wait(self, work: torch.distributed.Work, what: str) -> None:
        """Wait for `work`; failures become typed errors naming the group and the step."""
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            msg = _first_line(exc)
            cls = (
                WeightSyncTimeout
                if "timed out" in msg.lower() or "timeout" in msg.lower()
                else WeightSyncError
            )
            raise cls(
                f"{what} failed on {self.spec.describe(self.rank)} in weight-sync group "
                f"'{self.spec.group_name}' (timeout {self.spec.timeout_s:g} s): {msg}"
            ) from None

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            if self.spec.backend == "nccl":
                pg.abort()  # a dead peer would make a graceful NCCL shutdown block
            else:
                pg.shutdown()
        except RuntimeError as exc:
            log.warning("weight_sync_close_failed", group=self.spec.group_name, error=str(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
