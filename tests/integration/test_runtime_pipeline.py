"""Real node processes: the 3-stage pipeline delivers everything in order; a stalled sink
makes the source block at the high-water mark with flat memory."""

import asyncio

import pytest

from rlhf_async.control.coordinator import Coordinator
from rlhf_async.control.demo import address_maker, build_specs, run_demo


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_pipeline_delivers_10k_messages_in_order(scheme, tmp_path):
    # Two producers so "in order per producer" is checked through a fair-queued PULL.
    result = asyncio.run(run_demo(tmp_path / "run", transport=scheme, messages=5000,
                                  sources=2, floats=64, hwm=32))
    assert "stopped" not in result, result
    assert result["received"] == 10000
    assert result["out_of_order"] == 0 and result["bad_values"] == 0
    assert result["last_seq"] == {"source0": 5000, "source1": 5000}


async def _status(coord, node_id):
    return await coord.command(node_id, "status", timeout=10)


@pytest.mark.timeout(120)
def test_stalled_sink_blocks_source_at_hwm_with_flat_memory(tmp_path, ipc_dir):
    total = 100_000

    async def main():
        async with Coordinator(tmp_path / "run") as coord:
            # 256 KiB messages, HWM 4: a source that ignored backpressure would grow by
            # hundreds of MB within a second.
            specs = build_specs(address_maker("ipc", ipc_dir), messages=total,
                                floats=64 * 1024, hwm=4, stall=True)
            await coord.launch(specs)
            previous, stable = -1, 0
            while stable < 4:  # the sent counter stops moving: the source is blocked
                await asyncio.sleep(0.25)
                status = await _status(coord, "source0")
                sent = status["counters"].get("sent", 0)
                stable = stable + 1 if sent == previous and sent > 0 else 0
                previous = sent
            rss_before = status["rss_bytes"]
            await asyncio.sleep(1.0)
            later = await _status(coord, "source0")
            return sent, later["counters"]["sent"], rss_before, later["rss_bytes"]

    sent, sent_later, rss_before, rss_after = asyncio.run(main())
    assert sent == sent_later < 200, (sent, sent_later)  # bounded by the HWMs and kernel buffers
    assert rss_after - rss_before < 16 * 2**20, (rss_before, rss_after)


@pytest.mark.timeout(120)
def test_pause_and_resume_commands(tmp_path, ipc_dir):
    async def main():
        async with Coordinator(tmp_path / "run") as coord:
            specs = build_specs(address_maker("ipc", ipc_dir), messages=10**7, floats=4, hwm=8)
            await coord.launch(specs)
            assert await coord.command("source0", "pause") == {"paused": True}
            await asyncio.sleep(0.3)
            first = (await _status(coord, "source0"))["counters"].get("sent", 0)
            await asyncio.sleep(0.5)
            paused = await _status(coord, "source0")
            assert paused["paused"] and paused["counters"].get("sent", 0) == first
            assert await coord.command("source0", "resume") == {"paused": False}
            await asyncio.sleep(0.5)
            resumed = await _status(coord, "source0")
            assert resumed["counters"]["sent"] > first
            status = coord.status()
            assert {n["state"] for n in status["nodes"].values()} == {"ready"}

    asyncio.run(main())
