import asyncio

from ondemand.events import RESYNC, CountersChanged, EventBus, KeyRotated, ViewPublished
from ondemand.tasks import TaskGroup


async def test_handlers_get_their_type_and_a_reader_behind_gets_a_resync():
    bus = EventBus(queue_size=2)
    views, keys = [], []
    stop = bus.subscribe(ViewPublished, lambda e: views.append(e.view["id"]))
    bus.subscribe(KeyRotated, keys.append)
    with bus.stream(ViewPublished) as q:
        assert bus.readers(ViewPublished) == 1
        for i in range(3):
            bus.publish(ViewPublished({"id": i}))
        bus.publish(CountersChanged(7))  # nobody listens: dropped
        # a reader that fell behind gets one resync for what it missed (issue 23), then what follows
        bus.publish(ViewPublished({"id": 3}))
        assert [q.get_nowait() for _ in range(q.qsize())] == [RESYNC, ViewPublished({"id": 3})]
    assert bus.readers(ViewPublished) == 0
    stop()
    bus.publish(ViewPublished({"id": 9}))
    assert views == [0, 1, 2, 3] and keys == []


async def test_a_broken_handler_does_not_stop_the_others(caplog):
    bus = EventBus()
    seen = []
    bus.subscribe(KeyRotated, lambda e: 1 / 0)
    bus.subscribe(KeyRotated, seen.append)
    bus.publish(KeyRotated())
    assert seen == [KeyRotated()]
    assert "KeyRotated" in caplog.text and "ZeroDivisionError" in caplog.text


async def test_task_group_cancels_a_task_that_swallowed_its_cancellation():
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
