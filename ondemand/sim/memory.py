"""Sleep and wake, and the memory they move: the state of the two parts that sleep (vLLM's
sleep mode, SGLang's memory saver; engine's doc says both), their routes, the host memory a
level 1 sleep really holds (``--host-mib``), and this process's file for the fake nvidia-smi
(``--gpu-mib``, ``--sleep-gpu-mib``)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import orjson

from .faults import wake_fault
from .options import SimOptions
from .record import Journal
from .replies import Reply, SimError, answer, empty
from .server import Request

PARTS = ("weights", "kv_cache")  # what sleeps, as vLLM's wake_up tags name them


def hold(mib: int) -> bytearray | None:
    """``mib`` MiB of host memory, every page touched so that the RSS really grows."""
    if mib <= 0:
        return None
    b = bytearray(mib << 20)
    b[::4096] = b"\x01" * (len(b) // 4096)
    return b


def visible_gpus(env: str | None) -> list[int]:
    """The GPU indices in ``$CUDA_VISIBLE_DEVICES``: GPU 0 when unset, none when empty;
    like CUDA, the list ends at the first entry that is not an index."""
    if env is None:
        return [0]
    gpus: list[int] = []
    for item in env.split(","):
        item = item.strip()
        if not item.isdigit():
            break
        gpus.append(int(item))
    return gpus


def claim_gpu_memory(opts: SimOptions, mib: int | None = None) -> str | None:
    """Write this process's file for the fake nvidia-smi (see engine's doc), saying
    ``mib`` MiB per GPU (default ``opts.gpu_mib``), and return its path, or None when
    there is nothing to claim."""
    apps = os.environ.get("FAKE_NVIDIA_SMI_APPS")
    gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not opts.gpu_mib or not apps or not gpus:
        return None
    os.makedirs(apps, exist_ok=True)
    path = os.path.join(apps, str(os.getpid()))
    tmp = os.path.join(apps, f".{os.getpid()}.tmp")  # atomic: the fake never reads half a file
    with open(tmp, "w") as f:
        f.writelines(f"{gpu} {opts.gpu_mib if mib is None else mib}\n" for gpu in gpus)
    os.replace(tmp, path)
    return path


class Memory:
    """How the engine sleeps, and vLLM's and SGLang's routes for it (``routes.router``
    adds the flavor's)."""

    def __init__(self, opts: SimOptions, journal: Journal):
        self.opts = opts
        self.journal = journal
        self.asleep = dict.fromkeys(PARTS, False)
        self.sleep_level = 0  # 0 while both parts are awake
        self.dropped = False  # a level 2 sleep dropped the weights; a reload ends it
        self.poisoned = False  # --fail wake-garbage, after a wake: garbage for good
        self.host_mem: bytearray | None = None  # the weights' host copy (--host-mib) while asleep at level 1
        self.sleeps = self.wakes = 0
        self.lock = asyncio.Lock()  # one sleep, wake or reload at a time
        self.gpu_file: str | None = None  # this process's file for the fake nvidia-smi (serve sets it)

    @property
    def sleeping(self) -> bool:
        return any(self.asleep.values())

    @property
    def garbage(self) -> bool:
        """Whether the weights in GPU memory are not the model's (generation answers garbage)."""
        return self.dropped or self.poisoned

    # -- the state -------------------------------------------------------------------

    def _residue(self) -> None:
        """Rewrite this process's file for the fake nvidia-smi: --sleep-gpu-mib while asleep."""
        if self.gpu_file is not None:
            claim_gpu_memory(self.opts, self.opts.sleep_gpu_mib if self.sleeping else self.opts.gpu_mib)

    async def _sleep(self, level: int) -> None:
        async with self.lock:
            if self.sleeping and level <= self.sleep_level:
                return  # asleep already, as deep or deeper
            if self.opts.sleep_delay:
                await asyncio.sleep(self.opts.sleep_delay)
            self.asleep = dict.fromkeys(PARTS, True)
            self.sleep_level = level
            if level == 2:  # the weights are dropped, the host keeps no copy
                self.dropped, self.host_mem = True, None
            elif self.host_mem is None:
                self.host_mem = hold(self.opts.host_mib)
            self.sleeps += 1
            self._residue()
            self.journal.write("sleep", level=level)

    async def _wake(self, tags: Iterable[str]) -> None:
        async with self.lock:
            woken = [p for p in PARTS if p in tags and self.asleep[p]]
            if not woken:
                return
            if "weights" in woken and self.opts.wake_delay:
                await asyncio.sleep(self.opts.wake_delay)
            for p in woken:
                self.asleep[p] = False
            if "weights" in woken:
                self.host_mem = None  # back on the GPU: the host copy is freed
            if not self.sleeping:
                self.sleep_level = 0
            if self.opts.fail == "wake-garbage":
                self.poisoned = True
            self.wakes += 1
            self._residue()
            self.journal.write("wake", tags=woken)

    async def _reload(self) -> str | None:
        """Load the weights again (ends a level 2 sleep's garbage), or why not."""
        async with self.lock:
            if self.asleep["weights"]:
                return "the weights are asleep: wake them first"
            self.dropped = False
            return None

    # -- vLLM's routes ---------------------------------------------------------------

    async def sleep(self, request: Request) -> Reply:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            raise SimError(400, f"level must be 1 or 2, got {level!r}", param="level")
        await self._sleep(int(level))
        return empty()

    async def wake_up(self, request: Request) -> Reply:
        tags = request.query.getall("tags", [])
        unknown = [t for t in tags if t not in PARTS]
        if unknown:
            raise SimError(400, f"unknown tags {unknown}: the tags are {', '.join(PARTS)}", param="tags")
        fault = await wake_fault(self.opts.fail)
        if fault is not None:
            raise SimError(500, fault, "InternalServerError")
        await self._wake(tags or PARTS)
        return empty()

    async def is_sleeping(self, request: Request) -> Reply:
        return answer({"is_sleeping": self.sleeping})

    async def collective_rpc(self, request: Request) -> Reply:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise SimError(400, f"JSON decode error: {e}") from None
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            raise SimError(400, "Missing 'method' in request body", param="method")
        if method != "reload_weights":
            raise SimError(400, f"the simulator knows the method reload_weights only, not {method!r}",
                           param="method")
        why = await self._reload()
        if why is not None:
            raise SimError(400, why)
        return answer({"results": [None]})

    async def reset_prefix_cache(self, request: Request) -> Reply:
        return empty()

    # -- SGLang's routes -------------------------------------------------------------

    async def _sglang_body(self, request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            body = e
        if not isinstance(body, dict):  # FastAPI's validation error, as SGLang answers it
            message = "JSON decode error" if isinstance(body, Exception) else "Input should be an object"
            raise SimError(400, message, body={"object": "error", "message": message, "type": "Bad Request",
                                               "param": None, "code": 400})
        return body

    async def release_memory_occupation(self, request: Request) -> Reply:
        await self._sglang_body(request)
        await self._sleep(1 if self.opts.weights_cpu_backup else 2)
        return answer(None)

    async def resume_memory_occupation(self, request: Request) -> Reply:
        await self._sglang_body(request)
        fault = await wake_fault(self.opts.fail)
        if fault is not None:
            raise SimError(400, fault, body={"error": {"message": fault}})
        await self._wake(PARTS)
        return answer(None)

    async def update_weights_from_disk(self, request: Request) -> Reply:
        body = await self._sglang_body(request)
        if not isinstance(body.get("model_path"), str):
            message = "model_path: Field required"
            raise SimError(400, message, body={"object": "error", "message": message, "type": "Bad Request",
                                               "param": None, "code": 400})
        why = await self._reload()
        if why is not None:
            raise SimError(400, why, body={"success": False, "message": why, "num_paused_requests": 0})
        return answer({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    # -- the simulator's own route -----------------------------------------------------

    async def sim_state(self, request: Request) -> Reply:
        return answer({"sleeping": self.asleep, "level": self.sleep_level, "garbage": self.garbage,
                       "wakes": self.wakes, "sleeps": self.sleeps})
