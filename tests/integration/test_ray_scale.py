"""Scaling a Separation job on Ray (`rlhf-async scale` with `placement.launcher = ray`), on
a one-node Ray cluster of 4 CPUs: the job holds 3 one-CPU bundles (trainer, gen0,
scorer0); a second generator gets a new bundle (device 3), a third is refused at once with
one error naming what is missing while the job goes on, and the scale back down retires
gen1 and gives its bundle back; every prompt trained exactly once. The job is stopped 3
steps after the last scale (a new node on Ray starts a fresh Python: the job must outlast
it, however fast its steps run). Skipped without the [ray] extra."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rlhf_async.config import load_config
from rlhf_async.control.reshape import ReshapeError, Scale
from rlhf_async.metrics import read_metrics
from rlhf_async.runtime import run_loop
from rlhf_async.strategies.registry import request_scale
from tests.faults import run_during, steps_done, stop_job, trained_counts, wait_steps
from tests.integration.test_scale import TINY

ray = pytest.importorskip("ray", reason="needs the [ray] extra")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]
STORE = 80 * 1024**2  # bytes of object store: only small calls travel through Ray
# longer responses: a step outlasts a new node's start (a fresh Python on Ray, no fork server)
SLOW = ["task.min_len=24", "task.short_len=32", "task.max_len=32",
        "generation.max_new_tokens=40", "model.max_positions=96"]


def _groups() -> int:
    """The placement groups held now (the test's Ray connection is the job's: one process)."""
    return sum(1 for g in ray.util.placement_group_table().values() if g["state"] == "CREATED")


def test_scale_on_ray_adds_a_bundle_refuses_past_the_cluster_and_gives_it_back(
        tmp_path, cache):
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "object_store_memory": STORE, "include_dashboard": False})
    steps = 300  # at most: stopped 3 steps after the scale down
    try:
        cfg = load_config(None, [
            *TINY, "placement.devices=3", f"run.cache_dir={json.dumps(str(cache))}",
            f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=rs",
            f"train.steps={steps}", "placement.launcher=ray", f"ray.address={cluster.address}",
            "ray.placement_timeout_s=20", "run.checkpoint_every=0", *SLOW])
        run_dir, done, held = tmp_path / "rs", list[tuple](), list[int]()

        def worked(node: str) -> bool:
            return any(r.get(f"util/{node}", 0) > 0 for r in read_metrics(run_dir / "metrics.jsonl"))

        def scale_and_count(stop: threading.Event) -> None:
            """Each scale 3 steps after the last (the scale down once gen1 has worked);
            the job's placement groups after each; then a stop."""
            for scale in (Scale(generators=2), Scale(generators=3), Scale(generators=1)):
                while scale.generators == 1 and not worked("gen1"):
                    if stop.wait(0.1):
                        return
                if not wait_steps(run_dir, steps_done(run_dir) + 3, stop):
                    return
                t0 = time.monotonic()
                try:
                    answer: object = run_loop(request_scale(run_dir, scale, timeout=120))
                except ReshapeError as e:
                    answer = e
                done.append((steps_done(run_dir), answer, time.monotonic() - t0))
                held.append(_groups())
            if wait_steps(run_dir, steps_done(run_dir) + 3, stop):
                stop_job(run_dir)

        summary = run_during(cfg, scale_and_count)
    finally:
        cluster.shutdown()
    assert len(done) == 3, done
    (_, up, _), (_, refused, refused_s), (_, down, _) = done
    assert up.added == ["gen1"] and up.counts == {"generator": 2, "scorer": 1}
    assert isinstance(refused, ReshapeError), refused
    assert str(refused) == (
        "the Ray cluster cannot hold 1 more bundle(s) of {1 CPU} (devices [4]) beside the "
        "job's 4: missing 1 CPU: the job needs 5 CPU, the cluster has 4 CPU on 1 node(s); "
        "the job goes on with 2 generator(s), 1 scorer(s)")
    assert refused_s < 5, refused_s  # at once, not after ray.placement_timeout_s
    assert down.removed == ["gen1"] and down.counts == {"generator": 1, "scorer": 1}
    # device 3's bundle is a group of its own, kept through the refusal, given back after
    assert held == [2, 2, 1], held
    ran = [json.loads(x) for x in (run_dir / "ray_nodes.jsonl").read_text().splitlines()]
    assert {r["node"]: r["bundle"] for r in ran} == {
        "trainer": 0, "gen0": 1, "scorer0": 2, "gen1": 3}
    records = read_metrics(run_dir / "metrics.jsonl")
    trained = len(records)
    assert summary["stopped"] and trained < steps, summary
    assert [r["step"] for r in records] == list(range(trained))
    assert worked("gen1")  # it worked while it was there
    assert records[-1].get("faults/restarts", 0) == 0
    counts = trained_counts(run_dir)
    assert set(counts) == set(range(trained * 16)) and set(counts.values()) == {1}
    placement = json.loads((run_dir / "config.json").read_text())["placement"]
    assert (placement["devices"], placement["generators"], placement["generator"]) == (3, 1, [1])
