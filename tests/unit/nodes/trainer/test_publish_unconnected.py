"""A publication due while the weight-sync group is down (a regroup failed; the next one
has not formed) is skipped, not fatal: the coordinator asks for the weights again once the
group stands (`SyncGroup.republish`). It raised, and the trainer's program ended: every
trainer rank restarted from its checkpoint (the 64-node twin under SIGKILLs, twice)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from nodes.trainer.main import Trainer
from rlhf_async.pipeline.protocol import WeightSync
from rlhf_async.weight_sync.errors import WeightSyncError


class Sender:
    def plan(self, layout: Any, version: int, tied: Any) -> dict:
        raise WeightSyncError("weight sender is not connected: call connect(spec) first")


def test_a_publication_without_a_group_is_skipped_until_the_regroup():
    events: list[Any] = []
    warnings: list[tuple[str, dict]] = []

    async def send_event(event: Any, **kw: Any) -> None:
        events.append(event)

    me = SimpleNamespace(
        learner=SimpleNamespace(version=4, train=SimpleNamespace(publish_every=1),
                                weight_layout=lambda: {}),
        sender=Sender(), tied={}, lineage="L",
        node=SimpleNamespace(send_event=send_event,
                             log=SimpleNamespace(warning=lambda e, **kw: warnings.append((e, kw)))))
    got = asyncio.run(Trainer._publish(me))  # type: ignore[arg-type]
    assert got == WeightSync() and events == []
    assert warnings and warnings[0][0] == "publish_skipped"
