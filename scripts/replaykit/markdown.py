"""What the replay's scripts write: each table into bench/replay.md between its markers (the words
around them are kept), and a policy's rows by deployment."""
from __future__ import annotations

import re

from ondemand.replay import report
from ondemand.replay.types import PolicyResult

from .mix import ROOT


def per_deployment(result: PolicyResult) -> str:
    """Where requests failed or waited, by deployment: one policy's rows."""
    lines = ["| deployment | requests | wait ≤ SLO | timed out | refused | wait p99 | wake | cold | queue | "
             "cold starts | wakes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dep, tally in result.per_deployment.items():
        j = report.tally_json(tally)
        p99 = j["wait_s"]["p99"]
        lines.append(f"| {dep} | {j['requests']} | {100 * j['wait_slo_met']:.1f} % | {j['timed_out']} | "
                     f"{j['refused']} | {'-' if p99 is None else f'{p99:.1f} s'} | {j['waited']['wake']} | "
                     f"{j['waited']['cold']} | {j['waited']['queue']} | {j['cold_starts']} | {j['wakes']} |")
    return "\n".join(lines) + "\n"


def write_md(sections: dict[str, str]) -> None:
    path = ROOT / "bench" / "replay.md"
    text = path.read_text()
    for name, body in sections.items():
        begin, end = f"<!-- replay:{name} -->", f"<!-- /replay:{name} -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        m = pattern.search(text)
        if m is None:
            raise SystemExit(f"{path}: no {begin} ... {end} markers")
        text = text[:m.start()] + f"{begin}\n{body}{end}" + text[m.end():]
    path.write_text(text)
