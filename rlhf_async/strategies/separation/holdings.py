"""The weights each generator holds, counted by holding, for the staleness gate.

Why counted: the dispatch loop asks for the published version (the oldest the live
generators hold) each time one of them applies an update, i.e. once per generator per
publication; reading every generator's holding each time made a publication cost the
square of the generators (48 reads x 48 events at 64 nodes, a million at 1,000). The
count of each distinct (version, lineage) is kept as holdings change, so the question
costs the distinct holdings (a few: the versions in flight) plus the nodes down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, MutableMapping

from rlhf_async.pipeline.protocol import SFT_LINEAGE

Held = tuple[int, str]  # (weight version, lineage of the trainer that made it)


class Holdings(MutableMapping[str, Held]):
    """generator -> (version, lineage) it holds: a mapping whose every write (item set or
    delete, and so `pop`, `update`, ... which go through them) keeps `counts` in step."""

    def __init__(self, generators: Iterable[str] = ()) -> None:
        self._held: dict[str, Held] = {}
        self.counts: Counter[Held] = Counter()
        for g in generators:
            self[g] = (0, SFT_LINEAGE)  # every generator starts from the SFT policy

    def __getitem__(self, node: str) -> Held:
        return self._held[node]

    def __setitem__(self, node: str, held: Held) -> None:
        if (old := self._held.get(node)) is not None:
            self.counts[old] -= 1
        self._held[node] = held
        self.counts[held] += 1

    def __delitem__(self, node: str) -> None:
        self.counts[self._held.pop(node)] -= 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def published(self, lineage: str, down: Iterable[str]) -> int | None:
        """The oldest version the live generators (those not `down`) hold, if every one
        holds the weights of `lineage` (the live trainer's) or the SFT policy's (version 0);
        None when one holds another's or none is live."""
        live = self.counts - Counter(self[n] for n in down if n in self)  # positives only
        if not live or any(lin not in (lineage, SFT_LINEAGE) or (lin == SFT_LINEAGE and v != 0)
                           for v, lin in live):
            return None
        return min(v for v, _ in live)
