"""The replay's set-up: the box mix (bench/box-mix.toml), its three traces (bench/traces/), the
two boxes, the SLO, and one trace replayed under policies on a box, timed."""
from __future__ import annotations

import resource
import time
from pathlib import Path

from ondemand.replay.run import replay
from ondemand.replay.trace import Trace
from ondemand.replay.types import Box, Policy, PolicyResult, Replayed

ROOT = Path(__file__).resolve().parent.parent.parent
MIX = ROOT / "bench" / "box-mix.toml"
TRACES = {"code": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_code.csv",
          "conv": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_conv.csv",
          "servegen": ROOT / "bench" / "traces" / "servegen_language_7d.csv"}
TITLES = {"code": "Azure LLM inference trace 2023, code", "conv": "Azure LLM inference trace 2023, conv",
          "servegen": "ServeGen, 16 clients, a week"}
BOXES = {"dgx": Box(gpus=(80.0,) * 8, host_gib=2048),  # a DGX H100: 8 x 80 GiB, 2 TiB of host memory
         "16x80": Box(gpus=(80.0,) * 16, host_gib=2048)}  # where always-on fits: 1045 GiB booked on 1280
BOX = BOXES["dgx"]
ROOMY = BOXES["16x80"]
SLO_S = 5.0


def known(policies: tuple[str, ...]) -> tuple[str, ...]:
    """The policies this tree can replay (``cost`` and ``clairvoyant`` come with their issues)."""
    out = []
    for name in policies:
        try:
            Policy.parse(name)
        except ValueError:
            continue
        out.append(name)
    return tuple(out)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(name: str, deps: list[Replayed], policies: tuple[str, ...], *, box: Box = BOX, seed: int = 0
        ) -> tuple[list[PolicyResult], dict[str, float]]:
    """The trace under ``policies`` on ``box`` (``seed``: how rows without a model column go to
    the deployments; 0 for the committed tables)."""
    trace = Trace(str(TRACES[name]), deps, seed=seed)
    summary = trace.check()
    wall, cpu = time.monotonic(), time.process_time()
    results = replay(trace, deps, box, [Policy.parse(p) for p in policies], slo_s=SLO_S)
    took = {"wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu, "rss_mib": peak_rss_mib(),
            "requests": summary.requests, "models": len(summary.models)}
    return results, took
