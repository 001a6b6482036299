"""Multi-host pieces on one machine: hosts file parsing, an agent behind CURVE, and
`doctor` giving one clear line per problem (wrong key, closed port, missing host, ...)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest
import zmq

from rlhf_async.ops import doctor
from rlhf_async.runtime.hosts import Host, HostsError, device_map, parse_hosts
from rlhf_async.runtime.remote import AgentLink, AgentUnavailable
from rlhf_async.wire.security import Keyring, generate_keys

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hosts_file_parses_and_lists_every_problem():
    hosts = parse_hosts("# name address devices\n"
                        "a 10.0.0.1:7200 cuda:0-2   # three GPUs\n\n"
                        "b host-b.lan cpu:0,cuda:5\n")
    assert hosts == [Host("a", "10.0.0.1", 7200, ("cuda:0", "cuda:1", "cuda:2")),
                     Host("b", "host-b.lan", 7100, ("cpu:0", "cuda:5"))]
    assert [(h.name, d) for h, d in device_map(hosts)][3:] == [("b", "cpu:0"), ("b", "cuda:5")]
    assert hosts[0].agent == "tcp://10.0.0.1:7200"
    with pytest.raises(HostsError) as e:
        parse_hosts("a 10.0.0.1:99999 gpu:0\nb onlytwo\na 1.2.3.4 cuda:3-1\n", "h.txt")
    assert e.value.problems == [
        "h.txt:1: port '99999' must be 1..65535",
        "h.txt:1: device 'gpu:0' must look like cuda:N, cuda:A-B or cpu:N",
        "h.txt:2: expected 'name address[:port] devices', got 'b onlytwo'",
        "h.txt:3: device range 'cuda:3-1' ends before it starts",
        "h.txt:3: host 'a' is listed twice"]
    with pytest.raises(HostsError, match="no hosts"):
        parse_hosts("# empty\n")


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    generate_keys(tmp / "keys")
    generate_keys(tmp / "other")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "agent", "--bind",
                             f"tcp://127.0.0.1:{port}", "--keys", str(tmp / "keys"),
                             "--work-dir", str(tmp / "work")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "agent did not start"
            time.sleep(0.2)
    yield tmp, port
    proc.terminate()
    assert proc.wait(20) == 0


def test_doctor_one_line_per_problem(agent, monkeypatch):
    tmp, port = agent
    closed = _free_port()
    hosts = [Host("good", "127.0.0.1", port, ("cpu:0",)),
             Host("closed", "127.0.0.1", closed, ("cpu:0",)),
             Host("missing", "no-such-host.invalid", port, ("cpu:0",)),
             Host("nodev", "127.0.0.1", port, ("cuda:7",))]
    found = doctor.run_doctor(hosts, tmp / "keys", timeout=5)
    assert [f.ok for f in found] == [True, False, False, False]
    assert f"port {closed} closed" in found[1].text
    assert "'no-such-host.invalid' does not resolve" in found[2].text
    assert "devices cuda:7 not present there" in found[3].text
    assert all("\n" not in f.line() for f in found)
    wrong = doctor.run_doctor(hosts[:1], tmp / "other", timeout=2)
    assert not wrong[0].ok and "keys do not match" in wrong[0].text
    monkeypatch.setattr(doctor, "__version__", "9.9.9")
    old = doctor.run_doctor(hosts[:1], tmp / "keys", timeout=5)
    assert not old[0].ok and "this machine 9.9.9" in old[0].text


def test_agent_refuses_bad_requests(agent):
    tmp, port = agent
    ctx: zmq.Context = zmq.Context()
    link = AgentLink(Host("good", "127.0.0.1", port, ("cpu:0",)), Keyring.load(tmp / "keys"), ctx)
    try:
        for name, payload, error in (
                ("reboot", None, "unknown request 'reboot'"),
                ("launch", {"run": "../etc", "spec": {}}, "run name '../etc'"),
                ("launch", {"run": "r1", "spec": {"role": "x"}}, "missing field 'node_id'"),
                ("launch", {"run": "r1", "spec": {"role": "x", "node_id": "n", "entry": "a:b",
                                                  "device": "cuda:9"}}, "device 'cuda:9'"),
                ("poll", {"run": "r1", "node": "n"}, "no node 'n' in run 'r1'")):
            with pytest.raises(AgentUnavailable, match=error):
                link.request(name, payload, timeout=5)
    finally:
        link.close()
        ctx.term()


def test_doctor_cli_exit_codes(agent, tmp_path):
    tmp, port = agent
    (tmp_path / "hosts").write_text(f"good 127.0.0.1:{port} cpu:0\n")
    ok = subprocess.run([sys.executable, "-m", "rlhf_async", "doctor", str(tmp_path / "hosts"),
                         "--keys", str(tmp / "keys")], capture_output=True, text=True,
                        timeout=60, check=False)
    assert ok.returncode == 0 and "1 of 1 hosts ready" in ok.stdout, ok.stdout + ok.stderr
    (tmp_path / "bad").write_text("good 127.0.0.1:0 cpu\n")
    bad = subprocess.run([sys.executable, "-m", "rlhf_async", "doctor", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "port '0'" in bad.stderr


def test_remote_launch_on_an_unreachable_agent_is_a_failed_node(agent, tmp_path):
    from rlhf_async.runtime.remote import LAUNCH_FAILED, RemoteLauncher
    from rlhf_async.runtime.spec import NodeSpec

    tmp, port = agent
    hosts = [Host("up", "127.0.0.1", port, ("cpu:0",)),
             Host("down", "127.0.0.1", _free_port(), ("cpu:1",))]
    launcher = RemoteLauncher(hosts, run="r1", keys=tmp / "keys", launch_timeout=1.0)
    try:
        proc = launcher.launch(NodeSpec("x", "n1", "nodes.none:main", device="cpu:1"), tmp_path)
        assert proc.poll() == LAUNCH_FAILED and proc.pid is None
        started = launcher.launch(NodeSpec("x", "n2", "nodes.none:main", device="cpu:0"),
                                  tmp_path)
        assert started.pid is not None  # the agent started it; its entry does not exist
        rc = asyncio.run(started.wait(60))  # so it exits, and poll sees that remotely
        assert rc not in (None, 0, LAUNCH_FAILED)
    finally:
        launcher.close()
