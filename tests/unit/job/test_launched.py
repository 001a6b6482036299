"""What a launcher's environment means to a job, and what it is refused."""

import pytest

from rlhf_async.cli import main
from rlhf_async.config import ConfigError, JobConfig, PlacementConfig
from rlhf_async.engines.process_group import Launch, launched
from rlhf_async.job.launched import adopt_world, lock_step_only

ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_the_launchers_variables_make_a_rank(monkeypatch):
    for k in (*ENV, "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert launched() is None
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    assert launched() == Launch(rank=1, world=4, local_rank=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched() == Launch(1, 4, 1)
    monkeypatch.delenv("MASTER_PORT")
    assert launched() is None  # not all set: a plain run
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ConfigError, match="RANK=4 is not below WORLD_SIZE=4"):
        launched()
    monkeypatch.setenv("RANK", "-1")
    with pytest.raises(ConfigError, match="RANK='-1' is not a non-negative integer"):
        launched()


def test_devices_follow_the_world_and_only_lock_step_strategies_run():
    launch = Launch(0, 4, 0)
    assert adopt_world(JobConfig(), launch).placement.devices == 4
    four = JobConfig(placement=PlacementConfig(devices=4))
    assert adopt_world(four, launch).placement.devices == 4
    with pytest.raises(ConfigError, match="placement.devices: 2, but the launcher started"):
        adopt_world(JobConfig(placement=PlacementConfig(devices=2)), launch)
    lock_step_only("interleaving", True)
    with pytest.raises(ConfigError, match="separation starts its own node processes"):
        lock_step_only("separation", False)


def test_a_malformed_launcher_variable_is_one_line(tmp_path, monkeypatch, capsys):
    for k, v in {**ENV, "RANK": "x"}.items():
        monkeypatch.setenv(k, v)
    assert main(["run", f"run.output_dir={tmp_path}"]) == 2
    assert "RANK='x' is not a non-negative integer" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
