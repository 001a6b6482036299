"""Separation's node specs re-addressed for several hosts: every bound ipc endpoint gets a
tcp address on its node's host, every connect follows it."""

from __future__ import annotations

from rlhf_async.runtime import NodeSpec
from rlhf_async.strategies.separation.multihost import BASE_PORT, tcp_specs
from rlhf_async.wire.transport import Endpoint

SPECS = [
    NodeSpec("trainer", "trainer", "nodes.trainer:main",
             {"scored": Endpoint("pull", "ipc:///s/scored", bind=True)}, device="cpu:0"),
    NodeSpec("scorer", "scorer0", "nodes.scorer:main",
             {"rollouts": Endpoint("pull", "ipc:///s/scorer0", bind=True),
              "scored": Endpoint("push", "ipc:///s/scored")}, device="cpu:2"),
    NodeSpec("generator", "gen0", "nodes.generator:main",
             {"prompts": Endpoint("pull", "ipc:///s/prompts"),
              "rollouts": Endpoint("push", "ipc:///s/scorer0")}, device="cpu:1"),
]
WHERE = {"trainer": ("10.0.0.1", "cpu:0"), "scorer0": ("10.0.0.2", "cpu:0"),
         "gen0": ("10.0.0.2", "cpu:1")}


def _addresses(specs: list[NodeSpec]) -> dict[str, dict[str, str]]:
    return {s.node_id: {k: ep.address for k, ep in s.endpoints.items()} for s in specs}


def test_consecutive_ports_per_host_by_default():
    specs, prompts = tcp_specs(SPECS, "ipc:///s/prompts", WHERE, "10.0.0.1")
    assert prompts == f"tcp://10.0.0.1:{BASE_PORT}"
    assert _addresses(specs) == {
        "trainer": {"scored": f"tcp://10.0.0.1:{BASE_PORT + 1}"},
        "scorer0": {"rollouts": f"tcp://10.0.0.2:{BASE_PORT}",
                    "scored": f"tcp://10.0.0.1:{BASE_PORT + 1}"},
        "gen0": {"prompts": prompts, "rollouts": f"tcp://10.0.0.2:{BASE_PORT}"}}
    assert [s.device for s in specs] == ["cpu:0", "cpu:0", "cpu:1"]  # the host's own device


def test_ports_from_a_source():
    free = {"10.0.0.1": [5001, 5002], "10.0.0.2": [6001]}
    specs, prompts = tcp_specs(SPECS, "ipc:///s/prompts", WHERE, "10.0.0.1",
                               lambda host: free[host].pop())
    assert prompts == "tcp://10.0.0.1:5002"
    assert _addresses(specs)["gen0"] == {"prompts": prompts, "rollouts": "tcp://10.0.0.2:6001"}
    assert _addresses(specs)["trainer"] == {"scored": "tcp://10.0.0.1:5001"}
