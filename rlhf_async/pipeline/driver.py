"""The coordinator's side of the Separation pipeline.

It owns the data cursor: prompts of step s go out (cut into chunks) only when the staleness
gate allows, i.e. when every generator has applied a recent enough weight version. It
forwards each weight publication to the generators, turns node events into one metrics
record per trained step, and re-sends chunks the trainer refused as too stale.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rlhf_async.config import JobConfig, weight_sync_backend
from rlhf_async.coordinator import Coordinator, EventStream, NodeEvent
from rlhf_async.log import get_logger
from rlhf_async.metrics import MetricsWriter, Progress
from rlhf_async.pipeline.wire import ChunkId, prompts_message, split_prompts
from rlhf_async.rollout import PromptBatch
from rlhf_async.staleness import StalenessPolicy
from rlhf_async.task import SortDigitsTask
from rlhf_async.transport import Channel
from rlhf_async.weight_sync import GroupSpec

log = get_logger(component="pipeline")


class PipelineError(RuntimeError):
    """The pipeline cannot go on (a node died, the weight broadcast failed)."""


async def wait_loaded(events: EventStream, node_ids: list[str], timeout: float) -> dict:
    """Wait until every node has loaded its models (its `loaded` event); their payloads."""
    waiting, loaded = set(node_ids), {}
    deadline = time.monotonic() + timeout
    while waiting:
        try:
            ev = await events.get(timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            raise PipelineError(f"nodes did not load their models within {timeout:.0f}s: "
                                f"{sorted(waiting)} (see RUN_DIR/logs)") from None
        if ev.kind == "loaded":
            waiting.discard(ev.node_id)
            loaded[ev.node_id] = ev.payload
        elif ev.kind == "node_dead":
            raise PipelineError(f"node {ev.node_id} died while loading: "
                                f"{(ev.payload or {}).get('reason')} (see RUN_DIR/logs)")
    return loaded


async def connect_weight_sync(coord: Coordinator, events: EventStream, cfg: JobConfig,
                              trainer: str, generators: list[str], host: str) -> GroupSpec:
    """Build the trainer -> generators broadcast group. The generators start joining before
    the trainer does, so neither side waits on the other while holding the rendezvous."""
    ws = cfg.weight_sync
    spec = GroupSpec(weight_sync_backend(cfg), host, 0, 1 + len(generators), name="actor", epoch=0,
                     timeout_s=ws.timeout_s, peers=(trainer, *generators))
    spec = GroupSpec.from_dict(await coord.command(trainer, "weight_sync_prepare",
                                                   {"spec": spec.to_dict()}))
    for rank, gen in enumerate(generators, start=1):
        await coord.command(gen, "weight_sync_connect", {"spec": spec.to_dict(), "rank": rank})
    await coord.command(trainer, "weight_sync_connect", {"spec": spec.to_dict()},
                        timeout=ws.timeout_s + 10)
    waiting = set(generators)
    deadline = time.monotonic() + ws.timeout_s + 10
    while waiting:
        ev = await events.get(timeout=max(0.01, deadline - time.monotonic()))
        if ev.kind == "weight_sync_connected":
            waiting.discard(ev.node_id)
        elif ev.kind in ("weight_sync_failed", "node_dead"):
            raise PipelineError(f"weight-sync group {spec.group_name}: {ev.node_id} "
                                f"{ev.kind}: {ev.payload}")
    log.info("weight_sync_connected", group=spec.group_name, world=spec.world_size)
    return spec


class Driver:
    def __init__(self, cfg: JobConfig, coord: Coordinator, events: EventStream,
                 prompts: Channel, generators: list[str], run_dir: Path,
                 chunks_per_step: int, start_step: int = 0) -> None:
        self.cfg, self.coord, self.events, self.chan = cfg, coord, events, prompts
        self.generators, self.chunks = generators, chunks_per_step
        self.policy = StalenessPolicy(cfg.algo.max_staleness, cfg.train.publish_every)
        self.task = SortDigitsTask(cfg.task)
        self.applied = {g: 0 for g in generators}  # every generator starts from the SFT
        self.published = min(self.applied.values())
        self.gate = asyncio.Event()
        self.next_step = self.start_step = start_step
        self.outstanding: dict[tuple[int, int], PromptBatch] = {}
        self.queue = Counter[str]()  # chunks per stage: dispatched, generated, scored
        self.trained_ids = Counter[int]()
        self.busy: dict[str, float] = {}  # node -> cumulative busy seconds
        self.last_busy: dict[str, float] = {}
        self.writer = MetricsWriter(run_dir / "metrics.jsonl")
        # the trainer's record of what it trained: exactly-once is checked against this
        self.samples = MetricsWriter(run_dir / "trained_samples.jsonl")
        self.progress = Progress(cfg.train.steps, cfg.run.progress)
        self.t_last = time.perf_counter()
        self.result: dict[str, Any] = {}
        self._tasks: set[asyncio.Future[None]] = set()

    async def run(self) -> dict[str, Any]:
        dispatcher = asyncio.ensure_future(self._dispatch_loop())
        if self.start_step:  # generators hold the SFT weights: send the checkpoint's
            self._spawn(self.coord.command("trainer", "republish", None,
                                           timeout=self.cfg.weight_sync.timeout_s + 10))
        try:
            while True:
                get = asyncio.ensure_future(self.events.get())
                await asyncio.wait({get, dispatcher}, return_when=asyncio.FIRST_COMPLETED)
                if dispatcher.done() and dispatcher.exception() is not None:
                    get.cancel()
                    raise PipelineError(f"dispatching prompts failed: {dispatcher.exception()}")
                if get.done() and await self._handle(get.result()):
                    return self.result
                if not get.done():  # the dispatcher finished; keep reading events
                    if await self._handle(await get):
                        return self.result
        finally:
            dispatcher.cancel()
            for task in self._tasks:
                task.cancel()
            self.writer.close()
            self.samples.close()

    async def _dispatch_loop(self) -> None:
        g = self.cfg.algo.group_size
        while self.next_step < self.cfg.train.steps:
            step = self.next_step
            while not self.policy.can_dispatch(step, self.published):
                self.gate.clear()
                await self.gate.wait()
            prompts = self.task.prompt_batch(self.cfg.run.seed, "train", step,
                                             self.cfg.train.prompts_per_step, g)
            parts = split_prompts(prompts, g, self.chunks)
            for c, part in enumerate(parts):
                self.outstanding[(step, c)] = part
                self.queue["dispatched"] += 1
                await self.chan.send(prompts_message(ChunkId(step, c, len(parts)), part,
                                                     "coordinator"))
            self.next_step = step + 1

    async def _handle(self, ev: NodeEvent) -> bool:
        """One node event; True when the run is complete."""
        p = ev.payload if isinstance(ev.payload, dict) else {}
        if ev.kind == "publish":
            for gen in self.generators:
                self._spawn(self._forward(gen, p["plan"]))
        elif ev.kind == "weights_applied":
            self.applied[ev.node_id] = int(p["version"])
            self.published = min(self.applied.values())
            self.gate.set()
        elif ev.kind in ("generated", "scored"):
            self.queue["dispatched" if ev.kind == "generated" else "generated"] -= 1
            self.queue[ev.kind] += 1
            self.busy[ev.node_id] = float(p.get("busy_s", 0.0))
        elif ev.kind == "chunk_dropped":
            self.queue["scored"] -= 1
            cid = ChunkId.from_meta(p)
            self.queue["dispatched"] += 1
            await self.chan.send(prompts_message(cid, self.outstanding[(cid.step, cid.chunk)],
                                                 "coordinator"))
        elif ev.kind == "trained":
            self._record(ev.node_id, p)
        elif ev.kind == "done":
            self.result = p
            return True
        elif ev.kind in ("node_dead", "weight_sync_failed"):
            raise PipelineError(f"node {ev.node_id} failed: {p.get('reason') or p.get('error')}")
        return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, gen: str, plan: dict) -> None:
        try:
            await self.coord.command(gen, "update_weights", plan, timeout=30.0)
        except (TimeoutError, RuntimeError) as e:  # the node's death is reported separately
            log.warning("weights_not_forwarded", node=gen, error=str(e))

    def _record(self, trainer: str, p: dict) -> None:
        step, now = int(p["step"]), time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        for s in p["sample_ids"]:
            self.trained_ids[int(s)] += 1
        self.samples.write({"step": step, "sample_ids": p["sample_ids"],
                            "version": p["rollout_version"]})
        done = [k for k in self.outstanding if k[0] == step]
        for key in done:
            del self.outstanding[key]
        self.queue["scored"] = max(0, self.queue["scored"] - len(done))
        self.busy[trainer] = float(p.get("busy_s", 0.0))
        util = {f"util/{n}": (b - self.last_busy.get(n, 0.0)) / dt for n, b in self.busy.items()}
        self.last_busy = dict(self.busy)
        m = p["metrics"]
        record = {"step": step, **m, "time_step": dt, "samples_per_s": m["samples"] / dt,
                  "rollout_version": p["rollout_version"], "published_version": self.published,
                  "weight_sync_s": p.get("weight_sync_s", 0.0),
                  "weight_sync_bytes": p.get("weight_sync_bytes", 0),
                  "staleness_hist": p.get("staleness_hist", {}),
                  **{k: v for k, v in p.items() if k.startswith("staleness/")},
                  **{f"queue/{k}": v for k, v in self.queue.items()},
                  "queue/trainer": p.get("queue_trainer", 0), **util}
        self.writer.write(record)
        self.progress.update(record)
