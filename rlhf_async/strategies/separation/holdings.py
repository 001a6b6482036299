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
from collections.abc import Iterable

from rlhf_async.pipeline.protocol import SFT_LINEAGE

Held = tuple[int, str]  # (weight version, lineage of the trainer that made it)


class Holdings(dict[str, Held]):
    """generator -> (version, lineage) it holds; a dict whose every write (item set,
    `pop`, `del`) keeps `counts` in step."""

    def __init__(self, generators: Iterable[str] = ()) -> None:
        super().__init__()
        self.counts: Counter[Held] = Counter()
        for g in generators:
            self[g] = (0, SFT_LINEAGE)  # every generator starts from the SFT policy

    def __setitem__(self, node: str, held: Held) -> None:
        if node in self:
            self.counts[self[node]] -= 1
        super().__setitem__(node, held)
        self.counts[held] += 1

    def __delitem__(self, node: str) -> None:
        self.counts[self[node]] -= 1
        super().__delitem__(node)

    def pop(self, node: str, *default: Held | None) -> Held | None:  # type: ignore[override]
        if node in self:
            held = self[node]
            del self[node]
            return held
        if default:
            return default[0]
        raise KeyError(node)

    def published(self, lineage: str, down: Iterable[str]) -> int | None:
        """The oldest version the live generators (those not `down`) hold, if every one
        holds the weights of `lineage` (the live trainer's) or the SFT policy's (version 0);
        None when one holds another's or none is live."""
        live = self.counts - Counter(self[n] for n in down if n in self)  # positives only
        if not live or any(lin not in (lineage, SFT_LINEAGE) or (lin == SFT_LINEAGE and v != 0)
                           for v, lin in live):
            return None
        return min(v for v, _ in live)
