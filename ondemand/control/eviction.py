"""Which idle models to stop to make room: a pure rule, no side effects, no logging.

Candidates are already known to be stoppable (the controller's idle rules)
and of the requester's priority or lower (the controller leaves out every
deployment of higher priority: it is never a victim of a lower request); each
says what putting it away frees on each GPU (an awake one put to sleep: all but
what it keeps asleep; an awake one stopped, ``stop``, where make-room found that
sleeping them all cannot make room: all of it; an asleep one stopped: what it keeps).
This only picks,
lowest priority first, then awake before asleep (the tiers: a sleep costs a
wake of seconds, a stop a cold start), then least recently used, the shortest
prefix after whose stop some allowed set of GPUs fits the model (``choose``),
and of that prefix only the ones that hold memory on the chosen set: stopping a
model on another GPU frees nothing the new one can use. When all of them
together are not enough, none is picked: stopping models that cannot make room
would only lose them (BEHAVIOUR.md, "Making room", "Priorities and limits").
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
    id: int
    holds: Mapping[int, float]  # GiB per pool (GPU) its engine holds
    last_used: float  # monotonic time of the last slot granted or released
    rank: int = 1  # Priority.rank: lower ranks go first
    tier: int = 0  # 0 awake (put to sleep, or stopped), 1 asleep (stopped): awake ones go first
    stop: bool = False  # awake and stopped, not put to sleep: sleeping them all would not make it fit


def pick_victims(candidates: list[Candidate], free: Sequence[float],
                 choose: Callable[[list[float], frozenset[int]], tuple[int, ...] | None]
                 ) -> tuple[list[Candidate], tuple[int, ...]]:
    """(the victims, the GPU set the model gets once they are stopped), or ([], ()). ``choose`` is
    told the prefix put away (placement's rule for sleepers leaves the make-room's own victims out)."""
    sim = list(free)
    prefix: list[Candidate] = []
    for cand in sorted(candidates, key=lambda c: (c.rank, c.tier, c.last_used, c.id)):
        prefix.append(cand)
        for pool, gib in cand.holds.items():
            if 0 <= pool < len(sim):
                sim[pool] += gib
        chosen = choose(sim, frozenset(c.id for c in prefix))
        if chosen is not None:
            return [c for c in prefix if any(c.holds.get(g, 0.0) > 0 for g in chosen)], chosen
    return [], ()
