"""A cold start's phases, read from its engine's log, and the ETA they give.

A start goes through ``container`` (creating and starting the container or process: from the
move to ``starting``), ``process`` (the engine's process is up: the backend's start returned),
``weights`` (loading weights), ``compile`` (torch.compile, CUDA-graph capture, warm-up: from the
line that ends the weights' load) and ``serving`` (the API server starts; readiness checks run),
until ready. The last three come from the engine's own lines (``RULES``: vLLM's on a GPU and on
the CPU, SGLang's, llama.cpp's); a phase may be skipped (an engine that logs no compile), and an
engine that logs none stays in ``process`` until ready.

Pure: ``PhaseReader`` is fed the log's chunks as they come (a line may arrive in pieces, and
interleave with any other line) and says which phases they entered; ``Timeline`` is one start's
phases and when each began; ``PhaseHistory`` keeps each deployment's recorded phase durations
and gives the ETA: the remaining phases' medians, re-anchored when a phase begins. A deployment
none of whose starts showed a logged phase has no phase ETA (None): its single ETA stays.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping

PHASES = ("container", "process", "weights", "compile", "serving")
LOGGED = frozenset({"weights", "compile", "serving"})  # read from the engine's log lines
ETA_OF = 5  # the ETA is of the medians of this many last starts, as the single ETA is

# The lines that enter each logged phase (a substring of the line; case matters). A line that
# names a later phase than another rule wins: "Loading weights took" ends the weights' load.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("serving", (
        "Starting vLLM API server", "Starting vLLM server on", "Application startup complete",  # vLLM
        "Uvicorn running on", "The server is fired up and ready to roll",  # SGLang
        "server is listening on", "all slots are idle",  # llama.cpp
    )),
    ("compile", (
        "Loading weights took", "Model loading took", "Loading model weights took", "torch.compile takes",
        "Graph capturing finished", "Warming up model for the compilation",
        "init engine (profile, create kv cache, warmup model) took",  # vLLM, GPU and CPU
        "Load weight end", "Capture cuda graph begin", "Capture cuda graph end",  # SGLang
        "warming up the model",  # llama.cpp (common_init_from_params)
    )),
    ("weights", (
        "Starting to load model", "Loading safetensors checkpoint shards", "Loading model from scratch",  # vLLM
        "Load weight begin",  # SGLang
        "llama_model_loader: loaded meta data", "load_tensors:",  # llama.cpp
    )),
)
MAX_LINE = 64 * 1024  # a line is looked at in its first 64 KiB; the rest is dropped


def phase_of(line: str) -> str | None:
    """The logged phase ``line`` enters, or None."""
    for phase, needles in RULES:
        if any(n in line for n in needles):
            return phase
    return None


def later(phase: str, than: str | None) -> bool:
    return than is None or PHASES.index(phase) > PHASES.index(than)


class PhaseReader:
    """Reads a log's chunks into the logged phases they enter, only ever forward.

    ``reset_on``: a line that begins a new run of the engine (the process backend's marker),
    after which the phases are read anew: a tail that holds earlier runs gives only the last's."""

    def __init__(self, reset_on: str | None = None):
        self.reset_on = reset_on
        self.phase: str | None = None
        self._partial = bytearray()
        self._dropping = False  # the partial line is past MAX_LINE: the rest of it is dropped

    def feed(self, chunk: bytes) -> list[str]:
        """The phases the complete lines in ``chunk`` (and what came before it) entered, in order."""
        entered: list[str] = []
        start = 0
        while True:
            end = _line_end(chunk, start)
            if end < 0:
                self._keep(chunk[start:])
                return entered
            self._keep(chunk[start:end])
            line = self._partial.decode("utf-8", "replace")
            self._partial.clear()
            self._dropping = False
            start = end + 1
            if self.reset_on is not None and line.startswith(self.reset_on):
                self.phase = None
                entered.clear()  # an earlier run's phases say nothing of this one
                continue
            found = phase_of(line)
            if found is not None and later(found, self.phase):
                self.phase = found
                entered.append(found)

    def _keep(self, piece: bytes) -> None:
        if self._dropping:
            return
        room = MAX_LINE - len(self._partial)
        self._partial += piece[:room]
        self._dropping = len(piece) > room


def _line_end(chunk: bytes, start: int) -> int:
    """The index of the next line end (\\n, or the \\r of a progress bar's redraw) at or after start."""
    ends = [i for i in (chunk.find(b"\n", start), chunk.find(b"\r", start)) if i >= 0]
    return min(ends) if ends else -1


@dataclasses.dataclass
class Timeline:
    """One cold start's phases: (phase, when it began), in order; began at the first."""
    began: float
    estimate_s: float | None = None  # the ETA given at the start's beginning (for its error)
    phases: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.phases:
            self.phases.append(("container", self.began))

    @property
    def phase(self) -> str:
        return self.phases[-1][0]

    def enter(self, phase: str, at: float) -> bool:
        """Move to ``phase`` at ``at``, if it is later than the current one."""
        if not later(phase, self.phase):
            return False
        self.phases.append((phase, max(at, self.phases[-1][1])))
        return True

    def durations(self, ended: float) -> dict[str, float]:
        """How long each phase it went through took, the last until ``ended``."""
        out = {}
        for (phase, at), (_, nxt) in zip(self.phases, [*self.phases[1:], ("", ended)], strict=True):
            out[phase] = max(0.0, nxt - at)
        return out


class PhaseHistory:
    """Each deployment's recorded phase durations: the last ETA_OF starts' of each phase."""

    def __init__(self) -> None:
        self._durations: dict[int, dict[str, list[float]]] = {}

    def record(self, dep_id: int, durations: Mapping[str, float]) -> None:
        kept = self._durations.setdefault(dep_id, {})
        for phase, seconds in durations.items():
            row = kept.setdefault(phase, [])
            row.append(seconds)
            del row[:-ETA_OF]

    def forget(self, dep_id: int) -> None:
        self._durations.pop(dep_id, None)

    def medians(self, dep_id: int) -> dict[str, float]:
        """Each phase's median, for a deployment whose starts showed a logged phase; else {}."""
        kept = self._durations.get(dep_id, {})
        if not LOGGED & kept.keys():
            return {}
        return {phase: statistics.median(row) for phase, row in kept.items() if row}

    def eta_s(self, dep_id: int, timeline: Timeline | None, now: float) -> float | None:
        """What is left of the start: the current phase's median less its time so far (at
        least 0), plus the medians of the phases after it. None when it has no phase medians.
        Without a timeline: the whole start's (the sum of the medians)."""
        medians = self.medians(dep_id)
        if not medians:
            return None
        if timeline is None:
            return sum(medians.values())
        phase, at = timeline.phases[-1]
        left = max(0.0, medians.get(phase, 0.0) - (now - at))
        return left + sum(s for p, s in medians.items() if later(p, phase))

    def bars(self, dep_id: int, timeline: Timeline | None, now: float) -> list[dict[str, object]]:
        """The view's ``start_phases``: each phase of the start or of its medians, in order, with its
        expected seconds (its median, or None), its seconds so far, and whether it is done."""
        medians = self.medians(dep_id)
        seen = dict(timeline.phases) if timeline is not None else {}
        current = timeline.phase if timeline is not None else None
        out: list[dict[str, object]] = []
        for phase in PHASES:
            if phase not in medians and phase not in seen:
                continue
            if phase in seen:
                nxt = [at for p, at in timeline.phases if later(p, phase)] if timeline is not None else []
                elapsed = (nxt[0] if nxt else now) - seen[phase]
            else:
                elapsed = 0.0
            passed = phase in seen or (current is not None and later(current, phase))  # gone through, or skipped
            out.append({"phase": phase, "expected_s": _round(medians.get(phase)),
                        "elapsed_s": round(max(0.0, elapsed), 1), "done": phase != current and passed})
        return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
