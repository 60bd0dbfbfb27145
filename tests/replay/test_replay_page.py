"""A replay's page (ondemand/replay/page.py): one self-contained HTML file with its charts, from
a real replay's results (test_replay_report.py's); and the charts drawn to the pixel, from
timelines written by hand: of the memory's changes within one pixel the last stands, of the
queue's the most in it."""
from __future__ import annotations

import re

from test_replay_report import BOX, POLICIES, results

from ondemand.replay import page
from ondemand.replay.types import Policy, PolicyResult, Tally


def test_the_page_is_self_contained_with_its_charts():
    res = results()
    html = page.document("replay", [page.section(res, BOX, title="a trace", slo_s=5.0)])
    assert html.startswith("<!doctype html>") and html.endswith("</html>\n")
    assert not re.search(r"""(src|href)\s*=|url\(|https?://(?!www\.w3\.org)|@import""", html)
    assert html.count('aria-label="TTFT distribution"') == 1
    assert html.count('aria-label="GPU 0"') == html.count('aria-label="GPU 1"') == len(POLICIES)
    assert html.count('aria-label="queued for memory"') == len(POLICIES)
    assert "<title>a: 60 GiB</title>" in html  # a deployment's band names it and what it holds


def result(memory=(), queue=(), end_s=1000.0) -> PolicyResult:
    return PolicyResult(Policy.parse("current"), Tally(), {"a": Tally(), "b": Tally()}, end_s, list(memory),
                        list(queue))


def test_of_the_memorys_changes_within_one_pixel_the_last_stands_until_the_replays_end():
    """a holds 40 GiB then 10 GiB a tenth of a second later (a pixel is over a second here): the
    band says 10 GiB and runs to the right edge; b, on GPU 1, is not on GPU 0's chart."""
    r = result(memory=[(100.0, 0, "a", 40.0), (100.1, 0, "a", 10.0), (200.0, 1, "b", 20.0)])
    svg = page.gpu_chart(r, 0, 80.0, r.end_s, {"a": "red", "b": "blue"})
    assert re.findall(r"<title>(.*?)</title>", svg) == ["a: 10 GiB"]
    [(x, width)] = re.findall(r'<rect x="(\d+)" y="[\d.]+" width="(\d+)" height="[\d.]+" fill="red"', svg)
    assert int(x) + int(width) == page.WIDTH - page.RIGHT  # held until the replay ended
    assert "<title>b: 20 GiB</title>" in page.gpu_chart(r, 1, 80.0, r.end_s, {"a": "red", "b": "blue"})


def test_of_the_queues_changes_within_one_pixel_the_most_stands():
    """Three, then five, then one queued within a tenth of a second: the chart's scale is five and
    its line reaches the top there before it falls to one."""
    r = result(queue=[(0.0, 0), (100.0, 3), (100.05, 5), (100.1, 1)])
    svg = page.queue_chart(r, r.end_s)
    assert re.search(r'text-anchor="end">5</text>', svg)
    [points] = re.findall(r'points="([^"]+)"', svg)
    ys = [float(p.split(",")[1]) for p in points.split()]
    assert min(ys) == 0.0 and ys[-1] == page.QUEUE_HEIGHT * (1 - 1 / 5)
