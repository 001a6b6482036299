"""Three "hosts" as Linux network namespaces on one bridge. deploy/launch.sh starts an
agent in each (through an `ssh` stand-in that enters the namespace: there is no sshd in
this sandbox), checks them with `doctor`, and runs Separation across them over CURVE tcp.
One host's link is cut mid-run: the run stops with a checkpoint; once the link is back,
launch.sh again resumes it from that checkpoint and it finishes.

Needs root and `ip netns` (iproute2); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)
TAG = f"{os.getpid() % 10000}"
NET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.checkpoint_every=1", "placement.cpu_threads=1", "placement.strategy=separation",
        "placement.devices=3", "placement.generator=[1]", "runtime.time_to_dead=3",
        "runtime.restart_limit=0",
        "train.steps=14"]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=False)


def _cannot_netns() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"rlprobe{TAG}"
    r = _ip("netns", "add", probe)
    if r.returncode != 0:
        return f"`ip netns add` is not allowed here: {r.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Cluster:
    """Bridge rb<TAG> in the root namespace; host i is namespace rh<i>-<TAG> with address
    NET.i on veth rv<i>-<TAG> (its peer in the root namespace is rp<i>-<TAG>)."""

    def __init__(self, n: int) -> None:
        self.bridge, self.n = f"rb{TAG}", n
        self.procs: list[subprocess.Popen[bytes]] = []

    def ns(self, i: int) -> str:
        return f"rh{i}-{TAG}"

    def up(self) -> None:
        steps = [("link", "add", self.bridge, "type", "bridge"), ("link", "set", self.bridge, "up")]
        for i in range(1, self.n + 1):
            v, p, ns = f"rv{i}-{TAG}", f"rp{i}-{TAG}", self.ns(i)
            steps += [("netns", "add", ns), ("link", "add", p, "type", "veth", "peer", "name", v),
                      ("link", "set", v, "netns", ns), ("link", "set", p, "master", self.bridge),
                      ("link", "set", p, "up"),
                      ("-n", ns, "addr", "add", f"{NET}.{i}/24", "dev", v),
                      ("-n", ns, "link", "set", v, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"

    def link(self, i: int, state: str) -> None:
        assert _ip("link", "set", f"rp{i}-{TAG}", state).returncode == 0

    def run(self, i: int, argv: list[str], log: Path,
            extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": f"rv{i}-{TAG}", "OMP_NUM_THREADS": "1",
               **(extra_env or {})}
        with open(log, "ab") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=env,
                                    stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def down(self) -> None:
        for i in range(1, self.n + 1):  # agents launch.sh left behind after a failure
            pids = _ip("netns", "pids", self.ns(i)).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 15)
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for i in range(1, self.n + 1):
            _ip("netns", "del", self.ns(i))
            _ip("link", "del", f"rp{i}-{TAG}")
        _ip("link", "del", self.bridge)


@pytest.fixture
def cluster():
    reason = _cannot_netns()
    if reason is not None:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    c = Cluster(3)
    try:
        c.up()
        yield c
    finally:
        c.down()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


FAKE_SSH = """#!/bin/bash
# ssh stand-in: `fake-ssh hostI COMMAND` runs COMMAND in namespace I
i=${1#host}; shift
export GLOO_SOCKET_IFNAME=rv$i-%s
exec ip netns exec rh$i-%s bash -c "$*"
"""


def test_launch_across_namespaces_then_cut_a_link(cluster, tmp_path):
    ssh = tmp_path / "fake-ssh"
    ssh.write_text(FAKE_SSH % (TAG, TAG))
    ssh.chmod(0o755)
    (tmp_path / "hosts").write_text("".join(f"host{i} {NET}.{i}:7100 cpu:0\n"
                                            for i in range(1, 4)))
    launch = ["bash", str(Path(__file__).parents[2] / "deploy" / "launch.sh"),
              str(tmp_path / "hosts"), *TINY,
              f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
              f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", "run.name=mh"]
    env = {"RLHF_SSH": str(ssh), "RLHF_PYTHON": sys.executable,
           "RLHF_KEYS": str(tmp_path / "keys"), "RLHF_WORK": str(tmp_path / "work")}
    first = cluster.run(1, launch, tmp_path / "job1.log", env)
    ckpts = tmp_path / "runs" / "mh" / "checkpoints"
    _wait(lambda: len(list(ckpts.glob("ckpt-*"))) >= 3 or first.poll() is not None, 240,
          "three checkpoints")
    assert first.poll() is None, (tmp_path / "job1.log").read_text()[-3000:]
    cluster.link(2, "down")  # host2 holds the generator and the scorer
    assert first.wait(120) != 0
    log1 = (tmp_path / "job1.log").read_text()
    assert "3 of 3 hosts ready" in log1, log1[-3000:]
    assert "no heartbeat" in log1 and "the run stops with a checkpoint" in log1, log1[-3000:]
    assert not (tmp_path / "runs" / "mh" / "summary.json").exists()
    assert len(list(ckpts.glob("ckpt-*"))) >= 3
    cluster.link(2, "up")
    second = cluster.run(1, launch, tmp_path / "job2.log", env)
    assert second.wait(240) == 0, (tmp_path / "job2.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "runs" / "mh" / "summary.json").read_text())
    assert summary["start_step"] >= 2  # resumed from a checkpoint, not from scratch
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "runs" / "mh" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(14))  # every step once, across the two attempts
    for i, nodes in ((1, {"trainer.log"}), (2, {"gen0.log", "scorer0.log"})):
        logs = tmp_path / "work" / f"host{i}" / "mh" / "logs"
        assert {p.name for p in logs.iterdir()} == nodes
    _wait(lambda: all(not _ip("netns", "pids", cluster.ns(i)).stdout.split()
                      for i in range(1, 4)), 30, "launch.sh stopping every agent")
