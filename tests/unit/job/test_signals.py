"""job/signals.py: a stop signal's raise lands even when library code swallows the first one."""

import os
import signal
import time

import pytest

from rlhf_async.job.signals import on_stop_signals


class Stopped(Exception):
    """What the stop handler raises (the job's `JobStopped`, here)."""


def _stop(signum: int, _frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def test_a_stop_that_library_code_swallows_is_raised_again():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)
    timer = signal.getitimer(signal.ITIMER_REAL)
    swallowed, t0 = [], time.monotonic()
    with pytest.raises(Stopped, match="SIGTERM"), on_stop_signals(_stop, again_s=0.05):
        try:  # as torch's record_function does on its first use: `except Exception`
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        except Exception as e:
            swallowed.append(e)
        while time.monotonic() - t0 < 30:  # the stop's work goes on, until the raise again
            time.sleep(0.01)
    assert [type(e) for e in swallowed] == [Stopped]
    assert time.monotonic() - t0 < 10
    # SIGALRM and its timer as they were (pytest-timeout's here): no raise after the block
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)) == before
    assert signal.getitimer(signal.ITIMER_REAL)[1] == timer[1]


def test_a_block_that_no_stop_reached_leaves_sigalrm_alone():
    alarm, timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    with on_stop_signals(_stop, again_s=0.05):
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGALRM) == alarm
    assert signal.getitimer(signal.ITIMER_REAL)[0] <= timer[0]  # running on, or both unset
