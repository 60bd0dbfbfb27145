"""Property: an admin's field of any JSON type is checked, never a crash (admin/fields.py through
the real admin API). A ``PATCH /api/deployments/{id}`` of any editable field, with a value of any
type (numbers, booleans, strings, null, lists and objects, nested), on a stopped deployment, is
200 or 400 ``invalid_field`` naming that field, in the documented error form; after a 400 the
deployment (in memory and in the state file) is as it was. A ``gpu_ids`` of ``0`` was a 500."""
from __future__ import annotations

import asyncio
import os
import sqlite3
import urllib.error
import urllib.request

import orjson
from helpers import sim_command
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ondemand.admin.fields import EDITABLE

_N = os.environ.get("ONDEMAND_FUZZ_EXAMPLES")
EXAMPLES = int(_N) if _N else 300

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 1, -1, 65536, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 1.5, -0.5, 1e308]),
    st.text(max_size=12), st.sampled_from(["", "***", "a", "0", "vllm", "{port}", "/x:/y", "\x00", "\x85"]))
# Nested lists and objects of those (an object's keys are strings, as JSON's are).
VALUES = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)


def _patch(base: str, headers: dict[str, str], dep_id: int, body: dict) -> tuple[int, dict]:
    return _send("PATCH", f"{base}/api/deployments/{dep_id}", headers, body)


def _send(method: str, url: str, headers: dict[str, str], body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method, data=orjson.dumps(body),
                                 headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def _stored(db: str, dep_id: int) -> tuple:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT * FROM deployments WHERE id = ?", (dep_id,)).fetchone()


async def test_a_patch_of_any_type_is_200_or_400_naming_the_field(server):
    dep_id = await server.add("a", 4)
    await server.add("b", 4)  # a name another deployment holds: 409 name_taken, the one other answer
    db = str(server.cfg.db_path)
    headers = server.admin_headers()
    first = server.deployer.get(dep_id).as_dict()
    # Every example edits the same deployment as it was first: a field left changed by one
    # example could otherwise be named by the next one's refusal (a memory_gib over the box's
    # share once a model is set: a rule between two fields).
    baseline = {k: first[k] for k in EDITABLE}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(EDITABLE), VALUES)
    @example("gpu_ids", 0)  # the outside check's three (D2)
    @example("gpu_ids", 1.5)
    @example("gpu_ids", True)
    @example("gpu_ids", [0, 1])  # two GPUs on a one-pool budget: the refusal names gpu_ids, as sent
    @example("env", {"A": "***"})  # a masked secret sent back for a name that has none
    @example("command", [["ondemand"]])
    def one(field: str, value: object) -> None:
        before, stored = server.deployer.get(dep_id).as_dict(), _stored(db, dep_id)
        status, answer = _patch(server.url, headers, dep_id, {field: value})
        if status == 200:
            assert answer["id"] == dep_id and answer["state"] == "stopped", answer
            status, answer = _patch(server.url, headers, dep_id, baseline)
            assert status == 200, answer
            assert {k: v for k, v in server.deployer.get(dep_id).as_dict().items() if k != "updated_at"} == \
                {k: v for k, v in first.items() if k != "updated_at"}
            return
        if status == 409 and field == "name":
            assert answer["error"]["code"] == "name_taken", answer
        else:
            assert status == 400, (field, value, status, answer)
            assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "code"}, answer
            assert answer["error"]["code"] == "invalid_field" and answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["message"].startswith(f"{field}:"), (field, value, answer)
        assert server.deployer.get(dep_id).as_dict() == before and _stored(db, dep_id) == stored

    await asyncio.to_thread(one)


# What a creation takes besides the editable fields (mode: the route of its own on an edit).
CREATION_ONLY = ("mode", "start")


async def test_a_creation_of_any_type_is_201_or_400_naming_the_field(server):
    headers = server.admin_headers()

    def post(body: dict) -> tuple[int, dict]:
        return _send("POST", f"{server.url}/api/deployments", headers, body)

    def delete(dep_id: int) -> None:
        req = urllib.request.Request(f"{server.url}/api/deployments/{dep_id}", method="DELETE", headers=headers)
        urllib.request.urlopen(req, timeout=30).close()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(EDITABLE + CREATION_ONLY), VALUES)
    @example("gpu_ids", 0)
    @example("served_name", "a\x1bb")
    def one(field: str, value: object) -> None:
        body = {"name": "n", "command": sim_command("n"), "memory_gib": 4, "mode": "on_demand", "start": False,
                field: value}
        status, answer = post(body)
        if status == 201:
            delete(answer["id"])  # each example from an empty box
        else:
            assert status == 400, (field, value, status, answer)
            assert set(answer["error"]) == {"message", "type", "code"} and answer["error"]["code"] == "invalid_field"
            assert answer["error"]["message"].startswith(f"{field}:"), (field, value, answer)
        assert [d.name for d in server.deployer.all()] == []

    await asyncio.to_thread(one)


async def test_null_for_a_list_or_an_object_is_400_naming_it(server):
    """``env`` and ``volumes`` are an object and a list, as ``args`` and ``command`` are lists: null
    is none of them (an edit of ``{"env": null}`` was 200 and stored ``{}``; ``[]`` and ``{}``
    clear them). On an edit and at creation, nothing written."""
    dep_id = await server.add("a", 4, env={"X": "1"})
    db, headers = str(server.cfg.db_path), server.admin_headers()

    def check() -> None:
        before, stored = server.deployer.get(dep_id).as_dict(), _stored(db, dep_id)
        for field in ("env", "volumes", "args", "command"):
            for method, url, body in (
                    ("PATCH", f"{server.url}/api/deployments/{dep_id}", {field: None}),
                    ("POST", f"{server.url}/api/deployments", {"name": "n", "command": sim_command("n"), field: None})):
                status, answer = _send(method, url, headers, body)
                assert status == 400 and answer["error"]["code"] == "invalid_field", (method, field, answer)
                assert answer["error"]["message"].startswith(f"{field}:"), (method, field, answer)
        assert server.deployer.get(dep_id).as_dict() == before and _stored(db, dep_id) == stored
        assert [d.name for d in server.deployer.all()] == ["a"]
        status, answer = _patch(server.url, headers, dep_id, {"env": {}, "volumes": []})
        assert status == 200 and answer["env"] == {} and answer["volumes"] == [], answer

    await asyncio.to_thread(check)
