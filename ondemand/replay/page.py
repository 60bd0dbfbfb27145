"""A replay's page (``--html FILE``): one self-contained HTML file (inline SVG and CSS, nothing
fetched), with the table, each policy's TTFT distribution (the share of requests served within
each TTFT, on a log scale: a refused request never is), and per policy each GPU's memory over
time by deployment and the requests queued for memory. Times are drawn to the pixel: of the
changes within one pixel the last one stands (the queue: the most in it)."""
from __future__ import annotations

import html
import math
from collections.abc import Sequence

from .report import HEADER, rows
from .types import Box, PolicyResult

WIDTH, GPU_HEIGHT, QUEUE_HEIGHT, CDF_HEIGHT = 960, 56, 70, 320
LEFT, RIGHT = 56, 24  # room for the axes' labels
POLICY_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#7f7f7f", "#bcbd22")
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
.wide{overflow-x:auto}table{border-collapse:collapse;font-variant-numeric:tabular-nums;font-size:13px}
td,th{padding:2px 8px;border-bottom:1px solid #ddd;white-space:nowrap}
td{text-align:right}td:first-child,th:first-child{text-align:left}h2{margin-top:32px}
.legend span{display:inline-block;margin:0 12px 4px 0}.legend i{display:inline-block;width:10px;height:10px;
margin-right:4px}svg text{font-size:11px;fill:#555}"""


def color(i: int) -> str:
    """A deployment's color: hues a golden angle apart, so neighbours differ."""
    return f"hsl({(i * 137.508) % 360:.0f},55%,52%)"


def _x(t: float, end: float) -> float:
    return LEFT + (WIDTH - LEFT - RIGHT) * (t / end if end > 0 else 0.0)


def _time_axis(end: float, y: float) -> str:
    step = next(s for s in (60, 300, 600, 900, 1800, 3600, 7200, 21600, 86400, math.inf) if end / s <= 8)
    if not math.isfinite(step):
        step = end / 4
    ticks = []
    t = 0.0
    while t <= end + 1e-9:
        x = _x(t, end)
        label = f"{t / 60:g} min" if step < 3600 else f"{t / 3600:g} h"
        ticks.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{y}" stroke="#eee"/>'
                     f'<text x="{x:.1f}" y="{y + 12}" text-anchor="middle">{label}</text>')
        t += step
    return "".join(ticks)


def cdf_chart(results: Sequence[PolicyResult], slo_s: float) -> str:
    served = [r.total.ttft for r in results]
    top = max((s.max for s in served if s.count), default=1.0)
    lo, hi = -2, max(1, math.ceil(math.log10(max(top, 0.011))))
    h = CDF_HEIGHT

    def x(v: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * (math.log10(min(max(v, 10 ** lo), 10 ** hi)) - lo) / (hi - lo)

    parts = [f'<svg width="{WIDTH}" height="{h + 30}" role="img" aria-label="TTFT distribution">']
    for e in range(lo, hi + 1):
        parts.append(f'<line x1="{x(10 ** e):.1f}" x2="{x(10 ** e):.1f}" y1="0" y2="{h}" stroke="#eee"/>'
                     f'<text x="{x(10 ** e):.1f}" y="{h + 14}" text-anchor="middle">{10 ** e:g} s</text>')
    for p in (0, 25, 50, 75, 100):
        y = h - h * p / 100
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{p} %</text>')
    parts.append(f'<line x1="{x(slo_s):.1f}" x2="{x(slo_s):.1f}" y1="0" y2="{h}" stroke="#999" '
                 f'stroke-dasharray="4 3"/><text x="{x(slo_s) + 4:.1f}" y="12">SLO {slo_s:g} s</text>')
    for i, (r, s) in enumerate(zip(results, served, strict=True)):
        if not s.count or not r.total.requests:
            continue
        n = s.count
        picks = sorted({round(k * (n - 1) / 400) for k in range(401)})
        pts = [f"{x(v):.1f},{h - h * (k + 1) / r.total.requests:.1f}" for k, v in zip(picks, s.at_ranks(picks),
                                                                                         strict=True)]
        parts.append(f'<polyline fill="none" stroke="{POLICY_COLORS[i % len(POLICY_COLORS)]}" stroke-width="2" '
                     f'points="{x(s.min):.1f},{h} {" ".join(pts)}"><title>{html.escape(r.policy.name)}</title>'
                     '</polyline>')
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{POLICY_COLORS[i % len(POLICY_COLORS)]}"></i>'
                     f'{html.escape(r.policy.name)}</span>' for i, r in enumerate(results))
    return f'<div class="legend">{legend}</div>' + "".join(parts)


def gpu_chart(result: PolicyResult, gpu: int, size: float, end: float, colors: dict[str, str],
              axis: bool = False) -> str:
    """One GPU's memory over time (0 to its size), stacked by deployment in a fixed order."""
    h = GPU_HEIGHT
    held: dict[str, float] = {}
    snaps: list[tuple[int, dict[str, float]]] = []  # (pixel, what is held from it on)
    for t, g, name, gib in result.memory:
        if g != gpu:
            continue
        held[name] = gib
        px = round(_x(t, end))
        if snaps and snaps[-1][0] == px:
            snaps[-1] = (px, dict(held))
        else:
            snaps.append((px, dict(held)))
    rects = []
    order = list(colors)
    for i, (px, state) in enumerate(snaps):
        nxt = snaps[i + 1][0] if i + 1 < len(snaps) else round(_x(result.end_s, end))  # held until its replay ended
        if nxt <= px:
            continue
        bottom = 0.0
        for name in order:
            gib = state.get(name, 0.0)
            if gib <= 0:
                continue
            y0 = h - h * min(bottom + gib, size) / size
            y1 = h - h * min(bottom, size) / size
            rects.append(f'<rect x="{px}" y="{y0:.1f}" width="{nxt - px}" height="{max(y1 - y0, 0.5):.1f}" '
                         f'fill="{colors[name]}"><title>{html.escape(name)}: {gib:g} GiB</title></rect>')
            bottom += gib
    return (f'<svg width="{WIDTH}" height="{h + (20 if axis else 4)}" role="img" aria-label="GPU {gpu}">'
            f'<rect x="{LEFT}" y="0" width="{WIDTH - LEFT - RIGHT}" height="{h}" fill="#fafafa" stroke="#ddd"/>'
            f'{_time_axis(end, h) if axis else ""}'
            f'<text x="{LEFT - 4}" y="{h / 2 + 4:.0f}" text-anchor="end">GPU {gpu}</text>{"".join(rects)}</svg>')


def queue_chart(result: PolicyResult, end: float) -> str:
    """Requests queued for memory over time (the most within each pixel)."""
    h = QUEUE_HEIGHT
    cols: dict[int, tuple[int, int]] = {}  # pixel: (the most in it, the last)
    for t, n in result.queue:
        px = round(_x(t, end))
        most, _ = cols.get(px, (n, n))
        cols[px] = (max(most, n), n)
    top = max((most for most, _ in cols.values()), default=0) or 1

    def y(n: int) -> str:
        return f"{h - h * n / top:.1f}"

    pts, level = [f"{LEFT},{h}"], 0
    for px in sorted(cols):
        most, last = cols[px]
        peak = max(most, level)
        pts += [f"{px},{y(level)}", f"{px},{y(peak)}", f"{px + 1},{y(peak)}", f"{px + 1},{y(last)}"]
        level = last
    pts.append(f"{WIDTH - RIGHT},{y(level)}")
    return (f'<svg width="{WIDTH}" height="{h + 20}" role="img" aria-label="queued for memory">'
            f'<rect x="{LEFT}" y="0" width="{WIDTH - LEFT - RIGHT}" height="{h}" fill="#fafafa" stroke="#ddd"/>'
            f'{_time_axis(end, h)}<text x="{LEFT - 4}" y="10" text-anchor="end">{top}</text>'
            f'<polyline fill="none" stroke="#d62728" points="{" ".join(pts)}"/></svg>')


def section(results: Sequence[PolicyResult], box: Box, *, title: str, slo_s: float) -> str:
    """One run's part of a page: the box, the table, the TTFT distributions, and per policy each
    GPU's memory and the queue."""
    end = max((r.end_s for r in results), default=0.0) or 1.0
    names = list(results[0].per_deployment) if results else []
    colors = {name: color(i) for i, name in enumerate(names)}
    head = [f"SLO ≤{slo_s:g} s" if h == "SLO met" else h for h in HEADER]
    table = ('<div class="wide"><table><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
             + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in rows(results, slo_s)) + "</table></div>")
    legend = "".join(f'<span><i style="background:{c}"></i>{html.escape(n)}</span>' for n, c in colors.items())
    body = [f"<h1>{html.escape(title)}</h1>",
            f"<p>{len(box.gpus)} GPUs ({', '.join(f'{g:g}' for g in box.gpus)} GiB), {box.host_gib:g} GiB of host "
            f"memory; the replay ran {end / 3600:.2f} h of virtual time.</p>", table,
            "<h2>Time to first token</h2><p>The share of all requests served within each TTFT "
            "(log scale); a refused request is never served.</p>", cdf_chart(results, slo_s)]
    for r in results:
        body.append(f"<h2>{html.escape(r.policy.name)}: memory by GPU</h2><div class=\"legend\">{legend}</div>")
        body += [gpu_chart(r, g, size, end, colors, axis=g == len(box.gpus) - 1) for g, size in enumerate(box.gpus)]
        body.append("<h3>Requests queued for memory</h3>" + queue_chart(r, end))
    return "".join(body)


def document(title: str, sections: Sequence[str]) -> str:
    """The page: its sections, with the style inline."""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")
