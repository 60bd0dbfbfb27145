"""The simulator's generation routes (ondemand/sim/generation.py) on a real simulator on
127.0.0.1, spoken to over HTTP: chat, completions, responses and messages, streamed and not, in
their APIs' shapes with the deterministic tokens; embeddings, rerank, score, batches and
transcriptions; the body's checks; the --max-running queue as the metrics count it; and the
timing of --prefill-rate and --token-delay."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from sim_helpers import CHAT, metrics_until, simulator, sse


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
