"""A quantile sketch: the percentiles of a stream of seconds (0 or more) in memory that does not
grow with how many there are, and sketches that merge.

A log-bucketed histogram in the manner of DDSketch (Masson, Rim and Lee, VLDB 2019): a value x
above ``TINY`` goes to bucket ``ceil(log(x) / log(GAMMA))``, which holds the values in
(GAMMA^(i-1), GAMMA^i]; ``TINY`` and below, zero first (a request that waited for nothing),
share one bucket of their own. Each bucket keeps its count and its values' sum, and stands for
its values' mean: a value of rank k is estimated by the mean of the bucket that holds rank k. That
mean and the true value lie in the same bucket, so they differ by less than ``GAMMA - 1`` of the
true value, ``RELATIVE_ACCURACY``, 0.5 % (``TINY``, 1 ns, at most in the shared bucket), and a
bucket of ties (a cold start's 60 s, many times over) gives that value itself. The count, the
least and the greatest value are exact; so the lowest and highest rank are.

A quantile is linear between the two nearest ranks, as the exact one of the sorted values
would be: both ends are within the bound, and so is any point between them.

The buckets are one dense run of counts and sums, from the lowest bucket used to the highest
(8 + 8 bytes a bucket): memory grows with the span of the values, log(max / min) / log(GAMMA)
buckets (1 ms to 1000 s: 2,770 buckets, 43 KiB), never with their number.
"""
from __future__ import annotations

import array
import math
from collections.abc import Iterable, Iterator

RELATIVE_ACCURACY = 0.005
GAMMA = 1.0 + RELATIVE_ACCURACY
_LOG_GAMMA = math.log(GAMMA)
TINY = 1e-9  # values at or below share one bucket: their estimate is within TINY


class Sketch:
    """The values added so far, bucketed (module doc)."""
    __slots__ = ("count", "min", "max", "_zeros", "_zero_sum", "_offset", "_counts", "_sums")

    def __init__(self, values: Iterable[float] = ()) -> None:
        self.count = 0
        self.min = math.inf
        self.max = -math.inf
        self._zeros = 0  # the shared bucket of TINY and below
        self._zero_sum = 0.0
        self._offset = 0  # the index of the first bucket in _counts and _sums
        self._counts = array.array("q")
        self._sums = array.array("d")
        for x in values:
            self.add(x)

    def __len__(self) -> int:
        return self.count

    def __eq__(self, other: object) -> bool:
        """The same values added in the same order (the same buckets, to the bit)."""
        if not isinstance(other, Sketch):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in Sketch.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Sketch(count={self.count}, min={self.min}, max={self.max})"

    def add(self, x: float) -> None:
        """One more value: a finite number of seconds, 0 or more (ValueError otherwise)."""
        if not 0.0 <= x < math.inf:  # NaN fails too
            raise ValueError(f"a sketch takes finite values of 0 or more, not {x!r}")
        self.count += 1
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x
        if x <= TINY:
            self._zeros += 1
            self._zero_sum += x
            return
        self._bump(math.ceil(math.log(x) / _LOG_GAMMA), 1, x)

    def _bump(self, index: int, n: int, total: float) -> None:
        counts, sums = self._counts, self._sums
        if not counts:
            self._offset = index
            counts.append(n)
            sums.append(total)
            return
        i = index - self._offset
        if i < 0:  # a lower bucket than any so far: the run grows at its start
            counts[0:0] = array.array("q", bytes(8 * -i))
            sums[0:0] = array.array("d", bytes(8 * -i))
            self._offset = index
            i = 0
        elif i >= len(counts):
            more = i - len(counts) + 1
            counts.extend(array.array("q", bytes(8 * more)))
            sums.extend(array.array("d", bytes(8 * more)))
        counts[i] += n
        sums[i] += total

    def merge(self, other: Sketch) -> None:
        """Add ``other``'s values to these (the same buckets: the result is the sketch of both)."""
        if not other.count:
            return
        self.count += other.count
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self._zeros += other._zeros
        self._zero_sum += other._zero_sum
        for i, (n, total) in enumerate(zip(other._counts, other._sums, strict=True)):
            if n:
                self._bump(other._offset + i, n, total)

    def at_ranks(self, ranks: Iterable[int]) -> Iterator[float]:
        """The estimated value of each rank (0 the least, ``count - 1`` the greatest), ranks in
        ascending order, in one pass over the buckets."""
        last = self.count - 1
        buckets = self._buckets()
        seen = 0  # values in the buckets passed
        mean = 0.0
        for k in ranks:
            if not 0 <= k <= last:
                raise IndexError(f"rank {k} of {self.count} values")
            if k == 0:
                yield self.min
                continue
            if k == last:
                yield self.max
                continue
            while seen <= k:
                n, total = next(buckets)
                seen += n
                mean = total / n
            yield min(max(mean, self.min), self.max)  # the sum's rounding may stray a hair outside

    def _buckets(self) -> Iterator[tuple[int, float]]:
        if self._zeros:
            yield self._zeros, self._zero_sum
        for n, total in zip(self._counts, self._sums, strict=True):
            if n:
                yield n, total

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), linear between the nearest ranks; None with no values."""
        if not self.count:
            return None
        pos = q * (self.count - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, self.count - 1)
        a, b = self.at_ranks((lo, hi)) if hi > lo else (next(self.at_ranks((lo,))),) * 2
        return a + (b - a) * (pos - lo)

    def bytes_held(self) -> int:
        """The buckets' bytes (what grows with the values' span)."""
        return self._counts.itemsize * len(self._counts) + self._sums.itemsize * len(self._sums)
