"""What a Ray cluster lacks for a job's placement group, from its nodes' resources alone
(no Ray needed), and the config keys around placement.launcher = ray."""

from __future__ import annotations

import importlib.util

import pytest

from rlhf_async.config import ConfigError, load_config
from rlhf_async.planning.planner import prepare_run
from rlhf_async.runtime.ray_cluster import device_bundles, missing
from rlhf_async.runtime.ray_launcher import device_index

CPU1 = device_bundles("cpu", 1, 1)[0]


def test_one_bundle_per_device_with_its_gpu_and_cpus():
    assert device_bundles("cuda", 2, 4) == [{"CPU": 4.0, "GPU": 1.0}] * 2
    assert device_bundles("cpu", 3, 1) == [{"CPU": 1.0}] * 3
    assert [device_index(d) for d in ("cpu:0", "cuda:7", "cpu")] == [0, 7, 0]


def test_a_cluster_that_holds_the_bundles_lacks_nothing():
    nodes = [{"CPU": 1.0}, {"CPU": 2.0, "GPU": 0.0}]
    assert missing([CPU1] * 3, "PACK", nodes) is None
    assert missing([CPU1] * 2, "STRICT_SPREAD", nodes) is None
    assert missing([CPU1] * 2, "STRICT_PACK", nodes) is None


def test_what_is_missing_is_named():
    gpus = device_bundles("cuda", 4, 2)
    what = missing(gpus, "PACK", [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 1.0}])
    assert what == ("missing 2 GPU: the job needs 8 CPU, 4 GPU, the cluster has 17 CPU, "
                    "2 GPU on 2 node(s)")
    # enough in all, but split so that no node holds a whole bundle
    what = missing(device_bundles("cpu", 2, 2), "SPREAD", [{"CPU": 1.0}] * 4)
    assert what is not None and "nodes hold only 0 of the 2" in what
    what = missing([CPU1] * 3, "STRICT_PACK", [{"CPU": 2.0}, {"CPU": 2.0}])
    assert what is not None and "STRICT_PACK" in what and "holds 2 of the 3" in what
    what = missing([CPU1] * 3, "STRICT_SPREAD", [{"CPU": 4.0}, {"CPU": 4.0}])
    assert what is not None and "2 node(s) hold one, 3 are needed" in what


def test_ray_launcher_keys_are_checked():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["placement.launcher=slurm", "ray.placement_strategy=ANY",
                           "ray.placement_timeout_s=0"])
    text = str(e.value)
    assert "placement.launcher: 'slurm' is not one of 'local', 'ray'" in text
    assert "ray.placement_strategy: 'ANY'" in text and "ray.placement_timeout_s" in text
    with pytest.raises(ConfigError) as e:  # the agent path's keys are gone, with a pointer
        load_config(None, ['placement.hosts_file="hosts.txt"', 'placement.host=["reward=b"]'])
    assert "placement.hosts_file: removed; multi-host runs place their nodes on a Ray " \
        "cluster: placement.launcher = 'ray'" in str(e.value)
    assert "placement.host: removed;" in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_without_ray_the_extra_is_named():
    with pytest.raises(ConfigError, match=r"pip install 'rlhf-async\[ray\]'"):
        load_config(None, ["placement.launcher=ray"])


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the [ray] extra")
@pytest.mark.parametrize("strategy", ["flattening", "interleaving", "separation"])
def test_ray_launches_every_strategy(strategy):
    prepare_run(load_config(None, ["placement.launcher=ray", f"placement.strategy={strategy}",
                                   "placement.devices=2"]))
