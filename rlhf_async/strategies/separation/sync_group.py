"""The coordinator's side of Separation's weight sync: each publication forwarded to the
generators, and the broadcast group (trainer + live generators) kept whole. After a death
or a recovery the group is rebuilt under a new epoch with the generators live then, by one
task that retries while membership changes under it (a node dying mid-rebuild), and the
trainer is asked to publish its weights again once the group stands."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from rlhf_async.log import get_logger
from rlhf_async.strategies.separation.clients import (
    ControlPlane,
    GeneratorClient,
    PipelineError,
    TrainerClient,
    connect_weight_sync,
)
from rlhf_async.weight_sync import GroupSpec

log = get_logger(component="pipeline")


class SyncGroup:
    """`generators()` names the live generators and `trainer_up()` says whether the trainer
    is; `counts["regroups"]` counts the rebuilds (the run's fault metrics)."""

    def __init__(self, coord: ControlPlane, trainer: TrainerClient,
                 clients: dict[str, GeneratorClient], spec: GroupSpec, gen_ranks: int,
                 restart_limit: int, timeout_s: float, counts: Counter[str],
                 generators: Callable[[], list[str]], trainer_up: Callable[[], bool]) -> None:
        self.coord, self.trainer, self.clients, self.spec = coord, trainer, clients, spec
        self.gen_ranks = gen_ranks  # weight-sync ranks per generator (its tensor-parallel workers)
        self.restart_limit, self.timeout_s, self.counts = restart_limit, timeout_s, counts
        self.generators, self.trainer_up = generators, trainer_up
        self.task: asyncio.Future[None] | None = None  # the rebuild under way
        self._wanted = False

    async def forward(self, gen: str, plan: dict[str, Any], lineage: str) -> None:
        """Hand one publication (its bucket plan) to generator `gen`."""
        try:
            await self.clients[gen].update_weights(plan, lineage)
        except (TimeoutError, RuntimeError) as e:  # a death is reported on its own
            log.warning("weights_not_forwarded", node=gen, error=str(e))

    def rebuild(self) -> None:
        """Ask for the group to be rebuilt with the live generators."""
        self._wanted = True
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._rebuild_loop())

    async def _rebuild_loop(self) -> None:
        failures = 0
        while self._wanted:
            self._wanted = False
            if not self.trainer_up() or not self.generators():
                return  # the trainer's or a generator's recovery asks again
            # the trainer hosts the group: where it runs now (restarted on another Ray host)
            self.spec = dataclasses.replace(
                self.spec.with_epoch(self.spec.epoch + 1),
                master_addr=self.coord.host("trainer", self.spec.master_addr))
            self.counts["regroups"] += 1
            try:
                self.spec = await connect_weight_sync(
                    self.trainer, [self.clients[g] for g in self.generators()], self.spec,
                    self.gen_ranks)
            except PipelineError as e:
                failures += 1
                log.warning("regroup_failed", error=str(e), attempt=failures)
                if failures > 2 * max(1, self.restart_limit):
                    raise
                self._wanted = True
                await asyncio.sleep(0.5)
                continue
            await self.republish()

    async def republish(self) -> None:
        """Ask the trainer to send its current weights to the group again."""
        try:
            await self.trainer.republish(timeout=self.timeout_s + 10)
        except (TimeoutError, RuntimeError) as e:  # a death is reported on its own
            log.warning("republish_failed", error=str(e))

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
