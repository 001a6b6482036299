"""Separation on a Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head without
CPUs, as on real clusters, and three worker nodes of one CPU): trainer, generator and
scorer each on a node of its own, the same trajectory as the local launch at max_staleness
= 0; a placement larger than the cluster fails at once, naming what is missing; losing the
generator's, then the scorer's, then the trainer's Ray node mid-run restarts each on a spare
node and every prompt is still trained exactly once; a binding node moves the queue it binds
to the spare's address, and its peer follows; `rlhf-async doctor` checks every node and the
placement; the daemon runs a job that uses Ray (the Separation comparison's). Skipped without
the [ray] extra."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rlhf_async import job
from rlhf_async.cli import main
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.ops.daemon import call_daemon
from rlhf_async.runtime.ray_cluster import RayPlacementError
from tests.faults import run_during, trained_counts

ray = pytest.importorskip("ray", reason="needs the [ray] extra")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]
STORE = 80 * 1024**2  # bytes of object store per node: only small calls travel through Ray
TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=3", "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "placement.strategy=separation", "algo.max_staleness=0"]
# trainer on device 0, generator on 1, scorer on 2: with one CPU a node, a node each
APART = ["placement.devices=3", "placement.generator=[1]", "placement.reward=[2]"]
STEPS = 5  # of a run that loses a Ray node after 1, 2 and 3 steps: each restarted
LOSSY = ["placement.launcher=ray", f"train.steps={STEPS}", "algo.max_staleness=1",
         "run.checkpoint_every=1", "runtime.restart_limit=2", "runtime.time_to_dead=5",
         "weight_sync.timeout_s=20"]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
    try:
        for _ in range(3):
            c.add_node(num_cpus=1, object_store_memory=STORE)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def _cfg(tmp_path, cache, name, *overrides):
    return load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                              f"run.output_dir={json.dumps(str(tmp_path))}",
                              f"run.name={name}", *overrides])


def test_separation_on_three_ray_nodes_through_the_daemon_matches_the_local_launch(
        tmp_path, cache, cluster):
    """`rlhf-async submit ... placement.launcher=ray`: the daemon's job places its nodes on
    the cluster, as `rlhf-async run` would, and trains the local launch's trajectory."""
    job.run(_cfg(tmp_path, cache, "local", *APART))
    state = tmp_path / "state"
    cli = [sys.executable, "-m", "rlhf_async"]
    with open(tmp_path / "daemon.log", "wb") as log:
        daemon = subprocess.Popen([*cli, "serve", "--state-dir", str(state)],
                                  stdout=subprocess.DEVNULL, stderr=log)
    try:
        submit = [*cli, "submit", *TINY, *APART, f"run.cache_dir={json.dumps(str(cache))}",
                  "placement.launcher=ray", f"ray.address={cluster.address}",
                  "--state-dir", str(state)]
        deadline = time.monotonic() + 30  # until the daemon answers
        while (done := subprocess.run(submit, capture_output=True, text=True)).returncode:
            assert time.monotonic() < deadline, done.stderr
            time.sleep(0.5)
        assert done.stdout.startswith("job 1 queued")
        deadline = time.monotonic() + 180
        while (jobs := call_daemon(state, {"op": "jobs"}))[0]["state"] in ("queued", "running"):
            assert time.monotonic() < deadline, jobs
            time.sleep(1)
        assert jobs[0]["state"] == "finished", jobs
    finally:
        daemon.terminate()
        daemon.wait(30)
    run_dir = Path(jobs[0]["run_dir"])  # the daemon's: STATE/runs/job-1
    local, on_ray = (read_metrics(d / "metrics.jsonl") for d in (tmp_path / "local", run_dir))
    assert len(local) == len(on_ray) == 3
    for a, b in zip(local, on_ray, strict=True):
        for k in ("policy_loss", "value_loss", "reward", "kl", "entropy", "response_length"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)
    ran = [json.loads(line) for line in (run_dir / "ray_nodes.jsonl").read_text().splitlines()]
    where = {r["node"]: r["ray_node"] for r in ran}
    assert sorted(where) == ["gen0", "scorer0", "trainer"]
    assert len(set(where.values())) == 3  # each on a Ray node of its own
    assert set(where.values()) <= {n.node_id for n in cluster.list_all_nodes()}
    assert {r["node"]: r["bundle"] for r in ran} == {"trainer": 0, "gen0": 1, "scorer0": 2}
    for node in where:  # node logs where a local run has them, every endpoint CURVE tcp
        assert "node_exit" in (run_dir / "logs" / f"{node}.log").read_text()
        spec = json.loads((run_dir / "specs" / f"{node}.json").read_text())
        assert spec["control"].startswith("tcp://") and spec["keys"] == str(run_dir / "keys")
        assert all(ep["address"].startswith("tcp://") for ep in spec["endpoints"].values())


def test_flattening_ranks_on_two_ray_nodes_match_the_local_launch(tmp_path, cache, cluster):
    """Ray in torchrun's place: one `rlhf-async run` per rank, each on a node of its own.
    (Interleaving takes the same path: only the strategy's name differs.)"""
    strategy = "flattening"
    two = [f"placement.strategy={strategy}", "placement.devices=2", "train.steps=2"]
    job.run(_cfg(tmp_path, cache, "local", *two))
    summary = job.run(_cfg(tmp_path, cache, "ray", *two, "placement.launcher=ray",
                           f"ray.address={cluster.address}"))
    assert not ray.is_initialized()
    run_dir = tmp_path / "ray"
    assert summary["run_dir"] == str(run_dir) and summary["strategy"] == strategy
    local, on_ray = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("local", "ray"))
    assert len(local) == len(on_ray) == 2
    for a, b in zip(local, on_ray, strict=True):
        for k in ("policy_loss", "value_loss", "reward", "kl", "entropy", "response_length"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)
    ran = [json.loads(line) for line in (run_dir / "ray_nodes.jsonl").read_text().splitlines()]
    assert {r["node"]: r["bundle"] for r in ran} == {"rank0": 0, "rank1": 1}
    assert len({r["ray_node"] for r in ran}) == 2  # each rank on a Ray node of its own
    assert not list(tmp_path.glob(".ray.*.config.json"))  # the rank config file is gone


def test_a_placement_larger_than_the_cluster_fails_before_anything_starts(tmp_path, cache,
                                                                           cluster):
    t0 = time.monotonic()
    with pytest.raises(RayPlacementError) as e:
        job.run(_cfg(tmp_path, cache, "big", "placement.devices=4", "placement.cpu_threads=1",
                     "placement.launcher=ray", f"ray.address={cluster.address}"))
    assert time.monotonic() - t0 < 20
    assert str(e.value) == (
        "the Ray cluster cannot hold this job's placement group (4 bundle(s) of {1 CPU}, one "
        "per device, placed PACK): missing 1 CPU: the job needs 4 CPU, the cluster has 3 CPU "
        "on 4 node(s)")
    assert not (tmp_path / "big" / "logs").exists() and not (tmp_path / "big" / "specs").exists()
    assert not ray.is_initialized()


def test_the_doctor_checks_every_ray_node_and_the_placement(tmp_path, cache, cluster, capsys):
    args = ["doctor", "--timeout", "240",  # a Ray worker's start on a loaded CI machine
            *TINY, *APART, f"run.cache_dir={json.dumps(str(cache))}",
            f"run.output_dir={json.dumps(str(tmp_path))}", "placement.launcher=ray",
            f"ray.address={cluster.address}"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"ok    ray: {cluster.address}: 4 live node(s), 3 CPU, 0 GPU"
    assert lines[1] == ("ok    placement: 3 bundle(s) of {'CPU': 1.0} placed PACK: the nodes "
                        "hold them")
    assert len(lines) == 2 + 4 + 1 and all(x.startswith("ok    ") for x in lines[2:6])
    assert all("same versions, run.output_dir, run.cache_dir shared and writable, this host "
               "reachable" in x for x in lines[2:6])
    assert lines[-1] == "6 of 6 checks passed"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rlhf-async-doctor")]
    assert main([*args, "placement.devices=5", "placement.generator=[3]"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  placement: 5 bundle(s) of {'CPU': 1.0} placed PACK: missing 2 CPU" in out
    assert out.strip().endswith("5 of 6 checks passed; 1 failed")
    assert not ray.is_initialized()


def _remove_nodes_of(cluster, order: list[str], run_dir: Path, stop: threading.Event,
                     lost: list[str], placed: Callable[[], None]) -> None:
    """Take down the Ray node `order[i]` runs on once `i + 1` steps are trained; call
    `placed` as soon as the job's nodes have started (its bundles are placed). Each victim is
    frozen first and killed with its Ray node: it does no more work once its fault begins,
    so every later step waits for its restart (however fast the machine runs the others)."""
    metrics, ran = run_dir / "metrics.jsonl", run_dir / "ray_nodes.jsonl"

    def starts(node: str) -> list[dict]:
        lines = ran.read_text().splitlines() if ran.exists() else []
        return [r for r in map(json.loads, lines) if r["node"] == node]

    while not stop.is_set() and len(lost) < len(order):
        time.sleep(0.1)
        if placed is not None and all(starts(n) for n in order):
            placed()
            placed = None
        if placed is not None or not metrics.exists() or \
                len(metrics.read_text().splitlines()) < len(lost) + 1:
            continue
        last = starts(order[len(lost)])[-1]
        os.kill(last["pid"], signal.SIGSTOP)
        victim = next(n for n in cluster.worker_nodes if n.node_id == last["ray_node"])
        cluster.remove_node(victim)
        os.kill(last["pid"], signal.SIGKILL)  # gone with its host (Ray's SIGTERM waits)
        lost.append(victim.node_id)


class _Hold:
    """Holds a CPU of the Ray node it runs on."""

    def ready(self) -> bool:
        return True


# the nodes lost one after another; a binding node (the queue its peers push to) with the
# endpoint it binds and the node that connects to that
LOST = ["gen0", "scorer0", "trainer"]
BINDS = {"scorer0": ("rollouts", "gen0"), "trainer": ("scored", "scorer0")}
SPARES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]  # hosts of their own to Ray, on this machine


def test_lost_ray_nodes_restart_elsewhere_and_binding_nodes_move_their_endpoints(
        tmp_path, cache, cluster):
    """The generator's, the scorer's and the trainer's Ray nodes are lost in turn, each
    restarts on a spare Ray node (another address) and every prompt is still trained
    exactly once. The scorer binds its rollouts queue, the trainer its scored queue and
    hosts the weight-sync group: each binds at its new address and its peer, still running,
    connects there instead; the weight-sync group is formed anew at the trainer's new host.
    Last in the module: it changes the cluster."""
    spares = [cluster.add_node(num_cpus=1, object_store_memory=STORE, node_ip_address=ip)
              for ip in SPARES]
    cluster.wait_for_nodes()
    cfg = _cfg(tmp_path, cache, "lost", *APART, *LOSSY, f"ray.address={cluster.address}")
    run_dir, lost = tmp_path / "lost", list[str]()
    ray.init(address=cluster.address, log_to_driver=False)  # the job uses this connection
    try:  # the spares are held while the job places its group, then free for the nodes
        holds = [ray.remote(num_cpus=1)(_Hold).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote()
            for n in spares]
        assert ray.get([h.ready.remote() for h in holds], timeout=120)
        run_during(cfg, lambda stop: _remove_nodes_of(
            cluster, LOST, run_dir, stop, lost, lambda: [ray.kill(h) for h in holds]))
    finally:
        ray.shutdown()
    assert len(lost) == len(LOST), f"the run ended before {LOST[len(lost):]} were lost"
    counts = trained_counts(run_dir)
    assert set(counts) == set(range(STEPS * 8 * 2)) and set(counts.values()) == {1}
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert records[-1]["faults/restarts"] >= len(LOST)
    ran = [json.loads(x) for x in (run_dir / "ray_nodes.jsonl").read_text().splitlines()]
    for node, ray_node in zip(LOST, lost, strict=True):
        starts = [r for r in ran if r["node"] == node]
        assert starts[0]["ray_node"] == ray_node and starts[-1]["address"] in SPARES
        assert starts[-1]["bundle"] == starts[0]["bundle"]  # its device's, moved by Ray
    for node, (endpoint, peer) in BINDS.items():
        starts = [r for r in ran if r["node"] == node]
        first, now = starts[0], starts[-1]
        spec = json.loads((run_dir / "specs" / f"{node}.json").read_text())  # now's
        bound = spec["endpoints"][endpoint]["address"]
        assert bound.startswith(f"tcp://{now['address']}:")
        old = next(iter(now["moved"]))
        assert old.startswith(f"tcp://{first['address']}:") and now["moved"] == {old: bound}
        log = (run_dir / "logs" / f"{peer}.log").read_text()  # told to follow
        assert "endpoints_readdressed" in log and bound in log
    trainer_now = [r for r in ran if r["node"] == "trainer"][-1]
    ready = [json.loads(x) for x in (run_dir / "logs" / "gen0.log").read_text().splitlines()
             if '"weight_sync_group_ready"' in x]
    assert ready[-1]["store"].startswith(f"{trainer_now['address']}:"), ready
