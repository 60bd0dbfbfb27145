"""The soak's checks from the audit rows: make-room never took a deployment of higher priority
than its request, and only while that request waited; a limited deployment never served more than
its limit; adaptive warmth's pre-warms took memory from nobody."""
from __future__ import annotations

import collections
from typing import Any

from .plan import LIMITS, MAKE_ROOM, NAMES, PRIORITIES, RANK, make_room_for
from .state import Soak


async def priority_checks(soak: Soak) -> None:
    """From the audit rows and the request log: no make-room sleep or stop ever took a
    deployment of higher priority than the request it was made for, and each was made
    while a request for that one waited; the limited deployment never served more than its
    limit."""
    rows: list[dict[str, Any]] = []
    before = ""
    while True:
        status, page = await soak.od.api("GET", f"/audit?limit=1000{before}")
        if status != 200 or not page:
            break
        rows += page
        before = f"&before={page[-1]['id']}"
    soak.audit_rows = rows
    by_name = {name.upper(): n for n, name in enumerate(NAMES)}
    by_id = {i: n for n, i in enumerate(soak.ids)}
    stops = [r for r in rows if r["action"] == "ondemand_sleep" and r["text"].startswith(MAKE_ROOM)]
    asked = [*soak.done, *(d for _, d in soak.probes), *soak.beats]
    wrong, unasked = [], []
    for r in stops:
        victim, requester = by_id[r["deployment_id"]], by_name[make_room_for(r["text"])]
        if RANK[PRIORITIES[victim]] > RANK[PRIORITIES[requester]]:
            wrong.append(f"{NAMES[victim]} ({PRIORITIES[victim]}) for {NAMES[requester]} "
                         f"({PRIORITIES[requester]}) at {r['at']:.1f}")
        if not any(d.dep == requester and d.start - 1 <= r["at"] <= d.end + 2 for d in asked):
            unasked.append(f"{NAMES[victim]} for {NAMES[requester]} at {r['at']:.1f}")
    classes = collections.Counter(f"{PRIORITIES[by_id[r['deployment_id']]]} for "
                                  f"{PRIORITIES[by_name[make_room_for(r['text'])]]}" for r in stops)
    soak.check("no make-room sleep or stop took a deployment of higher priority than its request (audit rows)",
               bool(stops) and not wrong,
               "; ".join(wrong[:3]) or f"{len(stops)} make-room sleeps and stops: "
               + ", ".join(f"{k} x{c}" for k, c in sorted(classes.items())))
    soak.check("every make-room sleep or stop was made while a request for its model waited (request log)",
               not unasked, "; ".join(unasked[:3]) or f"{len(stops)} matched")
    busy = sum(d.outcome.endswith("ondemand_busy") for d in soak.done)
    over = {NAMES[n]: soak.inflight_peak[n] for n, limit in enumerate(LIMITS)
            if limit is not None and soak.inflight_peak[n] > limit}
    soak.check("a deployment with max_inflight never served more at once (views every 0.2 s)", not over,
               str(over) if over else f"{busy} refused 429 ondemand_busy; peaks "
               + ", ".join(f"{NAMES[n]} {soak.inflight_peak[n]}" for n in range(len(NAMES))))


def prewarm_checks(soak: Soak) -> None:
    """Adaptive warmth (india's pre-warms, from the audit rows, the metronome's requests and
    the views' queue every 0.2 s): a pre-warm takes memory from nobody."""
    rows, beats = soak.audit_rows, soak.beats
    prewarms = [r for r in rows if r["action"] == "ondemand_prewarm"]
    for_india = [r for r in rows if r["action"] == "ondemand_sleep" and r["text"].startswith(MAKE_ROOM)
                 and make_room_for(r["text"]) == "INDIA"]
    unasked = [f"{r['text'][:40]} at {r['at']:.1f}" for r in for_india
               if not any(d.start - 1 <= r["at"] <= d.end + 2 for d in beats)]
    soak.check("a pre-warm never made room: no sleep or stop for india but while a request for it was out",
               not unasked, "; ".join(unasked[:3]) or f"{len(for_india)} made for india's requests")
    queued = []
    for r in prewarms:
        around = [q for t, q in soak.queue_samples if r["at"] - 1 <= t <= r["at"] + 1]
        if len(around) >= 3 and frozenset.intersection(*around):
            queued.append(f"at {r['at']:.1f} ({', '.join(sorted(map(str, frozenset.intersection(*around))))})")
    india = soak.ids[NAMES.index("india")]
    victim = sum(1 for r in rows if r["action"] == "ondemand_sleep" and r["deployment_id"] == india
                 and r["text"].startswith(MAKE_ROOM))
    rests = sorted(r["at"] for r in rows if r["action"] == "ondemand_sleep" and r["deployment_id"] == india)
    # A hit: one of india's requests came before its engine was put away again.
    hits = sum(1 for r in prewarms if any(r["at"] <= d.start < min([t for t in rests if t > r["at"]] or [1e18])
                                          for d in beats))
    # What the pre-warms that found no free memory left in ondemand's log (control/effects.py).
    no_room = soak.od.stderr_path.read_text().count(f"no pre-warm of deployment {india}: ")
    soak.check("no pre-warm began while a request waited for memory (the queue the second around it); "
               "pre-warms were tried", bool(prewarms or no_room) and not queued,
               "; ".join(queued[:3]) or f"{len(prewarms)} pre-warms of india ({hits} hits), {no_room} found no "
               f"free memory; {victim} times make-room's victim")
