"""Adaptive warmth's decision core: a deployment's rhythm, learned from its idle gaps.

A pure room of the decision core (no I/O, no clock, no state but the gaps): the controller's
slots part learns each idle gap (from the moment the engine became idle to the next request's
arrival; the effects keep it in the state file, so a restart keeps what was learned) and
adaptive warmth (``keepwarm.py``) asks, when an idle period begins, for a ``Plan``: how long the
engine stays awake, the tier it then rests in, and when a pre-warm brings it back before the next
request is expected.

It starts from the hybrid-histogram policy of Shahrad et al. ("Serverless in the Wild", USENIX
ATC '20): a histogram of idle times; when it shows a pattern (the coefficient of variation of
its bin counts is high), unload after the execution and load again at the histogram's head (5th
percentile, less a 10 % margin), keep loaded until its tail (99th percentile, plus 10 %); when it
shows none, the fixed keep-alive. Where this differs, and why:

- **The head is conditional on the idle time already passed.** A model called in bursts has two
  kinds of gaps: seconds within a burst, half an hour between bursts. The plain head (5th
  percentile of all gaps) is a few seconds, which would never let it rest; the policy instead
  looks, for each moment ``t`` it could rest at, at the gaps longer than ``t``: once the burst's
  short gaps are behind, their head is the next burst's.
- **Unloading is a choice of tiers, not one.** A level-1 wake costs about a second, a level-2 wake
  a few, a cold start a minute. A rest is taken only when it lasts at least ``WORTH`` times the
  tier's cost to come back (and at least ``MIN_REST_RATIO`` of ``min_idle_timeout_s``: 30 s at its
  default of 60 s, half a second at 1 s, so that a box, or a test, that lowers the minimum sees the
  same decisions on a shorter clock), in the deepest tier that passes that test, so a short quiet
  time rests lightly and a long one frees everything.
- **Bounds from the configuration.** Awake idle no longer than ``idle_timeout_s`` and no shorter
  than ``min_idle_timeout_s``; at most ``KEEP`` gaps, the newest (the paper keeps 4 hours of
  1-minute bins, which loses both seconds-scale bursts and twice-a-day jobs).
- **The tail is taken from enough gaps.** Resting after the tail counts on the next request
  coming before it 99 times in 100; the sample's 99th percentile of n gaps (about the longest,
  below 100 of them) is exceeded by the next gap about 1 time in n + 1 (1 in 34 from 33 gaps).
  The tail is the gap of rank ``ceil(0.99 (n + 1))`` (``upper_quantile``), which needs 99 gaps:
  with fewer, no plan rests after the tail (it stays awake its idle timeout, as ``fixed``).
- **No ARIMA.** Where the gaps show no pattern the plan is ``None`` and the deployment behaves as
  ``fixed``; so it is, too, before its ``LEARN_AFTER``-th gap.
"""
from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The rest tiers' names, shallow to deep: a plan's ``rest``, and the keys of the costs it is given.
from ..engines.tiers import NAMES as TIERS

# The gaps kept per deployment (the newest) and how many before a plan is made.
KEEP = 500
LEARN_AFTER = 20
# The histogram's bins, over [0, the 99th percentile]; a coefficient of variation of their counts
# at or above PATTERN_CV is a pattern (the paper's threshold).
BINS = 240
PATTERN_CV = 2.0
# The head and tail of the (conditional) gaps, and their margins (the paper's).
HEAD_Q, TAIL_Q = 0.05, 0.99
HEAD_MARGIN, TAIL_MARGIN = 0.9, 1.1
# A rest must last WORTH times the tier's cost to come back, and at least MIN_REST_RATIO times
# min_idle_timeout_s (the shortest rest worth making scales with the shortest idle time allowed).
WORTH = 10.0
MIN_REST_RATIO = 0.5


@dataclass(frozen=True)
class Plan:
    """One idle period's decisions, in seconds from the moment the engine became idle."""

    awake_for_s: float  # stays awake idle this long, then rests (or, with rest None, follows fixed)
    rest: str | None  # the tier it rests in (TIERS); None: it does not rest early
    prewarm_in_s: float | None  # woken or started again at this moment; None: no pre-warm
    awake_until_s: float | None  # after a pre-warm, awake (idle) until this moment, then fixed


def quantile(ordered: list[float], q: float, start: int = 0) -> float:
    """The q-quantile of ``ordered[start:]`` (ordered, non-empty), linear between the closest
    ranks; the suffix is not copied."""
    pos = start + q * (len(ordered) - 1 - start)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def upper_quantile(ordered: list[float], q: float) -> float | None:
    """The gap that the next one exceeds with probability 1 - q, as far as ``ordered`` (n gaps,
    ordered) can tell: the k-th smallest for k = ceil(q (n + 1)), since the next of n + 1 gaps
    from one distribution is equally likely to fall in each of the n + 1 places among them.
    None when k > n: fewer than q / (1 - q) gaps (99 for the 99th percentile) cannot show it."""
    k = math.ceil(q * (len(ordered) + 1) - 1e-9)
    return ordered[k - 1] if k <= len(ordered) else None


def has_pattern(ordered: list[float]) -> bool:
    """The hybrid histogram's test: the gaps up to their 99th percentile, in BINS equal bins,
    concentrate in a few (the bin counts' coefficient of variation is at least PATTERN_CV).

    The CV of n gaps' counts in BINS bins carries their sampling noise: its square is, on
    average, the distribution's own (n-1)/n, plus about BINS/n. Below 60 gaps that noise alone
    is above PATTERN_CV, so that any gaps (even uniform or memoryless ones) would "show a
    pattern". The test is of the distribution's CV, the noise taken out (its unbiased estimate
    from the multinomial counts); with the paper's thousands of invocations the two agree."""
    top = quantile(ordered, TAIL_Q)
    if top <= 0:
        return True  # every gap (but outliers) is nil: the next request always comes at once
    counts = [0] * BINS
    for gap in ordered:
        if gap > top:
            break
        counts[min(int(gap / top * BINS), BINS - 1)] += 1
    n = sum(counts)
    if n < 2:
        return False
    cv2 = BINS * sum(c * c for c in counts) / (n * n) - 1  # the counts' CV, squared
    return (cv2 + 1 - BINS / n) * n / (n - 1) - 1 >= PATTERN_CV ** 2


class Rhythm:
    """A deployment's idle gaps (the newest KEEP) and the plan they give."""

    def __init__(self, gaps: Iterable[float] = ()):
        self._gaps: collections.deque[float] = collections.deque(maxlen=KEEP)
        for gap in gaps:
            self.add(gap)

    def add(self, gap_s: float) -> None:
        """Records one idle gap (a negative one, a clock's step back, counts as nil)."""
        self._gaps.append(max(0.0, float(gap_s)))

    @property
    def gaps(self) -> list[float]:
        """The gaps kept, oldest first (what the state file keeps)."""
        return list(self._gaps)

    def __len__(self) -> int:
        return len(self._gaps)

    def plan(self, *, idle_timeout_s: float, min_idle_timeout_s: float,
             tiers: Mapping[str, float]) -> Plan | None:
        """The plan for an idle period that begins now, or None to behave as ``fixed``.

        ``tiers`` maps each tier this deployment can rest in (TIERS' names) to its measured
        cost to come back from (a wake's or a cold start's seconds); the caller leaves out a tier
        that is not possible (no sleep API, the host reserve)."""
        if len(self._gaps) < LEARN_AFTER:
            return None
        ordered = sorted(self._gaps)
        if not has_pattern(ordered):
            return None
        floor = float(min_idle_timeout_s)
        ceiling = max(floor, float(idle_timeout_s))
        early = self._rest_early(ordered, floor, ceiling, tiers)
        if early is not None:
            return early
        top = upper_quantile(ordered, TAIL_Q)
        if top is not None and TAIL_MARGIN * top <= ceiling:
            # The next request almost always comes while it is awake: rest after the tail.
            return Plan(awake_for_s=max(floor, TAIL_MARGIN * top), rest=None, prewarm_in_s=None, awake_until_s=None)
        return None

    def _rest_early(self, ordered: list[float], floor: float, ceiling: float,
                    tiers: Mapping[str, float]) -> Plan | None:
        """The earliest moment in [floor, ceiling] at which, given the gaps longer than it, the
        next request is far enough for a rest in some tier to pay: the deepest such tier."""
        n = len(ordered)
        candidates = sorted({floor} | {g for g in ordered if floor < g <= ceiling})
        for t in candidates:
            first = bisect.bisect_right(ordered, t)  # the gaps longer than t: ordered[first:]
            # Too few gaps longer than t say nothing of the next request (under 5 % of them).
            if n - first < max(LEARN_AFTER // 4, HEAD_Q * n):
                break
            head = t + HEAD_MARGIN * (quantile(ordered, HEAD_Q, first) - t)
            for tier in reversed(TIERS):
                cost = tiers.get(tier)
                if cost is None:
                    continue
                rest_s = head - cost - t
                if rest_s >= max(MIN_REST_RATIO * floor, WORTH * cost):
                    tail = TAIL_MARGIN * quantile(ordered, TAIL_Q, first)
                    until = min(max(tail, head + floor), head + ceiling)
                    return Plan(awake_for_s=t, rest=tier, prewarm_in_s=head - cost, awake_until_s=until)
        return None
