"""Which idle models to stop to make room: a pure rule, no side effects, no logging.

Candidates are already known to be stoppable (the controller's idle rules);
this only picks, least recently used first, the shortest prefix whose memory
covers the shortfall. When all of them together are not enough, none is
picked: stopping models that cannot make room would only lose them
(BEHAVIOUR.md, "Making room").
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Candidate:
    id: int
    memory_gib: float
    last_used: float  # monotonic time of the last slot granted or released


def pick_victims(candidates: list[Candidate], shortfall: float) -> list[Candidate]:
    if shortfall <= 0:
        return []
    chosen: list[Candidate] = []
    freed = 0.0
    for cand in sorted(candidates, key=lambda c: (c.last_used, c.id)):
        chosen.append(cand)
        freed += cand.memory_gib
        if freed + 1e-9 >= shortfall:
            return chosen
    return []
