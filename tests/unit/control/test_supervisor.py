"""The supervisor without processes or sockets: fake `Popen`-shaped handles show which
deaths it declares, which it restarts, and when it stops restarting."""

import asyncio
import itertools
import os
import time

import pytest
import structlog

from rlhf_async.control.client import NodeEvent, NodeNotReady
from rlhf_async.control.supervisor import Supervisor
from rlhf_async.runtime.beats import BeatBoard
from rlhf_async.runtime.spec import NodeSpec

PIDS = itertools.count(1000)


class FakeProcess:
    def __init__(self) -> None:
        self.pid, self.rc, self.killed = next(PIDS), None, False

    def poll(self):
        return self.rc

    async def wait(self, timeout=None):
        return self.rc

    def terminate(self):
        self.rc = -15

    def kill(self):
        self.killed, self.rc = True, -9


class FakeLauncher:
    def __init__(self) -> None:
        self.launched: list[FakeProcess] = []

    def launch(self, spec, run_dir):
        self.launched.append(FakeProcess())
        return self.launched[-1]


def _supervisor(tmp_path, restart_limit=1, stopping=lambda: False, time_to_dead=5.0):
    events: list[NodeEvent] = []
    sup = Supervisor(tmp_path, FakeLauncher(), publish=events.append, stopping=stopping,
                     time_to_dead=time_to_dead, ready_timeout=60.0,
                     restart_limit=restart_limit, log=structlog.get_logger())
    sup.start(NodeSpec("worker", "w0", "mod.sub:main"))
    return sup, events


def test_a_crash_is_restarted_until_the_limit_then_left_dead(tmp_path):
    sup, events = _supervisor(tmp_path, restart_limit=1)
    first = sup.nodes["w0"].process
    first.rc = 1
    sup.check()
    assert [e.kind for e in events] == ["node_dead", "node_restarted"]
    assert events[0].payload["will_restart"] and events[0].payload["exit_code"] == 1
    second = sup.nodes["w0"].process
    assert second is not first and sup.nodes["w0"].restarts == 1 and sup.pid("w0") == second.pid
    second.rc = 1
    sup.check()
    assert [e.kind for e in events[2:]] == ["node_dead"]
    assert not events[2].payload["will_restart"] and sup.nodes["w0"].state == "dead"
    assert sup.pid("w0") is None


def test_a_silent_ready_node_is_killed_but_a_clean_exit_is_not_a_death(tmp_path):
    sup, events = _supervisor(tmp_path, restart_limit=0, time_to_dead=1.0)
    node = sup.nodes["w0"]
    node.mark_ready()
    sup.check()
    assert events == []  # heard from just now
    node.last_seen = time.monotonic() - 2.0
    sup.check()
    assert node.process.killed and events[0].kind == "node_dead"
    assert events[0].payload["reason"].startswith("no heartbeat for")
    sup.start(NodeSpec("worker", "w1", "mod.sub:main"))
    sup.nodes["w1"].process.rc = 0
    sup.check()
    assert events[-1].kind == "exited" and sup.nodes["w1"].state == "exited"


def test_no_restart_while_stopping_and_wait_ready_names_the_node(tmp_path):
    sup, events = _supervisor(tmp_path, restart_limit=3, stopping=lambda: True)
    sup.nodes["w0"].process.rc = 2
    with pytest.raises(NodeNotReady, match="'w0' exited with code 2"):
        asyncio.run(sup.wait_ready(["w0"], timeout=1.0))
    sup.check()
    assert [e.kind for e in events] == ["node_dead"] and len(sup.launcher.launched) == 1


def test_a_crash_says_its_last_log_line_a_kill_does_not(tmp_path):
    """A node that dies of an exception cannot send its reason: its log's last line (the
    exception) is the reason, in the death event and in the not-ready error."""
    sup, events = _supervisor(tmp_path, restart_limit=0)
    log = tmp_path / "w0.log"
    log.write_text("Traceback (most recent call last):\n  ...\n"
                   "ModuleNotFoundError: No module named 'safetensors'\n\n")
    sup.nodes["w0"].process.log_path, sup.nodes["w0"].process.rc = log, 1
    with pytest.raises(NodeNotReady, match=r"code 1 before it was ready \(ModuleNotFound"
                                           r"Error: No module named 'safetensors'\); see "):
        asyncio.run(sup.wait_ready(["w0"], timeout=1.0))
    sup.check()
    assert events[0].payload["reason"] == ("exited with code 1 (ModuleNotFoundError: No "
                                           "module named 'safetensors')")
    sup.start(NodeSpec("worker", "w1", "mod.sub:main"))
    sup.nodes["w1"].process.log_path, sup.nodes["w1"].process.rc = log, -9
    sup.check()
    assert events[-1].payload["reason"] == "exited with code -9"


def test_restart_kills_only_the_process_the_caller_means(tmp_path):
    sup, events = _supervisor(tmp_path, restart_limit=2)
    old = sup.nodes["w0"].process.pid
    assert sup.restart("w0", "peer died", old)
    assert not sup.restart("w0", "peer died", old)  # its replacement is left alone
    assert sup.nodes["w0"].restarts == 1 and sup.pid("w0") != old
    assert [e.kind for e in events] == ["node_dead", "node_restarted"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _clocked(tmp_path, restart_limit, stable_after_s):
    clock, events = FakeClock(), []
    sup = Supervisor(tmp_path, FakeLauncher(), publish=events.append, stopping=lambda: False,
                     time_to_dead=5.0, ready_timeout=60.0, restart_limit=restart_limit,
                     log=structlog.get_logger(), stable_after_s=stable_after_s, clock=clock)
    sup.start(NodeSpec("worker", "w0", "mod.sub:main"))
    return sup, events, clock


def _live_for(sup, clock, seconds, period=1.0):
    """The node answers heartbeats for `seconds` while the supervisor checks every `period`."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += period
        node = sup.nodes["w0"]
        if node.state == "starting":
            node.mark_ready()
        node.last_seen = clock.now
        sup.check()


def test_a_node_dying_once_an_hour_for_a_week_never_runs_out_of_restarts(tmp_path):
    sup, events, clock = _clocked(tmp_path, restart_limit=2, stable_after_s=300.0)
    for _ in range(7 * 24):
        _live_for(sup, clock, 3600.0, period=60.0)
        sup.nodes["w0"].process.rc = 1
        clock.now += 1.0
        sup.check()
    kinds = [e.kind for e in events]
    assert kinds.count("node_dead") == kinds.count("node_restarted") == 7 * 24
    assert all(e.payload["will_restart"] for e in events if e.kind == "node_dead")
    node = sup.nodes["w0"]
    assert node.restarts == 7 * 24 and node.failures == 1 and node.state == "starting"
    assert node.spec.incarnation == 7 * 24 and sup.status()["w0"]["incarnation"] == 7 * 24


def test_a_crash_looping_node_exhausts_its_restarts(tmp_path):
    sup, events, clock = _clocked(tmp_path, restart_limit=3, stable_after_s=300.0)
    for _ in range(4):  # ready each time, dead a minute later: never stable
        _live_for(sup, clock, 60.0)
        sup.nodes["w0"].process.rc = 1
        sup.check()
    dead = [e.payload["will_restart"] for e in events if e.kind == "node_dead"]
    assert dead == [True, True, True, False] and sup.nodes["w0"].state == "dead"
    assert len(sup.launcher.launched) == 4


def test_a_node_is_stable_only_while_ready_and_heard_from(tmp_path):
    sup, _, clock = _clocked(tmp_path, restart_limit=3, stable_after_s=30.0)
    sup.nodes["w0"].process.rc = 1
    sup.check()  # died while starting: restart 1
    assert sup.nodes["w0"].failures == 1
    clock.now += 50.0  # loading its models all that time: not healthy, not forgiven
    sup.nodes["w0"].last_seen = clock.now
    sup.check()
    assert sup.nodes["w0"].failures == 1
    _live_for(sup, clock, 29.0)
    assert sup.nodes["w0"].failures == 1  # seen healthy at the first check, 28 s ago
    _live_for(sup, clock, 2.0)
    assert sup.nodes["w0"].failures == 0 and sup.nodes["w0"].restarts == 1


def test_nodes_here_beat_into_the_board_each_start_in_a_slot_of_its_own(tmp_path):
    clock, events = FakeClock(), []
    board = BeatBoard.create(tmp_path / "beats", slots=3)
    sup = Supervisor(tmp_path, FakeLauncher(), publish=events.append, stopping=lambda: False,
                     time_to_dead=5.0, ready_timeout=60.0, restart_limit=1,
                     log=structlog.get_logger(), clock=clock, board=board)
    sup.start(NodeSpec("worker", "w0", "mod.sub:main"))
    first = sup.nodes["w0"]
    assert first.spec.beats == board.path and first.spec.beat_slot == 1
    first.mark_ready()
    for t in (4.0, 8.0, 12.0):  # beats written in place, no message: alive
        board.stamp(1, t)
        clock.now = t + 1.0
        sup.check()
    assert events == []
    clock.now = 18.0  # its last beat 6 s ago
    sup.check()
    assert [e.kind for e in events] == ["node_dead", "node_restarted"]
    second = sup.nodes["w0"]
    assert second.spec.beat_slot == 2 and second.spec.incarnation == 1
    second.mark_ready()
    board.stamp(1, 30.0)  # the first incarnation, woken up: its slot is no longer read
    clock.now = 30.0
    sup.check()
    assert events[-1].kind == "node_dead" and not events[-1].payload["will_restart"]
    sup.start(NodeSpec("worker", "w1", "mod.sub:main"))  # the board is full: the socket
    assert sup.nodes["w1"].spec.beats == "" and sup.nodes["w1"].spec.beat_slot == 0
    board.close()


class SentinelProcess(FakeProcess):
    """A process whose end a pipe tells, as a forked node's sentinel does."""

    def __init__(self) -> None:
        super().__init__()
        self.sentinel, self._end = os.pipe()

    def end(self, rc: int) -> None:
        self.rc = rc
        os.write(self._end, b"x")


def test_a_node_that_ends_is_seen_at_once_without_a_liveness_pass(tmp_path):
    async def main():
        events = []
        got = asyncio.Event()
        launcher = FakeLauncher()
        launcher.launch = lambda spec, run_dir: launcher.launched.append(  # type: ignore
            SentinelProcess()) or launcher.launched[-1]
        sup = Supervisor(tmp_path, launcher, publish=lambda e: (events.append(e), got.set()),
                         stopping=lambda: False, time_to_dead=5.0, ready_timeout=60.0,
                         restart_limit=0, log=structlog.get_logger())
        sup.start(NodeSpec("worker", "w0", "mod.sub:main"))
        sup.nodes["w0"].process.end(1)
        await asyncio.wait_for(got.wait(), timeout=30)  # a hang guard; `check` never runs
        assert events[0].kind == "node_dead" and events[0].payload["exit_code"] == 1

    asyncio.run(main())


def test_the_coordinators_stamp_goes_on_while_its_nodes_stop(tmp_path):
    """Nodes told to stop may take their grace (a trainer's checkpoint, a minute) and read
    the coordinator's stamp meanwhile: a closed supervisor declares no death but keeps
    stamping, or they would exit as orphans mid-checkpoint."""
    async def main():
        clock = FakeClock()
        board = BeatBoard.create(tmp_path / "beats", slots=2)
        sup = Supervisor(tmp_path, FakeLauncher(), publish=lambda e: None,
                         stopping=lambda: False, time_to_dead=5.0, ready_timeout=60.0,
                         restart_limit=0, log=structlog.get_logger(), clock=clock, board=board)
        watching = asyncio.ensure_future(sup.watch(0.001))
        sup.close()
        clock.now = 42.0
        for _ in range(30_000):  # a hang guard, not a timing: the stamp comes or it fails
            if board.read(0) == 42.0:
                break
            await asyncio.sleep(0.001)
        assert board.read(0) == 42.0 and not watching.done()
        watching.cancel()
        board.close()

    asyncio.run(main())
