"""The cost scheduler against its targets, per table of ``make replay`` (scripts/replay_bench.py):
the four measured targets the scheduler is held to, each said met or missed with its figures, so
the choice of the default (``seed`` until ``cost`` meets them on every table) reads off the run.

1. On a box where every model fits (``roomy``): no request waits in the memory queue under
   ``cost`` (and how many do under ``seed``).
2. ``cost`` times out no more requests than ``clairvoyant``, and none where every model fits.
3. ``cost``'s share within the SLO is within 1 point of ``clairvoyant``'s, and at least 99 %
   where ``clairvoyant`` reaches 99.5 %.
4. No policy but the reference dominates ``cost`` (each one that does is named with its failed
   requests beside ``cost``'s); where every model fits, it holds at most half of
   always-on's GiB-hours, or no more than ``clairvoyant`` where that is more. There, where
   ``clairvoyant=60`` was replayed, the figures also say what it holds: the least memory a policy
   that rests nothing before ``min_idle_timeout_s`` (60 s in the box mix) holds, knowing the future;
   a cap below it is one no product policy can meet.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from replay_front import FLOORED, REFERENCE, Point, dominated_by, point

from ondemand.replay import report
from ondemand.replay.types import PolicyResult


def verdicts(results: Sequence[PolicyResult], roomy: bool) -> list[tuple[str, bool, str]]:
    """(target, met, the figures) for each target that applies; [] without ``cost`` and the reference."""
    by = {r.policy.name: r for r in results}
    queued: dict[str, int] = {name: report.tally_json(by[name].total)["waited"]["queue"]
                              for name in ("cost", "seed") if name in by}
    return judge({name: point(r) for name, r in by.items()}, queued, roomy)


def judge(pts: Mapping[str, Point], queued: Mapping[str, int], roomy: bool) -> list[tuple[str, bool, str]]:
    """``verdicts`` on the policies' points and the requests that waited in the memory queue
    (``cost``'s, and ``seed``'s when known): what scripts/replay_cost.py reads from its cache."""
    if "cost" not in pts or REFERENCE not in pts:
        return []
    cost, ref = pts["cost"], pts[REFERENCE]
    out = []
    if roomy:
        seed = f"; `seed`: {queued['seed']:,}" if "seed" in queued else ""
        out.append(("no request waits for memory", queued["cost"] == 0,
                    f"{queued['cost']:,} requests waited in the memory queue{seed}"))
    limit = 0 if roomy else ref.timed_out
    out.append(("no more timeouts than the reference" + (", and none" if roomy else ""), cost.timed_out <= limit,
                f"{cost.timed_out:,} timed out, the reference {ref.timed_out:,}"))
    floor = max(ref.within - 0.01, 0.99 if ref.within >= 0.995 else 0.0)
    out.append(("within a point of the reference's share", cost.within >= floor - 1e-12,
                f"{100 * cost.within:.2f} % against {100 * ref.within:.2f} %"))
    over = dominated_by(cost, list(pts.values()))
    # Each dominating policy's failures beside cost's: a share that counts a request refused or
    # timed out after 15 minutes as one more miss can put a policy that fails hundreds ahead.
    fact = "dominated by " + ", ".join(f"`{n}` ({pts[n].failed:,} failed)" for n in over) + \
        f", `cost` {cost.failed:,} failed" if over else "dominated by none"
    ok = not over
    if roomy and "always-on" in pts:
        cap = max(pts["always-on"].gib_h / 2, ref.gib_h)
        ok = ok and cost.gib_h <= cap
        fact += f"; {cost.gib_h:,.0f} GiB-h against at most {cap:,.0f}"
        if FLOORED in pts:
            fact += (f"; the reference resting nothing before 60 s holds {pts[FLOORED].gib_h:,.0f}"
                     + (", over the cap" if pts[FLOORED].gib_h > cap else ""))
    out.append(("on the front" + (", at most half of always-on's memory" if roomy else ""), ok, fact))
    return out


def words(results: Sequence[PolicyResult], roomy: bool) -> str:
    """The verdicts as a list (empty without ``cost`` and the reference)."""
    lines = [f"- {'met' if ok else '**missed**'}: {what} ({facts})" for what, ok, facts in verdicts(results, roomy)]
    return "\n".join(lines) + "\n" if lines else ""
