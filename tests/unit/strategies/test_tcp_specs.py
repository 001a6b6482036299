"""Separation's node specs re-addressed for several hosts: every bound ipc endpoint gets a
tcp address on its node's host, every connect follows it."""

from __future__ import annotations

from rlhf_async.runtime import NodeSpec
from rlhf_async.strategies.separation.tcp import tcp_specs
from rlhf_async.wire.transport import Endpoint

SPECS = [
    NodeSpec("trainer", "trainer", "nodes.trainer.main:main",
             {"scored": Endpoint("pull", "ipc:///s/scored", bind=True)}, device="cpu:0"),
    NodeSpec("scorer", "scorer0", "nodes.scorer.main:main",
             {"rollouts": Endpoint("pull", "ipc:///s/scorer0", bind=True),
              "scored": Endpoint("push", "ipc:///s/scored")}, device="cpu:2"),
    NodeSpec("generator", "gen0", "nodes.generator.main:main",
             {"prompts": Endpoint("pull", "ipc:///s/prompts"),
              "rollouts": Endpoint("push", "ipc:///s/scorer0")}, device="cpu:1"),
]
WHERE = {"trainer": ("10.0.0.1", "cpu:0"), "scorer0": ("10.0.0.2", "cpu:0"),
         "gen0": ("10.0.0.2", "cpu:1")}


def _addresses(specs: list[NodeSpec]) -> dict[str, dict[str, str]]:
    return {s.node_id: {k: ep.address for k, ep in s.endpoints.items()} for s in specs}


def test_every_bind_moves_to_its_hosts_ports_and_every_connect_follows():
    ports = {"10.0.0.1": iter(range(7300, 7400)), "10.0.0.2": iter(range(7300, 7400))}
    specs, prompts = tcp_specs(SPECS, "ipc:///s/prompts", WHERE, "10.0.0.1",
                               lambda host: next(ports[host]))
    assert prompts == "tcp://10.0.0.1:7300"
    assert _addresses(specs) == {
        "trainer": {"scored": "tcp://10.0.0.1:7301"},
        "scorer0": {"rollouts": "tcp://10.0.0.2:7300", "scored": "tcp://10.0.0.1:7301"},
        "gen0": {"prompts": prompts, "rollouts": "tcp://10.0.0.2:7300"}}
    assert [s.device for s in specs] == ["cpu:0", "cpu:0", "cpu:1"]  # the host's own device


def test_ports_from_a_source():
    free = {"10.0.0.1": [5001, 5002], "10.0.0.2": [6001]}
    specs, prompts = tcp_specs(SPECS, "ipc:///s/prompts", WHERE, "10.0.0.1",
                               lambda host: free[host].pop())
    assert prompts == "tcp://10.0.0.1:5002"
    assert _addresses(specs)["gen0"] == {"prompts": prompts, "rollouts": "tcp://10.0.0.2:6001"}
    assert _addresses(specs)["trainer"] == {"scored": "tcp://10.0.0.1:5001"}
