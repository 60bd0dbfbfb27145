"""The wait queue for memory: one entry per deployment, by priority (high
first), then by first arrival.

The head is the first entry; it alone may make room by stopping idle models.
Memory freed for the head is reserved for it until it starts or gives up, so a
later entry that fits "right now" cannot take what was freed for someone else.
A reservation is per pool (GPU): GiB held on each GPU where memory was freed
for the head.

An entry of higher priority than the head takes the head when it arrives, and
with it what was freed for the old head, and what the old head's stops still
in flight free (BEHAVIOUR.md, "Priorities and limits"): nothing freed is given
back, and the old head keeps its place at the front of its own class.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass
class Entry:
    dep_id: int
    first_arrival: float
    rank: int = 1  # Priority.rank: 2 high, 1 normal, 0 low
    reserved: dict[int, float] = dataclasses.field(default_factory=dict)  # GiB per pool

    def key(self) -> tuple[int, float, int]:
        return (-self.rank, self.first_arrival, self.dep_id)


class WaitQueue:
    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._order: list[Entry] = []

    def __contains__(self, dep_id: int) -> bool:
        return dep_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, dep_id: int, first_arrival: float, rank: int = 1) -> bool:
        """Queue ``dep_id``; returns False when it already was (its place is kept). An
        entry of higher priority than the head becomes the head and takes over the old
        head's reservation."""
        if dep_id in self._entries:
            return False
        entry = Entry(dep_id, first_arrival, rank)
        old_head = self._order[0] if self._order else None
        self._entries[dep_id] = entry
        self._order.append(entry)
        self._order.sort(key=Entry.key)
        if old_head is not None and self._order[0] is entry and entry.rank > old_head.rank:
            self._move_reservation(old_head, entry)
        return True

    def rerank(self, dep_id: int, rank: int) -> None:
        """Its deployment's priority changed while queued: its place changes, its first
        arrival and its hold stay; above a lower head it takes that head's hold, as a new
        entry would."""
        entry = self._entries.get(dep_id)
        if entry is None or entry.rank == rank:
            return
        old_head = self._order[0]
        entry.rank = rank
        self._order.sort(key=Entry.key)
        if self._order[0] is entry and old_head is not entry and entry.rank > old_head.rank:
            self._move_reservation(old_head, entry)

    @staticmethod
    def _move_reservation(src: Entry, dst: Entry) -> None:
        for pool, amount in src.reserved.items():
            dst.reserved[pool] = dst.reserved.get(pool, 0.0) + amount
        src.reserved.clear()

    def remove(self, dep_id: int) -> bool:
        entry = self._entries.pop(dep_id, None)
        if entry is None:
            return False
        self._order.remove(entry)
        return True

    def head(self) -> int | None:
        return self._order[0].dep_id if self._order else None

    def is_head_or_empty(self, dep_id: int) -> bool:
        return not self._order or self._order[0].dep_id == dep_id

    def overtaken_by(self, dep_id: int) -> int | None:
        """The head, when it is of higher priority than ``dep_id``'s entry: what is freed
        for ``dep_id`` is held for it instead. None otherwise."""
        entry = self._entries.get(dep_id)
        if entry is None or not self._order:
            return None
        head = self._order[0]
        return head.dep_id if head.rank > entry.rank else None

    def reserve(self, dep_id: int, gib: Mapping[int, float]) -> None:
        """Hold ``gib`` (freed for ``dep_id``) for it, or for the head of higher priority
        that overtook it."""
        entry = self._entries.get(dep_id)
        if entry is None:
            return
        taker = self.overtaken_by(dep_id)
        if taker is not None:
            entry = self._entries[taker]
        for pool, amount in gib.items():
            entry.reserved[pool] = entry.reserved.get(pool, 0.0) + amount

    def reserved_for_others(self, dep_id: int) -> dict[int, float]:
        """GiB per pool held for entries other than ``dep_id``."""
        out: dict[int, float] = {}
        for e in self._order:
            if e.dep_id != dep_id:
                for pool, amount in e.reserved.items():
                    out[pool] = out.get(pool, 0.0) + amount
        return out

    def ids(self) -> list[int]:
        return [e.dep_id for e in self._order]

    def place(self, dep_id: int) -> tuple[int, int] | None:
        """(its place, counted from 1, and the queue's length), or None when not queued."""
        for i, e in enumerate(self._order):
            if e.dep_id == dep_id:
                return i + 1, len(self._order)
        return None
