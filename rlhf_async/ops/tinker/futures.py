"""Every Tinker operation answers at once with a request id; the client polls
`retrieve_future` until the result is there. `Futures` keeps those results; `Sequencer`
runs one model's training requests strictly in `seq_id` order (the client numbers them
1, 2, ... per training client and may send them out of order, e.g. the chunks of one
`forward_backward` in parallel), and answers a retried `seq_id` with the request id it
already has.

All model work runs on one worker thread (`Worker`), in the order it was handed over, so
that the event loop only ever parses, queues and answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhf_async.log import get_logger

log = get_logger(component="tinker_api")
KEEP_S = 3600.0  # a finished result stays retrievable this long (a client may ask again)
MAX_SEQ_AHEAD = 100_000  # a seq_id further ahead than this is a client bug, not a wait
GAP_TIMEOUT_S = 120.0  # requests wait this long for a missing earlier seq_id, then fail


class ApiError(Exception):
    """A request the API refuses: its HTTP status and a message for the user."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UserError(ValueError):
    """A request that fails for what it asks (a bad datum, an unknown loss): the future
    fails with category "user"."""


@dataclass
class Result:
    kind: Literal["json", "proto", "error"]
    value: Any  # dict (json), bytes (proto), (message, category) (error)
    done_at: float


class Futures:
    """Request id -> its result once there; `wait` long-polls."""

    def __init__(self) -> None:
        self._results: OrderedDict[str, Result] = OrderedDict()  # oldest result first
        self._events: dict[str, asyncio.Event] = {}

    def new(self, prefix: str = "") -> str:
        rid = prefix + uuid.uuid4().hex
        self._events[rid] = asyncio.Event()
        return rid

    def known(self, rid: str) -> bool:
        return rid in self._events or rid in self._results

    def resolve(self, rid: str, result: Result) -> None:
        self._results[rid] = result
        event = self._events.pop(rid, None)
        if event is not None:
            event.set()
        self._sweep(result.done_at)

    def done(self, rid: str, value: Any, kind: Literal["json", "proto"] = "json") -> None:
        self.resolve(rid, Result(kind, value, time.time()))

    def fail(self, rid: str, message: str, category: str) -> None:
        self.resolve(rid, Result("error", (message, category), time.time()))

    async def wait(self, rid: str, timeout: float) -> Result | None:
        """The result, or None if it is not there within `timeout` seconds."""
        event = self._events.get(rid)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        return self._results.get(rid)

    def _sweep(self, now: float) -> None:
        """Drop the results older than KEEP_S (from the front: a long run resolves
        thousands, and this runs at each)."""
        while self._results:
            rid = next(iter(self._results))
            if now - self._results[rid].done_at <= KEEP_S:
                return
            self._results.popitem(last=False)


class Worker:
    """The one thread that runs model work, in submission order; each job resolves its
    future on the event loop."""

    def __init__(self, futures: Futures) -> None:
        self.futures = futures
        # a new thread's OpenMP team is every core: keep the server's own thread count
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-model",
                                        initializer=torch.set_num_threads,
                                        initargs=(torch.get_num_threads(),))

    def submit(self, rid: str, job: Callable[[], tuple[Any, Literal["json", "proto"]]],
               what: str) -> None:
        loop = asyncio.get_running_loop()

        def run() -> None:
            try:
                value, kind = job()
            except UserError as e:
                loop.call_soon_threadsafe(self.futures.fail, rid, str(e), "user")
            except Exception as e:  # a server fault: logged with its traceback, reported
                log.exception("request failed", request=what, request_id=rid)
                loop.call_soon_threadsafe(self.futures.fail, rid,
                                          f"server error in {what}: {type(e).__name__}: {e}",
                                          "server")
            else:
                loop.call_soon_threadsafe(self.futures.done, rid, value, kind)

        self._pool.submit(run)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Sequencer:
    """One model's training requests in `seq_id` order (the first is 1, or where a restored
    model left off). Requests that wait `gap_timeout_s` for a seq_id that never comes fail
    with an error naming it, and the order goes on after them: a lost request must not
    hold a model forever. `on_accept(next)` hears each new highest seq_id (the service
    persists it, so that a restarted server expects what the client sends next)."""

    def __init__(self, worker: Worker, next_seq: int = 1,
                 gap_timeout_s: float = GAP_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_accept: Callable[[int], None] | None = None) -> None:
        self.worker = worker
        self.next_seq = next_seq
        self.gap_timeout_s = gap_timeout_s
        self._clock = clock
        self._on_accept = on_accept
        self._high = next_seq - 1
        self._waiting: dict[int, tuple[str, Callable[[], Any], str]] = {}
        self._ids: dict[int, str] = {}  # seq_id -> request id (a retry gets the same)
        self._since: float | None = None  # when the wait for next_seq began
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, seq_id: int | None, job: Callable[[], Any], what: str) -> str:
        if seq_id is None:
            raise ApiError(400, f"{what} needs a seq_id (the client's request counter)")
        if seq_id in self._ids:
            return self._ids[seq_id]
        if seq_id < self.next_seq:
            raise ApiError(400, f"{what}: seq_id {seq_id} is below this model's next one "
                                f"({self.next_seq}) and was never seen here (a request "
                                "accepted before a server restart is lost: send a new one)")
        if seq_id >= self.next_seq + MAX_SEQ_AHEAD:
            raise ApiError(400, f"{what}: seq_id {seq_id} is {seq_id - self.next_seq} ahead "
                                f"of this model's next one ({self.next_seq})")
        rid = self.worker.futures.new()
        self._ids[seq_id] = rid
        self._waiting[seq_id] = (rid, job, what)
        if seq_id > self._high:
            self._high = seq_id
            if self._on_accept is not None:
                self._on_accept(seq_id + 1)
        self._drain()
        return rid

    def _drain(self) -> None:
        ran = False
        while self.next_seq in self._waiting:
            rid_, job_, what_ = self._waiting.pop(self.next_seq)
            self.worker.submit(rid_, job_, what_)
            self._ids.pop(self.next_seq - 1000, None)  # a retry comes soon or never
            self.next_seq += 1
            ran = True
        if not self._waiting:
            self._since = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if ran or self._since is None:  # a new wait begins
            self._since = self._clock()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.gap_timeout_s,
                                                                self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.expire(self._clock())
        if self._waiting and self._timer is None:
            wait = max(0.0, self.gap_timeout_s - (self._clock() - (self._since or 0.0)))
            self._timer = asyncio.get_running_loop().call_later(wait + 0.01, self._on_timer)

    def expire(self, now: float) -> None:
        """If the requests have waited `gap_timeout_s` for a missing seq_id by `now`, fail
        them (each names the seq_ids that never came) and expect the one after them."""
        if not self._waiting or self._since is None or now - self._since < self.gap_timeout_s:
            return
        last = max(self._waiting)
        missing = [s for s in range(self.next_seq, last) if s not in self._waiting]
        gap = _spans(missing)
        log.warning("seq_id gap expired", missing=gap, failed=sorted(self._waiting))
        for seq_id in sorted(self._waiting):
            rid, _, what = self._waiting.pop(seq_id)
            self.worker.futures.fail(
                rid, f"{what} (seq_id {seq_id}) waited {self.gap_timeout_s:.0f} s for seq_id "
                     f"{gap}, which never reached the server (lost in a restart or a "
                     "dropped connection); it did not run, and requests after it run again",
                "server")
        self.next_seq = last + 1
        self._since = None

    @property
    def blocked(self) -> bool:
        """Requests wait for an earlier seq_id that has not come."""
        return bool(self._waiting)


def _spans(ids: list[int]) -> str:
    """[3, 4, 5, 8] -> '3-5, 8'."""
    out: list[str] = []
    for i in ids:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)
