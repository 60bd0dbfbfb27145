"""Adaptive warmth against the fixed idle timeouts, for ``make replay`` (scripts/replay_bench.py):
the targets of issue 32, measured, and the Pareto picture (GiB-hours against requests that
waited) as a hand-written SVG.

- **The fixed curve.** The policies ``fixed=60``, ``300``, ``600`` and ``1800`` are points (GiB-hours,
  waits); the curve is linear between neighbours by GiB-hours and, beyond its ends, the end
  point's waits. At adaptive's GiB-hours the curve must have at least 30 % more waits than
  adaptive (``WAITS_MARGIN``).
- **Waits**, two ways: ``wake + cold`` (a request that waited for its model's wake or start: the
  issue's measure), and every request that waited for anything, ``wake + cold + queue`` (a
  request counts once, by the longest thing it waited for: one that queued for memory and then
  woke its model is a ``queue``). On an over-booked box the queue is most of the waiting, and
  leaving it out would reward a policy for making requests queue instead of wake.
- **SLO and memory against always-on:** adaptive's SLO attainment at least always-on's less one
  point, at no more than half of always-on's GiB-hours, where always-on fits at all: on a box
  where it refuses models (its figures are then those of the models that fit, its refused
  requests missed the SLO) the target does not apply, and the table says so. Beside it,
  ``fixed=60``'s share: adaptive never stays awake less than ``min_idle_timeout_s`` (60 s), so it
  holds about as much as ``fixed=60`` at least.
- **Pre-warms:** hits / pre-warms.
"""
from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ondemand.replay import report
from ondemand.replay.types import PolicyResult

FIXED = ("fixed=60", "fixed=300", "fixed=600", "fixed=1800")
WAITS_MARGIN = 1.30  # the fixed curve's waits at adaptive's GiB-hours, at least this times adaptive's
SLO_POINTS = 0.01  # adaptive's SLO attainment at least always-on's less this
MEMORY_SHARE = 0.5  # ...at no more than this share of always-on's GiB-hours


def waits(r: PolicyResult, queue: bool) -> int:
    w = r.total.waited
    return w["wake"] + w["cold"] + (w["queue"] if queue else 0)


def gib_hours(r: PolicyResult) -> float:
    return r.total.gpu_gib_seconds / 3600


def slo(r: PolicyResult) -> float:
    return float(report.tally_json(r.total)["slo_met"])  # as the tables round it


def curve_at(points: Sequence[tuple[float, float]], x: float) -> float:
    """The fixed curve's waits at ``x`` GiB-hours: linear between its points (by GiB-hours),
    the end point's beyond either end."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else min(y0, y1)
    return pts[-1][1]


@dataclass(frozen=True)
class Verdict:
    """One trace and window's comparison."""
    gib_h: float  # adaptive's
    waits: dict[bool, tuple[int, float]]  # by "queue counted": adaptive's waits, the fixed curve's there
    slo: tuple[float, float]  # adaptive's, always-on's
    always_gib_h: float
    refused: int  # the models always-on refused
    prewarms: tuple[int, int]  # hits, pre-warms
    floor_gib_h: float  # fixed=60's: about the least adaptive can hold (it stays awake min_idle_timeout_s at least)

    def waits_met(self, queue: bool) -> bool:
        mine, curve = self.waits[queue]
        return curve >= WAITS_MARGIN * mine and curve > 0

    def more(self, queue: bool) -> str:
        """How many more waits the fixed curve has than adaptive, as the table says it."""
        mine, curve = self.waits[queue]
        if mine == 0:
            return "none either" if curve == 0 else "adaptive none"
        return f"{100 * (curve / mine - 1):+.0f} %"


def verdict(by: Mapping[str, PolicyResult]) -> Verdict:
    a, always = by["adaptive"], by["always-on"]
    out = {}
    for queue in (False, True):
        out[queue] = (waits(a, queue), curve_at([(gib_hours(by[p]), waits(by[p], queue)) for p in FIXED], gib_hours(a)))
    refused = sum(1 for t in always.per_deployment.values() if not t.gpu_gib_seconds)  # never placed
    return Verdict(gib_hours(a), out, (slo(a), slo(always)), gib_hours(always), refused,
                   (a.total.prewarm_hits, a.total.prewarms), gib_hours(by["fixed=60"]))


def table(rows: Sequence[tuple[str, str, Verdict]]) -> str:
    """The targets, one row a trace and window."""
    def mark(ok: bool) -> str:
        return "met" if ok else "**missed**"
    out = ["| trace | measured | adaptive GiB-h | wake + cold: adaptive, fixed curve there | the curve has | "
           "every wait (+ queue): adaptive, curve | the curve has | SLO ≤5 s: adaptive, always-on | "
           "GiB-h: always-on's | pre-warm hits |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for trace, window, v in rows:
        (w, wc), (q, qc) = v.waits[False], v.waits[True]
        slo_ok = v.slo[0] >= v.slo[1] - SLO_POINTS - 1e-9
        mem_ok = v.gib_h <= MEMORY_SHARE * v.always_gib_h
        hits, pre = v.prewarms
        if v.refused:  # the target holds "where always-on fits at all"
            against = (f"{v.always_gib_h:.0f}, refusing {v.refused} of the models: not applicable "
                       f"(adaptive holds {100 * v.gib_h / v.always_gib_h:.0f} %)")
            slo_mark = "not applicable"
        else:
            against = (f"{v.always_gib_h:.0f}: adaptive holds {100 * v.gib_h / v.always_gib_h:.0f} % ({mark(mem_ok)}; "
                       f"fixed=60 {100 * v.floor_gib_h / v.always_gib_h:.0f} %)")
            slo_mark = mark(slo_ok)
        out.append(f"| {trace} | {window} | {v.gib_h:.0f} | {w}, {wc:.0f} "
                   f"| {v.more(False)} ({mark(v.waits_met(False))}) | {q}, {qc:.0f} "
                   f"| {v.more(True)} ({mark(v.waits_met(True))}) "
                   f"| {100 * v.slo[0]:.1f} %, {100 * v.slo[1]:.1f} % ({slo_mark}) "
                   f"| {against} "
                   f"| {f'{hits}/{pre} ({100 * hits / pre:.0f} %)' if pre else 'none started'} |")
    return "\n".join(out) + "\n"


# --- the picture --------------------------------------------------------------------------

PANEL_W, PANEL_H, PAD_L, PAD_B, PAD_T, PAD_R = 400, 300, 58, 40, 28, 16
FIXED_COLOR, ADAPTIVE_COLOR, ALWAYS_COLOR = "#1f77b4", "#d62728", "#7f7f7f"


def _ticks(lo: float, hi: float) -> list[float]:
    """Round values between lo and hi, four to eight of them (steps of 1, 2 or 5 times a power of ten)."""
    raw = (hi - lo) / 5
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step) + 1)]


def _panel(title: str, by: Mapping[str, PolicyResult], ox: float, oy: float) -> str:
    names = [*FIXED, "adaptive", "always-on"]
    xs = [gib_hours(by[n]) for n in names]
    ys = [waits(by[n], True) for n in names]
    x_lo, x_hi = 0.9 * min(xs), 1.05 * max(xs)
    y_hi = max(1.0, 1.1 * max(ys))
    w, h = PANEL_W - PAD_L - PAD_R, PANEL_H - PAD_T - PAD_B

    def px(x: float) -> float:
        return ox + PAD_L + w * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        return oy + PAD_T + h - h * y / y_hi

    parts = [f'<text x="{ox + PAD_L}" y="{oy + 16}" font-weight="bold" fill="#222">{html.escape(title)}</text>',
             f'<rect x="{ox + PAD_L}" y="{oy + PAD_T}" width="{w}" height="{h}" fill="#fafafa" stroke="#ddd"/>']
    for yv in _ticks(0.0, y_hi):
        parts.append(f'<line x1="{ox + PAD_L}" x2="{ox + PAD_L + w}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" '
                     f'stroke="#eee"/><text x="{ox + PAD_L - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:g}</text>')
    for xv in _ticks(x_lo, x_hi):
        parts.append(f'<text x="{px(xv):.1f}" y="{oy + PAD_T + h + 14}" text-anchor="middle">{xv:g}</text>')
    parts.append(f'<text x="{ox + PAD_L + w / 2}" y="{oy + PANEL_H - 6}" text-anchor="middle">GiB-hours</text>'
                 f'<text x="{ox + 12}" y="{oy + PAD_T + h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 {ox + 12} {oy + PAD_T + h / 2})">requests that waited</text>')
    for queue, dash in ((True, ""), (False, ' stroke-dasharray="5 3"')):
        pts = sorted((gib_hours(by[n]), waits(by[n], queue), n) for n in FIXED)
        parts.append(f'<polyline fill="none" stroke="{FIXED_COLOR}" stroke-width="2"{dash} points="'
                     + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts) + '"/>')
        for x, y, n in pts:
            fill = FIXED_COLOR if queue else "#fff"
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{fill}" stroke="{FIXED_COLOR}">'
                         f'<title>{n}: {y} ({"every wait" if queue else "wake + cold"}), {x:.0f} GiB-h</title>'
                         '</circle>')
            if queue:
                parts.append(f'<text x="{px(x) + 5:.1f}" y="{py(y) - 5:.1f}">{n.split("=")[1]} s</text>')
        x, y = gib_hours(by["adaptive"]), waits(by["adaptive"], queue)
        fill = ADAPTIVE_COLOR if queue else "#fff"
        parts.append(f'<path d="M{px(x):.1f},{py(y) - 6:.1f} l6,6 l-6,6 l-6,-6 z" fill="{fill}" '
                     f'stroke="{ADAPTIVE_COLOR}" stroke-width="1.5"><title>adaptive: {y} '
                     f'({"every wait" if queue else "wake + cold"}), {x:.0f} GiB-h</title></path>')
    x = gib_hours(by["always-on"])
    parts.append(f'<rect x="{px(x) - 4:.1f}" y="{py(0) - 4:.1f}" width="8" height="8" fill="{ALWAYS_COLOR}">'
                 f'<title>always-on: no wait, {x:.0f} GiB-h, {by["always-on"].total.failed} requests refused'
                 '</title></rect>'
                 f'<text x="{px(x):.1f}" y="{py(0) - 8:.1f}" text-anchor="middle">always-on</text>')
    return "".join(parts)


def svg(panels: Sequence[tuple[str, Mapping[str, PolicyResult]]]) -> str:
    """The panels three a row, and the legend under them."""
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    width, height = cols * PANEL_W, rows * PANEL_H + 48
    body = [_panel(title, by, (i % cols) * PANEL_W, (i // cols) * PANEL_H) for i, (title, by) in enumerate(panels)]
    ly = rows * PANEL_H + 20
    legend = (f'<line x1="{PAD_L}" x2="{PAD_L + 24}" y1="{ly}" y2="{ly}" stroke="{FIXED_COLOR}" stroke-width="2"/>'
              f'<text x="{PAD_L + 30}" y="{ly + 4}">fixed=60, 300, 600, 1800 s: every request that waited '
              f'(wake, cold start or queue)</text>'
              f'<line x1="{PAD_L}" x2="{PAD_L + 24}" y1="{ly + 16}" y2="{ly + 16}" stroke="{FIXED_COLOR}" '
              f'stroke-width="2" stroke-dasharray="5 3"/><text x="{PAD_L + 30}" y="{ly + 20}">the same, wake + '
              'cold only</text>'
              f'<path d="M{PAD_L + 570},{ly - 6} l6,6 l-6,6 l-6,-6 z" fill="{ADAPTIVE_COLOR}"/>'
              f'<text x="{PAD_L + 580}" y="{ly + 4}">adaptive (hollow: wake + cold only)</text>'
              f'<rect x="{PAD_L + 566}" y="{ly + 12}" width="8" height="8" fill="{ALWAYS_COLOR}"/>'
              f'<text x="{PAD_L + 580}" y="{ly + 20}">always-on (on 8 GPUs it refuses 8 of the 16 models)</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
            f'{height}" role="img" aria-label="GiB-hours against requests that waited" '
            'font-family="system-ui,sans-serif" font-size="11" fill="#555">'
            f'<rect width="{width}" height="{height}" fill="#fff"/>{"".join(body)}{legend}</svg>\n')
