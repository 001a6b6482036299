"""Stop signals during the lock-step loop: one request per burst, a later one forces."""

import os
import signal
import time

import pytest

from rlhf_async.config import JobConfig
from rlhf_async.strategies import lockstep
from rlhf_async.strategies.base import JobStopped


def test_a_launchers_double_sigterm_is_one_stop_and_a_later_one_forces(monkeypatch):
    monkeypatch.setattr(lockstep, "REPEAT_S", 0.2)
    stop = lockstep.StopRequest()
    with lockstep._signals_stop(stop) as forced:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun sends two back to back
        assert stop.event.is_set() and stop.reason == "SIGTERM" and not forced.is_set()
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):  # in-process: unwind now
            os.kill(os.getpid(), signal.SIGTERM)
        assert forced.is_set()


@pytest.mark.parametrize("finished", [True, False])
def test_a_stop_during_the_final_save_is_a_finished_run(monkeypatch, tmp_path, finished):
    """SIGTERM after the last step (while the policy is saved) once reported the run as
    stopped with no checkpoint, and its resume trained every step again."""
    def rank_loop(cfg, art, run_dir, rank, world, start, make_scorer, strategy, precision,
                  stop):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives in the final save
        if finished:
            stop.finished.set()
        return finished

    monkeypatch.setattr(lockstep, "rank_loop", rank_loop)
    cfg = JobConfig()
    if finished:
        result = lockstep.run_ranks(cfg, None, tmp_path, 0, None, "flattening", None)
        assert result.policy_dir == tmp_path / "policy"
    else:
        with pytest.raises(JobStopped, match="SIGTERM"):
            lockstep.run_ranks(cfg, None, tmp_path, 0, None, "flattening", None)
