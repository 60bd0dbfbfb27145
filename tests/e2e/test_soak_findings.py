"""Defects the soak and the crash test found (scripts/soak.py, scripts/crash.py), each pinned
by a test that fails without its fix."""
from __future__ import annotations

import logging

import aiohttp
from helpers import dep_fields, running_deployer

from ondemand.gateway import answers
from ondemand.http.body import Body
from ondemand.model import Mode, State


async def test_a_client_gone_after_the_last_chunk_is_no_internal_error():
    """A client that hangs up after the engine's last chunk, before the end of the chunked
    answer, made write_eof raise: the gateway logged "failed" with a traceback, and aiohttp
    a second one. It is a hang-up like any other."""
    class Engine:  # the engine connection's side of the body: nothing to pause here
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...

    class Up:
        content = Body(Engine(), 2 ** 16)

    Up.content.arrived([b"data: [DONE]\n\n"])
    Up.content.feed_eof()

    class Out:
        offered: list[bytes] = []

        def write_now(self, chunk: bytes) -> bool:
            return False

        async def write(self, chunk: bytes) -> None:
            self.offered.append(chunk)

        async def end(self, chunk: bytes = b"") -> None:
            self.offered.append(chunk)
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    out = Out()
    await answers.pump(out, Up())  # type: ignore[arg-type]  # returns: no exception out of it
    assert out.offered == [b"data: [DONE]\n\n"]  # the last chunk went with the end


async def test_a_switch_to_always_on_cut_by_a_crash_is_not_left_pending(tmp_path, store, caplog):
    """`mode set ID always_on` of a stopped deployment writes the pending mode, then admits the
    start: two transactions. A SIGKILL between them left the row stopped with the switch
    pending, and after the restart nothing would ever start it, while requests waited for
    that start until their timeout and the reaper and make-room never touched it. At start-up
    such a switch is cleared (as a refused start clears it): the deployment is on demand."""
    row = await store.insert_deployment(dep_fields("a", 10, "on_demand", state="stopped"))
    await store.update_deployment(row["id"], pending_mode=Mode.ALWAYS_ON)
    caplog.set_level(logging.INFO, "ondemand.engines.deployer")
    async with running_deployer(tmp_path, store) as d:
        dep = d.get(row["id"])
        assert dep.state is State.STOPPED and dep.mode is Mode.ON_DEMAND and dep.pending_mode is None
    stored = [r for r in await store.deployments() if r["id"] == row["id"]][0]
    assert stored["pending_mode"] is None and stored["mode"] == "on_demand"
    assert "switch to always_on was cut short" in caplog.text


async def test_a_client_gone_before_an_error_answer_is_written_is_no_internal_error(tmp_path, monkeypatch, caplog):
    """An answer the gateway writes itself (an error, a health check) to a client that has
    gone: write_eof raised out of the handler and aiohttp logged "Error handling request"
    with a traceback. It is a hang-up; aiohttp's own end of the request copes with it."""
    from aiohttp import web
    from helpers import run_app

    async def gone(self, data=b""):
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async with run_app(tmp_path) as srv:
        monkeypatch.setattr(web.Response, "write_eof", gone)
        caplog.set_level(logging.INFO)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            try:
                async with s.post(srv.gw(999, "chat/completions"), json={}, headers=srv.auth()) as r:
                    await r.read()
            except aiohttp.ClientError:
                pass  # nothing was written: the server closed the connection
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
