"""The engine double: real servers on 127.0.0.1, port 0, spoken to over HTTP."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from helpers import ROOT

from ondemand.sim.engine import SimOptions, SimServer, main, parse_args


@contextlib.asynccontextmanager
async def simulator(**kw):
    kw.setdefault("model", "demo")
    server = SimServer(SimOptions(port=0, **kw), shutdown_timeout=0.1)
    port = await server.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield session
    finally:
        await server.stop()


@pytest.fixture
async def sim():
    async with simulator() as session:
        yield session


def sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) of each SSE message."""
    out = []
    assert text.endswith("\n\n")
    for block in text[:-2].split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            else:
                assert field == "data", line
                data.append(value)
        out.append((event, "\n".join(data)))
    return out


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "say something nice"}]}


async def test_models(sim):
    async with sim.get("/v1/models") as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "demo" and card["object"] == "model"
    assert card["owned_by"] == "ondemand-simulator"
    assert card["root"] == "demo" and card["max_model_len"] == 4096 and isinstance(card["created"], int)
    async with sim.get("/v1/models/demo") as r:
        assert r.status == 200 and (await r.json())["id"] == "demo"
    async with sim.get("/v1/models/other") as r:
        assert r.status == 404
        assert (await r.json())["error"] == {"message": "The model `other` does not exist.",
                                             "type": "NotFoundError", "param": "model", "code": 404}


async def test_health_is_503_during_startup_delay():
    t0 = time.monotonic()
    async with simulator(startup_delay=0.5) as s:
        for path in ("/health", "/v1/models"):
            async with s.get(path) as r:
                assert r.status == 503
        async with s.post("/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503
        async with s.get("/_sim/requests") as r:
            assert r.status == 200 and len(await r.json()) == 3
        while True:
            async with s.get("/health") as r:
                if r.status == 200:
                    assert await r.read() == b""
                    break
                assert r.status == 503
            await asyncio.sleep(0.02)
        assert time.monotonic() - t0 >= 0.5
        async with s.get("/v1/models") as r:
            assert r.status == 200


async def test_never_ready():
    async with simulator(fail="never-ready") as s, s.get("/health") as r:
        assert r.status == 503
        assert (await r.json())["error"]["message"] == "Loading model"


async def test_chat_non_stream(sim):
    async with sim.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "chat.completion" and body["model"] == "demo"
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == " ".join(f"tok{i}" for i in range(16))
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19,
                             "prompt_tokens_details": None}
    async with sim.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4}) as r:
        body = await r.json()
    assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3"
    assert body["choices"][0]["finish_reason"] == "length"
    async with sim.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "ignore_eos": True}) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 40


async def test_chat_stream(sim):
    req = {**CHAT, "stream": True, "max_tokens": 5}
    async with sim.post("/v1/chat/completions", json=req) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:]] == ["tok0", " tok1", " tok2", " tok3", " tok4"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None] * 4 + ["length"]
    assert all("usage" not in c for c in chunks)

    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with sim.post("/v1/chat/completions", json=req) as r:
        events = sse(await r.text())
    last = json.loads(events[-2][1])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
    assert json.loads(events[-3][1])["choices"][0]["finish_reason"] == "stop"


async def test_completions(sim):
    req = {"model": "demo", "prompt": "once upon a time", "max_tokens": 3}
    async with sim.post("/v1/completions", json=req) as r:
        body = await r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "tok0 tok1 tok2" and body["usage"]["prompt_tokens"] == 4
    async with sim.post("/v1/completions", json={**req, "stream": True}) as r:
        events = sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    assert "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1]) == "tok0 tok1 tok2"


async def test_responses(sim):
    req = {"model": "demo", "input": "hello there", "max_output_tokens": 100}
    async with sim.post("/v1/responses", json=req) as r:
        body = await r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["text"].startswith("tok0 tok1")
    assert body["usage"]["input_tokens"] == 2 and body["usage"]["output_tokens"] == 16

    async with sim.post("/v1/responses", json={**req, "stream": True, "max_output_tokens": 2}) as r:
        events = sse(await r.text())
    types = [e for e, _ in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    datas = [json.loads(d) for _, d in events]
    assert [d["type"] for d in datas] == types
    assert [d["sequence_number"] for d in datas] == list(range(len(types)))
    assert "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta") == "tok0 tok1"
    assert datas[-1]["response"]["output"][0]["content"][0]["text"] == "tok0 tok1"
    assert datas[-1]["response"]["status"] == "incomplete"


async def test_messages(sim):
    req = {"model": "demo", "max_tokens": 1024, "messages": [{"role": "user", "content": "hi"}]}
    async with sim.post("/v1/messages", json=req) as r:
        body = await r.json()
    assert body["type"] == "message" and body["stop_reason"] == "end_turn"
    assert body["content"][0]["type"] == "text" and body["usage"] == {"input_tokens": 1, "output_tokens": 16}

    async with sim.post("/v1/messages", json={**req, "stream": True, "max_tokens": 3}) as r:
        events = sse(await r.text())
    assert [e for e, _ in events] == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + [
        "content_block_stop", "message_delta", "message_stop", None]
    datas = [json.loads(d) for e, d in events if e]
    assert all(d["type"] == e for d, (e, _) in zip(datas, events))
    assert "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta") == "tok0 tok1 tok2"
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"


async def metrics_until(session, *lines: str) -> str:
    """The metrics text once it holds every line (a stream's end is seen by the server a token later)."""
    for _ in range(300):
        async with session.get("/metrics") as r:
            text = await r.text()
        if all(line + "\n" in text for line in lines):
            return text
        await asyncio.sleep(0.01)
    raise AssertionError(f"{lines} not in {text}")


async def test_metrics_count_running_and_waiting():
    running, waiting = 'vllm:num_requests_running{model_name="demo"}', 'vllm:num_requests_waiting{model_name="demo"}'
    async with simulator(token_delay=0.02, tokens=500, max_running=1) as s:
        r = await s.post("/v1/chat/completions", json={**CHAT, "stream": True})
        await r.content.readuntil(b"\n\n")
        queued = asyncio.ensure_future(s.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}))
        await metrics_until(s, f"{running} 1.0", f"{waiting} 1.0")
        r.close()  # the slow stream's client leaves; the queued request gets its turn
        async with await queued as q:
            assert q.status == 200
        await metrics_until(s, f"{running} 0.0", f"{waiting} 0.0")


async def test_llamacpp_flavor():
    async with simulator(flavor="llamacpp", token_delay=0.02, tokens=500) as s:
        async with s.get("/health") as r:
            assert await r.json() == {"status": "ok"}
        r = await s.post("/v1/chat/completions", json={**CHAT, "stream": True, "model": "any"})
        await r.content.readuntil(b"\n\n")
        await metrics_until(s, "llamacpp:requests_processing 1", "llamacpp:requests_deferred 0")
        r.close()
        await metrics_until(s, "llamacpp:requests_processing 0")


async def test_sleep_and_wake_up(sim):
    async with sim.get("/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    async with sim.post("/sleep?level=1") as r:
        assert r.status == 200
    async with sim.get("/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": True}
    async with sim.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
    async with sim.get("/health") as r:
        assert r.status == 200
    async with sim.post("/wake_up") as r:
        assert r.status == 200
    async with sim.get("/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    async with sim.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200


async def test_requests_are_recorded():
    async with simulator(record_limit=3) as s:
        async with s.post("/v1/chat/completions?x=1", json=CHAT, headers={"X-Tenant": "acme"}) as r:
            assert r.status == 200
        async with s.get("/_sim/requests") as r:
            [rec] = await r.json()
        assert rec["method"] == "POST" and rec["path"] == "/v1/chat/completions" and rec["query"] == "x=1"
        assert ["X-Tenant", "acme"] in rec["headers"]
        assert json.loads(rec["body"]) == CHAT
        for _ in range(4):
            await (await s.get("/health")).release()
        async with s.get("/_sim/requests") as r:
            assert [x["path"] for x in await r.json()] == ["/health"] * 3
        async with s.delete("/_sim/requests") as r:
            assert r.status == 204
        async with s.get("/_sim/requests") as r:
            assert await r.json() == []


async def test_errors(sim):
    async with sim.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}) as r:
        assert r.status == 404
        assert (await r.json())["error"] == {"message": "The model `gpt-4` does not exist.",
                                             "type": "NotFoundError", "param": "model", "code": 404}
    async with sim.post("/v1/chat/completions", data=b'{"model":', headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400
    async with sim.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}) as r:
        assert r.status == 400
    async with sim.get("/nowhere") as r:
        assert r.status == 404 and await r.json() == {"detail": "Not Found"}


async def test_other_routes(sim):
    async with sim.post("/v1/embeddings", json={"model": "demo", "input": ["a b", "c"]}) as r:
        body = await r.json()
    assert [d["index"] for d in body["data"]] == [0, 1] and len(body["data"][0]["embedding"]) == 8
    async with sim.post("/v1/embeddings", json={"input": "a b"}) as r:
        assert (await r.json())["data"][0]["embedding"] == body["data"][0]["embedding"]
    async with sim.post("/v1/rerank", json={"query": "q", "documents": ["a", "b", "c"], "top_n": 2}) as r:
        results = (await r.json())["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    async with sim.post("/v1/score", json={"text_1": "q", "text_2": ["a", "b"]}) as r:
        assert [d["index"] for d in (await r.json())["data"]] == [0, 1]
    async with sim.post("/v1/chat/completions/batch", json={"messages": [CHAT["messages"]] * 2}) as r:
        assert [c["index"] for c in (await r.json())["choices"]] == [0, 1]
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
    form.add_field("model", "demo")
    async with sim.post("/v1/audio/transcriptions", data=form) as r:
        assert r.status == 200 and "text" in await r.json()


def test_parse_args():
    o = parse_args(["--port", "9", "--model", "m", "--flavor", "llamacpp", "--fail", "exit-after", "2.5",
                    "--token-delay", "0.1", "--tokens", "4", "--startup-delay", "1"])
    assert (o.port, o.model, o.flavor, o.fail, o.fail_after, o.token_delay, o.tokens, o.startup_delay) == (
        9, "m", "llamacpp", "exit-after", 2.5, 0.1, 4, 1.0)
    assert parse_args([]).host == "127.0.0.1"
    for bad in (["--fail", "exit-after"], ["--fail", "crash-mid-stream", "1"], ["--fail", "explode"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_exit_at_start_in_process(capsys):
    assert main(["--fail", "exit-at-start"]) == 3
    assert "exit-at-start" in capsys.readouterr().err


async def spawn(*args: str, env: dict[str, str] | None = None):
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ondemand.sim.engine", "--port", "0", "--model", "demo", *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def started(proc) -> int:
    line = (await asyncio.wait_for(proc.stderr.readline(), 5)).decode()
    assert line.startswith("ondemand simulator (not a real engine) serving demo on 127.0.0.1:"), line
    return int(line.rsplit(":", 1)[1])


async def test_exit_at_start_subprocess():
    proc = await spawn("--fail", "exit-at-start")
    _, err = await asyncio.wait_for(proc.communicate(), 5)
    assert proc.returncode == 3 and b"exit-at-start" in err


async def test_crash_mid_stream_subprocess():
    proc = await spawn("--fail", "crash-mid-stream")
    try:
        port = await started(proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200
            received = []
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json={**CHAT, "stream": True}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            received.append(line[6:].strip())
        assert await asyncio.wait_for(proc.wait(), 5) == 1
        assert len(received) == 4 and b"[DONE]" not in received  # the role chunk, then 3 tokens
        assert json.loads(received[-1])["choices"][0]["delta"]["content"] == " tok2"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_exit_after_subprocess():
    proc = await spawn("--fail", "exit-after", "0.2")
    try:
        await started(proc)
        assert await asyncio.wait_for(proc.wait(), 5) == 1
        assert b"exit-after" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_stops_cleanly():
    proc = await spawn()
    try:
        await started(proc)
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_journal_records_requests_and_the_inflight_at_sigterm(tmp_path):
    """--journal: boot, each request's path and header names (no values), its end, and at
    SIGTERM the generation requests still in flight; the file outlives the process."""
    journal = tmp_path / "journal.jsonl"
    proc = await spawn("--journal", str(journal), "--token-delay", "0.5", "--tokens", "20")
    try:
        port = await started(proc)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                              headers={"Authorization": "Bearer sk-secret", "X-Other": "v"}) as r:
                assert r.status == 200
            stream = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "stream": True})
            await stream.content.readline()  # it is being generated now
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            stream.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = journal.read_text()
    assert "sk-secret" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [e["ev"] for e in lines[:3]] == ["boot", "req", "end"]
    assert {e["pid"] for e in lines} == {proc.pid}
    assert "authorization" in lines[1]["h"] and "x-other" in lines[1]["h"]
    assert lines[1]["path"] == "/v1/chat/completions"
    sigterm = [e for e in lines if e["ev"] == "sigterm"]
    assert len(sigterm) == 1 and sigterm[0]["inflight"] == 1


def test_it_takes_the_flags_the_recipes_write_and_refuses_others():
    """The simulator stands in for the engines a recipe starts: their flags as
    recipes.launch writes them are accepted, the served name is vLLM's
    (--served-model-name, else the model), and an unknown flag exits 2 as vLLM does."""
    from ondemand.engines.recipes import Box, launch
    from ondemand.model import Deployment
    for engine, model in (("vllm", "org/m"), ("sglang", "org/m"), ("llamacpp", "/srv/m.gguf")):
        dep = Deployment(id=1, name="d", served_name="served", engine=engine, model=model, memory_gib=8, gpu_count=2)
        argv = launch(dep, Box(backend="process", commands={engine: ()}), gpu_size_gib=80).args
        opts = parse_args([a.replace("{port}", "0") for a in argv])
        assert opts.model == "served" and opts.port == 0, (engine, argv)
    assert parse_args(["org/m"]).model == "org/m"
    assert parse_args(["--model", "legacy"]).model == "legacy"  # the tests' and the demo's older form
    with pytest.raises(SystemExit) as exit_:
        parse_args(["org/m", "--no-such-flag"])
    assert exit_.value.code == 2


# -- sleep levels (issue 22) ------------------------------------------------------------------

TOKS = " ".join(f"tok{i}" for i in range(16))
GARBAGE = " ".join(f"garbage{i}" for i in range(16))


async def content(s) -> str:
    async with s.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["message"]["content"]


async def state(s) -> dict:
    async with s.get("/_sim/state") as r:
        assert r.status == 200
        return await r.json()


async def call(s, method: str, path: str, status: int = 200, **kw):
    async with s.request(method, path, **kw) as r:
        assert r.status == status, (path, r.status, await r.text())
        return await r.json() if r.content_type == "application/json" else await r.read()


def awake(**kw) -> dict:
    return {"sleeping": {"weights": False, "kv_cache": False}, "level": 0, "garbage": False, **kw}


async def test_level_1_keeps_the_weights(sim):
    assert await content(sim) == TOKS
    await call(sim, "POST", "/sleep")  # level 1 by default
    assert await state(sim) == {"sleeping": {"weights": True, "kv_cache": True}, "level": 1, "garbage": False,
                                "wakes": 0, "sleeps": 1}
    await call(sim, "POST", "/v1/chat/completions", 503, json=CHAT)
    await call(sim, "POST", "/v1/completions", 503, json={"prompt": "x"})
    for path in ("/health", "/v1/models", "/metrics"):  # as vLLM: they answer while asleep
        await call(sim, "GET", path)
    await call(sim, "POST", "/sleep?level=1")  # asleep already: nothing changes
    assert (await state(sim))["sleeps"] == 1
    await call(sim, "POST", "/wake_up")
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": False}
    assert await state(sim) == awake(wakes=1, sleeps=1)
    assert await content(sim) == TOKS  # the same deterministic answer


async def test_level_2_answers_garbage_until_the_weights_are_reloaded(sim):
    await call(sim, "POST", "/sleep?level=2")
    await call(sim, "POST", "/wake_up?tags=weights")
    st = await state(sim)
    assert st["sleeping"] == {"weights": False, "kv_cache": True} and st["level"] == 2 and st["garbage"]
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": True}
    await call(sim, "POST", "/v1/chat/completions", 503, json=CHAT)  # the KV cache still sleeps
    assert await call(sim, "POST", "/collective_rpc", json={"method": "reload_weights"}) == {"results": [None]}
    assert not (await state(sim))["garbage"]
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": True}
    await call(sim, "POST", "/wake_up?tags=kv_cache")
    await call(sim, "POST", "/reset_prefix_cache")
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": False}
    assert await content(sim) == TOKS
    # A plain wake after level 2, without the reload: 200, but garbage, in every generation route.
    await call(sim, "POST", "/sleep?level=1")
    await call(sim, "POST", "/sleep?level=2")  # deeper: the weights are dropped after all
    assert (await state(sim))["level"] == 2
    await call(sim, "POST", "/wake_up")
    assert await content(sim) == GARBAGE
    body = await call(sim, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert body["choices"][0]["text"] == "garbage0 garbage1"
    req = {**CHAT, "stream": True, "max_tokens": 2}
    events = sse((await call(sim, "POST", "/v1/chat/completions", json=req)).decode())
    assert [json.loads(d)["choices"][0]["delta"]["content"] for _, d in events[1:-1]] == ["garbage0", " garbage1"]
    await call(sim, "POST", "/collective_rpc", json={"method": "reload_weights"})
    assert await content(sim) == TOKS
    assert await state(sim) == awake(wakes=3, sleeps=3)


async def test_sleep_and_rpc_errors(sim):
    for level in ("0", "3", "x", ""):
        err = (await call(sim, "POST", f"/sleep?level={level}", 400))["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == "level"
    assert not (await state(sim))["sleeping"]["weights"]
    await call(sim, "POST", "/collective_rpc", 400, json={"method": "explode"})
    await call(sim, "POST", "/collective_rpc", 400, json={})
    await call(sim, "POST", "/sleep?level=2")
    await call(sim, "POST", "/wake_up?tags=gpu", 400)
    await call(sim, "POST", "/collective_rpc", 400, json={"method": "reload_weights"})  # the weights sleep
    await call(sim, "POST", "/wake_up?tags=kv_cache&tags=weights")
    assert (await state(sim))["sleeping"] == {"weights": False, "kv_cache": False}
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk"):
        await call(sim, "POST", path, 404, json={})  # SGLang's routes are not vLLM's


async def test_sleep_and_wake_delays():
    async with simulator(sleep_delay=0.2, wake_delay=0.3) as s:
        t0 = time.monotonic()
        await call(s, "POST", "/sleep")
        assert time.monotonic() - t0 >= 0.2
        t0 = time.monotonic()
        waking = asyncio.ensure_future(call(s, "POST", "/wake_up"))
        await asyncio.sleep(0.1)
        assert (await state(s))["sleeping"]["weights"]  # still waking
        await waking
        assert time.monotonic() - t0 >= 0.3
        assert await state(s) == awake(wakes=1, sleeps=1)


async def test_wake_fails_and_hangs():
    async with simulator(fail="wake-fails") as s:
        await call(s, "POST", "/sleep")
        err = (await call(s, "POST", "/wake_up", 500))["error"]
        assert "wake-fails" in err["message"] and err["code"] == 500
        assert (await state(s))["sleeping"] == {"weights": True, "kv_cache": True}
    async with simulator(fail="wake-hangs") as s:
        await call(s, "POST", "/sleep")
        with pytest.raises(asyncio.TimeoutError):
            await call(s, "POST", "/wake_up", timeout=aiohttp.ClientTimeout(total=0.3))
        assert await call(s, "GET", "/is_sleeping") == {"is_sleeping": True}


async def test_wake_garbage_is_for_good():
    async with simulator(fail="wake-garbage") as s:
        assert await content(s) == TOKS
        await call(s, "POST", "/sleep")
        await call(s, "POST", "/wake_up")
        assert await content(s) == GARBAGE
        await call(s, "POST", "/collective_rpc", json={"method": "reload_weights"})
        assert await content(s) == GARBAGE
        assert (await state(s))["garbage"]


async def test_sglang_flavor():
    async with simulator(flavor="sglang") as s:
        assert await call(s, "GET", "/health") == b""
        assert (await call(s, "GET", "/v1/models"))["data"][0]["id"] == "demo"
        assert "sglang:num_running_reqs" in (await call(s, "GET", "/metrics")).decode()
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/collective_rpc")):
            await call(s, method, path, 404)  # vLLM's routes are not SGLang's
        assert await call(s, "POST", "/release_memory_occupation", json={}) is None
        assert await state(s) == {"sleeping": {"weights": True, "kv_cache": True}, "level": 2, "garbage": True,
                                  "wakes": 0, "sleeps": 1}  # no --enable-weights-cpu-backup: level 2
        await call(s, "POST", "/v1/chat/completions", 503, json=CHAT)
        body = await call(s, "POST", "/update_weights_from_disk", 400, json={"model_path": "org/m"})
        assert body["success"] is False  # the weights still sleep
        await call(s, "POST", "/release_memory_occupation", 400)  # no body: FastAPI's 400
        assert await call(s, "POST", "/resume_memory_occupation", json={}) is None
        assert await content(s) == GARBAGE
        body = await call(s, "POST", "/update_weights_from_disk", json={"model_path": "org/m"})
        assert body["success"] is True and body["message"]
        assert await content(s) == TOKS
        assert await state(s) == awake(wakes=1, sleeps=1)
    async with simulator(flavor="sglang", weights_cpu_backup=True, fail="wake-fails") as s:
        await call(s, "POST", "/release_memory_occupation", json={})
        assert (await state(s))["level"] == 1 and not (await state(s))["garbage"]
        assert "wake-fails" in (await call(s, "POST", "/resume_memory_occupation", 400, json={}))["error"]["message"]


def test_parse_args_sleep_flags():
    o = parse_args(["--sleep-delay", "1.5", "--wake-delay", "2", "--sleep-gpu-mib", "300", "--host-mib", "64",
                    "--flavor", "sglang", "--enable-weights-cpu-backup", "--fail", "wake-hangs"])
    assert (o.sleep_delay, o.wake_delay, o.sleep_gpu_mib, o.host_mib, o.flavor, o.weights_cpu_backup, o.fail) == (
        1.5, 2.0, 300, 64, "sglang", True, "wake-hangs")
    assert parse_args(["--fail", "wake-garbage"]).fail == "wake-garbage"
    assert not parse_args([]).weights_cpu_backup
    for bad in (["--host-mib", "-1"], ["--wake-delay", "-1"], ["--sleep-level", "2"], ["--flavor", "tgi"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(bad)
        assert exit_.value.code == 2


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_host_mib_is_real_memory_while_asleep_at_level_1():
    host = 64
    proc = await spawn("--host-mib", str(host))
    try:
        port = await started(proc)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            before = vm_rss_mib(proc.pid)
            await call(s, "POST", "/sleep?level=1")
            asleep = vm_rss_mib(proc.pid)
            assert asleep - before >= 0.8 * host, (before, asleep)
            await call(s, "POST", "/wake_up")
            woken = vm_rss_mib(proc.pid)
            assert asleep - woken >= host / 2, (asleep, woken)
            await call(s, "POST", "/sleep?level=2")  # level 2 keeps no copy
            assert vm_rss_mib(proc.pid) - woken < host / 2
    finally:
        proc.kill()
        await proc.wait()


async def test_sleep_gpu_mib_and_the_journal(tmp_path):
    apps, journal = tmp_path / "apps", tmp_path / "journal.jsonl"
    env = {**os.environ, "FAKE_NVIDIA_SMI_APPS": str(apps), "CUDA_VISIBLE_DEVICES": "0,3"}
    proc = await spawn("--gpu-mib", "1000", "--sleep-gpu-mib", "150", "--journal", str(journal), env=env)
    try:
        port = await started(proc)
        file = apps / str(proc.pid)
        assert file.read_text() == "0 1000\n3 1000\n"
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            await call(s, "POST", "/sleep?level=2")
            assert file.read_text() == "0 150\n3 150\n"
            await call(s, "POST", "/wake_up?tags=weights")
            assert file.read_text() == "0 150\n3 150\n"  # the KV cache still sleeps
            await call(s, "POST", "/wake_up?tags=kv_cache")
            assert file.read_text() == "0 1000\n3 1000\n"
        assert sorted(p.name for p in apps.iterdir()) == [str(proc.pid)]  # no temporary file left
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 5) == 0
        assert not file.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    marks = [(e["ev"], e.get("level"), e.get("tags")) for e in lines if e["ev"] in ("sleep", "wake")]
    assert marks == [("sleep", 2, None), ("wake", None, ["weights"]), ("wake", None, ["kv_cache"])]
    assert all(e["pid"] == proc.pid and "t" in e for e in lines)


async def test_load_weights_reads_the_checkpoint_and_is_ready_only_after(tmp_path, capfd):
    """--load-weights: the load lasts at least the read of the weight files. The one file here is
    a FIFO the test holds open: until it closes it, the read goes on and the engine answers 503;
    the lines after the load, and readiness, come after the read."""
    model = tmp_path / "tiny"
    model.mkdir()
    fifo = model / "model.safetensors"
    os.mkfifo(fifo)
    opts = parse_args(["--load-weights", str(model), "--served-model-name", "demo", "--startup-delay", "0.3",
                       "--weights-delay", "0.1", "--compile-delay", "0.1"])
    assert opts.weights_path == str(model) and opts.model == "demo"
    server = SimServer(dataclasses.replace(opts, port=0), shutdown_timeout=0.1)
    port = await server.start()
    writer = None
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            writer = await asyncio.to_thread(open, fifo, "wb")  # the reader has opened it: the load began
            writer.write(b"\0" * 4096)
            await asyncio.sleep(0.6)  # past the whole --startup-delay: still loading, the read goes on
            async with s.get("/v1/models") as r:
                assert r.status == 503
            assert "Loading weights took" not in capfd.readouterr().err
            writer.close()
            began = time.monotonic()
            while True:
                async with s.get("/v1/models") as r:
                    if r.status == 200:
                        break
                assert time.monotonic() - began < 5
                await asyncio.sleep(0.02)
            # Ready the startup delay after the start, moved by the read's excess over --weights-delay.
            assert time.monotonic() - began >= 0.1
            err = capfd.readouterr().err
            assert "Loading weights took" in err and err.index("Loading weights took") < err.index("Starting vLLM API")
    finally:
        if writer is not None and not writer.closed:
            writer.close()
        await server.stop()


def test_load_weights_needs_a_local_model(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--load-weights", "org/not-here"])
    assert exit_.value.code == 2
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_args(["--load-weights", "-m", str(gguf)]).weights_path == str(gguf)


async def test_prefill_rate_times_the_first_token_and_the_end():
    """--prefill-rate: the prompt's words at that rate, then the first token at once, each token
    taking --token-delay after it: a stream of 4 tokens after 40 words at 200 words/s has its first
    token after 0.2 s and ends 4 delays later (a replay's engine: TTFT is the prefill)."""
    async with simulator(prefill_rate=200, token_delay=0.1, tokens=100) as s:
        req = {"model": "demo", "prompt": "w " * 40, "max_tokens": 4, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        async with s.post("/v1/completions", json=req) as r:
            first = None
            async for chunk in r.content.iter_any():
                if first is None and b"tok0" in chunk:
                    first = time.monotonic() - t0
            end = time.monotonic() - t0
        assert 0.2 <= first < 0.2 + 0.09  # the prefill, and no token's delay before the first
        assert end >= 0.2 + 4 * 0.1
        t0 = time.monotonic()
        async with s.post("/v1/completions", json={**req, "stream": False, "prompt": "w " * 20}) as r:
            assert (await r.json())["usage"] == {"prompt_tokens": 20, "total_tokens": 24, "completion_tokens": 4,
                                                 "prompt_tokens_details": None}
        assert time.monotonic() - t0 >= 0.1 + 4 * 0.1
    async with simulator(token_delay=0.1, tokens=100) as s:  # without it: a delay before each token, as before
        t0 = time.monotonic()
        async with s.post("/v1/completions", json={**req, "stream": True}) as r:
            async for chunk in r.content.iter_any():
                if b"tok0" in chunk:
                    break
        assert time.monotonic() - t0 >= 0.1
