"""The coordinator's side of a multi-rank Separation trainer: its ranks kept one group
(the node side is nodes/trainer/group.py)."""

from __future__ import annotations

import asyncio

from rlhf_async.log import get_logger
from rlhf_async.strategies.separation.clients import ControlPlane, PipelineError, TrainerClient

log = get_logger(component="pipeline")


async def connect_trainer_group(plane: ControlPlane, ranks: list[str], addr: str,
                                timeout: float) -> dict[str, int]:
    """Form the group of a multi-rank trainer (ranks[0] hosts the rendezvous at `addr`):
    every rank is told where to meet and answers once the group stands, with its pid.
    Bounded by `timeout`; a rank that died or never came is a PipelineError."""
    clients = [TrainerClient(plane, r) for r in ranks]
    try:
        port = await clients[0].prepare_group()
        replies = await asyncio.gather(*(
            c.join_group(addr, port, i, len(ranks), timeout) for i, c in enumerate(clients)))
    except (TimeoutError, RuntimeError) as e:
        raise PipelineError(f"trainer group {', '.join(ranks)}: {e}") from None
    log.info("trainer_group_connected", ranks=ranks, addr=addr, port=port)
    return {r: reply.pid for r, reply in zip(ranks, replies, strict=True)}


class TrainerRanks:
    """The ranks of a multi-rank trainer, kept one group (their side:
    nodes/trainer/group.py). The group is its members' processes: one that dies breaks it, so
    `died` restarts the members still running, and a new group is formed from the new
    processes once all are up, in the background (`form`). A death while a group forms
    (ranks may be waiting in its rendezvous) restarts every rank and forms it afresh.
    With one rank there is nothing to keep."""

    def __init__(self, coord: ControlPlane, ranks: list[str], addr: str,
                 timeout: float) -> None:
        self.coord, self.ranks, self.addr, self.timeout = coord, ranks, addr, timeout
        self.members: dict[str, int] = {}  # rank -> pid, of the group that stands
        self.joining: dict[str, int] = {}  # rank -> pid, told to join a group now
        self.gone: set[int] = set()  # pids of broken groups (and ones killed here)
        self.task: asyncio.Future[None] | None = None

    @property
    def grouped(self) -> bool:
        return len(self.ranks) > 1

    def form(self) -> None:
        """Form the group in the background; `failure` reports if it cannot."""
        if self.grouped and (self.task is None or self.task.done()):
            self.task = asyncio.ensure_future(self._form())

    def failure(self) -> BaseException | None:
        task = self.task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    def died(self, node: str, pid: int | None) -> list[str]:
        """Note that process `pid` of `node` died (it is being restarted). Returns the
        ranks restarted because of it."""
        if node not in self.ranks or not self.grouped or pid in self.gone:
            return []  # not a rank, or a process whose group is known to be broken
        if pid in self.members.values():
            killed = self._restart(self.members, f"its trainer group lost {node}")
            self.members = {}
        elif pid in self.joining.values():  # the others may wait in its rendezvous
            if self.task is not None:
                self.task.cancel()
            killed = self._restart(self._current(), f"{node} died while its trainer "
                                                    "group formed")
        else:
            return []  # never in a group: its replacement joins the one being formed
        self.form()
        return killed

    def _current(self) -> dict[str, int]:
        return {r: p for r in self.ranks if (p := self.coord.pid(r)) is not None}

    def _restart(self, pids: dict[str, int], reason: str) -> list[str]:
        self.gone.update(pids.values())
        return [r for r, pid in pids.items() if self.coord.restart(r, reason, pid)]

    async def _form(self) -> None:
        failures = 0
        while True:
            await self.coord.wait_ready(self.ranks)
            self.joining = self._current()
            try:
                # rank 0 hosts the rendezvous: where it runs now (moved on Ray: elsewhere)
                addr = self.coord.host(self.ranks[0], self.addr)
                pids = await connect_trainer_group(self.coord, self.ranks, addr, self.timeout)
            except PipelineError as e:
                failures += 1
                if failures > 2:
                    raise PipelineError(f"the trainer ranks did not form a group: {e}") \
                        from None
                log.warning("trainer_group_failed", error=str(e), attempt=failures)
                self._restart(self._current(), f"its trainer group did not form: {e}")
                continue
            finally:
                self.joining = {}
            if all(self.coord.pid(r) == pid for r, pid in pids.items()):
                self.members = pids
                return
            # a rank was restarted while the others joined: that group is broken already
            self._restart(pids, "a rank of its new trainer group restarted meanwhile")
