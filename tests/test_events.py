
from ondemand.events import EventBus


async def test_subscribers_and_listeners_get_views():
    bus = EventBus(queue_size=2)
    seen = []
    stop = bus.listen(lambda kind, view: seen.append(view["id"]))
    with bus.subscribe() as q:
        for i in range(3):
            bus.publish({"id": i})
        # a slow subscriber keeps the newest views
        assert [q.get_nowait()[1]["id"] for _ in range(2)] == [1, 2]
    assert bus.subscribers == 0
    stop()
    bus.publish({"id": 9})
    assert seen == [0, 1, 2]


async def test_broken_listener_does_not_stop_others(caplog):
    bus = EventBus()
    seen = []
    bus.listen(lambda k, v: 1 / 0)
    bus.listen(lambda k, v: seen.append(v))
    bus.publish({"id": 1})
    assert seen == [{"id": 1}]


async def test_task_group_cancels_a_task_that_swallowed_its_cancellation():
    from ondemand.tasks import TaskGroup
    import asyncio
    group = TaskGroup("t")
    seen = []

    async def stubborn():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("swallowed")  # as asyncio.wait_for may on 3.10/3.11
        await asyncio.sleep(10)

    group.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    await asyncio.wait_for(group.close(), 5)
    assert seen == ["swallowed"] and len(group) == 0
