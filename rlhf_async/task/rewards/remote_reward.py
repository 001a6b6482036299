"""A reward served over HTTP: `task.reward = "http://HOST:PORT/PATH"` (or https://).

A batch of responses is posted as JSON `{"prompts": [...], "responses": [...], "columns":
{name: [one value per row]}}` in requests of at most `task.reward_request_rows` rows, at
most `task.reward_max_in_flight` of them waiting at once in a process; the server answers
`{"rewards": [one number per row]}` (`rlhf-async serve-reward` serves a Python function
that way). A try that cannot connect, gets no answer within `task.reward_timeout_s`, or is
answered 408, 429, 502, 503 or 504 is made again, `task.reward_retries` more times, after
`task.reward_backoff_s`, then twice that, ...; what is still wrong after the last try, and
any other answer that is not one finite number per row, is one `RewardServerError` naming
the URL and what it answered. It is a `RewardFunctionError`, so it stops the run the way a
failing reward function does (a restart would only ask the same server again).

Why the standard library's client: the rule is called from synchronous code (the lock-step
loop, the scorer's scoring thread), so an async client would need an event loop of its own
per call; a request is one blocking exchange on a thread, which releases the GIL while it
waits, and the scorer overlaps it with its forwards (`RewardMix.overlap`).
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from rlhf_async.config import TaskConfig
from rlhf_async.task.rewards.reward_fn import RewardFunctionError, RuleReward

RETRIED = frozenset({408, 429, 502, 503, 504})  # what a busy or restarting server answers
SNIPPET = 200  # characters of an unexpected answer shown in the error


def is_url(spec: str) -> bool:
    """`task.reward` names a reward server (not a function)."""
    return spec.startswith(("http://", "https://"))


class RewardServerError(RewardFunctionError):
    """The reward server cannot be reached, or answered something other than rewards: one
    line (it is no mistake in the config file, so not listed as one)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.args = (self.problems[0],)


def _snippet(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return repr(text if len(text) <= SNIPPET else text[:SNIPPET] + "...")


def _plain(value: Any) -> Any:
    """A column value JSON cannot carry as it is: numpy/torch values by their lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} ({value!r:.60})")


class RemoteReward:
    """A reward server, called like `RuleReward`: (prompts, responses, columns, indices)
    -> one finite reward per response."""

    def __init__(self, url: str, t: TaskConfig) -> None:
        parts = urlsplit(url)
        self.url, self.https = url, parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s, self.retries, self.backoff_s = \
            t.reward_timeout_s, t.reward_retries, t.reward_backoff_s
        self.rows = t.reward_request_rows
        self.slots = threading.BoundedSemaphore(t.reward_max_in_flight)
        self.pool = ThreadPoolExecutor(t.reward_max_in_flight,
                                       thread_name_prefix="reward-request")

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 columns: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[float]:
        """One finite reward per response (`indices` are not sent: the server gets the
        rows' columns instead)."""
        n = len(prompts)
        step = self.rows or max(n, 1)
        cuts = [slice(i, min(i + step, n)) for i in range(0, n, step)]
        if len(cuts) <= 1:  # the caller's thread already overlaps it with the forwards
            return self._request(prompts, responses, columns) if n else []
        futures = [self.pool.submit(self._request, prompts[c], responses[c], columns[c])
                   for c in cuts]
        return [r for f in futures for r in f.result()]

    def _request(self, prompts: Sequence[str], responses: Sequence[str],
                 columns: Sequence[dict[str, Any]]) -> list[float]:
        body, last = self._body(prompts, responses, columns), ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with self.slots:
                    status, reason, data = self._post(body)
            except TimeoutError:
                last = f"gave no answer within task.reward_timeout_s = {self.timeout_s:g} s"
                continue
            except OSError as e:  # refused, reset, unreachable, no such host
                last = f"could not be reached ({e.strerror or e})"
                continue
            except http.client.HTTPException as e:  # bytes, but not an HTTP answer
                raise self._error(f"answered something that is not HTTP "
                                  f"({type(e).__name__}: {e})") from None
            if status in RETRIED:
                last = f"answered {status} {reason}: {_snippet(data)}"
                continue
            return self._rewards(status, reason, data, len(prompts))
        raise self._error(f"{last} (the last of {self.retries + 1} tries; "
                          f"task.reward_retries = {self.retries})")

    def _error(self, what: str) -> RewardServerError:
        return RewardServerError(f"reward server {self.url} {what}")

    def _body(self, prompts: Sequence[str], responses: Sequence[str],
              columns: Sequence[dict[str, Any]]) -> bytes:
        names = sorted({k for c in columns for k in c})
        cols = {k: [c.get(k) for c in columns] for k in names}
        try:
            return json.dumps({"prompts": list(prompts), "responses": list(responses),
                               "columns": cols}, default=_plain).encode()
        except (TypeError, ValueError) as e:
            raise self._error(f"cannot be sent the prompt rows' columns {names}: {e} is "
                              "not JSON") from None

    def _post(self, body: bytes) -> tuple[int, str, bytes]:
        """(status, reason, body) of one POST on a fresh connection."""
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", self.path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.read()
        finally:
            conn.close()

    def _rewards(self, status: int, reason: str, data: bytes, n: int) -> list[float]:
        if status != 200:
            raise self._error(f"answered {status} {reason}: {_snippet(data)}")
        try:
            answer = json.loads(data)
        except ValueError:
            raise self._error(f"answered 200 with a body that is not JSON: "
                              f"{_snippet(data)}") from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise self._error(f"answered {_snippet(data)}; expected "
                              '{"rewards": [one number per response]}')
        if len(rewards) != n:
            raise self._error(f"answered {len(rewards)} rewards for {n} responses; expected "
                              "one per response")
        # bools count, as from a reward function: true = 1.0
        bad = next((i for i, r in enumerate(rewards)
                    if not isinstance(r, numbers.Real) or not math.isfinite(r)), None)
        if bad is not None:
            raise self._error(f"answered {rewards[bad]!r} as reward {bad} of {n}; a reward "
                              "is a finite number")
        return [float(r) for r in rewards]


Rule = RuleReward | RemoteReward


def load_rule(t: TaskConfig, rows: str) -> Rule | None:
    """`task.reward` ready to call: the function (imported now), the server (asked only
    when called), or None when there is none. `rows`: what a prompt's index counts."""
    if not t.reward:
        return None
    if is_url(t.reward):
        return RemoteReward(t.reward, t)
    return RuleReward.load(t.reward, t.reward_batched, t.reward_timeout_s, rows)
