"""A running Separation job gains or loses generator and scorer processes (`rlhf-async scale
RUN_DIR generators=N scorers=M`: a `Scale` command to the coordinator, control/reshape.py).

The trainer never restarts and no prompt is lost or trained twice:
- a new scorer starts on a free device; once it is up every generator also sends to it;
- a new generator starts on a free device and joins the Driver as a node "recovering"
  with nothing to hand back: once it has loaded, the weight-sync group is rebuilt with it
  (as after a restart) and it pulls prompt chunks from the shared queue;
- a generator to retire leaves the weight-sync group first (the group is rebuilt without
  it, so a broadcast never waits on it), then stops; a scorer to retire is first left out
  of every generator's peers, then stops. The chunks either may have held are sent again
  (the trainer drops duplicates), like a dead node's, but no failure is counted;
- the run directory's config.json and placement.txt follow, so `resume` continues with
  the new shape.
Where the devices come from: on this machine, the placement's free devices; on Ray
(`Devices`, on_ray.py) also new bundles, reserved before anything starts (a cluster that
cannot hold them refuses the scale) and given back once a scale down leaves them unused.
One scale at a time; a refused one (control/reshape.py) changes nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from rlhf_async.config import JobConfig
from rlhf_async.control.coordinator import Coordinator, CoordinatorError
from rlhf_async.control.reshape import Reshape, ReshapeError, Scale, Scaled, plan_reshape
from rlhf_async.log import get_logger
from rlhf_async.pipeline.protocol import SFT_LINEAGE
from rlhf_async.runtime.messages import Peers, Stop
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.strategies.placement import INFER, Placement, ProcessPlacement
from rlhf_async.strategies.separation.clients import GeneratorClient
from rlhf_async.strategies.separation.driver import ChunkState, Driver
from rlhf_async.strategies.separation.startup import generator_ranks

log = get_logger(component="scaling")
ROLE_MODELS = {"generator": ("shadow_actor",), "scorer": ("reward", "reference")}
MODEL_ROLE = {"shadow_actor": "generator", "reward": "scorer", "reference": "scorer"}


def reshaped(p: Placement, plan: Reshape) -> Placement:
    """`p` with the plan's processes retired and started; each inference model's devices
    and replicas follow its processes."""
    kept = [q for q in p.processes if q.node_id not in plan.remove]
    added = [ProcessPlacement(n, role, ROLE_MODELS[role], devs, INFER)
             for n, (role, devs) in plan.add.items()]
    order = {"trainer": 0, "generator": 1, "scorer": 2}

    def key(q: ProcessPlacement) -> tuple[int, int, str]:
        digits = "".join(c for c in q.node_id if c.isdigit())
        return order.get(q.role, 3), int(digits or 0), q.node_id

    procs = tuple(sorted(kept + added, key=key))
    models = []
    for m in p.models:
        role = MODEL_ROLE.get(m.model)
        if role is None:
            models.append(m)
            continue
        mine = [q for q in procs if q.role == role]
        models.append(replace(m, devices=tuple(sorted({d for q in mine for d in q.devices})),
                              replicas=len(mine)))
    return replace(p, processes=procs, models=tuple(models))


def persist(run_dir: Path, p: Placement) -> None:
    """The run directory's config.json (what `resume` reads) and placement.txt follow `p`:
    generator and scorer devices and counts given explicitly."""
    path = run_dir / "config.json"
    cfg = json.loads(path.read_text())
    gens, scorers = p.by_role("generator"), p.by_role("scorer")
    cfg["placement"].update(
        devices=p.num_devices, generator=[d for q in gens for d in q.devices], generators=len(gens),
        reward=[d for q in scorers for d in q.devices],
        reference=[d for q in scorers for d in q.devices], scorers=len(scorers))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2))
    tmp.replace(path)
    (run_dir / "placement.txt").write_text(p.table() + "\n")


class Devices(Protocol):
    """Devices beyond the placement's, for a launcher that can reserve more (Ray)."""

    async def reserve(self, old: Placement, new: Placement) -> None:
        """Hold every device `new` uses before its new processes start (`old`'s are held);
        ReshapeError, holding nothing more, when it cannot."""

    async def settle(self, p: Placement) -> None:
        """`p` is the job's shape now: give back what only earlier shapes used."""


class Scaler:
    """Applies `Scale` commands to the running job (`coord.handle(Scale, scaler.scale)`).
    `make_specs(placement)` gives every node's spec for a placement (running nodes' as
    they run), `chunks_for` the chunks a step's prompts are cut into (the runner's);
    with `devices`, a scale may use devices past the placement's (Ray's new bundles)."""

    def __init__(self, cfg: JobConfig, coord: Coordinator, driver: Driver,
                 placement: Placement,
                 make_specs: Callable[[Placement], Awaitable[list[NodeSpec]]],
                 chunks_for: Callable[[Placement], int], run_dir: Path,
                 devices: Devices | None = None) -> None:
        self.cfg, self.coord, self.driver, self.placement = cfg, coord, driver, placement
        self.make_specs, self.chunks_for, self.run_dir = make_specs, chunks_for, run_dir
        self.devices, self.base_devices = devices, placement.num_devices
        self.grace = 10.0  # a retired node's stop: it finishes its decode step, then exits
        self._lock = asyncio.Lock()

    def plan(self, scale: Scale) -> Reshape:
        """What `scale` changes; ReshapeError (nothing changed) when it cannot be done."""
        if self.coord.stop_requested.is_set():
            raise ReshapeError("the job is stopping; scale it after `rlhf-async resume`")
        procs = {q.node_id: (q.role, q.devices) for q in self.placement.processes}
        word = "GPU" if self.placement.device_kind == "cuda" else "CPU slot"
        targets, width = scale.targets(), {"generator": generator_ranks(self.placement)}
        room = self.placement.num_devices
        if self.devices is not None:  # free devices first, then as many new as asked
            room += sum(n * width.get(r, 1) for r, n in targets.items())
        return plan_reshape(procs, room, targets, width, word)

    def reshaped(self, plan: Reshape) -> Placement:
        """The placement after `plan`; with `devices`, as many devices as it uses (never
        fewer than the job started with)."""
        new = reshaped(self.placement, plan)
        if self.devices is None:
            return new
        top = max(d for q in new.processes for d in q.devices)
        return replace(new, num_devices=max(self.base_devices, top + 1))

    async def scale(self, scale: Scale) -> Scaled:
        async with self._lock:
            plan = self.plan(scale)
            counts = {r: len(self.placement.by_role(r)) for r in ROLE_MODELS}
            if plan.empty:
                return Scaled([], [], counts)
            new = self.reshaped(plan)
            log.info("scaling", add={n: list(d) for n, (_, d) in plan.add.items()},
                     remove=list(plan.remove), counts=plan.counts)
            if self.devices is not None:
                await self.devices.reserve(self.placement, new)
            try:
                specs = {s.node_id: s for s in await self.make_specs(new)}
                await self._start([specs[n] for n in plan.add])
            except BaseException:
                if self.devices is not None:
                    await self.devices.settle(self.placement)
                raise
            await self._repeer(specs)
            await self._retire(list(plan.remove))
            self.driver.chunks = self.chunks_for(new)
            self.placement = new
            if self.devices is not None:
                await self.devices.settle(new)
            persist(self.run_dir, new)
            counts = {r: len(new.by_role(r)) for r in ROLE_MODELS}
            log.info("scaled", counts=counts)
            return Scaled(list(plan.add), list(plan.remove), counts)

    async def _start(self, specs: list[NodeSpec]) -> None:
        """Start the new processes; each joins the Driver once it has loaded its models."""
        if not specs:
            return
        d = self.driver
        for spec in specs:
            d.roles[spec.node_id] = spec.role
            d.down.add(spec.node_id)  # not live until loaded: the gate does not wait on it
            d.joining.add(spec.node_id)
            if spec.role == "generator":
                d.clients[spec.node_id] = GeneratorClient(self.coord, spec.node_id)
                d.applied[spec.node_id] = (0, SFT_LINEAGE)
        try:
            await self.coord.launch(specs)
        except CoordinatorError as e:
            for spec in specs:  # a start that failed leaves the job as it was
                self._forget(spec.node_id)
                if spec.node_id in self.coord.nodes:
                    await self.coord.supervisor.retire(spec.node_id, 1.0)
            raise ReshapeError(f"new processes did not start: {e}") from None

    async def _repeer(self, specs: dict[str, NodeSpec]) -> None:
        """Every running generator sends its rollouts to the scorers of `specs` (a
        generator restarted later starts with them too), in its own order (runner.py's
        `_rollouts`); one whose scorers are the same keeps the order it has."""
        for node, record in list(self.coord.nodes.items()):
            if record.spec.role != "generator" or node not in specs:
                continue
            ep, new = record.spec.endpoints["rollouts"], specs[node].endpoints["rollouts"]
            peers = [new.address, *new.also]
            if {ep.address, *ep.also} == set(peers):
                continue
            eps = {**record.spec.endpoints, "rollouts": new}
            record.spec = replace(record.spec, endpoints=eps)
            try:
                await self.coord.call(node, Peers("rollouts", peers))
            except (TimeoutError, CoordinatorError) as e:  # restarting: its spec has them
                log.warning("peers_not_changed", node=node, error=str(e))

    async def _retire(self, nodes: list[str]) -> None:
        """Retire `nodes` together: generators leave the weight-sync group in one regroup,
        all stop at once, then the chunks they may have held go out again, once. (Which
        generator holds which chunk is not known, so each retirement sends every chunk
        not yet generated: one by one, n retirements queued n copies of each.)"""
        if not nodes:
            return
        d = self.driver
        roles = {n: d.roles[n] for n in nodes}
        gens = [n for n, r in roles.items() if r == "generator"]
        if gens:  # out of the weight-sync group before they stop; until the new group
            # stands they still take the current group's broadcasts
            d.leaving.update(gens)
            await self._regroup()
        await asyncio.gather(*(self._stop(n, r) for n, r in roles.items()))
        # chunks they may have held (queued or half done) go out again; duplicates of those
        # that got through are dropped by the trainer
        d.resend((ChunkState.DISPATCHED,) if not set(roles.values()) - {"generator"} else
                 (ChunkState.DISPATCHED, ChunkState.GENERATED))
        d.gate.set()  # the oldest weights held may be newer now

    async def _stop(self, node: str, role: str) -> None:
        d = self.driver
        d.down.add(node)
        d.applied.pop(node, None)
        try:
            await self.coord.call(node, Stop("scaled down"), timeout=2.0)
        except (TimeoutError, CoordinatorError) as e:  # dead already: terminated below
            log.warning("retire_stop_unanswered", node=node, error=str(e))
        rc = await self.coord.supervisor.retire(node, self.grace)
        self._forget(node)
        log.info("node_scaled_down", node=node, role=role, exit_code=rc)

    async def _regroup(self) -> None:
        """Rebuild the weight-sync group with the live generators and wait for it."""
        sync = self.driver.sync
        sync.rebuild()
        while sync.task is not None and not sync.task.done():
            await asyncio.wait({sync.task})

    def _forget(self, node: str) -> None:
        d = self.driver
        for table in (d.roles, d.clients, d.applied):
            table.pop(node, None)  # type: ignore[attr-defined]
        d.records.forget(node)
        d.down.discard(node)
        d.joining.discard(node)
        d.leaving.discard(node)

