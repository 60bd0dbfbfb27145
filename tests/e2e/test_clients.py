"""The official OpenAI Python SDK against the whole gateway end to end.

A real ``openai.AsyncOpenAI`` (base_url = the gateway's /ondemand/{id}/v1, the
on-demand key as api_key, ``max_retries=0`` so an SDK retry never hides an
error) talks to ondemand on loopback (the ``server`` fixture), which starts the engine
simulator as a process. Nothing on the client side is a double: what passes
here is what the SDK itself parses, validates and raises.

Memory pressure, as in test_gateway: a 15 GiB deployment started and held busy
(a slot in flight, so make-room may not stop it) leaves too little of the 24 GiB
for a 12 GiB one, which therefore queues; freeing it (release the slot, mark it
idle for its full timeout, fresh engine metrics) lets make-room stop the big
one and start the queued one.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import openai
import pytest
from helpers import wait_for
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseCreatedEvent

from ondemand import app as app_mod

pytestmark = pytest.mark.clients

HI = [{"role": "user", "content": "hello there"}]
TEXT = " ".join(f"tok{i}" for i in range(16))  # the simulator's default answer
NOTICE = "[ondemand] X is waiting for GPU memory (place 1 of 1); your answer follows.\n\n"
HEALTH = {"x-dgxmm-health-check": "1"}


@contextlib.asynccontextmanager
async def sdk(server, dep_id, key: str | None = None):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/ondemand/{dep_id}/v1", api_key=key or server.key,
                                max_retries=0, timeout=30)
    try:
        yield client
    finally:
        await client.close()


async def pressure(server):
    """big (15 GiB) ready and busy, x (12 GiB, served as "X") stopped: a request for x queues."""
    big = await server.add("big", 15)
    x = await server.add("x", 12)
    await server.deployer.restart(big)
    slot = await server.admission.acquire(big)
    return big, x, slot


async def relieve(server, big, slot):
    """Let make-room stop big: no slot, idle for its full timeout, engine metrics say idle."""
    slot.release()
    server.controller.record(big).last_activity = 0
    await server.app[app_mod.SAMPLER].sample_once()


async def queued(server, x):
    await wait_for(lambda: x in server.controller.queue, timeout=10, what=f"{x} queued for memory")


# --- chat completions --------------------------------------------------------------------


async def test_cold_start_chat_is_parsed_by_the_sdk(server):
    a = await server.add("a", 10, "--startup-delay", "0.3")
    assert server.state(a) == "stopped"
    async with sdk(server, a) as client:
        raw = await client.chat.completions.with_raw_response.create(model="A", messages=HI)
        answer = raw.parse()
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/json")
    assert int(raw.headers["content-length"]) == len(raw.content)
    assert isinstance(answer, ChatCompletion)
    assert answer.object == "chat.completion" and answer.model == "A" and answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == TEXT
    assert choice.finish_reason == "stop" and answer.usage.completion_tokens == 16
    assert server.state(a) == "ready"
    assert server.controller.inflight(a) == 0 and server.controller.status(a)["last_request_at"] is not None


async def test_streaming_chat_chunks_have_content(server):
    a = await server.add("a")
    async with sdk(server, a) as client:
        stream = await client.chat.completions.create(model="A", messages=HI, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    assert all(isinstance(c, ChatCompletionChunk) and c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert server.state(a) == "ready"
    await wait_for(lambda: server.controller.inflight(a) == 0, what="slot released after the stream")


async def test_queued_streaming_chat_first_chunk_is_the_notice(server):
    big, x, slot = await pressure(server)
    async with sdk(server, x) as client:
        # The gateway answers 200 + SSE headers as soon as the request queues,
        # so create() returns while x is still stopped.
        stream = await client.chat.completions.create(model="X", messages=HI, stream=True)
        assert stream.response.status_code == 200
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        first = await stream.__anext__()
        assert isinstance(first, ChatCompletionChunk)
        assert first.id == "ondemand-queued" and first.object == "chat.completion.chunk" and first.model == "X"
        assert first.choices[0].delta.content == NOTICE and first.choices[0].finish_reason is None
        assert server.state(x) == "stopped" and server.controller.status(x)["phase"] == "queued"
        await relieve(server, big, slot)
        rest = [c async for c in stream]
    assert rest and all(isinstance(c, ChatCompletionChunk) for c in rest)
    assert all(c.id != "ondemand-queued" and c.id.startswith("chatcmpl-") and c.model == "X" for c in rest)
    assert "".join(c.choices[0].delta.content or "" for c in rest) == TEXT
    assert rest[-1].choices[0].finish_reason == "stop"
    assert server.state(big) == "stopped" and server.state(x) == "ready"


async def test_queued_stream_through_the_sdk_stream_helper_accumulates_a_valid_message(server):
    big, x, slot = await pressure(server)
    async with sdk(server, x) as client, client.chat.completions.stream(model="X", messages=HI) as stream:
        events = aiter(stream)
        first = await anext(events)
        assert first.type == "chunk" and first.chunk.id == "ondemand-queued"
        await relieve(server, big, slot)
        async for _ in events:
            pass
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == NOTICE + TEXT  # this part holds
    # Appending this message to the history is what a chat client does next; the
    # next request would then carry role "assistantassistant".
    assert message.role == "assistant"


async def test_queued_answers_that_wait_silently(server):
    """Five requests queue for x together; none gets an early 200. Then:
    plain chat and plain Responses get the notice prepended to their text
    (Content-Length recomputed), structured output (json_object) gets none,
    streaming or not, and a Responses stream begins with response.created."""
    big, x, slot = await pressure(server)
    async with sdk(server, x) as client:
        chat = client.chat.completions
        calls = {
            "chat": chat.with_raw_response.create(model="X", messages=HI),
            "response": client.responses.with_raw_response.create(model="X", input="hi"),
            "json": chat.create(model="X", messages=HI, response_format={"type": "json_object"}),
            "json_stream": chat.create(model="X", messages=HI, response_format={"type": "json_object"},
                                       stream=True),
            "responses_stream": client.responses.create(model="X", input="hi", stream=True),
        }
        tasks = {k: asyncio.ensure_future(c) for k, c in calls.items()}
        await queued(server, x)
        await wait_for(lambda: server.controller.status(x)["queued"] == len(tasks), what="all five waiting")
        # Stays: a window in which nothing may happen (no answer before the engine is ready).
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks.values())  # nothing is sent before the engine answers
        await relieve(server, big, slot)
        done = {k: await t for k, t in tasks.items()}

        # plain chat: the notice in front of the content, and the SDK parses it
        raw = done["chat"]
        answer = raw.parse()
        assert isinstance(answer, ChatCompletion) and answer.id.startswith("chatcmpl-")
        assert answer.choices[0].message.content == NOTICE + TEXT
        assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens == 16
        assert int(raw.headers["content-length"]) == len(raw.content)  # recomputed: the body grew

        # plain Responses: the notice in the first output_text part
        raw = done["response"]
        response = raw.parse()
        assert isinstance(response, Response) and response.output_text == NOTICE + TEXT
        assert int(raw.headers["content-length"]) == len(raw.content)

        # structured output: exactly the engine's text, streaming or not
        assert isinstance(done["json"], ChatCompletion) and done["json"].choices[0].message.content == TEXT
        chunks = [c async for c in done["json_stream"]]
        assert all(c.id != "ondemand-queued" for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT

        # Responses stream: typed events from response.created on, no notice anywhere
        events = [e async for e in done["responses_stream"]]
        assert isinstance(events[0], ResponseCreatedEvent)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
        assert events[-1].type == "response.completed" and events[-1].response.output_text == TEXT

        # a request that did not queue gets the engine's answer untouched
        again = await chat.create(model="X", messages=HI)
        assert again.choices[0].message.content == TEXT
    assert server.state(big) == "stopped" and server.state(x) == "ready"


# --- embeddings ------------------------------------------------------------------------------


async def test_embeddings_cold_start(server):
    e = await server.add("e")
    async with sdk(server, e) as client:
        # the SDK asks for base64 unless told otherwise and decodes it itself
        answer = await client.embeddings.create(model="E", input=["first text", "second"])
        floats = await client.embeddings.create(model="E", input="first text", encoding_format="float",
                                                dimensions=4)
    assert isinstance(answer, CreateEmbeddingResponse) and answer.model == "E"
    assert [d.index for d in answer.data] == [0, 1]
    for d in answer.data:
        assert len(d.embedding) == 8 and all(isinstance(v, float) for v in d.embedding)
        assert abs(sum(v * v for v in d.embedding) - 1) < 1e-3  # unit vectors: decoded right
    assert answer.data[0].embedding != answer.data[1].embedding
    assert len(floats.data[0].embedding) == 4
    assert answer.usage.prompt_tokens == 3 and server.state(e) == "ready"


# --- Responses API ---------------------------------------------------------------------------


async def test_responses_plain_and_streaming(server):
    a = await server.add("a")
    async with sdk(server, a) as client:
        answer = await client.responses.create(model="A", input="hello there")
        assert isinstance(answer, Response) and answer.status == "completed" and answer.output_text == TEXT
        stream = await client.responses.create(model="A", input="hello there", stream=True)
        events = [e async for e in stream]
    assert isinstance(events[0], ResponseCreatedEvent) and events[0].type == "response.created"
    assert events[0].response.status == "in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == TEXT
    assert events[-1].type == "response.completed" and events[-1].response.output_text == TEXT


# --- LiteLLM's health check ------------------------------------------------------------------


async def test_health_check_as_litellm_sends_it(server):
    a = await server.add("a")
    before = server.controller.status(a)
    async with sdk(server, a) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="A", messages=[{"role": "user", "content": "ping"}], max_tokens=1, extra_headers=HEALTH)
        answer = raw.parse()
        assert raw.headers["x-dgxmm-ondemand-state"] == "stopped"
        assert isinstance(answer, ChatCompletion) and answer.object == "chat.completion" and answer.model == "A"
        assert answer.choices[0].message.content == "" and answer.choices[0].message.role == "assistant"
        assert answer.choices[0].finish_reason == "stop" and answer.usage.total_tokens == 0
        # the other shapes LiteLLM may probe parse too
        resp = await client.responses.create(model="A", input="ping", extra_headers=HEALTH)
        assert isinstance(resp, Response) and resp.output_text == "" and resp.status == "completed"
        emb = await client.embeddings.create(model="A", input="ping", extra_headers=HEALTH)
        assert isinstance(emb, CreateEmbeddingResponse) and emb.data[0].embedding == []
    assert server.state(a) == "stopped"
    assert server.controller.status(a) == before
    assert server.controller.waiting() == 0


# --- errors as the SDK's exceptions ----------------------------------------------------------


async def test_wrong_key_is_authentication_error(server):
    a = await server.add("a")
    async with sdk(server, a, key=server.key + "x") as client:
        with pytest.raises(openai.AuthenticationError) as exc:
            await client.chat.completions.create(model="A", messages=HI)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    assert exc.value.type == "authentication_error"
    assert server.state(a) == "stopped"


async def test_start_failure_is_503_start_failed(server):
    a = await server.add("a", 10, "--fail", "exit-at-start")
    async with sdk(server, a) as client:
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model="A", messages=HI)
        assert isinstance(exc.value, openai.APIStatusError)
        assert exc.value.status_code == 503 and exc.value.code == "start_failed"
        assert exc.value.type == "server_error"
        # refused for the backoff: the same error, streaming too (nothing queued, so no notice), no second start
        with pytest.raises(openai.InternalServerError) as again:
            await client.chat.completions.create(model="A", messages=HI, stream=True)
        assert again.value.status_code == 503 and again.value.code == "start_failed"
        assert "refused" in again.value.message
    assert server.state(a) == "failed"
    starts = [e for e in await server.deployer.store.events(a) if e["text"] == "Started for a request"]
    assert len(starts) == 1


@pytest.mark.server(ondemand_queue_timeout_s=1)
async def test_queue_timeout_is_503(server):
    big, x, slot = await pressure(server)
    async with sdk(server, x) as client:

        async def plain_chat():
            with pytest.raises(openai.InternalServerError) as exc:
                await client.chat.completions.create(model="X", messages=HI)
            return exc.value

        async def responses_stream():
            with pytest.raises(openai.InternalServerError) as exc:
                await client.responses.create(model="X", input="hi", stream=True)
            return exc.value

        async def chat_stream():
            # already 200 with the notice: the timeout arrives in the stream
            stream = await client.chat.completions.create(model="X", messages=HI, stream=True)
            seen = []
            with pytest.raises(openai.APIError) as exc:
                async for chunk in stream:
                    seen.append(chunk)
            assert [c.id for c in seen] == ["ondemand-queued"]
            return exc.value

        t = time.monotonic()
        plain, typed, streamed = await asyncio.gather(plain_chat(), responses_stream(), chat_stream())
        took = time.monotonic() - t
    for err in (plain, typed):
        assert err.status_code == 503 and err.code == "ondemand_queue_timeout"
    assert not isinstance(streamed, openai.APIStatusError)  # in-band: no status to give
    assert streamed.code == "ondemand_queue_timeout" and streamed.type == "server_error"
    assert 0.9 < took < 5
    assert server.controller.waiting() == 0 and server.state(x) == "stopped"
    slot.release()
