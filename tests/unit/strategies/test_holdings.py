"""The staleness gate's question (the oldest version the live generators hold, if all hold
the live trainer's weights) from counted holdings: the same answer as reading every
generator, without reading every generator on each `WeightsApplied`."""

from __future__ import annotations

import asyncio
import random

from rlhf_async.config import load_config
from rlhf_async.pipeline.protocol import SFT_LINEAGE, WeightsApplied
from rlhf_async.strategies.separation.driver import Driver
from rlhf_async.strategies.separation.holdings import Holdings
from rlhf_async.strategies.separation.trainer_ranks import TrainerRanks
from rlhf_async.weight_sync import GroupSpec
from tests.unit.strategies.test_driver import LINEAGE, Events, FakeCoord, Prompts


def _brute(held: dict[str, tuple[int, str]], down: set[str], lineage: str) -> int | None:
    live = [held[g] for g in held if g not in down]
    if not live or any(lin not in (lineage, SFT_LINEAGE) or (lin == SFT_LINEAGE and v != 0)
                       for v, lin in live):
        return None
    return min(v for v, _ in live)


def test_counted_holdings_answer_as_reading_every_generator() -> None:
    rng = random.Random(0)
    names = [f"gen{i}" for i in range(12)]
    got, ref = Holdings(names[:8]), {n: (0, SFT_LINEAGE) for n in names[:8]}
    down: set[str] = set()
    answers = set()
    for _ in range(2000):
        op, n = rng.random(), rng.choice(names)
        if op < 0.6:  # an update applied (a dead trainer's lineage now and then), or a join
            held = (rng.randint(0, 4), rng.choice([LINEAGE, LINEAGE, LINEAGE, "old"]))
            got[n] = ref[n] = held
        elif op < 0.7:  # restarted: the SFT weights again
            got[n] = ref[n] = (0, SFT_LINEAGE)
        elif op < 0.8:  # retired by a scale
            assert got.pop(n, None) == ref.pop(n, None)
        elif op < 0.9:
            down.add(n)
        else:
            down.discard(n)
        assert dict(got) == ref
        answer = got.published(LINEAGE, down)
        assert answer == _brute(ref, down, LINEAGE)
        answers.add(answer)
    assert None in answers and len(answers) > 3  # both kinds of answer were asked


def test_the_gate_reads_few_holdings_per_weights_applied(tmp_path) -> None:
    """64 generators each apply version 1; the dispatch loop asks after each. Reading every
    generator each time was 64 x 64 reads; now about one a WeightsApplied."""
    gens = [f"gen{i}" for i in range(64)]
    roles = {"trainer": "trainer", "scorer0": "scorer", **dict.fromkeys(gens, "generator")}
    cfg = load_config(None, ["train.steps=3", "train.prompts_per_step=64",
                             "run.progress=false"])
    coord = FakeCoord()
    d = Driver(cfg, coord, Events(), Prompts(), roles,
               GroupSpec("gloo", "127.0.0.1", 0, 65, timeout_s=5), tmp_path, 2, 0, LINEAGE,
               TrainerRanks(coord, ["trainer"], "127.0.0.1", 5.0))

    class Spy(type(d.applied)):  # type: ignore[misc]  # whatever mapping the driver keeps
        reads = 0

        def __getitem__(self, node: str) -> tuple[int, str]:
            Spy.reads += 1
            return super().__getitem__(node)

    spy = Spy()
    for n, held in d.applied.items():
        spy[n] = held
    d.applied, Spy.reads = spy, 0
    d.down.add("gen63")  # one is down: the answer leaves it out

    async def main() -> list[int | None]:
        seen = []
        for g in gens[:-1]:
            await d._on(g, WeightsApplied(1, LINEAGE))
            seen.append(d._published())  # what the dispatch loop asks on each
        return seen

    seen = asyncio.run(main())
    assert seen[:-1] == [0] * 62 and seen[-1] == 1
    assert Spy.reads <= 3 * len(gens), Spy.reads
