"""The wait queue for memory: one entry per deployment, in order of first arrival.

The head is the deployment whose earliest waiting request arrived first; it
alone may make room by stopping idle models. Memory freed for the head is
reserved for it until it starts or gives up, so a later entry that fits
"right now" cannot take what was freed for someone else. A reservation is
per pool (GPU): GiB held on each GPU where memory was freed for the head.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass
class Entry:
    dep_id: int
    first_arrival: float
    reserved: dict[int, float] = dataclasses.field(default_factory=dict)  # GiB per pool


class WaitQueue:
    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._order: list[Entry] = []

    def __contains__(self, dep_id: int) -> bool:
        return dep_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, dep_id: int, first_arrival: float) -> bool:
        """Queue ``dep_id``; returns False when it already was (its place is kept)."""
        if dep_id in self._entries:
            return False
        entry = Entry(dep_id, first_arrival)
        self._entries[dep_id] = entry
        self._order.append(entry)
        self._order.sort(key=lambda e: (e.first_arrival, e.dep_id))
        return True

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

    def reserve(self, dep_id: int, gib: Mapping[int, float]) -> None:
        entry = self._entries.get(dep_id)
        if entry is not None:
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
