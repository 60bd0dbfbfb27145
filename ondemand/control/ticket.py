"""What the controller gives a request it does not refuse: a ``Ticket``, and the words of
its verdict (``Want``: what the request asks of its deployment; ``Waits``: what a ticket
that may not go on yet waits for). Plain values: the decisions are the controller's."""
from __future__ import annotations

import enum
from typing import Protocol

from ..model import Deployment


class Want(enum.Enum):
    """What a gateway request asks of its deployment (its route, and the health marker)."""
    LIST = "models"  # GET v1/models: answered from the deployment's record, in any state
    MODEL = "model"  # GET or HEAD v1/models/{model}: forwarded without a slot, while ready
    HEALTH = "health"  # a traffic route with the health marker: answered by the gateway itself
    TRAFFIC = "traffic"  # a traffic route: a slot (on demand), or forwarded while ready (always on)


class Waits(enum.Enum):
    """Why a ticket may not go on yet (``Admission.wait`` gives it a ticket of its own then)."""
    START = "start"  # not ready: it waits for a start, a wake, or a stop to end
    DRAIN = "drain"  # ready, but an administrator's sleep drains it: it waits for the drain's end


class _Releases(Protocol):
    def release(self, dep_id: int) -> None: ...


class Ticket:
    """The controller's answer to one request, made in one step (no await between its reads):
    ``dep``, the deployment as the core read it; ``base``, its engine's base URL, read by the
    edge in the same step (the upstream target; None when there is nothing to forward to);
    the slot it holds, if any (``release()`` gives it back, and is idempotent, so a double
    release cannot drift the count); and ``waits``, None when the request may go on now."""
    __slots__ = ("dep", "base", "waits", "_slot")

    def __init__(self, dep: Deployment, base: str | None = None, slot: _Releases | None = None,
                 waits: Waits | None = None):
        self.dep = dep
        self.base = base
        self.waits = waits
        self._slot = slot  # the controller that counts it, until it is given back

    @property
    def holds_slot(self) -> bool:
        return self._slot is not None

    def release(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release(self.dep.id)

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
