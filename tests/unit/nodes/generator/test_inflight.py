import asyncio

import pytest

from nodes.generator.inflight import InflightWeights, Span
from rlhf_async.strategies.separation.protocol import SFT_LINEAGE


def test_updates_go_in_at_the_next_step_in_order_and_the_span_records_them():
    copied = []
    held = InflightWeights(lambda staged: copied.append(staged) or staged)
    start, span = held.begin()
    assert (start, held.between()) == (0, 0) and not held.pending
    first, second = held.offer(1, "A"), held.offer(2, "A")
    assert held.pending and not first.done()
    assert held.between() == 2 and copied == [1, 2]  # both, oldest first
    assert first.result() == 1 and second.result() == 2
    held.end(span)
    assert span.held == [(0, SFT_LINEAGE), (1, "A"), (2, "A")] and span.swaps == 2
    assert span.lineage() == "A"  # version 0 is the SFT policy of every lineage
    held.offer(3, "A")
    held.apply_pending()  # between chunks: recorded in no span
    assert span.swaps == 2 and (held.version, held.lineage) == (3, "A")


def test_open_spans_each_record_the_updates_taken_while_they_are_open():
    held = InflightWeights(lambda staged: staged)
    _, first = held.begin()
    held.offer(1, "A")
    held.between()
    _, second = held.begin()  # continuous batching: a later chunk joins the batch
    held.offer(2, "A")
    held.between()
    held.end(first)
    held.offer(3, "A")
    held.between()
    held.end(second)
    assert [v for v, _ in first.held] == [0, 1, 2]
    assert [v for v, _ in second.held] == [1, 2, 3]


def test_a_failed_copy_fails_its_update_and_keeps_the_weights():
    def swap(staged):
        if staged == "bad":
            raise ValueError("does not fit")
        return staged

    held = InflightWeights(swap)
    bad, good = held.offer("bad", "A"), held.offer(4, "A")
    assert held.apply_pending() == 4
    with pytest.raises(ValueError, match="does not fit"):
        bad.result()
    assert good.result() == 4


def test_a_chunk_over_two_trainer_lineages_belongs_to_no_trainer():
    assert Span([(3, "A")]).lineage() == "A"
    assert Span([(0, SFT_LINEAGE), (1, "B")]).lineage() == "B"
    assert Span([(2, "A"), (2, "B")]).lineage() == "A+B"


def test_an_idle_waiter_gets_the_version_from_the_sampling_thread():
    held = InflightWeights(lambda staged: staged)

    async def main():
        fut = held.offer(5, "A")
        held.begin()
        # the sampling thread's next decode step takes it
        await asyncio.to_thread(held.between)
        return await asyncio.wrap_future(fut)

    assert asyncio.run(main()) == 5
