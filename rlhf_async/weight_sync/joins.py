"""One node's joins of weight-sync groups: one at a time, and only of the newest epoch.

Why: a member joins in a rendezvous its node cannot cut short, and gloo's connectFullMesh,
after a peer dies in it, runs well past the group's timeout (a pair at a time, each
waiting out a peer that left). The coordinator meanwhile gives up on that epoch and
starts the next ones; a node that served its connect commands in order then joined each
abandoned epoch in turn, alone, after its members had left, and was never in the current
one (the 64-node twin under SIGKILLs: every regroup failed from step 7). So a join asked
while a newer epoch of the same group has been asked of this process is refused at once,
and a join still waiting for its peers leaves when a newer epoch is asked, the epoch
abandoned for every member (`group.BroadcastGroup._join`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlhf_async.weight_sync.group import ask_epoch, check_current
from rlhf_async.weight_sync.spec import GroupSpec


class Joins:
    """`join(spec, rank, connect)` runs `connect` (blocking: a sender's or receiver's
    `connect`) in a thread under `lock`, the lock the node's transfers also hold, unless a
    newer epoch of the group was asked first (`WeightSyncSuperseded`)."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock

    async def join(self, spec: GroupSpec, rank: int, connect: Callable[[], None]) -> None:
        ask_epoch(spec)  # before the lock: a join queued or waiting behind it gives up
        async with self.lock:
            check_current(spec, rank)
            await asyncio.to_thread(connect)
