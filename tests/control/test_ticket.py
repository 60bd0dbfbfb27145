"""What the controller gives a request it does not refuse (ondemand/control/ticket.py): a ``Ticket``
with the deployment as read, its engine's address and the slot, if any, that ``release`` gives back
once however often it is called (by hand, or on leaving its ``async with``, an error too), so a
double release cannot drift the count. Which ticket a request is given: test_admission.py."""
from __future__ import annotations

import pytest

from ondemand.control.ticket import Ticket, Waits
from ondemand.model import Deployment

DEP = Deployment(id=3, name="d3", served_name="D3")


class Slots:
    """The owner of the slots a ticket gives its slot back to."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, dep_id: int) -> None:
        self.released.append(dep_id)


def test_a_ticket_gives_its_slot_back_once():
    slots = Slots()
    ticket = Ticket(DEP, "http://127.0.0.1:8001", slot=slots)
    assert ticket.holds_slot and ticket.dep is DEP and ticket.base == "http://127.0.0.1:8001" and ticket.waits is None
    ticket.release()
    ticket.release()
    assert slots.released == [3] and not ticket.holds_slot


async def test_leaving_its_async_with_gives_the_slot_back_on_an_error_too():
    slots = Slots()
    ticket = Ticket(DEP, slot=slots)
    with pytest.raises(RuntimeError):
        async with ticket as held:
            assert held is ticket and slots.released == []
            raise RuntimeError("the client hung up")
    assert slots.released == [3]
    ticket.release()  # given back already: nothing more
    assert slots.released == [3]


def test_a_ticket_that_waits_holds_nothing_to_give_back():
    ticket = Ticket(DEP, waits=Waits.START)
    assert not ticket.holds_slot and ticket.base is None and ticket.waits is Waits.START
    ticket.release()
    assert not ticket.holds_slot
