"""Stop signals during the lock-step loop: one request per burst, a later one forces."""

import os
import signal
import time

import pytest

from rlhf_async.strategies import lockstep


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
