"""The world a LiteLLM sync reads and the double it writes to, for tests/litellm/: the deployments,
the key and the engines' addresses (``World``), the sync and the client made for the LiteLLM
admin-API double (tests/litellm_double.py), deployment rows and reading the double's entries back."""
from __future__ import annotations

import asyncio
import copy
import hashlib

from ondemand.litellm.client import LiteLLMClient
from ondemand.litellm.sync import LiteLLMSync

MASTER = "sk-master"
INTERNAL = "http://dgxmm:8090/dgxmm"
INTERNAL_B = "http://box-b:8090/dgxmm"
BOX = "box-a"


def fp(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def dep(dep_id: int, name: str, *, mode: str | None = "on_demand", state: str = "stopped",
        role: str = "model", served_name: str | None = None) -> dict:
    return {"id": dep_id, "name": name, "served_name": served_name or f"{name}-served",
            "engine": "vllm", "state": state, "mode": mode, "role": role}


class World:
    """The deployments, key and engine addresses the sync reads."""

    def __init__(self, *deps: dict, key: str | None = "key-one"):
        self.deployments = list(deps)
        self.key = key
        self.addresses: dict[int, str] = {}
        self.delay = 0.0
        self.syncs = 0
        self.running = 0
        self.max_running = 0
        self.started = asyncio.Event()

    async def list_deployments(self) -> list[dict]:
        self.syncs += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.started.set()
        try:
            if self.delay:
                await asyncio.sleep(self.delay)  # a slow deployment listing: the behaviour under test
            return copy.deepcopy(self.deployments)
        finally:
            self.running -= 1

    def current_key(self) -> str | None:
        return self.key

    def engine_base_url(self, d: dict) -> str | None:
        return self.addresses.get(d["id"])

    def set(self, dep_id: int, **fields) -> None:
        next(d for d in self.deployments if d["id"] == dep_id).update(fields)


def make_client(double) -> LiteLLMClient:
    return LiteLLMClient(double.url, MASTER, timeout_s=2.0, verify_attempts=2, verify_delay_s=0.01)


def make_sync(double, world: World, *, queue_timeout_s: int = 900, interval_s: float = 60.0,
              instance: str = BOX, internal_url: str = INTERNAL, client: LiteLLMClient | None = None) -> LiteLLMSync:
    """The sync of ``world`` to the double; ``client``: the LiteLLM client it uses (a new one)."""
    return LiteLLMSync(client=client if client is not None else make_client(double), internal_url=internal_url,
                       queue_timeout_s=queue_timeout_s, list_deployments=world.list_deployments,
                       current_key=world.current_key, engine_base_url=world.engine_base_url,
                       interval_s=interval_s, instance=instance)


def by_dgxmm_id(double) -> dict:
    out: dict = {}
    for m in double.models:
        if "dgxmm_id" in m["model_info"]:
            out.setdefault(m["model_info"]["dgxmm_id"], []).append(m)
    return out


def assert_adds_before_deletes(calls) -> None:
    writes = [path for method, path, _ in calls if method == "POST"]
    assert "/model/new" in writes and "/model/delete" in writes
    assert max(i for i, p in enumerate(writes) if p == "/model/new") < \
        min(i for i, p in enumerate(writes) if p == "/model/delete"), writes


def warmth(double) -> tuple:
    (m,) = double.models
    return m["model_info"]["id"], m["litellm_params"]["order"], m["model_info"]["dgxmm_state"]
