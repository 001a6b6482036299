"""Scaling a running Separation job without processes: the reshaped placement, the run
directory's config that `resume` reads, and the order in which the Scaler changes a
running Driver (a fake coordinator records each command, as in test_driver.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from rlhf_async.config import load_config, to_dict
from rlhf_async.control.reshape import ReshapeError, Scale, plan_reshape
from rlhf_async.pipeline.protocol import (
    Loaded,
    NodeDead,
    Published,
    WeightSyncPrepare,
)
from rlhf_async.runtime.messages import Peers, tag
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.strategies.registry import runnable_placement
from rlhf_async.strategies.separation.runner import build_specs
from rlhf_async.strategies.separation.scaling import Scaler, persist, reshaped
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.wire.transport import Endpoint
from tests.unit.strategies.test_driver import LINEAGE, FakeCoord, Harness, settle

SHAPE = ["placement.strategy=separation", "placement.devices=5", "placement.generator=[1]",
         "placement.reward=[2]"]


def _placement(over: list[str]) -> Any:
    return runnable_placement(load_config(None, [*SHAPE, *over]))


def test_reshaped_placement_and_persisted_config_resume_the_same_shape(tmp_path):
    p = _placement([])
    procs = {q.node_id: (q.role, q.devices) for q in p.processes}
    new = reshaped(p, plan_reshape(procs, 5, {"generator": 2, "scorer": 2}))
    assert [(q.node_id, q.devices) for q in new.processes] == [
        ("trainer", (0,)), ("gen0", (1,)), ("gen1", (3,)), ("scorer0", (2,)), ("scorer1", (4,))]
    shadow, reward = new.model("shadow_actor"), new.model("reward")
    assert shadow is not None and (shadow.devices, shadow.replicas) == ((1, 3), 2)
    assert reward is not None and (reward.devices, reward.replicas) == ((2, 4), 2)
    (tmp_path / "config.json").write_text(json.dumps(to_dict(load_config(None, SHAPE))))
    persist(tmp_path, new)
    # what `resume` does: the run's config.json, placed again
    resumed = runnable_placement(load_config(str(tmp_path / "config.json"), []))
    assert resumed.processes == new.processes
    assert "gen1" in (tmp_path / "placement.txt").read_text()


@dataclass
class Record:
    spec: NodeSpec


@dataclass
class Supervisor:
    retired: list[str] = field(default_factory=list)

    async def retire(self, node: str, grace: float) -> int:
        self.retired.append(node)
        return 0


class ScalingCoord(FakeCoord):
    """The fake coordinator with what the Scaler also needs: launch, nodes, retire."""

    def __init__(self, specs: list[NodeSpec]) -> None:
        super().__init__()
        self.nodes = {s.node_id: Record(s) for s in specs}
        self.supervisor = Supervisor()
        self.stop_requested = asyncio.Event()
        self.launched: list[str] = []

    async def call(self, node_id: str, cmd: Any, timeout: float = 10.0) -> Any:
        if isinstance(cmd, Peers):  # a node answers with the addresses it left
            self.commands.append((node_id, cmd))
            return []
        return await super().call(node_id, cmd, timeout)

    async def launch(self, specs: list[NodeSpec]) -> None:
        self.launched += [s.node_id for s in specs]
        self.nodes.update({s.node_id: Record(s) for s in specs})


def _specs(p: Any) -> list[NodeSpec]:
    scorers = [f"ipc://s/{q.node_id}" for q in p.by_role("scorer")]
    out = []
    for q in p.processes:
        eps = {"rollouts": Endpoint("push", scorers[0], also=tuple(scorers[1:]))} \
            if q.role == "generator" else \
            {"rollouts": Endpoint("pull", f"ipc://s/{q.node_id}", bind=True)} \
            if q.role == "scorer" else {}
        out.append(NodeSpec(q.role, q.node_id, "x:main", eps))
    return out


def _scaler(tmp_path: Any, placement: Any) -> tuple[Harness, ScalingCoord, Scaler]:
    (tmp_path / "config.json").write_text(json.dumps(to_dict(load_config(None, SHAPE))))
    h = Harness(tmp_path)
    coord = ScalingCoord(_specs(placement))
    h.driver.coord = h.driver.sync.coord = h.driver.trainer.plane = coord
    for client in h.driver.clients.values():
        client.plane = coord
    h.coord = coord
    async def specs(p: Any) -> list[NodeSpec]:
        return _specs(p)

    scaler = Scaler(SimpleNamespace(), coord, h.driver, placement,  # type: ignore[arg-type]
                    specs, lambda p: 2 * len(p.by_role("generator")), tmp_path)
    return h, coord, scaler


def test_a_retired_generator_leaves_the_sync_group_before_it_is_stopped(tmp_path):
    """gen1 is out of the new weight-sync group before its Stop; a publication meanwhile
    still reaches it (it is in the current group: the broadcast must not wait on a missing
    peer); its chunks go out again, and no failure is counted."""
    async def main() -> None:
        p = _placement(["placement.generator=[1,3]", "placement.generators=2"])
        h, coord, scaler = _scaler(tmp_path, p)
        await h.start()
        assert sorted(h.driver.generators) == ["gen0", "gen1"]
        await h.send("trainer", Published({"version": 1}, LINEAGE))
        scaled = await scaler.scale(Scale(generators=1))
        assert scaled.removed == ["gen1"] and scaled.counts["generator"] == 1
        names = [(n, tag(c)) for n, c in coord.commands]
        prepare = next(i for i, (n, c) in enumerate(coord.commands)
                       if isinstance(c, WeightSyncPrepare))
        stop = names.index(("gen1", "stop"))
        assert prepare < stop
        members = coord.commands[prepare][1].spec.peers  # type: ignore[attr-defined]
        assert "gen1" not in members and "gen0" in members
        assert ("gen1", "update_weights") in names[:prepare]
        assert coord.supervisor.retired == ["gen1"]
        assert "gen1" not in h.driver.roles and h.driver.generators == ["gen0"]
        assert h.driver.counts["resent_chunks"] >= 1 and h.driver.counts["restarts"] == 0
        assert h.driver.chunks == 2
        cfg = json.loads((tmp_path / "config.json").read_text())["placement"]
        assert (cfg["generator"], cfg["generators"]) == ([1], 1)
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_a_new_scorer_is_every_generators_peer_and_a_new_generator_joins_once_loaded(
        tmp_path):
    async def main() -> None:
        h, coord, scaler = _scaler(tmp_path, _placement([]))
        await h.start()
        sent = len(h.prompts.sent)
        scaled = await scaler.scale(Scale(generators=2, scorers=2))
        assert coord.launched == ["gen1", "scorer1"] and scaled.added == ["gen1", "scorer1"]
        peers = [(n, c) for n, c in coord.commands if isinstance(c, Peers)]
        assert peers == [("gen0", Peers("rollouts", ["ipc://s/scorer0", "ipc://s/scorer1"]))]
        assert coord.nodes["gen0"].spec.endpoints["rollouts"].also == ("ipc://s/scorer1",)
        assert "gen1" in h.driver.down  # not waited on by the gate until it has loaded
        await h.send("gen1", Loaded())
        await h.send("scorer1", Loaded())
        assert h.driver.generators == ["gen0", "gen1"] and not h.driver.joining
        assert len(h.prompts.sent) == sent  # a new node has nothing to hand back
        assert h.driver.counts["regroups"] >= 1
        with pytest.raises(ReshapeError, match="not enough free"):
            await scaler.scale(Scale(generators=3))
        assert scaler.placement.by_role("generator")[-1].node_id == "gen1"  # unchanged
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_a_new_generator_that_dies_while_loading_hands_back_the_chunks_it_pulled(tmp_path):
    """Its prompts socket connects when its process starts: chunks reach it before it has
    loaded. Killed then, its restart sends the dispatched chunks again (the trainer drops
    duplicates); a stall at step 4 in a run with such a kill is what this fixed."""
    async def main() -> None:
        h, _, scaler = _scaler(tmp_path, _placement([]))
        await h.start()
        await scaler.scale(Scale(generators=2))
        dispatched = sorted(k for k, s in h.driver.chunk_state.items() if s.value == "dispatched")
        assert dispatched
        sent = len(h.prompts.sent)
        await h.send("gen1", NodeDead("killed", will_restart=True))
        await h.send("gen1", Loaded())
        assert sorted(h.prompts.sent[sent:]) == dispatched
        assert h.driver.generators == ["gen0", "gen1"] and h.driver.counts["restarts"] == 1
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


class Devices:
    """Devices past the placement's, as on Ray: reserved before a start, given back after."""

    def __init__(self, refuse: str = "") -> None:
        self.refuse, self.calls = refuse, list[tuple]()

    async def reserve(self, old: Any, new: Any) -> None:
        self.calls.append(("reserve", old.num_devices, new.num_devices))
        if self.refuse:
            raise ReshapeError(self.refuse)

    async def settle(self, p: Any) -> None:
        self.calls.append(("settle", p.num_devices))


def test_with_devices_a_scale_past_the_placement_reserves_new_ones_and_gives_them_back(
        tmp_path):
    """Three devices, all in use: gen1 goes on device 3, reserved before it starts; the
    placement (and config.json) grows to 4 devices, and back to 3 after the scale down."""
    async def main() -> None:
        h, _, scaler = _scaler(tmp_path, _placement(["placement.devices=3"]))
        scaler.devices = devices = Devices()
        await h.start()
        up = await scaler.scale(Scale(generators=2))
        assert up.added == ["gen1"] and scaler.placement.by_role("generator")[1].devices == (3,)
        assert devices.calls == [("reserve", 3, 4), ("settle", 4)]
        assert json.loads((tmp_path / "config.json").read_text())["placement"]["devices"] == 4
        await h.send("gen1", Loaded())
        down = await scaler.scale(Scale(generators=1))
        assert down.removed == ["gen1"] and devices.calls[-2:] == [("reserve", 4, 3),
                                                                   ("settle", 3)]
        assert json.loads((tmp_path / "config.json").read_text())["placement"]["devices"] == 3
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_devices_that_cannot_be_reserved_refuse_the_scale_and_nothing_starts(tmp_path):
    async def main() -> None:
        h, coord, scaler = _scaler(tmp_path, _placement(["placement.devices=3"]))
        scaler.devices = Devices("the Ray cluster cannot hold 1 more bundle(s)")
        await h.start()
        before, roles = scaler.placement, dict(h.driver.roles)
        with pytest.raises(ReshapeError, match="cannot hold"):
            await scaler.scale(Scale(generators=2, scorers=2))
        assert coord.launched == [] and scaler.placement == before
        assert h.driver.roles == roles  # no node joined the Driver
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_generators_deal_their_rollouts_over_the_scorers_from_different_starts(tmp_path):
    """A PUSH socket deals its messages over its peers in the order it connected to them,
    one chunk a generator a step: with one order for all, every generator sent step s's
    chunk to the same scorer (the twin: two of four scorers busy a step, a whole step's
    scoring on one). Each generator starts at its own scorer; a scale keeps the order of
    the peers a generator has (a Peers command only where the set changes)."""
    cfg = load_config(None, ["placement.strategy=separation", "placement.devices=7",
                             "placement.generator=[1,2,3,4]", "placement.reward=[5,6]"])
    p = runnable_placement(cfg)
    specs = build_specs(cfg, Artefacts(tmp_path / "sft", None, {}, {}), tmp_path, p, "/s")[0]
    firsts = [s.endpoints["rollouts"].address for s in specs if s.role == "generator"]
    assert firsts == ["ipc:///s/scorer0", "ipc:///s/scorer1"] * 2
    for s in specs:
        if s.role == "generator":  # every scorer, each once
            ep = s.endpoints["rollouts"]
            assert sorted([ep.address, *ep.also]) == ["ipc:///s/scorer0", "ipc:///s/scorer1"]


def test_a_scale_down_retires_its_generators_together(tmp_path):
    """One regroup for all the generators that leave, and each chunk not yet generated
    sent again once: retired one by one, each retirement sent every dispatched chunk
    again (which generator holds which is not known), so 16 -> 8 generators in the twin
    queued 8 copies of every chunk in flight (a 223 s step against 89 s)."""
    async def main() -> None:
        p = _placement(["placement.generator=[1,3]", "placement.generators=2"])
        h, _, scaler = _scaler(tmp_path, p)
        await h.start()
        await scaler.scale(Scale(generators=3))
        await h.send("gen2", Loaded())
        dispatched = sorted(k for k, s in h.driver.chunk_state.items() if s.value == "dispatched")
        assert dispatched
        sent, regroups = len(h.prompts.sent), h.driver.counts["regroups"]
        scaled = await scaler.scale(Scale(generators=1))
        await settle()
        assert sorted(scaled.removed) == ["gen1", "gen2"]
        assert sorted(h.prompts.sent[sent:]) == dispatched
        assert h.driver.counts["regroups"] == regroups + 1
        assert h.driver.generators == ["gen0"] and h.driver.counts["restarts"] == 0
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())
