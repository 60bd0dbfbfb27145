"""A simulated engine that batches as vLLM's does, on the virtual clock: :class:`Engine`.

What a real engine does with the requests it holds, as far as a scheduler in front of it can feel
it (the time to first token and to the last):

- **A KV cache of ``kv_tokens``.** A request is admitted when its whole context (input + output
  tokens) fits beside the contexts of those already running, else it waits inside the engine, in
  arrival order (vLLM's first-come-first-served scheduler: the head waits, and those behind it
  with it). A request larger than the whole cache runs alone (vLLM would preempt and recompute;
  the replay has it run when nothing else does). ``max_concurrency`` bounds the requests running
  at once as well (vLLM's ``max_num_seqs``).
- **Prefill shared by the engine.** The engine prefills ``prefill_tokens_per_s`` in all, shared
  evenly by the requests prefilling at that moment (chunked prefill interleaves them); a request's
  first token comes when its prefill ends.
- **Decode per request, bounded per engine.** Each request then decodes its output at
  ``decode_tokens_per_s``, but the engine as a whole at most ``decode_batch_tokens_per_s``, shared
  evenly: a batch past the engine's bandwidth slows everyone down.

Both phases are processor-sharing queues whose members all get the same rate, so each keeps one
virtual clock (the service a member has received since the phase began), and a member ends when
that clock reaches its start mark plus its work: one heap per phase, O(log n) per event, however
many requests run. One timer is out for the engine's next event; every arrival or end sets it
again. Requests longer than ``max_model_len`` never get here: the edge rejects them at arrival,
as vLLM does.
"""
from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol

from .clock import Timer, VirtualClock
from .types import Costs

EPS = 1e-9


class Job(Protocol):
    """A request inside an engine."""

    @property
    def input_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...

    def first_token(self, at: float) -> None: ...

    def ended(self, at: float) -> None: ...


class _Shared:
    """Members that share a rate evenly: ``rate(n)`` is what each of ``n`` gets, per second."""
    __slots__ = ("rate", "heap", "served", "since", "_seq")

    def __init__(self, rate: Callable[[int], float]):
        self.rate = rate
        self.heap: list[tuple[float, int, Job]] = []  # (the virtual clock at which it ends, order, job)
        self.served = 0.0  # the service each member has received since the phase began
        self.since = 0.0  # the real time ``served`` was last brought up to
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.heap)

    def advance(self, now: float) -> None:
        if self.heap:
            self.served += (now - self.since) * self.rate(len(self.heap))
        self.since = now

    def add(self, job: Job, work: float, now: float) -> None:
        self.advance(now)
        heapq.heappush(self.heap, (self.served + work, next(self._seq), job))

    def next_end(self) -> float | None:
        """When the first member's work is done, at today's rate (None: no member)."""
        if not self.heap:
            return None
        return self.since + max(0.0, self.heap[0][0] - self.served) / self.rate(len(self.heap))

    def done(self, now: float) -> list[Job]:
        """The members whose work is done by ``now``, removed."""
        self.advance(now)
        out = []
        # Done when what is left ends no later than now as the clock tells time (a week or years
        # into a trace, a remainder of float error is below the clock's resolution: a timer set
        # for it would fire at this same moment again, forever).
        while self.heap and now + max(0.0, self.heap[0][0] - self.served) / self.rate(len(self.heap)) <= now + EPS:
            out.append(heapq.heappop(self.heap)[2])
        return out


class Engine:
    """One engine's requests: waiting inside it, prefilling, decoding."""
    __slots__ = ("costs", "clock", "kv_used", "waiting", "prefill", "decode", "_context", "_timer", "_stepping")

    def __init__(self, costs: Costs, clock: VirtualClock):
        self.costs = costs
        self.clock = clock
        self.kv_used = 0
        self.waiting: collections.deque[Job] = collections.deque()
        batch = costs.decode_batch_tokens_per_s or float("inf")
        self.prefill = _Shared(lambda n: costs.prefill_tokens_per_s / n)
        self.decode = _Shared(lambda n: min(costs.decode_tokens_per_s, batch / n))
        self._context: dict[int, int] = {}  # id(job) -> its context, held in the cache until it ends
        self._timer: Timer | None = None
        self._stepping = False

    @property
    def running(self) -> int:
        return len(self.prefill) + len(self.decode)

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def enter(self, job: Job) -> None:
        self.waiting.append(job)
        self._step()

    def _admit(self, now: float) -> None:
        """Admit from the head while its context fits (or it would run alone)."""
        costs = self.costs
        while self.waiting:
            job = self.waiting[0]
            context = job.input_tokens + job.output_tokens
            running = self.running
            if running and (running >= costs.max_concurrency or self.kv_used + context > costs.kv_tokens):
                return
            self.waiting.popleft()
            self.kv_used += context
            self._context[id(job)] = context
            self.prefill.add(job, max(job.input_tokens, 1), now)

    def _step(self) -> None:
        """Bring both phases to now, move what finished on, admit, and set the next event. A job's
        report may bring another request in (``enter``): that one is taken by the step under way."""
        if self._stepping:
            return
        self._stepping = True
        try:
            self._run_step()
        finally:
            self._stepping = False

    def _run_step(self) -> None:
        now = self.clock.now
        self.decode.advance(now)  # before prefill's ends join it: they decode from now on
        for job in self.prefill.done(now):
            job.first_token(now)
            self.decode.add(job, max(job.output_tokens, 0), now)
        for job in self.decode.done(now):
            self.kv_used -= self._context.pop(id(job))
            job.ended(now)
        self._admit(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        ends = [t for t in (self.prefill.next_end(), self.decode.next_end()) if t is not None]
        if ends:
            self._timer = self.clock.call_later(min(ends) - now, self._step)
