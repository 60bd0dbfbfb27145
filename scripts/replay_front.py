"""The replay's tables read as a choice (``make replay``, scripts/replay_bench.py): each policy's
point (GiB-hours held, the share of requests that waited at most the SLO), the Pareto front of the
product's and its peers' policies, each one's distance to the ``clairvoyant`` reference, the
words that say where ondemand's own policies lose, and the picture, a hand-written SVG.

A policy is *dominated* when another (the reference aside) has a higher share within the SLO and
no more GiB-hours, or the same share with fewer; the front is those that are not. The reference
knows every arrival in advance: it is no product policy, so it dominates nobody here, and its row
says how far each policy is from what knowing the future gives. ``clairvoyant=60``, the reference
whose own rests wait 60 s idle (the product's floor, ``min_idle_timeout_s``), is a reference too:
the least memory a policy with that floor holds.
"""
from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ondemand.replay import report
from ondemand.replay.types import PolicyResult

REFERENCE = "clairvoyant"
FLOORED = "clairvoyant=60"  # the reference under the box mix's min_idle_timeout_s (the default, 60 s)
OURS = ("seed", "fixed=600", "adaptive", "cost")  # ondemand's own: the default first
PANEL_W, PANEL_H = 420, 300
PAD_L, PAD_R, PAD_T, PAD_B = 52, 16, 28, 40


@dataclass(frozen=True)
class Point:
    name: str
    gib_h: float
    within: float  # wait_slo_met, a fraction
    failed: int
    timed_out: int
    refused: int


def point(r: PolicyResult) -> Point:
    j = report.tally_json(r.total)
    return Point(r.policy.name, j["gpu_gib_hours"], j["wait_slo_met"], j["failed"], j["timed_out"], j["refused"])


def is_reference(name: str) -> bool:
    """``clairvoyant``, or the same with a floor (``clairvoyant=S``)."""
    return name.partition("=")[0] == REFERENCE


def dominated_by(p: Point, others: Sequence[Point]) -> list[str]:
    return [o.name for o in others if o.name != p.name and not is_reference(o.name)
            and o.within >= p.within and o.gib_h <= p.gib_h and (o.within > p.within or o.gib_h < p.gib_h)]


def table(results: Sequence[PolicyResult]) -> str:
    """One row a policy: its point, its distance to the reference, and who dominates it."""
    pts = [point(r) for r in results]
    ref = next((p for p in pts if p.name == REFERENCE), None)
    head = ("| policy | wait ≤ SLO | vs clairvoyant | failed (timed out + refused) | GiB-h | × clairvoyant's "
            "| dominated by |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for p in pts:
        gap = "" if ref is None or p is ref else f"{100 * (p.within - ref.within):+.1f} pts"
        share = "" if ref is None or p is ref or ref.gib_h <= 0 else f"{p.gib_h / ref.gib_h:.2f}"
        by = "reference" if is_reference(p.name) else (", ".join(dominated_by(p, pts)) or "on the front")
        lines.append(f"| {p.name} | {100 * p.within:.1f} % | {gap} | {p.failed} ({p.timed_out} + {p.refused}) | "
                     f"{p.gib_h:,.0f} | {share} | {by} |")
    return "\n".join(lines) + "\n"


def words(results: Sequence[PolicyResult]) -> str:
    """Where ondemand's own policies lose, in sentences made from the numbers."""
    pts = {p.name: p for p in map(point, results)}
    ref = pts.get(REFERENCE)
    out = []
    for name in OURS:
        p = pts.get(name)
        if p is None:
            continue
        by = dominated_by(p, list(pts.values()))
        said = f"`{name}`: {100 * p.within:.1f} % within the SLO at {p.gib_h:,.0f} GiB-h"
        if ref is not None:
            gap = round(100 * (p.within - ref.within), 1)
            said += (", level with the reference" if gap == 0 else
                     f", {abs(gap):.1f} points {'above' if gap > 0 else 'below'} the reference")
        if p.timed_out:
            said += f"; {p.timed_out:,} requests timed out in the queue"
        said += f"; dominated by {', '.join(f'`{n}`' for n in by)}." if by else "; on the front."
        out.append("- " + said)
    return "\n".join(out) + "\n"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step) + 1)]


def _panel(title: str, results: Sequence[PolicyResult], ox: float, oy: float) -> str:
    pts = [point(r) for r in results]
    xs = [math.log10(max(p.gib_h, 1.0)) for p in pts]
    ys = [100 * p.within for p in pts]
    x_lo, x_hi = min(xs) - 0.05, max(xs) + 0.05
    y_lo, y_hi = max(0.0, min(ys) - 2), 100.0
    w, h = PANEL_W - PAD_L - PAD_R, PANEL_H - PAD_T - PAD_B

    def px(x: float) -> float:
        return ox + PAD_L + w * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        return oy + PAD_T + h - h * (y - y_lo) / (y_hi - y_lo)

    parts = [f'<text x="{ox + PAD_L}" y="{oy + 16}" font-weight="bold" fill="#222">{html.escape(title)}</text>',
             f'<rect x="{ox + PAD_L}" y="{oy + PAD_T}" width="{w}" height="{h}" fill="#fafafa" stroke="#ddd"/>']
    for yv in _ticks(y_lo, y_hi):
        parts.append(f'<line x1="{ox + PAD_L}" x2="{ox + PAD_L + w}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" '
                     f'stroke="#eee"/><text x="{ox + PAD_L - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:g} %'
                     '</text>')
    for e in range(math.floor(x_lo), math.ceil(x_hi) + 1):
        for m in (1, 2, 5):
            xv = math.log10(m * 10 ** e)
            if x_lo <= xv <= x_hi:
                parts.append(f'<text x="{px(xv):.1f}" y="{oy + PAD_T + h + 14}" text-anchor="middle">'
                             f'{m * 10 ** e:,}</text>')
    parts.append(f'<text x="{ox + PAD_L + w / 2}" y="{oy + PANEL_H - 6}" text-anchor="middle">GiB-hours (log)</text>'
                 f'<text x="{ox + 12}" y="{oy + PAD_T + h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 {ox + 12} {oy + PAD_T + h / 2})">waited ≤ SLO</text>')
    front = sorted((p for p in pts if not is_reference(p.name) and not dominated_by(p, pts)), key=lambda p: p.gib_h)
    if len(front) > 1:
        parts.append('<polyline fill="none" stroke="#999" stroke-dasharray="4 3" points="' + " ".join(
            f"{px(math.log10(max(p.gib_h, 1.0))):.1f},{py(100 * p.within):.1f}" for p in front) + '"/>')
    for p, x, y in zip(pts, xs, ys, strict=True):
        color = "#c0392b" if is_reference(p.name) else "#2c7fb8" if p.name in OURS else "#777"
        parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{color}"><title>{html.escape(p.name)}: '
                     f'{y:.1f} % within the SLO, {p.gib_h:,.0f} GiB-h, {p.failed} failed</title></circle>'
                     f'<text x="{px(x) + 5:.1f}" y="{py(y) - 5:.1f}" fill="{color}">{html.escape(p.name)}</text>')
    return "".join(parts)


def svg(panels: Sequence[tuple[str, Sequence[PolicyResult]]]) -> str:
    """The panels two a row: ondemand's policies blue, the peers grey, the reference red, the
    front dashed."""
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    width, height = cols * PANEL_W, rows * PANEL_H
    body = [_panel(title, res, (i % cols) * PANEL_W, (i // cols) * PANEL_H) for i, (title, res) in enumerate(panels)]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
            f'{height}" role="img" aria-label="GiB-hours against the share of requests that waited at most the SLO" '
            'font-family="system-ui,sans-serif" font-size="11" fill="#555">'
            f'<rect width="{width}" height="{height}" fill="#fff"/>{"".join(body)}</svg>\n')


def by_name(results: Sequence[PolicyResult]) -> Mapping[str, PolicyResult]:
    return {r.policy.name: r for r in results}
