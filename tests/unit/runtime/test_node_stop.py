"""A node waiting for input ends at a stop at once (`Node.unless_stopped`)."""

import asyncio
from collections import Counter
from types import SimpleNamespace

from rlhf_async.runtime.node import Node
from rlhf_async.runtime.spec import NodeSpec


def node() -> Node:
    transport = SimpleNamespace(counters=Counter(), channel=lambda ep: None)
    return Node(NodeSpec("scorer", "scorer0", "nodes.scorer.main:main"), transport, None)


def test_a_stop_ends_the_wait_and_cancels_it():
    async def main():
        n, cancelled = node(), asyncio.Event()

        async def recv():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.05, n.request_stop, "test")
        got = await asyncio.wait_for(n.unless_stopped(recv()), 5)
        return got, cancelled.is_set()

    assert asyncio.run(main()) == (None, True)


def test_input_that_comes_first_is_returned():
    async def main():
        n = node()

        async def recv():
            await asyncio.sleep(0.01)
            return b"chunk"

        first = await n.unless_stopped(recv())
        n.request_stop("test")
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(b"late")  # already there when the stop is: still handed over
        return first, await n.unless_stopped(ready)

    assert asyncio.run(main()) == (b"chunk", b"late")
