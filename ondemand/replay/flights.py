"""A replay's requests as the gateway's edge holds them, on the virtual clock.

Each request arrives at its time and gets the controller's verdict as the gateway does
(``Controller.admit``: a refusal, or a ticket, holding a slot when the deployment is on demand
and ready); a ticket that waits then waits exactly as ``control/admission.py`` waits: ``join``,
then ``take`` each time the controller wakes it (``notify``, heard one event later, as a task
wakes) or its deadline passes, and ``leave`` once it has its ticket or its verdict. With its
ticket it enters its engine; the ticket is released when its last token is out.

Per request: its TTFT (arrival to first token at the client: the wait, then inside the engine,
then the prefill; a request that does not stream gets its first token with its last), what it
waited for, the deepest of ``ready`` (nothing), ``wake``, ``cold`` (a start), ``queue`` (it
queued for memory), and whether it was served or refused; tallied for its deployment and the
box (a request that arrived before the measured window, ``measure_from_s``, is not). The
count of requests queued for memory at each change is the page's queue timeline.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..control.controller import Controller, Waiter
from ..control.ticket import Ticket, Want
from ..errors import OndemandError
from ..model import State
from .clock import Timer, VirtualClock
from .types import Request, Tally, fits_engine
from .world import World

RANK = {"ready": 0, "wake": 1, "cold": 2, "queue": 3}
# How a request ends: served; its deadline passed in the queue; answered at once with an error;
# longer than its engine's max_model_len (rejected at arrival, apart from the failures).
SERVED, TIMED_OUT, REFUSED, REJECTED = "served", "timed_out", "refused", "rejected"


class Flight:
    """One request, from its arrival to its last token or its refusal (the world's ``Job``)."""
    __slots__ = ("edge", "req", "dep_id", "arrival", "waiter", "timer", "poked", "waited", "queued", "ticket",
                 "ttft", "wait", "done")

    def __init__(self, edge: Flights, req: Request, dep_id: int, arrival: float):
        self.edge = edge
        self.req = req
        self.dep_id = dep_id
        self.arrival = arrival
        self.waiter: Waiter | None = None
        self.timer: Timer | None = None
        self.poked = False
        self.waited = "ready"
        self.queued = False
        self.ticket: Ticket | None = None
        self.ttft = 0.0
        self.wait = 0.0  # arrival to the moment a ready engine took it (or its deadline)
        self.done = False

    @property
    def input_tokens(self) -> int:
        return self.req.input_tokens

    @property
    def output_tokens(self) -> int:
        return self.req.output_tokens

    def wait_for(self, kind: str) -> None:
        if RANK[kind] > RANK[self.waited]:
            self.waited = kind

    def poke(self) -> None:
        """The controller's ``notify``: the waiting task runs again one event later."""
        if not self.poked and not self.done:
            self.poked = True
            self.edge.clock.call_later(0, lambda: self.edge.look(self))

    def on_queued(self) -> None:
        self.edge.queued(self, True)

    def first_token(self, at: float) -> None:
        self.ttft = at - self.arrival

    def ended(self, at: float) -> None:
        if not self.req.stream:  # its first token comes with its last
            self.ttft = at - self.arrival
        if self.ticket is not None:
            self.ticket.release()
        self.edge.finished(self, SERVED)


class Flights:
    """The edge: arrivals, waits and ends; the tallies (per deployment, by name, and ``total``);
    the queue's timeline when ``drawn`` (a page will draw it: it grows with the trace)."""

    def __init__(self, world: World, controller: Controller, clock: VirtualClock, tallies: Mapping[str, Tally],
                 total: Tally, slo_s: float, drawn: bool = True):
        self.world = world
        self.controller = controller
        self.clock = clock
        self.tallies = tallies
        self.total = total
        self.slo_s = slo_s
        self.ids = {d.name: d.id for d in world.deployments()}
        self.names = {d.id: d.name for d in world.deployments()}
        self.open = 0  # requests arrived and not yet ended or refused
        self.measure_from_s = 0.0  # requests that arrived before are served but not counted
        self.waiting_for_memory = 0
        self.drawn = drawn
        self.timeline: list[tuple[float, int]] = [(0.0, 0)] if drawn else []

    def arrive(self, req: Request) -> None:
        f = Flight(self, req, self.ids[req.model], self.clock.now)
        self.open += 1
        if not fits_engine(req, self.world.costs(f.dep_id)):
            self.finished(f, REJECTED)  # as vLLM answers a request longer than max_model_len: it starts nothing
            return
        ctl = self.controller
        try:
            ticket = ctl.admit(f.dep_id, Want.TRAFFIC)
            if ticket.waits is not None:
                dep = ticket.dep
                if dep.state is not State.READY:
                    waking = dep.state is State.ASLEEP or (dep.state is State.STARTING and dep.sleep_level is not None)
                    f.wait_for("wake" if waking else "cold")
                f.waiter = ctl.join(f.dep_id, arrival=f.arrival, notify=f.poke, on_queued=f.on_queued)
        except OndemandError:  # a refusal: over max_inflight, the queue full, planned, a start's backoff
            self.finished(f, REFUSED)
            return
        if ticket.waits is None:
            self._serve(f, ticket)
        else:
            self.look(f)  # as admission takes right after joining

    def look(self, f: Flight) -> None:
        """The waiter's turn (admission's loop): its ticket, its verdict, or wait on."""
        f.poked = False
        if f.done or f.waiter is None:
            return
        if f.timer is not None:
            f.timer.cancel()
            f.timer = None
        ctl = self.controller
        try:
            ticket = ctl.take(f.waiter)
        except OndemandError as exc:  # a verdict, or its deadline passed
            self._leave(f)
            timed_out = exc.code == "ondemand_queue_timeout"
            if timed_out:  # counted at its deadline (the look that found it late came a hair after)
                f.wait = min(self.clock.now - f.arrival, ctl.queue_timeout_s)
            self.finished(f, TIMED_OUT if timed_out else REFUSED)
            return
        if ticket is None:
            f.timer = self.clock.call_later(ctl.next_wake(f.waiter) + 0.001, lambda: self.look(f))
            return
        self._leave(f)
        f.wait_for(self.world.ready_kind.get(f.dep_id, "cold"))
        self._serve(f, ticket)

    def _leave(self, f: Flight) -> None:
        if f.waiter is not None:
            self.controller.leave(f.waiter)
            f.waiter = None
        if f.queued:
            self.queued(f, False)

    def _serve(self, f: Flight, ticket: Ticket) -> None:
        f.ticket = ticket
        f.wait = self.clock.now - f.arrival
        self.world.engines[f.dep_id].enter(f)

    def queued(self, f: Flight, now_queued: bool) -> None:
        if f.queued == now_queued:
            return
        f.queued = now_queued
        if now_queued:
            f.wait_for("queue")
        self.waiting_for_memory += 1 if now_queued else -1
        if not self.drawn:
            return
        t = self.clock.now
        if self.timeline[-1][0] == t:
            self.timeline[-1] = (t, self.waiting_for_memory)
        else:
            self.timeline.append((t, self.waiting_for_memory))

    def finished(self, f: Flight, outcome: str) -> None:
        f.done = True
        self.open -= 1
        if f.arrival < self.measure_from_s:
            return
        served = outcome == SERVED
        met = served and f.ttft <= self.slo_s + 1e-9
        wait_met = served and f.wait <= self.slo_s + 1e-9
        for t in (self.tallies[self.names[f.dep_id]], self.total):
            t.requests += 1
            if outcome == REJECTED:
                t.rejected += 1
                continue
            t.waited[f.waited] += 1
            if served:
                t.served += 1
                t.add_ttft(f.ttft)
                t.add_wait(f.wait)
                t.slo_met += met
                t.wait_slo_met += wait_met
                continue
            t.failed += 1
            if outcome == TIMED_OUT:
                t.timed_out += 1
                t.add_wait(f.wait)
            else:
                t.refused += 1
