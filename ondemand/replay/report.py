"""What a replay says: the table (one row a policy, on stdout or in Markdown) and the JSON.

The JSON's shape: ``{"trace": {"requests", "duration_s", "models"}, "box": {"gpus"},
"policies": {NAME: {"requests", "served", "failed", "timed_out", "refused", "rejected",
"wait_slo_met", "wait_s": {"p50", "p90", "p99", "max"}, "slo_met", "ttft_s": {the same},
"waited": {"ready", "wake", "cold", "queue"}, "cold_starts", "wakes", "sleeps", "stops", "prewarms",
"prewarm_hits", "gpu_hours", "gpu_gib_hours", "per_deployment": {NAME: {the same but
per_deployment}}}}}``. ``prewarms`` counts adaptive warmth's pre-warms that started,
``prewarm_hits`` those a request found awake (or coming up) for it. ``wait_s`` is what the
gateway and the scheduling cost a request: from its arrival to the moment a ready engine took it
(of the served and the timed-out requests, which count at their deadline); ``wait_slo_met`` the
served requests whose wait met the SLO, over the requests less the ``rejected`` (too long for
their engine's ``max_model_len``, refused at arrival as vLLM refuses them). ``failed`` is
``timed_out`` (the queue's deadline) plus ``refused`` (answered at once with an error: the queue
full, ``does_not_fit``, 429, a start's backoff). ``slo_met`` is the
fraction of requests whose TTFT met the SLO (a refused request never does; the shares are
exact counts); a percentile is linear between the two nearest ranks, of the tally's sketch
(``sketch.py``: within 0.5 % of the exact value, ``max`` exact), null with nothing served;
``trace.duration_s`` runs from the first arrival to the end of the last request (the longest
of the policies');
``trace.models`` counts the deployments the trace's requests went to; ``trace.measured_from_s``,
only with a warm-up (``--warmup-s``), is where the counts begin (the policies' counts and hours
are the measured window's; ``trace.requests`` is the whole trace's).
Numbers are rounded (seconds and hours to 3 decimals, percentiles to 3 significant digits as
well, fractions to 4), so the same inputs give the same bytes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson

from .sketch import Sketch
from .types import WAITED, Box, PolicyResult, Tally


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits) + 0.0  # + 0.0: never a -0.0


def _sig(x: float | None) -> float | None:
    """A percentile as the JSON gives it: 3 significant digits (the sketch's 0.5 % is below half
    of the third digit's step but near its top: rarely does it change the rounded value), and no
    more than 3 decimals, as every other figure in seconds."""
    if not x:
        return _r(x)
    return _r(x, min(3, 2 - math.floor(math.log10(x))))


def _quantiles(values: Sketch) -> dict[str, float | None]:
    return {"p50": _sig(values.quantile(0.5)), "p90": _sig(values.quantile(0.9)), "p99": _sig(values.quantile(0.99)),
            "max": _r(values.max if values.count else None)}


def tally_json(t: Tally) -> dict[str, Any]:
    counted = t.requests - t.rejected  # a request too long for its engine is no request to wait for
    return {
        "requests": t.requests, "served": t.served, "failed": t.failed,
        "timed_out": t.timed_out, "refused": t.refused, "rejected": t.rejected,
        "wait_slo_met": _r(t.wait_slo_met / counted if counted else 0.0, 4),
        "wait_s": _quantiles(t.wait),
        "slo_met": _r(t.slo_met / t.requests if t.requests else 0.0, 4),
        "ttft_s": _quantiles(t.ttft),
        "waited": {k: t.waited[k] for k in WAITED},
        "cold_starts": t.cold_starts, "wakes": t.wakes, "sleeps": t.sleeps, "stops": t.stops,
        "prewarms": t.prewarms, "prewarm_hits": t.prewarm_hits,
        "gpu_hours": _r(t.gpu_seconds / 3600), "gpu_gib_hours": _r(t.gpu_gib_seconds / 3600),
    }


def to_json(results: Sequence[PolicyResult], box: Box, requests: int, models: int,
            measured_from_s: float = 0.0) -> dict[str, Any]:
    trace: dict[str, Any] = {"requests": requests, "duration_s": _r(max((r.end_s for r in results), default=0.0)),
                             "models": models}
    if measured_from_s:
        trace["measured_from_s"] = _r(measured_from_s)
    return {
        "trace": trace,
        "box": {"gpus": list(box.gpus)},
        "policies": {r.policy.name: {**tally_json(r.total),
                                     "per_deployment": {name: tally_json(t) for name, t in r.per_deployment.items()}}
                     for r in results},
    }


def json_bytes(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"


HEADER = ["policy", "wait ≤ SLO", "failed", "GiB-h", "requests", "timed out", "refused", "rejected", "wait p99",
          "TTFT ≤ SLO", "TTFT p50", "p99", "ready", "wake", "cold", "queue", "cold starts", "wakes", "sleeps", "stops",
          "pre-warm hits", "GPU-h"]


def rows(results: Sequence[PolicyResult], slo_s: float) -> list[list[str]]:
    out = []
    for r in results:
        j = tally_json(r.total)
        ttft = j["ttft_s"]
        out.append([r.policy.name, f"{100 * j['wait_slo_met']:.1f} %", str(j["failed"]), f"{j['gpu_gib_hours']:.0f}",
                    str(j["requests"]), str(j["timed_out"]), str(j["refused"]), str(j["rejected"]),
                    _seconds(j["wait_s"]["p99"]), f"{100 * j['slo_met']:.1f} %",
                    _seconds(ttft["p50"]), _seconds(ttft["p99"]),
                    *(str(j["waited"][k]) for k in WAITED),
                    str(j["cold_starts"]), str(j["wakes"]), str(j["sleeps"]), str(j["stops"]),
                    hit_rate(j["prewarm_hits"], j["prewarms"]), f"{j['gpu_hours']:.2f}"])
    return out


def hit_rate(hits: int, prewarms: int) -> str:
    """The pre-warms' hit rate as the table shows it: "7/9 (78 %)", or "-" with none."""
    return f"{hits}/{prewarms} ({100 * hits / prewarms:.0f} %)" if prewarms else "-"


def _seconds(x: float | None) -> str:
    """A percentile in the table: 3 significant digits, as the JSON has it (2 decimals below 1 s)."""
    if x is None:
        return "-"
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s" if x < 100 else f"{x:.0f} s"


def _header(slo_s: float) -> list[str]:
    return [h.replace("SLO", f"{slo_s:g} s") if "≤ SLO" in h else h for h in HEADER]


def table(results: Sequence[PolicyResult], slo_s: float) -> str:
    """One row a policy, aligned for a terminal: first the share of requests that waited at most
    ``slo_s`` (the queue, a wake, a start: what the scheduling costs them), the failures and the
    GiB-hours held; then the TTFT's share (the engine's prefill and queue included)."""
    header = _header(slo_s)
    cells = [header, *rows(results, slo_s)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    return "\n".join(lines) + "\n"


def markdown(results: Sequence[PolicyResult], slo_s: float) -> str:
    header = _header(slo_s)
    rule = "|".join(" --- " if i == 0 else " ---: " for i in range(len(header)))
    out = ["| " + " | ".join(header) + " |", f"|{rule}|"]
    out += ["| " + " | ".join(row) + " |" for row in rows(results, slo_s)]
    return "\n".join(out) + "\n"


def comparison(pairs: Sequence[tuple[PolicyResult, PolicyResult]], slo_s: float) -> str:
    """``--live``: each policy's virtual replay and live run, one row each (GPU-hours are not
    measured live)."""
    head = ["policy", "run", "requests", "failed", f"SLO ≤{slo_s:g} s", "TTFT p50", "p99", "queue", "cold starts",
            "wakes", "sleeps", "stops"]
    cells = [head]
    for virtual, live in pairs:
        for run, r in (("virtual", virtual), ("live", live)):
            j = tally_json(r.total)
            cells.append([r.policy.name, run, str(j["requests"]), str(j["failed"]), f"{100 * j['slo_met']:.1f} %",
                          _seconds(j["ttft_s"]["p50"]), _seconds(j["ttft_s"]["p99"]), str(j["waited"]["queue"]),
                          str(j["cold_starts"]), str(j["wakes"]), str(j["sleeps"]), str(j["stops"])])
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                     strict=True)))
                     for row in cells) + "\n"
