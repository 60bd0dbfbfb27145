"""The deployer (ondemand/engines/deployer.py) over real engine simulators and the real state
file: a start, a stop and its precheck (in one step with its mark), a sleep, a removal, the fit
check, the start-up gates (one per GPU), a stop's cause, and the starts owed after ondemand's
restart (``restart_lost``: refused, retried, raced, made again). What one deployment's unit does
(its wait for readiness, the watchdog's checks, the take-back of an engine) is test_unit.py's."""
import asyncio
import contextlib
import os

import pytest
from helpers import dep_fields, running_deployer, wait_for
from test_unit import as_if_ondemand_died

from ondemand.engines.deployer import StartFailed, StartInterrupted
from ondemand.errors import DeployerError, InsufficientMemory
from ondemand.events import DeploymentChanged


async def test_start_ready_stop(tmp_path, store):
    changes = []

    def publish(e):
        if isinstance(e, DeploymentChanged):  # not the start's events (StartBegan, StartEnded)
            changes.append((e.old_state, e.new_state))
    async with running_deployer(tmp_path, store, publish=publish) as d:
        dep = await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "0.3"))
        await d.restart(dep.id, actor="ondemand", audit="ondemand_start", text="started for a request")
        assert d.get(dep.id).state == "ready"
        url = d.base_url(dep.id)
        assert url.startswith("http://127.0.0.1:")
        proc = d.engine(dep.id).ref
        assert await d.stop(dep.id, actor="admin")
        assert d.get(dep.id).state == "stopped"
        assert proc.returncode is not None  # the process is gone
        assert ("stopped", "starting") in changes and ("starting", "ready") in changes
        assert ("ready", "stopping") in changes and ("stopping", "stopped") in changes
        row = await store.deployment(dep.id)
        assert row["state"] == "stopped"
        texts = [e["text"] for e in await store.events(dep.id)]
        assert "started for a request" in texts and "ready" in texts
        audit = await store.audit(dep.id)
        assert [a["action"] for a in audit] == ["ondemand_start"]
        log = (tmp_path / "logs" / "a.log").read_text()
        assert "simulator" in log


async def test_second_that_does_not_fit_raises(tmp_path, store):
    async with running_deployer(tmp_path, store, capacity=24) as d:
        a = await d.create(dep_fields("a", 16))
        b = await d.create(dep_fields("b", 16))
        await d.restart(a.id)
        with pytest.raises(InsufficientMemory) as exc:
            await d.restart(b.id)
        assert (exc.value.need, exc.value.free, exc.value.capacity) == (16, 8, 24)
        assert d.get(b.id).state == "stopped"
        await d.stop(a.id)
        await d.restart(b.id)


async def test_refusing_precheck_leaves_it_ready(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a"))
        await d.restart(dep.id)
        seen = []

        def precheck(dep):
            seen.append(dep.state)
            return False
        assert await d.stop(dep.id, precheck, actor="ondemand", audit="ondemand_sleep") is False
        assert seen == ["ready"] and d.get(dep.id).state == "ready"
        assert await store.audit(dep.id) == []  # only approved stops are audited
        assert await d.stop(dep.id, lambda row: True, actor="ondemand", audit="ondemand_sleep",
                            text="Put to sleep after 10 min idle")
        assert [a["action"] for a in await store.audit(dep.id)] == ["ondemand_sleep"]


async def test_precheck_and_marking_stopping_have_no_await_between(tmp_path, store):
    """A task that runs between the precheck and `stopping` would see the old state."""
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a"))
        await d.restart(dep.id)
        observed = []

        async def observer():
            await asyncio.sleep(0)
            observed.append(d.get(dep.id).state)

        def precheck(row):
            asyncio.get_running_loop().create_task(observer())
            return True
        await d.stop(dep.id, precheck)
        assert observed == ["stopping"]


@pytest.mark.parametrize("target", ["ready", "failed", "stopped"])
async def test_pending_mode_applied_in_the_transition(tmp_path, store, target):
    # The short timeout only where the start must fail: a ready start may take longer on a loaded machine.
    async with running_deployer(tmp_path, store, start_timeout_s=1.0 if target == "failed" else 30) as d:
        args = ("--fail", "never-ready") if target == "failed" else ()
        dep = await d.create(dep_fields("a", 10, "on_demand", *args))
        await d.update(dep.id, pending_mode="always_on")
        await d.admit_start(dep.id)
        if target == "stopped":
            await wait_for(lambda: d.get(dep.id).state == "starting")
            await d.stop(dep.id)
        else:
            with pytest.raises(StartFailed) if target == "failed" else contextlib_null():
                await d.wait_started(dep.id)
        row = await store.deployment(dep.id)
        assert row["state"] == target
        assert (row["mode"], row["pending_mode"]) == ("always_on", None)
        assert (d.get(dep.id).mode, d.get(dep.id).pending_mode) == ("always_on", None)


def contextlib_null():
    import contextlib
    return contextlib.nullcontext()


async def test_stop_while_starting_interrupts_waiters(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "5"))
        await d.admit_start(dep.id)
        waiter = asyncio.ensure_future(d.wait_started(dep.id))
        await wait_for(lambda: d.engine(dep.id) is not None, what="engine started")
        await d.stop(dep.id)
        with pytest.raises(StartInterrupted):
            await waiter
        assert d.get(dep.id).state == "stopped"


async def test_starts_pass_the_gate_one_at_a_time(tmp_path, store):
    async with running_deployer(tmp_path, store, capacity=100) as d:
        a = await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "0.5"))
        b = await d.create(dep_fields("b", 10, "on_demand", "--startup-delay", "0.5"))
        await d.admit_start(a.id)
        await d.admit_start(b.id)
        await wait_for(lambda: d.engine(a.id) is not None, what="a's engine started")
        assert d.engine(b.id) is None and not d.unit(b.id).gated  # b waits at the gate
        await d.wait_started(a.id)
        await d.wait_started(b.id)
        # stop while waiting at the gate cancels nothing half-way
        c = await d.create(dep_fields("c", 10, "on_demand", "--startup-delay", "0.5"))
        e = await d.create(dep_fields("e", 10, "on_demand"))
        await d.stop(a.id); await d.stop(b.id)
        await d.admit_start(c.id)
        await d.admit_start(e.id)
        await d.stop(e.id)
        assert d.get(e.id).state == "stopped" and d.engine(e.id) is None
        await d.wait_started(c.id)


async def test_starts_on_other_gpus_do_not_wait_for_each_other(tmp_path, store):
    """The gate is per GPU: two starts on two GPUs run together; two that share a GPU still
    go one at a time; an engine with no GPU passes no gate."""
    from ondemand.control.budget import Budget
    budget = Budget("static", gpu_capacity_gib=(80, 80))
    async with running_deployer(tmp_path, store, budget=budget) as d:
        # (Best fit would put both on GPU 0: the pins put them on one GPU each.)
        a = await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "1", gpu_ids=[0], gpu_count=1))
        b = await d.create(dep_fields("b", 10, "on_demand", "--startup-delay", "1", gpu_ids=[1], gpu_count=1))
        await d.admit_start(a.id)
        await d.admit_start(b.id)
        assert (d.get(a.id).gpus, d.get(b.id).gpus) == ((0,), (1,))
        await wait_for(lambda: d.engine(a.id) is not None and d.engine(b.id) is not None, what="both engines started together")
        assert d.get(a.id).state == d.get(b.id).state == "starting"
        await d.wait_started(a.id)
        await d.wait_started(b.id)
        await d.stop(a.id)
        await d.stop(b.id)
        c = await d.create(dep_fields("c", 10, "on_demand", "--startup-delay", "1", gpu_ids=[1], gpu_count=1))
        e = await d.create(dep_fields("e", 10, "on_demand", "--startup-delay", "1", gpu_ids=[1], gpu_count=1))
        cpu = await d.create(dep_fields("cpu", 10, "on_demand", gpu_count=0))
        await d.admit_start(c.id)
        await d.admit_start(e.id)
        await d.admit_start(cpu.id)
        await wait_for(lambda: d.engine(c.id) is not None, what="c's engine started")
        assert d.engine(e.id) is None  # same GPU: waits at its gate
        await d.wait_started(cpu.id)  # no GPU: no gate, ready while c still loads
        assert d.get(c.id).state == "starting"
        await d.wait_started(c.id)
        await d.wait_started(e.id)


async def test_sleep_and_wake(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a"))
        await d.restart(dep.id)
        await d.sleep(dep.id)
        assert d.get(dep.id).state == "asleep"
        await d.restart(dep.id)  # wakes it: it is asleep
        assert d.get(dep.id).state == "ready"
        llama = await d.create(dep_fields("l", 1, engine="llamacpp"))
        await d.restart(llama.id)
        with pytest.raises(DeployerError, match="no sleep mode"):
            await d.sleep(llama.id)


async def test_a_sleep_is_published_with_how_long_its_call_held_the_memory(tmp_path, store):
    """Warmth by value weighs a slow sleep (a request that comes meanwhile waits for it): the
    ``Slept`` event says how long the engine's sleep call took, from the mark to its end."""
    from ondemand.events import Slept
    seen: list[Slept] = []
    async with running_deployer(tmp_path, store, publish=lambda e: isinstance(e, Slept) and seen.append(e)) as d:
        dep = await d.create(dep_fields("a", 10, "on_demand", "--sleep-delay", "0.4"))
        await d.restart(dep.id)
        await d.sleep(dep.id)
    assert [e.name for e in seen] == ["a"]
    assert 0.4 <= seen[0].took_s < 5


async def test_a_sleeps_memory_is_not_free_for_another_start_until_its_call_ends(tmp_path, store):
    """On the static budget (nothing measured) a sleeper counted only its residue from its mark,
    so a start could take memory still in use, and one queued behind a head could take what
    make-room was freeing for the head. Until the call ends the sleeper holds all of it, but
    for its own wake."""
    async with running_deployer(tmp_path, store, capacity=24) as d:
        a = await d.create(dep_fields("a", 10, "on_demand", "--sleep-delay", "1"))
        b = await d.create(dep_fields("b", 16))
        await d.restart(a.id)
        sleeping = asyncio.ensure_future(d.sleep(a.id))
        await wait_for(lambda: d.get(a.id).state == "asleep", what="a marked asleep")
        with pytest.raises(InsufficientMemory):
            await d.admit_start(b.id)
        assert await sleeping  # its level (not stopped instead)
        await d.restart(b.id)  # the call has ended: a keeps its residue only
        assert d.get(b.id).state == "ready"


async def test_a_sleeper_may_wake_into_its_own_memory_while_its_call_is_out(tmp_path, store):
    async with running_deployer(tmp_path, store, capacity=24) as d:
        a = await d.create(dep_fields("a", 10, "on_demand", "--sleep-delay", "0.5"))
        await d.restart(a.id)
        sleeping = asyncio.ensure_future(d.sleep(a.id))
        await wait_for(lambda: d.get(a.id).state == "asleep", what="a marked asleep")
        assert await d.admit_start(a.id)  # its wake waits for the call, then wakes
        await d.wait_started(a.id)
        await sleeping
        assert d.get(a.id).state == "ready"


async def test_remove_stops_and_forgets(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a"))
        await d.restart(dep.id)
        proc = d.engine(dep.id).ref
        await d.remove(dep.id)
        assert d.get(dep.id) is None and await store.deployment(dep.id) is None
        assert proc.returncode is not None


async def test_a_stop_is_published_once_with_its_cause(tmp_path, store):
    """The change that starts a stop carries why (the metrics count stops by it); no other does."""
    from ondemand.events import StopCause
    seen = []
    d_cm = running_deployer(tmp_path, store, watch_interval_s=0.1, publish=lambda e: isinstance(e, DeploymentChanged)
                            and seen.append((e.old_state, e.new_state, e.cause)))
    async with d_cm as d:
        a = (await d.create(dep_fields("a"))).id
        b = (await d.create(dep_fields("b"))).id
        await d.restart(a)
        await d.restart(b)
        assert await d.stop(a, actor="admin")
        os.killpg(d.engine(b).ref.pid, 9)  # b's engine dies while it serves
        # Wait for the failure's change to be published, not just marked: a change carries the
        # deployment as it is when published, so a restart between the two would show as starting.
        await wait_for(lambda: any(c[2] is StopCause.FAILED for c in seen))
        await d.restart(b)
    assert [c for c in seen if c[2] is not None] == [
        ("ready", "stopping", StopCause.ADMIN), ("ready", "failed", StopCause.FAILED),
        ("ready", "stopped", StopCause.SHUTDOWN)]


# --- after a restart of ondemand (issue 21, "After a reboot") -----------------------------


async def test_always_on_engines_lost_with_ondemand_start_again_and_a_stop_stays_a_stop(tmp_path, store):
    """The process backend never adopts a child: after a clean shutdown (it stops them) and after
    a crash (the next ondemand kills the leftover), the always-on deployment that was ready is
    started again and becomes ready; one an administrator stopped stays stopped, an on-demand
    one rests stopped."""
    async with running_deployer(tmp_path, store) as d:
        a = (await d.create(dep_fields("a", 4, "always_on"))).id
        b = (await d.create(dep_fields("b", 4, "always_on"))).id
        c = (await d.create(dep_fields("c", 4, "on_demand"))).id
        for i in (a, b, c):
            await d.restart(i)
        await d.stop(b)  # an administrator's stop
    row = await store.deployment(a)
    assert (row["state"], row["mode"], row["pending_mode"]) == ("stopped", "always_on", "always_on")  # owed
    for restart in ("after a clean shutdown", "after a crash"):
        async with running_deployer(tmp_path, store) as d:
            assert (d.get(a).state, d.get(a).pending_mode) == ("stopped", "always_on"), restart
            assert (d.get(b).state, d.get(b).pending_mode) == ("stopped", None), restart
            assert (d.get(c).state, d.get(c).pending_mode) == ("stopped", None), restart
            tasks = d.restart_lost()
            assert len(tasks) == 1
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            await d.wait_started(a)
            assert (d.get(a).state, d.get(a).mode, d.get(a).pending_mode) == ("ready", "always_on", None)
            assert d.get(b).state == "stopped" and d.get(c).state == "stopped"
            if restart == "after a clean shutdown":
                abandoned = d.engine(a).ref  # the "dead" ondemand's child process
                pid = abandoned.pid
                await as_if_ondemand_died(d)
        if restart == "after a clean shutdown":
            os.kill(pid, 0)  # left running by the "dead" ondemand
            row = await store.deployment(a)
            assert (row["state"], row["pending_mode"]) == ("ready", None)
    # The next ondemand killed it; reaping it here closes its pipes before the test's loop does
    # (else their finalizer runs on a closed loop, in whichever test comes next).
    assert await asyncio.wait_for(abandoned.wait(), 10) is not None
    texts = [e["text"] for e in await store.events(a)]
    assert "engine gone after ondemand restarted; it will be started again" in texts
    assert texts.count("starting again after ondemand restarted") == 2
    assert not [e for e in await store.events(b) if "again" in e["text"]]


async def test_a_start_owed_that_does_not_fit_says_why_and_is_tried_again(tmp_path, store, caplog):
    """Two always-on engines that no longer fit together: one starts, the other stays stopped
    with the refusal in its reason (and the log), owed still, and starts once room is made."""
    ids = [(await store.insert_deployment(dep_fields(n, 16, "always_on", state="ready")))["id"] for n in "ab"]
    async with running_deployer(tmp_path, store, capacity=24, restart_retry_s=0.2) as d:
        d.restart_lost()

        def refused():
            return [i for i in ids if "start was refused" in (d.get(i).state_reason or "")]
        await wait_for(refused, what="a refusal noted")
        [waiting] = refused()
        [first] = [i for i in ids if i != waiting]
        await d.wait_started(first)
        now = d.get(waiting)
        assert (now.state, now.pending_mode) == ("stopped", "always_on")
        assert "needs 16 GiB" in now.state_reason and "tried again in" in now.state_reason
        assert "start was refused (needs 16 GiB" in caplog.text and "tried again in 0.2 s" in caplog.text
        await d.stop(first)  # room made: the next try starts it
        await wait_for(lambda: d.get(waiting).state == "ready", timeout=30, what="the owed start once it fits")
        assert d.get(first).state == "stopped"  # the stop stays: it owed nothing


async def test_a_start_owed_while_the_budget_cannot_be_read_is_tried_again(tmp_path, store):
    """After a reboot nvidia-smi may not answer yet: the owed start is not dropped, its reason
    says why, and the next try starts it."""
    from ondemand.errors import BudgetError
    i = (await store.insert_deployment(dep_fields("a", 4, "always_on", state="ready")))["id"]
    async with running_deployer(tmp_path, store, restart_retry_s=0.2) as d:
        real = d.budget.read
        calls = []

        async def flaky(deps):
            calls.append(1)
            if len(calls) == 1:
                raise BudgetError("nvidia-smi: NVIDIA-SMI has failed (the driver is not loaded yet)")
            return await real(deps)
        d.budget.read = flaky
        await asyncio.gather(*d.restart_lost())
        await d.wait_started(i)
        assert d.get(i).state == "ready" and len(calls) == 2
    texts = [e["text"] for e in await store.events(i)]
    assert any("driver is not loaded yet" in t and "tried again in 0.2 s" in t for t in texts), texts


async def test_a_request_and_an_admin_start_during_an_owed_start_start_it_once(tmp_path, store):
    """A request that arrives while the start is owed waits for it (it starts nothing itself); an
    administrator's start racing the owed one is the one attempt; the engine starts once."""
    from helpers import controller_env
    i = (await store.insert_deployment(dep_fields("a", 4, "always_on", "--startup-delay", "0.3",
                                                  state="ready")))["id"]
    async with controller_env(tmp_path, store) as env:
        d = env.deployer
        starts = []
        real = d.backend.start

        async def counted(dep, how=None):
            starts.append(dep.id)
            return await real(dep, how)
        d.backend.start = counted
        request = asyncio.ensure_future(env.acquire(i))
        await wait_for(lambda: env.controller.waiting(i) == 1, what="the request waiting")
        env.controller.tick()  # the queue's clock, driven: it starts nothing owed either
        await env.effects_done()
        assert not request.done() and d.get(i).state == "stopped" and starts == []
        admin = asyncio.ensure_future(d.restart(i, actor="admin"))
        tasks = d.restart_lost(env.controller.held_for_others)
        slot = await asyncio.wait_for(request, 10)
        slot.release()
        await admin
        await asyncio.gather(*tasks)
        assert starts == [i] and d.get(i).state == "ready" and d.get(i).pending_mode is None
        assert [e["text"] for e in await store.events(i)].count("ready") == 1


async def test_an_admin_stop_while_the_owed_start_reads_the_budget_cancels_it(tmp_path, store):
    """A stop of a deployment owed a start is a stop: it settles the debt (and the pending mode),
    even against the owed start's fit check already under way; nothing starts."""
    i = (await store.insert_deployment(dep_fields("a", 4, "always_on", state="starting")))["id"]
    async with running_deployer(tmp_path, store) as d:
        gate = asyncio.Event()
        reading = asyncio.Event()
        real = d.budget.read

        async def slow_read(deps):
            reading.set()
            await gate.wait()
            return await real(deps)
        d.budget.read = slow_read
        tasks = d.restart_lost()
        await asyncio.wait_for(reading.wait(), 5)
        assert await d.stop(i, actor="admin", text="stopped by an administrator")
        gate.set()
        await asyncio.gather(*tasks)
        now = d.get(i)
        assert (now.state, now.mode, now.pending_mode) == ("stopped", "always_on", None)
        assert d.engine(i) is None and d.unit(i).task is None
    row = await store.deployment(i)
    assert (row["state"], row["pending_mode"]) == ("stopped", None)
    async with running_deployer(tmp_path, store) as d:
        assert d.restart_lost() == []  # and the next ondemand owes nothing either


async def test_a_container_removed_while_ondemand_was_down_is_made_again(tmp_path, store):
    """The docker backend over the Docker API double: a running container is adopted (nothing
    restarted); one removed while ondemand was down is made again and becomes ready."""
    from docker_double import DockerDouble

    from ondemand.control.budget import Budget
    from ondemand.engines.backends.docker import DockerBackend
    from ondemand.engines.deployer import Deployer

    image, network = "ondemand-sim-engine:latest", "ondemand-test"
    double = DockerDouble()
    double.add_network(network, [("172.30.0.0/16", "172.30.0.1")])
    double.add_image(image, [])

    def backend():
        return DockerBackend(docker_url=double.url, network=network, gpus=False, in_container=False)

    @contextlib.asynccontextmanager
    async def ondemand():
        d = Deployer(store, backend(), Budget("static", 24), start_timeout_s=20, stop_timeout_s=5)
        await d.load()
        try:
            yield d
        finally:
            await d.close(stop_engines=False)  # as the app: docker engines keep running

    sim = ["python3", "-m", "ondemand", "sim-engine", "--host", "127.0.0.1", "--port", "8000", "--model", "A"]
    async with double:
        async with ondemand() as d:
            dep = await d.create({**dep_fields("a", 4, "always_on"), "command": [], "image": image, "args": sim})
            await d.restart(dep.id)
            first = d.engine(dep.id).ref
        async with ondemand() as d:  # still running: adopted
            assert d.get(dep.id).state == "ready" and d.engine(dep.id).ref == first
            assert d.restart_lost() == []
        gone = backend()
        await gone.remove(dep)  # `docker rm -f` while ondemand is down
        await gone.close()
        async with ondemand() as d:
            assert (d.get(dep.id).state, d.get(dep.id).pending_mode) == ("stopped", "always_on")
            await asyncio.gather(*d.restart_lost())
            await d.wait_started(dep.id)
            assert d.get(dep.id).state == "ready" and d.engine(dep.id).ref != first
            assert len([c for c in double.containers.values() if c["Name"] == "/ondemand-a"]) == 1
            await d.stop(dep.id)
