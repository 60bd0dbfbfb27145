"""The soak's checks from the engines' journal (``--journal``): no forbidden header reached an
engine, no busy engine was stopped, and tiered warmth (BEHAVIOUR.md, "Tiered warmth"): sleeps at
their level and audited, wakes as each engine's failure mode says, failing wakes audited; and the
counts of the summary's warmth table."""
from __future__ import annotations

import collections
from typing import Any

import soaklib

from .plan import ENGINE_ARGS, FORBIDDEN, IDLE_ACTIONS, LEVELS, MAKE_ROOM, NAMES, WAKE_RESULTS, wake_failure
from .state import Soak


def journal_checks(soak: Soak) -> None:
    events = soaklib.read_journal(soak.journal)
    reqs = [e for e in events if e["ev"] == "req"]
    leaked = collections.Counter(h for e in reqs for h in e["h"] if h in FORBIDDEN)
    soak.check("no Authorization, Cookie, health-check or forwarding header reached an engine", not leaked,
               f"{dict(leaked)} in {len(reqs)} engine requests" if leaked else f"{len(reqs)} engine requests")
    stops = [e for e in events if e["ev"] == "soak" and "admin_stop" in e]
    busy = [e for e in events if e["ev"] == "sigterm" and e["inflight"] > 0]
    unexcused = [e for e in busy if not any(s["admin_stop"] == e["model"] and e["t"] - 15 <= s["t"] <= e["t"]
                                            for s in stops)]
    sigterms = sum(e["ev"] == "sigterm" for e in events)
    soak.check("no engine stopped with a request in flight, but by an administrator's deploy stop",
               not unexcused, f"{sigterms} SIGTERMs; busy: {len(busy)} after deploy stop, "
                              f"{len(unexcused)} otherwise {[(e['model'], e['inflight']) for e in unexcused][:4]}")
    soak.boots = sum(e["ev"] == "boot" for e in events)
    soak.engine_requests = len(reqs)
    soak.events = soaklib.rows(soak.od.cfg.db_path, "SELECT at, deployment_id, text FROM events ORDER BY id")
    warmth_checks(soak, soaklib.WarmthJournal(events), stops)


def warmth_checks(soak: Soak, wj: soaklib.WarmthJournal, admin_stops: list[dict[str, Any]]) -> None:
    """Sleeps and wakes, from the engines' journal and the audit rows (BEHAVIOUR.md, "Tiered
    warmth"); and the counts of the summary's warmth table."""
    sleep_checks(soak, wj)
    results, failing = wakes_by_result(soak, wj, admin_stops)
    killed_asleep_check(soak)
    audited = [r for r in soak.audit_rows if r["action"] == "ondemand_wake_failed"]
    kinds_audit = failed_wake_checks(soak, wj, admin_stops, audited, failing)
    soak.warmth = warmth_table(soak, wj, results, failing, audited, kinds_audit)


def sleep_checks(soak: Soak, wj: soaklib.WarmthJournal) -> None:
    """No busy engine put to sleep, none served asleep, each slept at its deployment's level, and
    the audited sleeps are the engines' sleeps."""
    soak.check("no engine put to sleep with a generation request in flight (journal: sleep call vs req/end)",
               not wj.busy_sleeps, "; ".join(wj.busy_sleeps[:3]) or f"{len(wj.sleeps)} sleeps")
    soak.check("no generation request reached an asleep engine (journal: between its sleep call and its wake)",
               not wj.asleep_served, "; ".join(wj.asleep_served[:3]) or f"{len(wj.sleeps)} sleeps")
    levels = collections.Counter((model, level) for _, model, _, level in wj.sleeps)
    off = [f"{m} at level {lv} x{c}" for (m, lv), c in sorted(levels.items())
           if LEVELS[IDLE_ACTIONS[NAMES.index(m.lower())]] != lv]
    soak.check("every engine slept at its deployment's level (sleep 1, sleep2 2; stop never)", not off,
               "; ".join(off[:4]) or ", ".join(f"{m.lower()} {lv} x{c}" for (m, lv), c in sorted(levels.items())))
    # Each audited sleep (ondemand_sleep into asleep) matched with the engine's sleep line of
    # that level (within 5 s after); a sleep cut by the SIGKILL of ondemand needs none.
    by_id = {i: NAMES[n].upper() for n, i in enumerate(soak.ids)}
    ordered = sorted((r["at"], by_id[r["deployment_id"]], r["detail"]["level"]) for r in soak.audit_rows
                     if r["action"] == "ondemand_sleep" and (r.get("detail") or {}).get("to") == "asleep")
    lines = sorted((t, model, level) for _, model, t, level in wj.sleeps)
    unmatched = []
    for at, model, level in ordered:
        hit = next((x for x in lines if x[1] == model and x[2] == level and at - 0.5 <= x[0] <= at + 5), None)
        if hit is not None:
            lines.remove(hit)
        elif not any(a - 5 <= at <= b for a, b in soak.down) and not any(
                NAMES[n].upper() == model and at - 1 <= when <= at + 5 for n, when in soak.killed_asleep.values()):
            # (an engine the soak SIGKILLed as it was marked asleep never got its sleep call)
            unmatched.append(f"{model.lower()} level {level} audited at {at:.1f}, no sleep line")
    unmatched += [f"{model.lower()} level {level} at {t:.1f}, not audited" for t, model, level in lines]
    soak.check("every sleep ondemand audited reached its engine, and every engine's sleep was audited",
               not unmatched, "; ".join(unmatched[:3]) or f"{len(ordered)} audited, {len(wj.sleeps)} slept")


def cut(soak: Soak, w: soaklib.Wake, admin_stops: list[dict[str, Any]]) -> str | None:
    """What cut a wake short, if anything did: the SIGKILL of ondemand (its restart stops the
    engine) or an administrator's deploy stop. A wake cut so is no failed wake."""
    if w.pid in soak.left_behind and (w.result in ("killed", "killed after", "stopped") or
                                      any(w.end_t >= a - 0.5 for a, _ in soak.down)):
        return "cut by the restart of ondemand"
    # The mark is written as the command line starts, a second or so before the stop.
    if any(s["admin_stop"] == w.model and w.t - 3 <= s["t"] <= w.end_t for s in admin_stops):
        return "cut by deploy stop"
    return None


def wakes_by_result(soak: Soak, wj: soaklib.WarmthJournal, admin_stops: list[dict[str, Any]]
                    ) -> tuple[collections.Counter[str], list[soaklib.Wake]]:
    """The wakes counted by how they ended (or what cut them), and the failing ones that are not
    cut: each must be audited."""
    results = collections.Counter(cut(soak, w, admin_stops) or w.result for w in wj.wakes)
    failing = [w for w in wj.wakes if w.failed and cut(soak, w, admin_stops) is None]
    # An asleep engine SIGKILLed by the soak while its deployment was starting was being
    # woken, before the wake's first call: the wake finds no engine, and fails. One killed
    # asleep may have been too, if a request came between the last look and the kill.
    for pid, model, t in wj.vanished_asleep:
        waking = pid in soak.killed_starting
        if pid in soak.killed_asleep:
            n, when = soak.killed_asleep[pid]
            waking = any(r["action"] == "ondemand_wake_failed" and r["deployment_id"] == soak.ids[n]
                         and "no engine to wake" in str(r["detail"].get("reason"))
                         and when - 1 <= r["at"] <= when + 10 for r in soak.audit_rows)
        if waking and pid not in soak.left_behind:
            w = soaklib.Wake(pid, model, t, 0)
            w.close("killed", t)
            failing.append(w)
            results["killed before its first wake call"] += 1
    return results, failing


def killed_asleep_check(soak: Soak) -> None:
    """An asleep engine SIGKILLed: its deployment failed (exited while asleep), never left asleep."""
    seen_failed = []
    for n, when in soak.killed_asleep.values():
        later = [e["text"] for e in soak.events if e["deployment_id"] == soak.ids[n] and e["at"] >= when]
        if later and later[0].startswith("Woken for a request"):
            later = later[1:]  # a request came as it was killed: the wake
        seen_failed.append((NAMES[n], later[0] if later else "nothing"))
    wrong = [f"{name}: {text}" for name, text in seen_failed
             if not text.startswith(("asleep → failed: engine exited", "wake from sleep",
                                     "the engine's sleep failed"))]  # killed during its sleep call
    soak.check("an asleep engine SIGKILLed: its deployment failed (or its wake, just begun, failed)",
               not wrong, "; ".join(wrong[:3]) or
               ", ".join(f"{name}: {text[:40]}" for name, text in seen_failed) or "none was found asleep")


def failed_wake_checks(soak: Soak, wj: soaklib.WarmthJournal, admin_stops: list[dict[str, Any]],
                       audited: list[dict[str, Any]], failing: list[soaklib.Wake]) -> collections.Counter[str]:
    """The audited wake failures are the journal's failing wakes, and each engine's wakes ended
    as its failure mode says. The audited failures by kind."""
    by_id = {i: NAMES[n].upper() for n, i in enumerate(soak.ids)}
    per_model_audit = collections.Counter(by_id[r["deployment_id"]] for r in audited)
    per_model_journal = collections.Counter(w.model for w in failing)
    kinds_audit = collections.Counter(wake_failure(r) for r in audited)
    kinds_journal = collections.Counter({"refused": "refused", "mismatch": "mismatch", "killed": "unreachable"}
                                        [w.result] for w in failing)
    soak.check("ondemand_wake_failed audit rows = the failing wakes the journal shows (per deployment, per kind)",
               per_model_audit == per_model_journal and kinds_audit == kinds_journal,
               f"audit {dict(sorted(per_model_audit.items()))} {dict(kinds_audit)}; journal "
               f"{dict(sorted(per_model_journal.items()))} {dict(kinds_journal)}")
    expect = {NAMES[n].upper(): ("refused" if "wake-fails" in extra else "mismatch" if "wake-garbage" in extra
                                 else "ready") for n, extra in enumerate(ENGINE_ARGS)}
    uncut = [w for w in wj.wakes if cut(soak, w, admin_stops) is None]
    odd = collections.Counter(f"{w.model} {w.result}" for w in uncut
                              if w.result in ("ready", "refused", "mismatch") and w.result != expect[w.model])
    tried = {m for m, r in expect.items() if r != "ready"}
    soak.check("every wake of a wake-fails engine was refused, of the wake-garbage one caught by its check; "
               "every other one woke",
               # some wake failed; a short run may never wake one deployment (its asleep engine
               # SIGKILLed, or busy whenever a probe looked), so not each kind is asked for
               not odd and bool({expect[w.model] for w in uncut} & {"refused", "mismatch"}),
               "; ".join(f"{k} x{c}" for k, c in odd.items()) or "wakes of " + ", ".join(
                   f"{m.lower()} {sum(w.model == m for w in wj.wakes)}" for m in sorted(tried)))
    return kinds_audit


def warmth_table(soak: Soak, wj: soaklib.WarmthJournal, results: collections.Counter[str],
                 failing: list[soaklib.Wake], audited: list[dict[str, Any]],
                 kinds_audit: collections.Counter[str]) -> list[tuple[str, int, str]]:
    """The rows of the summary's warmth table."""
    rows = [r for r in soak.audit_rows if r["action"] == "ondemand_sleep"]

    def count(pred: Any) -> int:
        return sum(1 for r in rows if pred(r["text"], r.get("detail") or {}))
    level_n = collections.Counter(level for *_, level in wj.sleeps)
    after_failed = sum(1 for w in failing if any(b[1] == w.model and b[2] >= w.t for b in wj.boots))
    return [
        ("sleeps at level 1 (engines' journal)", level_n[1], ""),
        ("sleeps at level 2 (engines' journal)", level_n[2], ""),
        ("put to sleep idle (reaper)", count(lambda t, d: t.startswith("Put to sleep after") and "level" in d), ""),
        ("stopped idle (reaper; idle_action stop)",
         count(lambda t, d: t.startswith("Put to sleep after") and "level" not in d), ""),
        ("make-room: an awake engine put to sleep",
         count(lambda t, d: t.startswith(MAKE_ROOM[0]) and "level" in d), ""),
        ("make-room: an awake engine stopped (idle_action stop)",
         count(lambda t, d: t.startswith(MAKE_ROOM[0]) and "level" not in d), ""),
        ("make-room: an asleep engine stopped", count(lambda t, d: t.startswith(MAKE_ROOM[1])), ""),
        *[(f"wakes: {k}", results.get(k, 0), WAKE_RESULTS.get(k, ""))
          for k in sorted({"ready", "refused", "mismatch", *results})],
        ("wake failures audited (ondemand_wake_failed)", len(audited),
         ", ".join(f"{k} {c}" for k, c in sorted(kinds_audit.items()))),
        ("cold starts (engine processes started)", len(wj.boots),
         f"{after_failed} after a failed wake"),
    ]
