"""Where a node restarted on another host binds (`rehome`): no Ray cluster needed."""

import socket

from rlhf_async.runtime import NodeSpec
from rlhf_async.runtime.ray_launcher import rehome
from rlhf_async.wire.transport import Endpoint


def test_a_node_binds_on_its_new_host_and_only_what_it_bound_elsewhere_moves():
    spec = NodeSpec("scorer", "scorer0", "nodes.scorer.main:main", endpoints={
        "rollouts": Endpoint("pull", "tcp://10.0.0.2:5000", bind=True),
        "here": Endpoint("pull", "tcp://127.0.0.1:5001", bind=True),
        "scored": Endpoint("push", "tcp://10.0.0.1:6000")})
    moved = rehome(spec, "127.0.0.1")
    assert list(moved) == ["tcp://10.0.0.2:5000"]  # connects and binds already here stay
    host, _, port = moved["tcp://10.0.0.2:5000"].removeprefix("tcp://").rpartition(":")
    assert host == "127.0.0.1"
    with socket.socket() as s:  # a port free on the new host
        s.bind((host, int(port)))
    assert rehome(spec.readdressed(moved), "127.0.0.1") == {}  # restarted there again
