"""A start as one object (engines/start.py, ``unit.start``) and its events on the deployer's bus:
``StartBegan`` and ``StartEnded``, their fields and their order beside the ``DeploymentChanged``
of their step (a step's start events come first: an end, then a beginning, then the change),
for a cold start, a wake, a failed wake turned cold, a start stopped or removed, ondemand's
shutdown during a start, and a start taken back by the next ondemand. Real engine simulators
and the real state file; the Docker API double where an engine must outlive ondemand."""
from __future__ import annotations

import contextlib
import time

from helpers import dep_fields, running_deployer, wait_for

from ondemand.control.budget import Budget
from ondemand.events import DeploymentChanged, StartBegan, StartEnded


class Heard:
    """What the deployer published, in order."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def __call__(self, event: object) -> None:
        self.events.append(event)

    def of(self, kind: type, dep_id: int) -> list:
        return [e for e in self.events if isinstance(e, kind) and e.dep_id == dep_id]

    def story(self, dep_id: int) -> list[tuple]:
        """The starts' beginnings and ends and the state changes of ``dep_id``, in order."""
        out: list[tuple] = []
        for e in self.events:
            if isinstance(e, StartBegan) and e.dep_id == dep_id:
                out.append(("began", e.kind, e.level))
            elif isinstance(e, StartEnded) and e.dep_id == dep_id:
                out.append(("ended", e.kind, e.level, e.result))
            elif isinstance(e, DeploymentChanged) and e.dep_id == dep_id:
                out.append((e.old_state and e.old_state.value, e.new_state and e.new_state.value))
        return out


def plenty(tmp_path) -> str:
    """A meminfo with host memory to spare: a level-1 sleep stays level 1 whatever this machine has."""
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 67108864 kB\nMemFree: 1000 kB\nMemAvailable: 62914560 kB\n")
    return str(path)


async def test_a_cold_start_is_one_object_announced_before_the_changes_of_its_steps(tmp_path, store):
    heard = Heard()
    async with running_deployer(tmp_path, store, publish=heard) as d:
        a = (await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "0.3"))).id
        assert d.unit(a).start is None
        await d.admit_start(a)
        start = d.unit(a).start
        assert (start.kind, start.level, start.gpus, start.taken_back) == ("cold", None, d.get(a).gpus, False)
        await d.wait_started(a)
        assert d.unit(a).start is None and d.unit(a).launched is start and start.result == "ready"
    assert heard.story(a)[:5] == [(None, "stopped"), ("began", "cold", None), ("stopped", "starting"),
                                  ("ended", "cold", None, "ready"), ("starting", "ready")]
    (began,), (ended, *_) = heard.of(StartBegan, a), heard.of(StartEnded, a)
    assert began.start is start and ended.start is start and began.name == ended.name == "a"
    assert (began.at, began.gpus) == (start.at, start.gpus) and not ended.taken_back
    ready = next(e for e in heard.of(DeploymentChanged, a) if e.new_state == "ready")
    assert ended.at == ready.dep.updated_at  # the wall clock of the step that ended it
    assert 0.3 <= ended.duration_s < 20 and ended.at - began.at >= 0.3


async def test_a_wake_and_a_failed_wake_turned_cold(tmp_path, store):
    """A wake is a start of kind wake at its sleep level. A failed one (its check answers
    otherwise) ends ``mismatch`` and a cold start begins, in the step of the change from
    starting to starting: two events, in that order, before it; the cold start's duration is
    from there, not from the wake's beginning."""
    heard = Heard()
    async with running_deployer(tmp_path, store, budget=Budget("static", 24, meminfo_path=plenty(tmp_path)),
                                publish=heard) as d:
        # A wake of 0.3 s: longer than the row's write of its beginning (a faster one may end before
        # that change is published, which then carries it ready, after both its start events).
        a = (await d.create(dep_fields("a", 4, "on_demand", "--wake-delay", "0.3", idle_action="sleep"))).id
        # Its wake check is recorded at its cold start (it sleeps when idle), and a wake answers otherwise.
        b = (await d.create(dep_fields("b", 4, "on_demand", "--fail", "wake-garbage", "--wake-delay", "0.3",
                                       idle_action="sleep"))).id
        for dep_id in (a, b):
            await d.restart(dep_id)
            assert await d.sleep(dep_id, 1) == 1
            heard.events = [e for e in heard.events if getattr(e, "dep_id", None) != dep_id]  # from the wake on
            await d.restart(dep_id)  # a wake: asleep
            assert d.get(dep_id).state == "ready" and d.unit(dep_id).start is None
        stories = {dep_id: heard.story(dep_id) for dep_id in (a, b)}  # (not the shutdown's stops)
    assert stories[a] == [("began", "wake", 1), ("asleep", "starting"), ("ended", "wake", 1, "ready"),
                              ("starting", "ready")]
    assert stories[b] == [("began", "wake", 1), ("asleep", "starting"), ("ended", "wake", 1, "mismatch"),
                              ("began", "cold", None), ("starting", "starting"), ("ended", "cold", None, "ready"),
                              ("starting", "ready")]
    wake, cold = heard.of(StartEnded, b)
    turned = heard.of(DeploymentChanged, b)[1]
    assert turned.old_state == turned.new_state == "starting" and turned.dep.sleep_level is None and wake.start is not cold.start and wake.start.level == 1
    assert wake.at <= heard.of(StartBegan, b)[1].at <= cold.at
    assert cold.duration_s <= cold.at - turned.dep.updated_at + 0.05  # timed from the turn, not the wake


async def test_a_start_stopped_or_removed_ends_so_before_the_change_to_stopping(tmp_path, store):
    heard = Heard()
    async with running_deployer(tmp_path, store, publish=heard) as d:
        a = (await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "5"))).id
        b = (await d.create(dep_fields("b", 10, "on_demand", "--startup-delay", "5"))).id
        await d.admit_start(a)
        await wait_for(lambda: d.engine(a) is not None, what="a's engine created")
        await d.stop(a)
        await d.admit_start(b)  # at the gate behind nothing: its engine is being created, or about to be
        await d.remove(b)
        assert d.unit(a).start is None
    assert heard.story(a)[1:] == [("began", "cold", None), ("stopped", "starting"), ("ended", "cold", None, "stopped"),
                                  ("starting", "stopping"), ("stopping", "stopped")]
    assert heard.story(b)[1:] == [("began", "cold", None), ("stopped", "starting"), ("ended", "cold", None, "removed"),
                                  ("starting", "stopping"), ("stopping", "stopped"), ("stopped", None)]


async def test_ondemands_shutdown_interrupts_a_start(tmp_path, store):
    """The process backend stops its engines with ondemand: the start ends interrupted, before
    the change that records the stop."""
    heard = Heard()
    async with running_deployer(tmp_path, store, publish=heard) as d:
        a = (await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "5"))).id
        await d.admit_start(a)
        await wait_for(lambda: d.engine(a) is not None, what="its engine created")
    assert heard.story(a)[-2:] == [("ended", "cold", None, "interrupted"), ("starting", "stopped")]
    assert len(heard.of(StartEnded, a)) == 1


async def test_a_start_under_way_at_a_restart_is_interrupted_then_taken_back(tmp_path, store):
    """Docker backend over the Docker API double, whose engines outlive ondemand: the start ends
    ``interrupted`` at shutdown with no change (its row stays starting); the next ondemand takes
    it back at its start-up: ``StartBegan`` taken back, begun at its row's stamp, then it ends
    ready as any start, timed from that stamp."""
    from docker_double import DockerDouble

    from ondemand.engines.backends.docker import DockerBackend
    from ondemand.engines.deployer import Deployer

    image, network = "ondemand-sim-engine:latest", "ondemand-test"
    double = DockerDouble()
    double.add_network(network, [("172.30.0.0/16", "172.30.0.1")])
    double.add_image(image, [])

    @contextlib.asynccontextmanager
    async def ondemand(heard: Heard):
        backend = DockerBackend(docker_url=double.url, network=network, gpus=False, in_container=False)
        d = Deployer(store, backend, Budget("static", 24), start_timeout_s=20, stop_timeout_s=5, publish=heard)
        await d.load()
        try:
            yield d
        finally:
            await d.close(stop_engines=False)  # as the app: docker engines keep running

    sim = ["python3", "-m", "ondemand", "sim-engine", "--host", "127.0.0.1", "--port", "8000", "--model", "A",
           "--startup-delay", "2"]
    first, second = Heard(), Heard()
    async with double:
        async with ondemand(first) as d:
            dep = await d.create({**dep_fields("a", 4), "command": [], "image": image, "args": sim})
            await d.admit_start(dep.id)
            await wait_for(lambda: d.engine(dep.id) is not None, what="its container created")
        assert first.story(dep.id)[-2:] == [("stopped", "starting"), ("ended", "cold", None, "interrupted")]
        row = await store.deployment(dep.id)
        assert row["state"] == "starting"
        began = time.monotonic()
        async with ondemand(second) as d:
            (taken,) = second.of(StartBegan, dep.id)  # announced while it loaded
            assert (taken.kind, taken.level, taken.taken_back, taken.at) == ("cold", None, True, row["updated_at"])
            assert d.unit(dep.id).start is taken.start
            await d.wait_started(dep.id)
            here = time.monotonic() - began
            await d.stop(dep.id)
    assert second.story(dep.id)[:3] == [("began", "cold", None), ("ended", "cold", None, "ready"),
                                        ("starting", "ready")]
    ended = second.of(StartEnded, dep.id)[0]
    assert ended.taken_back and ended.duration_s > here  # from its row's stamp, before this ondemand
    assert abs(ended.duration_s - (ended.at - row["updated_at"])) < 0.5


async def test_the_apps_litellm_entry_ranks_a_failed_wakes_cold_start_cold_at_once(tmp_path):
    """The whole ondemand and the LiteLLM double: a wake keeps its entry's asleep rank; once it
    failed its check, the wake's StartEnded asks for a sync, and the entry ranks cold while its
    cold start (3 s) still runs, not at ready or at the next periodic sync (a minute)."""
    from helpers import run_app
    from litellm_double import litellm_double

    async with litellm_double("sk-m") as double:
        key = tmp_path / "master.key"
        key.write_text("sk-m\n")
        settings = {"litellm.url": double.url, "litellm.master_key_file": str(key), "reap_interval_s": 3600,
                    "budget.host_reserve_gib": 0, "budget.meminfo_path": plenty(tmp_path)}
        async with run_app(tmp_path, **settings) as server:
            d = server.deployer
            a = await server.add("a", 4, "--fail", "wake-garbage", "--startup-delay", "3", idle_action="sleep")

            def rank() -> tuple[int, str] | None:
                mine = [m for m in double.models if m["model_info"].get("dgxmm_id") == a]
                return (mine[0]["litellm_params"]["order"], mine[0]["model_info"]["dgxmm_state"]) if mine else None
            await d.restart(a)
            assert await d.sleep(a, 1) == 1
            await wait_for(lambda: rank() == (2, "asleep"), what="the asleep rank")
            await d.admit_start(a)  # the wake: its check answers otherwise, then it starts cold
            await wait_for(lambda: rank() == (3, "cold"), what="the cold rank", timeout=20)
            assert server.state(a) == "starting"
            await d.wait_started(a)
