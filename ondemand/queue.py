"""The wait queue for memory: one entry per deployment, in order of first arrival.

The head is the deployment whose earliest waiting request arrived first; it
alone may make room by stopping idle models. Memory freed for the head is
reserved for it until it starts or gives up, so a later entry that fits
"right now" cannot take what was freed for someone else.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Entry:
    dep_id: int
    first_arrival: float
    reserved_gib: float = 0.0


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

    def reserve(self, dep_id: int, gib: float) -> None:
        if dep_id in self._entries:
            self._entries[dep_id].reserved_gib += gib

    def reserved_for_others(self, dep_id: int) -> float:
        return sum(e.reserved_gib for e in self._order if e.dep_id != dep_id)

    def ids(self) -> list[int]:
        return [e.dep_id for e in self._order]
