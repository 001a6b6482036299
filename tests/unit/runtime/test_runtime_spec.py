import json

import pytest

from rlhf_async.runtime import NodeSpec, SpecError
from rlhf_async.runtime.process import main as node_main
from rlhf_async.runtime.process import resolve_entry
from rlhf_async.runtime.spec import tcp_host
from rlhf_async.wire.transport import Endpoint


def _spec(**over):
    base = dict(role="sink", node_id="sink0", entry="nodes.demo_pipeline:sink",
                endpoints={"in": Endpoint("pull", "ipc:///tmp/x/in", bind=True, hwm=4)},
                params={"expect": 3}, control="ipc:///tmp/x/ctl")
    return NodeSpec(**{**base, **over})


def test_spec_json_roundtrip(tmp_path):
    spec = _spec()
    spec.write(tmp_path / "s.json")
    assert NodeSpec.read(tmp_path / "s.json") == spec
    assert spec.with_control("tcp://h:1").control == "tcp://h:1"


def test_spec_lists_every_problem_at_once():
    with pytest.raises(SpecError) as exc:
        _spec(node_id="bad id!", entry="no-colon", num_threads=0, heartbeat_s=-1,
              env={"A": 1}, flush_denormal="yes")
    text = str(exc.value)
    for fragment in ("node_id", "entry", "num_threads", "heartbeat_s", "env",
                     "flush_denormal 'yes' must be true or false"):
        assert fragment in text


def test_from_dict_rejects_unknown_fields_and_bad_endpoints():
    d = _spec().to_dict()
    d["colour"] = "red"
    d["endpoints"]["in"]["type"] = "pair"
    with pytest.raises(SpecError, match=r"unknown field 'colour'.*endpoints.in"):
        NodeSpec.from_dict(d)


def test_unreadable_spec_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert node_main(["--spec", str(tmp_path / "bad.json")]) == 2
    assert node_main(["--spec", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "empty_ctl.json").write_text(json.dumps(_spec(control="").to_dict()))
    assert node_main(["--spec", str(tmp_path / "empty_ctl.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # one structured log line per bad spec, naming what is wrong
    assert len(lines) == 3 and all("bad_node_spec" in line for line in lines)
    assert "not JSON" in lines[0] and "cannot read" in lines[1] and "control" in lines[2]


def test_resolve_entry():
    assert resolve_entry("nodes.demo_pipeline:sink").__name__ == "sink"
    with pytest.raises(SpecError, match="cannot be loaded"):
        resolve_entry("nodes.no_such_module:main")
    with pytest.raises(SpecError, match="async def"):
        resolve_entry("rlhf_async.control.demo:build_specs")


def test_a_readdressed_spec_follows_moved_peers_bound_or_connected():
    spec = _spec(endpoints={
        "in": Endpoint("pull", "tcp://10.0.0.2:5000", bind=True),
        "out": Endpoint("push", "tcp://10.0.0.3:6000", also=("tcp://10.0.0.4:6000",)),
        "local": Endpoint("pull", "ipc:///tmp/x/local", bind=True)})
    assert spec.bound_tcp() == ["tcp://10.0.0.2:5000"]
    assert spec.connects_to({"tcp://10.0.0.4:6000"})
    assert not spec.connects_to({"tcp://10.0.0.2:5000"})  # bound there, not connected
    moved = spec.readdressed({"tcp://10.0.0.4:6000": "tcp://10.0.0.9:7000",
                              "tcp://10.0.0.2:5000": "tcp://10.0.0.8:5001"})
    assert moved.endpoints["out"] == Endpoint("push", "tcp://10.0.0.3:6000",
                                              also=("tcp://10.0.0.9:7000",))
    assert moved.endpoints["in"].address == "tcp://10.0.0.8:5001" and moved.endpoints["in"].bind
    assert moved.endpoints["local"] == spec.endpoints["local"]
    assert spec.readdressed({}) == spec
    # where the node runs for its peers (a trainer's rendezvous): its bound tcp host
    assert spec.host() == "10.0.0.2" and moved.host() == "10.0.0.8"
    ipc_only = _spec(endpoints={"local": Endpoint("pull", "ipc:///tmp/x/l", bind=True)})
    assert ipc_only.host() is None and tcp_host("tcp://[::1]:5") == "::1"
