"""Tiered warmth through the admin API (issue 22): ``idle_action`` on creation, dry run and
edit; the sleep route's level; a wake; ``host_memory`` in ``/api/host``. A real server
(process backend) with engine-simulator deployments."""
import time

import aiohttp
import pytest
from helpers import sim_command, wait_for

GIB_KIB = 1024 * 1024


async def api(server, method, path, body=None):
    conn = aiohttp.UnixConnector(path=str(server.cfg.admin_socket))
    url = f"http://ondemand{server.cfg.base_path}/api{path}"
    async with aiohttp.ClientSession(connector=conn) as s, s.request(method, url, json=body) as r:
        return r.status, await r.json()


async def sim_state(server, dep_id):
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep_id) + "/_sim/state") as r:
        return await r.json()


def sleeper(name="a", *sim_args, **kw):
    """A vLLM deployment without a recipe (the simulator as its command) that may sleep."""
    body = {"name": name, "engine": "vllm", "command": sim_command(name, *sim_args), "memory_gib": 4,
            "mode": "on_demand", "idle_action": "sleep"}
    body.update(kw)
    return body


def meminfo(path, total_gib, available_gib):
    path.write_text(f"MemTotal: {int(total_gib * GIB_KIB)} kB\nMemFree: 1000 kB\n"
                    f"MemAvailable: {int(available_gib * GIB_KIB)} kB\n")
    return str(path)


async def audit_count(server):
    return len(await server.deployer.store.audit(limit=1000))


async def test_create_and_dry_run_with_idle_action(server):
    status, view = await api(server, "POST", "/deployments", sleeper("a", idle_action="sleep2"))
    assert status == 201 and view["idle_action"] == "sleep2" and view["sleep_level"] is None
    assert server.deployer.get(view["id"]).idle_action.value == "sleep2"
    status, view = await api(server, "POST", "/deployments", sleeper("b", idle_action=None))
    assert status == 400  # null is no value: leave it out for auto
    body = sleeper("c")
    del body["idle_action"]
    status, view = await api(server, "POST", "/deployments", body)
    assert status == 201 and view["idle_action"] == "auto"
    # sglang: both sleeps; a recipe's flags follow the level (dry run: nothing written)
    n = len(server.deployer.all())
    recipe = {"name": "q", "engine": "sglang", "model": "Qwen/Qwen3-8B", "memory_gib": 4, "mode": "on_demand"}
    for action, level, backup in (("sleep2", 2, False), ("sleep", 1, True), ("auto", 0, False), ("stop", 0, False)):
        status, view = await api(server, "POST", "/deployments?dry_run=1", {**recipe, "idle_action": action})
        assert status == 200 and view["dry_run"] is True and view["idle_action"] == action, view
        assert view["idle_level"] == level  # auto on one pool (static, no gpu_capacity_gib): a stop
        assert ("--enable-memory-saver" in view["argv"]) is (level > 0)
        assert ("--enable-weights-cpu-backup" in view["argv"]) is backup
    status, view = await api(server, "POST", "/deployments?dry_run=1",
                             {**recipe, "engine": "vllm", "idle_action": "sleep2"})
    assert status == 200 and "--enable-sleep-mode" in view["argv"] and "VLLM_SERVER_DEV_MODE" in view["env_names"]
    assert len(server.deployer.all()) == n


@pytest.mark.parametrize("engine, action", [("llamacpp", "sleep"), ("llamacpp", "sleep2"), ("custom", "sleep"),
                                            ("custom", "sleep2"), ("vllm", "hibernate"), ("vllm", 1),
                                            ("sglang", "SLEEP")])
async def test_idle_action_refused_names_the_field_and_writes_nothing(server, engine, action):
    before = await audit_count(server)
    for query in ("", "?dry_run=1"):
        status, err = await api(server, "POST", "/deployments" + query,
                                sleeper("a", engine=engine, idle_action=action))
        assert status == 400 and err["error"]["code"] == "invalid_field", err
        assert err["error"]["message"].startswith("idle_action:")
    assert server.deployer.all() == [] and await server.deployer.store.deployments() == []
    assert await audit_count(server) == before


@pytest.mark.parametrize("engine", ["llamacpp", "custom"])
async def test_engines_without_a_sleep_api_may_stop(server, engine):
    for action in ("auto", "stop"):
        status, view = await api(server, "POST", "/deployments", sleeper(f"{engine}-{action}", engine=engine,
                                                                        idle_action=action))
        assert status == 201 and view["idle_action"] == action


async def test_edit_idle_action(server):
    _, view = await api(server, "POST", "/deployments", sleeper("a"))
    i = view["id"]
    status, view = await api(server, "PATCH", f"/deployments/{i}", {"idle_action": "sleep2"})
    assert status == 200 and view["idle_action"] == "sleep2"
    (row,) = [r for r in await server.deployer.store.audit(i) if r["action"] == "deployment_update"]
    assert row["detail"] == {"old": {"idle_action": "sleep"}, "new": {"idle_action": "sleep2"}}
    # refused: a bad value; a sleep on an engine without a sleep API, either way round
    before = server.deployer.get(i).as_dict()
    for body in ({"idle_action": "nap"}, {"engine": "llamacpp"}, {"engine": "custom", "idle_action": "sleep"}):
        status, err = await api(server, "PATCH", f"/deployments/{i}", body)
        assert status == 400 and err["error"]["message"].startswith("idle_action:"), (body, err)
    assert server.deployer.get(i).as_dict() == before
    status, view = await api(server, "PATCH", f"/deployments/{i}", {"engine": "llamacpp", "idle_action": "stop"})
    assert status == 200 and (view["engine"], view["idle_action"]) == ("llamacpp", "stop")
    await api(server, "PATCH", f"/deployments/{i}", {"engine": "vllm", "idle_action": "sleep"})
    # it changes the engine's flags: not while the engine runs
    status, _ = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200
    status, err = await api(server, "PATCH", f"/deployments/{i}", {"idle_action": "stop"})
    assert status == 409 and err["error"]["code"] == "deployment_busy"
    assert server.deployer.get(i).idle_action.value == "sleep"


async def test_sleep_at_level_2_and_wake(server):
    _, view = await api(server, "POST", "/deployments", sleeper("a"))
    i = view["id"]
    status, view = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200 and view["state"] == "ready" and view["wake_check"]  # recorded: it may sleep
    status, view = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 2})
    assert status == 200 and (view["state"], view["sleep_level"]) == ("asleep", 2), view
    state = await sim_state(server, i)
    assert state["level"] == 2 and state["sleeping"] == {"weights": True, "kv_cache": True}
    # asleep already: 409, nothing changes
    status, err = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})
    assert status == 409 and err["error"]["code"] == "invalid_state"
    status, view = await api(server, "POST", f"/deployments/{i}/wake?wait=1")
    assert status == 200 and view["state"] == "ready" and view["sleep_level"] is None, view
    state = await sim_state(server, i)
    assert state["level"] == 0 and not state["garbage"] and state["wakes"] >= 1
    async with aiohttp.ClientSession() as s:  # the weights came back: the engine answers as before
        async with s.post(view["base_url"] + "/v1/completions",
                          json={"model": "a", "prompt": "The capital of France is", "max_tokens": 1}) as r:
            assert (await r.json())["choices"][0]["text"] == view["wake_check"]
    assert not [r for r in await server.deployer.store.audit(i) if r["action"] == "ondemand_wake_failed"]
    # no level: its idle_action's (sleep2 here)
    await api(server, "POST", f"/deployments/{i}/stop")
    await api(server, "PATCH", f"/deployments/{i}", {"idle_action": "sleep2"})
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep")
    assert status == 200 and view["sleep_level"] == 2


async def test_sleep_refused_without_a_sleep_api(server):
    _, view = await api(server, "POST", "/deployments", sleeper("a", engine="custom", idle_action="stop"))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, err = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})
    assert status == 409 and err["error"]["code"] == "invalid_state" and "no sleep mode" in err["error"]["message"]
    assert server.state(i) == "ready"


async def test_host_reserve_turns_level_1_into_level_2(server, tmp_path):
    # 20 GiB available, a 16 GiB reserve: a level-1 sleep predicted at memory_gib (8) would leave 12
    server.deployer.budget.meminfo_path = meminfo(tmp_path / "meminfo", 64, 20)
    _, view = await api(server, "POST", "/deployments", sleeper("a", memory_gib=8))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})
    assert status == 200 and (view["state"], view["sleep_level"]) == ("asleep", 2), view
    assert (await sim_state(server, i))["level"] == 2
    _, events = await api(server, "GET", f"/deployments/{i}/events")
    assert any("host memory" in e["text"] and "level 2" in e["text"] for e in events)


async def test_host_memory_in_host(server, tmp_path):
    server.deployer.budget.meminfo_path = "/proc/meminfo"  # this box's own, not the tests' plenty
    _, host = await api(server, "GET", "/host")
    hm = host["host_memory"]
    assert set(hm) == {"total_gib", "available_gib", "asleep_gib", "reserve_gib"}
    assert hm["total_gib"] > 0 and 0 <= hm["available_gib"] <= hm["total_gib"]  # this box's /proc/meminfo
    assert (hm["asleep_gib"], hm["reserve_gib"]) == (0, 16.0)
    server.deployer.budget.meminfo_path = meminfo(tmp_path / "meminfo", 64, 48)
    _, view = await api(server, "POST", "/deployments", sleeper("a", "--host-mib", "64", memory_gib=1))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    _, view = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})
    assert view["sleep_level"] == 1
    await wait_for(lambda: server.deployer.get(i).host_gib is not None, what="the sleeper's host memory measured")
    host_gib = server.deployer.get(i).host_gib
    assert host_gib >= 64 / 1024  # its process really holds the weights' copy
    _, host = await api(server, "GET", "/host")
    assert host["host_memory"] == {"total_gib": 64.0, "available_gib": 48.0, "asleep_gib": host_gib,
                                   "reserve_gib": 16.0}
    await api(server, "POST", f"/deployments/{i}/stop")
    server.deployer.budget.meminfo_path = str(tmp_path / "nothing-here")
    _, host = await api(server, "GET", "/host")
    assert host["host_memory"] == {"total_gib": None, "available_gib": None, "asleep_gib": 0, "reserve_gib": 16.0}


async def test_sglang_sleeps_at_the_level_its_flags_chose(server):
    _, view = await api(server, "POST", "/deployments",
                        sleeper("a", "--flavor", "sglang", engine="sglang", idle_action="sleep2"))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})
    # refused, or put to sleep at the level the engine really sleeps at
    assert status == 409 or view["sleep_level"] == (await sim_state(server, i))["level"] == 2, view
    if status == 200:
        status, view = await api(server, "POST", f"/deployments/{i}/wake?wait=1")
        assert status == 200 and view["state"] == "ready"
        assert not [r for r in await server.deployer.store.audit(i) if r["action"] == "ondemand_wake_failed"]


async def test_views_say_the_effective_idle_level(server):
    _, a = await api(server, "POST", "/deployments", sleeper("a", idle_action="sleep2"))
    _, b = await api(server, "POST", "/deployments", sleeper("b", idle_action="auto"))
    assert (a["idle_level"], b["idle_level"]) == (2, 0)  # auto without a recipe: a stop
    _, views = await api(server, "GET", "/deployments")
    assert [v["idle_level"] for v in views] == [2, 0]


@pytest.mark.server(**{"deployer.wake_timeout_s": 1})
@pytest.mark.parametrize("fail, result", [("wake-garbage", "mismatch"), ("wake-hangs", "failed"),
                                          ("wake-fails", "failed")])
async def test_a_failed_wake_starts_cold(server, fail, result):
    _, view = await api(server, "POST", "/deployments", sleeper("a", "--fail", fail))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    _, view = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})
    assert view["sleep_level"] == 1
    t = time.monotonic()
    status, view = await api(server, "POST", f"/deployments/{i}/wake?wait=1")
    took = time.monotonic() - t
    assert status == 200 and view["state"] == "ready" and view["sleep_level"] is None, view
    state = await sim_state(server, i)  # a new engine (it never slept), awake and sound
    assert (state["level"], state["garbage"], state["sleeps"]) == (0, False, 0), state
    (row,) = [r for r in await server.deployer.store.audit(i) if r["action"] == "ondemand_wake_failed"]
    assert row["detail"]["result"] == result and row["detail"]["level"] == 1 and row["actor"] == "ondemand"
    # The cold start is stored and published as one, without the level: the start history
    # times it from there (a hung wake's second is not in it) and records no wake.
    events = [e["text"] for e in await server.deployer.store.events(i)]  # newest first
    assert events.index("starting cold after the failed wake from sleep level 1") < events.index(row["text"])
    rows = await wait_for(lambda: _starts_of(server, i, 2), what="the two cold starts recorded")
    assert [(kind, level) for kind, _, level in rows] == [("start", None), ("start", None)], rows
    async def slept():  # the administrator's sleep, its call timed (written by a task of its own)
        return [(kind, level) for kind, _, level in (await server.deployer.store.starts(20))[i] if kind == "sleep"]
    assert await wait_for(slept, what="the sleep in the state file") == [("sleep", 1)]
    if fail == "wake-hangs":
        assert rows[-1][1] < took - 1.0, (rows, took)  # wake_timeout_s is 1 s


async def _starts_of(server, dep_id: int, n: int):
    """Its cold starts and wakes (not its sleeps), once there are ``n``."""
    rows = [r for r in (await server.deployer.store.starts(20)).get(dep_id, []) if r[0] != "sleep"]
    return rows if len(rows) >= n else None  # more than n: the assertion after it shows them


async def test_an_edit_that_makes_another_engine_forgets_its_sleep_measurements(server):
    _, view = await api(server, "POST", "/deployments", sleeper("a"))
    i = view["id"]
    await server.deployer.update(i, sleep_host_gib=2.0, asleep_gib=0.5)  # as a past sleep measured them
    status, view = await api(server, "PATCH", f"/deployments/{i}", {"memory_gib": 60})
    assert status == 200
    dep = server.deployer.get(i)
    assert (dep.sleep_host_gib, dep.asleep_gib) == (None, None)  # the prediction is memory_gib again: 60
