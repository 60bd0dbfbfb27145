"""The controller against the real deployer, process backend and engine simulator (what the real
effects do on their own: test_effects.py)."""
import asyncio
import contextlib
import random

import pytest
from helpers import controller_env, two_pools, wait_for

from ondemand.errors import OndemandError
from ondemand.model import State


async def code_of(coro):
    with pytest.raises(OndemandError) as exc:
        await coro
    return exc.value.code


async def test_ready_gives_a_slot_at_once_and_release_is_idempotent(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a")
        await env.start(a)
        c = env.controller
        slot = await env.acquire(a)
        assert c.inflight(a) == 1 and c.status(a)["phase"] == "serving"
        slot.release()
        slot.release()
        assert c.inflight(a) == 0 and c.status(a)["phase"] == "idle"
        async with await env.acquire(a):
            assert c.inflight(a) == 1
        assert c.inflight(a) == 0
        assert c.status(a)["last_request_at"] is not None


async def test_burst_of_first_requests_starts_once(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a", 10, "--startup-delay", "0.3")
        slots = await asyncio.gather(*(env.acquire(a) for _ in range(50)))
        assert env.controller.inflight(a) == 50
        for s in slots:
            s.release()
        audit = await store.audit(a)
        assert [r["action"] for r in audit] == ["ondemand_start"]
        assert audit[0]["actor"] == "ondemand" and audit[0]["user"] is None
        starts = [e for e in await store.events(a) if e["detail"].get("to") == "starting"]
        assert len(starts) == 1
        assert env.controller.waiting() == 0


async def test_queue_full_fails_at_once(tmp_path, store):
    async with controller_env(tmp_path, store, max_queued=3) as env:
        a = await env.add("a", 10, "--startup-delay", "1")
        waiters = [asyncio.ensure_future(env.acquire(a)) for _ in range(3)]
        await wait_for(lambda: env.controller.waiting() == 3)
        with pytest.raises(OndemandError) as exc:
            await env.acquire(a)
        assert exc.value.code == "ondemand_queue_full" and exc.value.headers["Retry-After"] == "60"
        for s in await asyncio.gather(*waiters):
            s.release()


async def test_deadline_counts_from_arrival(tmp_path, store):
    async with controller_env(tmp_path, store, queue_timeout_s=1) as env:
        a = await env.add("a", 10, "--startup-delay", "5")
        arrival = env.controller.clock() - 0.8  # the request arrived a while ago
        t0 = env.controller.clock()
        assert await code_of(env.acquire(a, arrival=arrival)) == "ondemand_queue_timeout"
        assert env.controller.clock() - t0 < 0.9  # ~0.2 s left of 1 s, not a whole second
        await env.effects_done()  # the audit row is written by an effect
        assert [r["action"] for r in await store.audit(a)][0] == "ondemand_queue_timeout"
        assert env.controller.waiting() == 0


async def test_asleep_is_woken(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a")
        await env.start(a)
        await env.deployer.sleep(a)
        async with await env.acquire(a):
            assert env.state(a) == "ready"
        assert "Woken for a request" in [e["text"] for e in await store.events(a)]


@pytest.mark.parametrize("how", ["starting_by_hand", "stopping", "pending_mode"])
async def test_states_that_wait_without_starting(tmp_path, store, how):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a", 10, "--startup-delay", "0.5", state="planned" if how == "planned" else "stopped")
        c = env.controller
        if how == "starting_by_hand":
            await env.deployer.admit_start(a, actor="admin")
        elif how == "pending_mode":
            await env.deployer.update(a, pending_mode="always_on")
        elif how == "stopping":
            await env.start(a)
            env.deployer.amend(a, state=State.STOPPING)  # as mid-stop
        waiter = asyncio.ensure_future(env.acquire(a))
        # Whatever could start it has run: the join, the queue's clock (driven here, not waited
        # for) and the effects they asked for.
        await wait_for(lambda: c.waiting(a) == 1, what="the request waiting")
        c.tick()
        await env.effects_done()
        assert not waiter.done()
        starts = [r for r in await store.audit(a) if r["action"] == "ondemand_start"]
        assert starts == []  # the controller started nothing itself
        if how == "starting_by_hand":
            (await waiter).release()
        else:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        assert c.waiting() == 0


async def test_does_not_fit_at_once(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=24) as env:
        big = await env.add("big", 30)
        assert await code_of(env.acquire(big)) == "does_not_fit"
        # always-on models shrink what on-demand ones can ever use
        ao = await env.add("ao", 16, mode="always_on")
        await env.start(ao)
        mid = await env.add("mid", 10)
        assert await code_of(env.acquire(mid)) == "does_not_fit"
        assert env.controller.waiting() == 0 and len(env.controller.queue) == 0


async def test_make_room_stops_lru_idle_victims(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=24) as env:
        a, b, x = await env.add("a", 8), await env.add("b", 8), await env.add("x", 12)
        await env.start(a)
        await env.start(b)
        (await env.acquire(b)).release()  # b used after a: a is least recently used
        env.skip(1.1)  # both idle for their full timeout
        await env.fresh_metrics()
        queued = []
        async with await env.acquire(x, on_queued=lambda: queued.append(1)):
            assert env.state(x) == "ready"
        assert env.state(a) == "stopped" and env.state(b) == "ready"
        sleeps = [r for r in await store.audit() if r["action"] == "ondemand_sleep"]
        assert len(sleeps) == 1 and sleeps[0]["deployment_id"] == a
        assert sleeps[0]["text"] == "Put to sleep to make room for X" and sleeps[0]["user"] is None
        assert queued == []  # make-room found its victim: no queued notice (only the queue gets one)


async def test_victims_must_be_idle_for_their_full_timeout(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=20, queue_timeout_s=30) as env:
        c = env.controller
        a, x = await env.add("a", 10, idle_timeout_s=2), await env.add("x", 12)
        await env.start(a)
        await env.fresh_metrics()
        t0 = c.clock()
        async with await env.acquire(x):
            waited = c.clock() - t0
        assert waited >= 1.5  # woke when a's idle timeout ran out, not after 15 s
        assert waited < 8
        assert env.state(a) == "stopped"


async def test_busy_engine_by_metrics_is_not_a_victim(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=20, queue_timeout_s=2) as env:
        a = await env.add("a", 10, "--token-delay", "0.2")
        x = await env.add("x", 12)
        await env.start(a)
        env.skip(1.1)
        async with two_pools() as s:
            # a request that reached the engine around the gateway keeps it busy
            body = {"model": "A", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with s.post(env.deployer.base_url(a) + "/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
                await env.fresh_metrics()
                assert not env.sampler.idle(a)
                assert await code_of(env.acquire(x)) == "ondemand_queue_timeout"
        assert env.state(a) == "ready"


async def test_all_victims_not_enough_stops_none(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=24, queue_timeout_s=1) as env:
        a, b, x = await env.add("a", 6), await env.add("b", 10), await env.add("x", 20)
        await env.start(a)
        await env.start(b)
        slot = await env.acquire(b)  # b is busy; a alone frees too little
        env.skip(1.1)
        await env.fresh_metrics()
        queued = []
        assert await code_of(env.acquire(x, on_queued=lambda: queued.append(1))) == "ondemand_queue_timeout"
        assert queued == [1]
        assert env.state(a) == "ready" and env.state(b) == "ready"
        slot.release()


async def test_memory_freed_for_the_head_is_not_taken_by_a_later_entry(tmp_path, store, fake_nvidia_smi):
    """Memory freed for the head is reserved for it (the queue on its own: test_queue.py): a later
    entry that fits in what is free now, but not beside the reservation, must wait."""
    from ondemand.control.budget import Budget
    smi = fake_nvidia_smi("20480, 10240")  # 20 GiB, v's 10 GiB in use
    budget = Budget("nvidia-smi", nvidia_smi=smi)
    async with controller_env(tmp_path, store, budget=budget, make_room_wait_s=0.3, queue_timeout_s=20) as env:
        c = env.controller
        v = await env.add("v", 10)
        x = await env.add("x", 15)
        y = await env.add("y", 12)
        await env.start(v)
        env.skip(1.1)
        await env.fresh_metrics()
        wx = asyncio.ensure_future(env.acquire(x))
        # v is stopped for x, but the GPU still reads as used (as nvidia-smi
        # does for a while): x stays queued, holding what was freed for it.
        await wait_for(lambda: env.state(v) == "stopped" and x in c.queue and c.queue.reserved_for_others(y) == {0: 10},
                       what="x queued with a reservation")
        fake_nvidia_smi("20480, 0")  # now the memory shows as free
        wy = asyncio.ensure_future(env.acquire(y))
        (await wx).release()  # x got its memory ...
        assert env.state(x) == "ready"
        await wait_for(lambda: y in c.queue, what="y queued")  # ... and y (12 GiB) did not take it
        assert not wy.done() and env.state(y) == "stopped"
        wy.cancel()


async def test_later_entry_that_fits_starts_while_head_is_blocked(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=20, queue_timeout_s=20) as env:
        c = env.controller
        busy = await env.add("busy", 10)
        x = await env.add("x", 18)
        y = await env.add("y", 8)
        await env.start(busy)
        slot = await env.acquire(busy)
        wx = asyncio.ensure_future(env.acquire(x))
        await wait_for(lambda: x in c.queue, what="x queued")
        assert c.status(x)["phase"] == "queued"
        async with await env.acquire(y):  # fits in the 10 GiB free: nothing was freed for x
            assert y not in c.queue and x in c.queue
        slot.release()
        env.skip(1.1)
        await env.fresh_metrics()
        (await wx).release()  # busy and y were stopped for it, least recently used first
        assert env.state(x) == "ready" and env.state(busy) == "stopped" and env.state(y) == "stopped"


async def test_stopped_while_starting_for_request(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a", 10, "--startup-delay", "5")
        w = asyncio.ensure_future(env.acquire(a))
        await wait_for(lambda: env.state(a) == "starting")
        assert env.controller.status(a)["phase"] == "starting_for_request"
        await env.deployer.stop(a)
        assert await code_of(w) == "ondemand_stopped"
        # no backoff: the next request starts it again
        b = await env.add("b")
        async with await env.acquire(b):
            pass


async def test_removed_while_waiting(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a", 10, "--startup-delay", "5")
        w = asyncio.ensure_future(env.acquire(a))
        await wait_for(lambda: env.state(a) == "starting")
        await env.deployer.remove(a)
        assert await code_of(w) == "ondemand_stopped"
        b = await env.add("b", 10, "--startup-delay", "5")
        await env.deployer.admit_start(b, actor="admin")  # started by hand: its waiters only wait
        w = asyncio.ensure_future(env.acquire(b))
        await wait_for(lambda: env.controller.waiting(b) == 1)
        await env.deployer.remove(b)
        assert await code_of(w) == "not_found"
        assert env.controller.waiting() == 0


async def test_start_failure_backoff(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        c = env.controller
        a = await env.add("a", 10, "--fail", "exit-at-start")
        ws = [asyncio.ensure_future(env.acquire(a)) for _ in range(3)]
        codes = [await code_of(w) for w in ws]
        assert codes == ["start_failed"] * 3
        # refused at once, without a start, for 60 s
        assert await code_of(env.acquire(a)) == "start_failed"
        assert c.record(a).backoff.delay == 60
        starts = [e for e in await store.events(a) if e["detail"].get("to") == "starting"]
        assert len(starts) == 1
        # doubling, capped at 900
        c.record(a).backoff.until = 0
        assert await code_of(env.acquire(a)) == "start_failed"
        assert c.record(a).backoff.delay == 120
        for _ in range(5):
            c.record(a).backoff.until = 0
            await code_of(env.acquire(a))
        assert c.record(a).backoff.delay == 900
        # a changed configuration resets it, and a good start works
        await env.deployer.update(a, command=["ondemand", "sim-engine", "--port", "{port}", "--model", "A"])
        assert c.record(a).backoff is None
        async with await env.acquire(a):
            pass


async def test_set_mode_resets_backoff(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        c = env.controller
        a = await env.add("a", 10, "--fail", "exit-at-start")
        await code_of(env.acquire(a))
        assert c.record(a).backoff is not None
        await env.admission.set_mode(a, "on_demand", idle_timeout_s=120, set_idle_timeout=True)
        assert c.record(a).backoff is None
        assert env.deployer.get(a).idle_timeout_s == 120
        audit = (await store.audit(a))[0]
        assert audit["action"] == "ondemand_mode"
        assert audit["detail"]["old"]["idle_timeout_s"] is None and audit["detail"]["new"]["idle_timeout_s"] == 120


async def test_switch_to_always_on_of_a_stopped_one(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a", 10, "--startup-delay", "0.5")
        await env.admission.set_mode(a, "always_on")
        dep = env.deployer.get(a)
        assert (dep.mode, dep.pending_mode, dep.state) == ("on_demand", "always_on", "starting")
        # acquire waits for set_mode's start instead of starting it itself
        async with await env.acquire(a):
            dep = env.deployer.get(a)
            assert (dep.mode, dep.pending_mode, dep.state) == ("always_on", None, "ready")
        assert [r["action"] for r in await store.audit(a)] == ["ondemand_mode"]
        row = await store.deployment(a)
        assert (row["mode"], row["pending_mode"]) == ("always_on", None)
        # the reaper never picks it now
        env.skip(1.1)
        await env.fresh_metrics()
        assert await env.reap() == []


async def test_switch_to_always_on_refused_start_leaves_it(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=20) as env:
        a, b = await env.add("a", 15), await env.add("b", 10)
        await env.start(a)
        with pytest.raises(OndemandError) as exc:
            await env.admission.set_mode(b, "always_on")
        assert exc.value.code == "insufficient_memory"
        dep = env.deployer.get(b)
        assert (dep.mode, dep.pending_mode, dep.state) == ("on_demand", None, "stopped")


async def test_switch_of_a_ready_one_just_stores(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a")
        await env.start(a)
        await env.admission.set_mode(a, "always_on")
        assert env.deployer.get(a).mode == "always_on" and env.deployer.get(a).pending_mode is None
        with pytest.raises(OndemandError, match="idle_timeout_s"):
            await env.admission.set_mode(a, "on_demand", idle_timeout_s=0, set_idle_timeout=True)


async def test_reaper_and_idle_timer(tmp_path, store):
    from ondemand.control.reaper import Reaper
    async with controller_env(tmp_path, store) as env:
        c = env.controller
        a = await env.add("a", 10, idle_timeout_s=1)
        await env.start(a)
        await env.fresh_metrics()
        assert await env.reap() == []  # ready restarts the idle timer
        env.skip(0.7)
        (await env.acquire(a)).release()  # a slot restarts it again
        env.skip(0.7)
        await env.fresh_metrics()
        assert await env.reap() == []
        slot = await env.acquire(a)
        env.skip(1.1)
        await env.fresh_metrics()
        assert await env.reap() == []  # in flight: never stopped
        slot.release()
        reaper = Reaper(c, interval_s=0.1)
        task = asyncio.ensure_future(reaper.run())
        await wait_for(lambda: env.state(a) == "stopped", timeout=5, what="reaped")
        task.cancel()
        sleeps = [r for r in await store.audit(a) if r["action"] == "ondemand_sleep"]
        assert sleeps[0]["text"] == "Put to sleep after 0.02 min idle"  # 1 s
        assert c.status(a)["phase"] == "sleeping"


async def test_hang_up_while_queued_removes_the_entry(tmp_path, store):
    async with controller_env(tmp_path, store, capacity=20) as env:
        c = env.controller
        a, x = await env.add("a", 15), await env.add("x", 10)
        await env.start(a)
        slot = await env.acquire(a)
        w = asyncio.ensure_future(env.acquire(x))
        await wait_for(lambda: x in c.queue)
        assert c.status(x) == {"inflight": 0, "queued": 1, "last_request_at": None, "phase": "queued", "queue_position": 1, "idle_until": None, "backoff_until": None, "held_for": None, "put_away_early": None}
        w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await w
        assert x not in c.queue and c.waiting() == 0 and c.status(x)["queued"] == 0
        slot.release()


def held_budget(release: asyncio.Event):
    """A static budget whose reading waits for ``release`` (an admit held in its one await)."""
    from ondemand.control.budget import Budget

    class HeldBudget(Budget):
        async def measure(self):
            await release.wait()
            return None
    return HeldBudget("static", 24)


async def test_attempt_starts_nothing_when_nobody_waits(tmp_path, store):
    """The only waiter hangs up while the start's memory reading is out: the deployer asks
    again whether anyone wants the start in the step that would mark it starting."""
    release = asyncio.Event()
    async with controller_env(tmp_path, store, budget=held_budget(release)) as env:
        a = await env.add("a")
        w = asyncio.ensure_future(env.acquire(a))
        await wait_for(lambda: env.controller.attempt_phase(a) is not None)
        w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await w
        release.set()
        await env.effects_done()
        assert env.state(a) == "stopped" and env.controller.waiting() == 0
        assert env.controller.attempt_phase(a) is None  # nothing left behind


@pytest.mark.parametrize("seed", [pytest.param(s, marks=[pytest.mark.slow] if s >= 1 else []) for s in range(20)])
async def test_race_hang_ups_at_random_moments(tmp_path, store, seed):
    """200 acquires with random hang-ups against two deployments that do not
    fit together: counts return to 0, no stopped engine had a slot when its
    precheck ran, and no request hangs."""
    rng = random.Random(seed)
    async with controller_env(tmp_path, store, capacity=20, queue_timeout_s=8) as env:
        c = env.controller
        a = await env.add("a", 12, "--startup-delay", "0.1", idle_timeout_s=1)
        b = await env.add("b", 12, "--startup-delay", "0.1", idle_timeout_s=1)
        violations = []
        real_is_idle = c.is_idle

        def checked_is_idle(dep, now=None):
            ok = real_is_idle(dep, now)
            if ok and c.inflight(dep.id):
                violations.append(dep.id)
            return ok
        c.is_idle = checked_is_idle
        real_may = c.start_side.may_put_away

        def checked_may(victim, requester, now=None):  # make-room's choice and its stop's precheck
            ok = real_may(victim, requester, now)
            if ok and c.inflight(victim.id):
                violations.append(("victim busy", victim.id))
            return ok
        c.start_side.may_put_away = checked_may
        real_stop = env.deployer.stop

        async def stop(dep_id, precheck=None, **kw):
            def wrapped(dep):
                ok = precheck(dep)
                if ok and c.inflight(dep_id):
                    violations.append(("stopped busy", dep_id))
                return ok
            return await real_stop(dep_id, wrapped if precheck else None, **kw)
        env.deployer.stop = stop

        async def one(i):
            target = a if rng.random() < 0.5 else b
            task = asyncio.ensure_future(env.acquire(target))
            hang = rng.random()
            if hang < 0.3:
                await asyncio.sleep(rng.random() * 0.5)
                task.cancel()
            try:
                slot = await task
            except (asyncio.CancelledError, OndemandError):
                return
            try:
                # some generations outlast the idle timeout: only the in-flight
                # count keeps those models from being stopped
                await asyncio.sleep(1.0 + rng.random() * 0.4 if rng.random() < 0.05 else rng.random() * 0.05)
            finally:
                slot.release()

        async def reaper():
            while True:
                await asyncio.sleep(0.2)
                await env.fresh_metrics()
                await env.reap()

        r = asyncio.ensure_future(reaper())
        try:
            waves = []
            for i in range(200):
                waves.append(asyncio.ensure_future(one(i)))
                if rng.random() < 0.05:
                    await asyncio.sleep(rng.random() * 0.3)
            done, pending = await asyncio.wait(waves, timeout=30)
            assert not pending, "a request hung"
        finally:
            r.cancel()
        assert violations == []
        assert c.waiting() == 0 and c.inflight(a) == 0 and c.inflight(b) == 0
        assert c.status(a)["queued"] == 0 and c.status(b)["queued"] == 0 and len(c.queue) == 0
        assert not c.attempts()


async def test_too_big_is_not_refused_right_after_an_ondemand_stop(tmp_path, store):
    """Within ~20 s of an on-demand stop freed memory may still read as used, so a model
    bigger than the capacity waits instead of failing at once; later it fails at once."""
    async with controller_env(tmp_path, store, capacity=24, queue_timeout_s=1) as env:
        a = await env.add("a", 10)
        big = await env.add("big", 30)
        await env.start(a)
        env.skip(1.1)
        await env.fresh_metrics()
        assert await env.reap() == [a]
        assert await code_of(env.acquire(big)) == "ondemand_queue_timeout"  # waited, not refused
        env.skip(21)  # the stop is no longer recent
        assert await code_of(env.acquire(big)) == "does_not_fit"


async def test_a_wake_that_fails_starts_the_engine_cold_and_is_no_failed_start(tmp_path, store):
    """A failed wake is audited ondemand_wake_failed, the engine is stopped and started cold,
    and its waiters are served by the new engine; only a failed cold start would back off."""
    async with controller_env(tmp_path, store) as env:
        c = env.controller
        a = await env.add("a", 10, "--fail", "wake-fails")
        await env.start(a)
        pid = env.deployer.engine(a).ref.pid
        await env.deployer.sleep(a)
        ws = [asyncio.ensure_future(env.acquire(a)) for _ in range(2)]
        for w in ws:
            async with await w:
                assert env.state(a) == "ready"
        assert env.deployer.engine(a).ref.pid != pid  # another engine: a cold start
        assert c.record(a).backoff is None
        audit = await store.audit(a)
        failed = [r for r in audit if r["action"] == "ondemand_wake_failed"]
        assert len(failed) == 1 and "500" in failed[0]["detail"]["reason"] and failed[0]["detail"]["result"] == "failed"


async def test_background_wake_without_memory_queues(tmp_path, store, fake_nvidia_smi):
    """Asleep, its weights left the GPU; others took the memory: the wake queues."""
    from ondemand.control.budget import Budget
    smi = fake_nvidia_smi("24576, 4096")
    async with controller_env(tmp_path, store, budget=Budget("nvidia-smi", nvidia_smi=smi),
                              queue_timeout_s=3) as env:  # the wake after it needs room under load
        # Its engine shows 10 GiB on the GPU awake and none asleep: the sleep is seen to free it.
        a = await env.add("a", 10, "--gpu-mib", "10240")
        await env.start(a)
        await env.deployer.sleep(a)
        fake_nvidia_smi("24576, 20480")  # 4 GiB free now: someone else's memory
        queued = []
        assert await code_of(env.acquire(a, on_queued=lambda: queued.append(1))) == "ondemand_queue_timeout"
        assert queued == [1] and env.state(a) == "asleep"
        fake_nvidia_smi("24576, 4096")
        async with await env.acquire(a):
            assert env.state(a) == "ready"


async def test_waiters_of_a_switch_to_always_on_whose_start_failed(tmp_path, store):
    """While set_mode starts it the waiters wait; when that start fails the deployment
    is always on and failed: they are told so at once."""
    async with controller_env(tmp_path, store) as env:
        c = env.controller
        a = await env.add("a", 10, "--fail", "exit-at-start")
        await env.admission.set_mode(a, "always_on")
        assert await code_of(env.acquire(a)) == "start_failed"  # the start they waited for failed
        dep = env.deployer.get(a)
        assert (dep.mode, dep.pending_mode, dep.state) == ("always_on", None, "failed")
        assert c.waiting() == 0


async def test_a_slow_make_room_holds_up_nobody(tmp_path):
    """While make-room waits for a victim that takes 3 s to stop, a mode switch, the
    status, another deployment's stop and a ready model's request each answer at once."""
    import time

    from helpers import run_app

    # No reaper: it would stop the idle victim itself, before make-room could (a race the
    # test would lose under load).
    async with run_app(tmp_path, **{"deployer.stop_timeout_s": 10, "reap_interval_s": 3600}) as server:
        victim = await server.add("v", 10, "--shutdown-delay", "3", idle_timeout_s=1)
        ready = await server.add("r", 4, idle_timeout_s=3600)
        other = await server.add("o", 1, idle_timeout_s=3600)
        spare = await server.add("s", 1)
        x = await server.add("x", 14)
        for dep_id in (victim, ready, other):
            await server.deployer.restart(dep_id)
        c = server.controller
        c.record(victim).last_activity = 0  # idle for its full timeout
        await wait_for(lambda: c.is_idle(server.deployer.get(victim)), timeout=30, what="the victim idle by every rule")
        chat = {"model": "X", "messages": [{"role": "user", "content": "hi"}]}
        async with two_pools() as http:
            cold = asyncio.ensure_future(http.post(server.gw(x, "chat/completions"), json=chat,
                                                   headers=server.auth()))
            await wait_for(lambda: server.state(victim) == "stopping", what="the victim stopping")
            admin = server.admin_headers()
            timings = {}

            async def timed(name, method, url, **kw):
                t0 = time.monotonic()
                async with http.request(method, url, **kw) as r:
                    await r.read()
                    assert r.status == 200, (name, r.status, await r.text())
                timings[name] = time.monotonic() - t0

            await timed("mode set", "PATCH", f"{server.url}/api/deployments/{spare}/mode", headers=admin,
                        json={"mode": "on_demand", "idle_timeout_s": 120})
            await timed("status", "GET", f"{server.url}/api/deployments", headers=admin)
            await timed("ready request", "POST", server.gw(ready, "chat/completions"),
                        json={**chat, "model": "R"}, headers=server.auth())
            await timed("stop", "POST", f"{server.url}/api/deployments/{other}/stop", headers=admin)
            assert server.state(victim) == "stopping", "the make-room was over before the checks"
            # Each far below the victim's 3 s: none waited for the make-room (a bound that holds on
            # 2 loaded cores too; the stop of "o" is a real process's exit).
            assert max(timings.values()) < 1.0, timings
            async with await cold as r:
                assert r.status == 200
        assert server.state(x) == "ready" and server.state(victim) == "stopped"


@pytest.mark.parametrize("seed", [pytest.param(s, marks=[pytest.mark.slow] if s >= 1 else []) for s in range(10)])
async def test_race_the_limit_under_concurrent_acquires(tmp_path, store, seed):
    """300 acquires of a deployment with max_inflight 3, started cold (the first ones wait
    for the start), with random hang-ups and random holding times: the in-flight count
    never passes 3 at any moment (read in the step of every grant), every refusal is 429 ondemand_busy,
    and the counts return to 0. The limit is read in the step that grants, as the slots are."""
    rng = random.Random(seed)
    async with controller_env(tmp_path, store, queue_timeout_s=8, max_queued=1000) as env:
        c = env.controller
        a = await env.add("a", 10, "--startup-delay", "0.2", max_inflight=3)
        peaks, codes = [], []

        async def granted():
            ticket = await env.acquire(a)
            # The step of the grant still: a coroutine that returns resumes its caller at once.
            peaks.append(c.inflight(a))
            return ticket

        async def one():
            task = asyncio.ensure_future(granted())
            if rng.random() < 0.2:
                await asyncio.sleep(rng.random() * 0.3)
                task.cancel()
            try:
                slot = await task
            except asyncio.CancelledError:
                return
            except OndemandError as exc:
                codes.append(exc.code)
                return
            try:
                await asyncio.sleep(rng.random() * 0.05)
            finally:
                slot.release()

        waves = []
        for _ in range(300):
            waves.append(asyncio.ensure_future(one()))
            if rng.random() < 0.1:
                await asyncio.sleep(rng.random() * 0.05)
        done, pending = await asyncio.wait(waves, timeout=30)
        assert not pending, "a request hung"
        assert peaks and max(peaks) <= 3
        assert codes and set(codes) == {"ondemand_busy"}
        assert c.busy_total(a) == len(codes) and c.backoff_left(a) == 0
        assert c.inflight(a) == 0 and c.waiting() == 0 and not c.attempts()
