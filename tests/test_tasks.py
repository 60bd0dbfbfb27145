"""ondemand/tasks.py: ``TaskGroup``, through which every background task goes, on a real event
loop: a task named after its owner and held until it ends, a failure logged with its traceback
(a cancellation is not one), ``close`` cancelling every task with its reason and waiting
until each has ended, even one that swallows its first cancellation, and ``finish`` letting them
end on their own for a while first."""
import asyncio
import logging

import pytest

from ondemand.tasks import TaskGroup


async def test_a_task_is_named_held_until_it_ends_and_returns_its_result():
    group = TaskGroup("owner")
    release = asyncio.Event()

    async def work():
        await release.wait()
        return 42
    task = group.spawn(work(), "work")
    assert task.get_name() == "owner:work" and len(group) == 1
    release.set()
    assert await task == 42
    await asyncio.sleep(0)  # its done callback
    assert len(group) == 0


async def test_a_failure_is_logged_with_its_traceback_and_a_cancellation_is_not(caplog):
    group = TaskGroup("owner")

    async def fail():
        raise RuntimeError("broken on purpose")
    with caplog.at_level(logging.ERROR, logger="ondemand.tasks"):
        task = group.spawn(fail(), "failing")
        with pytest.raises(RuntimeError):
            await task
        await asyncio.sleep(0)
        assert await group.spawn(asyncio.sleep(0, "fine"), "fine") == "fine"  # a success: nothing logged
        quiet = group.spawn(asyncio.sleep(60), "sleeping")
        await asyncio.sleep(0)
        quiet.cancel()
        with pytest.raises(asyncio.CancelledError):
            await quiet
        await asyncio.sleep(0)
    (record,) = [r for r in caplog.records if r.name == "ondemand.tasks"]
    assert record.getMessage() == "task owner:failing failed" and record.exc_info[1].args == ("broken on purpose",)
    assert len(group) == 0


async def test_close_cancels_each_task_with_its_reason_and_waits_for_it_to_end():
    group = TaskGroup("owner")
    reasons, cleaned = [], []

    async def long():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError as exc:
            reasons.append(exc.args)
            await asyncio.sleep(0.05)  # its clean-up takes a while: close waits for it
            cleaned.append(1)
            raise
    tasks = [group.spawn(long(), f"t{i}") for i in range(3)]
    await asyncio.sleep(0)
    await group.close("test over")
    assert reasons == [("test over",)] * 3 and cleaned == [1, 1, 1]
    assert all(t.cancelled() for t in tasks) and len(group) == 0


async def test_close_cancels_again_a_task_that_swallowed_its_cancellation(caplog):
    group = TaskGroup("owner")
    cancels = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) == 2:
                    raise
                asyncio.current_task().uncancel()  # as wait_for could lose one (CPython gh-86296)
    task = group.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="ondemand.tasks"):
        await asyncio.wait_for(group.close(), 10)
    assert task.cancelled() and cancels == [1, 1]
    assert "task owner:stubborn ignored its cancellation; cancelling again" in caplog.text


async def test_finish_lets_the_tasks_end_on_their_own_within_its_time_then_cancels_the_rest():
    group = TaskGroup("owner")
    ends = []

    async def short():
        await asyncio.sleep(0.05)
        ends.append("short")

    async def endless():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ends.append("cancelled")
            raise
    group.spawn(short(), "short")
    group.spawn(endless(), "endless")
    await group.finish(0.5)
    assert sorted(ends) == ["cancelled", "short"] and len(group) == 0


async def test_finish_cancelled_while_it_waits_still_cancels_what_is_left():
    """A second Ctrl-C during shutdown's grace: the tasks must not outlive it (the store they
    write to closes next)."""
    group = TaskGroup("owner")
    task = group.spawn(asyncio.sleep(60), "endless")
    finishing = asyncio.ensure_future(group.finish(30))
    await asyncio.sleep(0.05)
    finishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await finishing
    assert task.cancelled() and len(group) == 0
