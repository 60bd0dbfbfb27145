"""Generation: the routes that answer with tokens or scores (chat, completions, responses,
messages, embeddings, rerank, score, transcriptions), what they share (the body's checks, the
answer's length, the deterministic tokens), and their timing (``--token-delay``, the
``--max-running`` queue, a stream cut short by a sleep or ``--fail crash-mid-stream``)."""
from __future__ import annotations

import array
import asyncio
import base64
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import orjson

from .faults import CRASH_AFTER, die
from .memory import Memory
from .options import SimOptions
from .replies import STREAMED, Reply, SimError, answer, text
from .server import Request

GENERATION = frozenset((
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    "/v1/audio/transcriptions", "/v1/chat/completions/batch"))

_SSE = {"Content-Type": "text/event-stream; charset=utf-8"}
_DONE = b"data: [DONE]\n\n"

_TOK: list[str] = []  # token i as text, shared by every request
_TOKJ: list[bytes] = []  # the same, JSON-encoded once
_GTOK: list[str] = []  # token i of garbage (the weights are not the model's), and JSON-encoded
_GTOKJ: list[bytes] = []


def _tokens(n: int) -> None:
    for i in range(len(_TOK), n):
        s, g = (f" tok{i}", f" garbage{i}") if i else ("tok0", "garbage0")
        _TOK.append(s)
        _TOKJ.append(orjson.dumps(s))
        _GTOK.append(g)
        _GTOKJ.append(orjson.dumps(g))


def _event(d: dict[str, Any]) -> bytes:
    kind: str = d["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(d) + b"\n\n"


def _words(x: Any) -> int:
    if isinstance(x, str):
        return len(x.split())
    if isinstance(x, list):
        return sum(_words(e) for e in x)
    if isinstance(x, dict):
        return _words(x.get("content", x.get("text")))
    return 1 if isinstance(x, int) and not isinstance(x, bool) else 0


def _uid() -> str:
    return uuid.uuid4().hex


class Generation:
    """The generation routes and their state (the requests running and waiting)."""

    def __init__(self, opts: SimOptions, mem: Memory):
        self.opts = opts
        self.mem = mem  # whether it sleeps (a stream is cut short), and whether its weights are garbage
        self.vllm = opts.flavor == "vllm"  # it refuses another model's name (llama.cpp and SGLang serve any)
        self.json_only = opts.flavor != "llamacpp"  # a body that is not application/json is a 400
        self.model = opts.model
        self.model_j = orjson.dumps(opts.model)
        self.crash = opts.fail == "crash-mid-stream"
        self.running = 0
        self.waiting = 0
        self.sem = asyncio.Semaphore(opts.max_running) if opts.max_running > 0 else None
        _tokens(opts.tokens)

    # -- what every generation shares ------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        if self.json_only and request.content_type != "application/json":
            raise SimError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise SimError(400, f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise SimError(400, "Input should be a valid dictionary or object")
        model = body.get("model")
        if model and model != self.model and self.vllm:  # llama.cpp serves whatever is asked
            raise SimError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return body

    def _length(self, body: dict[str, Any], *keys: str) -> tuple[int, bool]:
        """Tokens to generate, and whether the request's limit cut them short."""
        for k in keys:
            lim = body.get(k)
            if lim is not None:
                if not isinstance(lim, int) or isinstance(lim, bool) or lim < 1:
                    raise SimError(400, f"{k} must be at least 1, got {lim}.", param=k)
                if lim > self.opts.max_model_len:
                    raise SimError(400, f"'{k}' is too large: {lim}. This model's maximum context length is "
                                        f"{self.opts.max_model_len} tokens.", param=k)
                n = lim if body.get("ignore_eos") else min(lim, self.opts.tokens)
                _tokens(n)
                return n, n == lim
        return self.opts.tokens, False

    async def _enter(self) -> None:
        if self.sem is not None:
            self.waiting += 1
            try:
                await self.sem.acquire()
            finally:
                self.waiting -= 1
        self.running += 1

    def _leave(self) -> None:
        self.running -= 1
        if self.sem is not None:
            self.sem.release()

    async def _prefill(self, prompt: int) -> bool:
        """``--prefill-rate``: the prompt's words at that rate before the first token; True when
        it applies (its tokens then come at once and each takes ``--token-delay`` after it)."""
        if self.opts.prefill_rate <= 0:
            return False
        if prompt > 0:
            await asyncio.sleep(prompt / self.opts.prefill_rate)
        return True

    async def _generate(self, n: int, make: Callable[[], object], prompt: int = 0) -> Reply:
        await self._enter()
        try:
            await self._prefill(prompt)
            if self.opts.token_delay:
                await asyncio.sleep(self.opts.token_delay * n)
            out = make()
            return out if isinstance(out, Reply) else answer(out)
        finally:
            self._leave()

    async def _stream(self, request: Request, n: int, before: list[bytes], frame: Callable[[int], bytes],
                      after: Callable[[], Iterable[bytes]], prompt: int = 0) -> Reply:
        await self._enter()
        call = request.call
        try:
            await call.start(200, _SSE)
            write = call.write
            for b in before:
                await write(b)
            prefilled = await self._prefill(prompt)
            delay = self.opts.token_delay
            crash_at = min(CRASH_AFTER, n - 1) if self.crash else -1
            for i in range(n):
                if delay and (not prefilled or i):
                    await asyncio.sleep(delay)
                if self.mem.sleeping:  # as vLLM's sleep: what the engine runs is aborted, the stream cut short
                    await call.end()
                    return STREAMED
                if i == crash_at:
                    die("crash mid-stream (--fail crash-mid-stream)")
                await write(frame(i))
            if delay and prefilled and n:
                await asyncio.sleep(delay)  # the last token's: the stream ends n delays after the prefill
            for b in after():
                await write(b)
            await call.end()
        except ConnectionResetError:
            pass  # the client went away; so does the generation
        finally:
            self._leave()
        return STREAMED

    # -- the routes -----------------------------------------------------------------

    def _usage(self, p: int, n: int) -> dict[str, Any]:
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n, "prompt_tokens_details": None}

    def _text(self) -> tuple[list[str], list[bytes]]:
        """The tokens generation answers with (and JSON-encoded): garbage when the weights are."""
        return (_GTOK, _GTOKJ) if self.mem.garbage else (_TOK, _TOKJ)

    def _openai_end(self, body: dict[str, Any], rid: str, kind: str, created: int, p: int,
                    n: int) -> Callable[[], Iterator[bytes]]:
        """The end of an OpenAI stream (chat or completions, ``kind`` its chunks' object): the
        usage chunk when ``stream_options.include_usage`` asks for it, then ``[DONE]``."""
        so = body.get("stream_options")
        usage = isinstance(so, dict) and bool(so.get("include_usage", True))

        def after() -> Iterator[bytes]:
            if usage:
                yield b"data: " + orjson.dumps({
                    "id": rid, "object": kind, "created": created,
                    "model": self.model, "choices": [], "usage": self._usage(p, n)}) + b"\n\n"
            yield _DONE
        return after

    async def chat(self, request: Request) -> Reply:
        body = await self._body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise SimError(400, "messages: Field required", param="messages")
        n, cut = self._length(body, "max_completion_tokens", "max_tokens")
        p, rid, created = _words(msgs), "chatcmpl-" + _uid(), int(time.time())
        finish, (tok, tj) = "length" if cut else "stop", self._text()
        if not body.get("stream"):
            return await self._generate(n, lambda: {
                "id": rid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [self._chat_choice(0, tok[:n], finish)], "usage": self._usage(p, n)}, p)
        head = (b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,'
                b'"choices":[{"index":0,"delta":{') % (rid.encode(), created, self.model_j)
        mid = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        end = b'},"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % finish.encode()
        last, after = n - 1, self._openai_end(body, rid, "chat.completion.chunk", created, p, n)
        return await self._stream(request, n, [head + b'"role":"assistant","content":""' + mid],
                                  lambda i: head + b'"content":' + tj[i] + (end if i == last else mid), after, p)

    def _chat_choice(self, index: int, tokens: list[str], finish: str) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": "".join(tokens), "refusal": None,
                                            "tool_calls": [], "reasoning_content": None},
                "logprobs": None, "finish_reason": finish, "stop_reason": None}

    async def chat_batch(self, request: Request) -> Reply:
        body = await self._body(request)
        convs = body.get("messages")
        if not isinstance(convs, list) or not convs:
            raise SimError(400, "messages: Field required", param="messages")
        if not isinstance(convs[0], list):
            convs = [convs]
        if body.get("stream"):
            raise SimError(400, "Streaming is not supported for batch chat completions.", param="stream")
        n, cut = self._length(body, "max_completion_tokens", "max_tokens")
        p, finish = _words(convs), "length" if cut else "stop"
        rid, created, tok = "chatcmpl-" + _uid(), int(time.time()), self._text()[0][:n]
        return await self._generate(n, lambda: {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model,
            "choices": [self._chat_choice(i, tok, finish) for i in range(len(convs))],
            "usage": self._usage(p, n * len(convs))})

    async def completions(self, request: Request) -> Reply:
        body = await self._body(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise SimError(400, "prompt: Field required", param="prompt")
        n, cut = self._length(body, "max_tokens")
        p, rid, created = _words(prompt), "cmpl-" + _uid(), int(time.time())
        finish, (tok, tj) = "length" if cut else "stop", self._text()
        if not body.get("stream"):
            return await self._generate(n, lambda: {
                "id": rid, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "text": "".join(tok[:n]), "logprobs": None, "finish_reason": finish,
                             "stop_reason": None, "prompt_logprobs": None}],
                "usage": self._usage(p, n)}, p)
        head = b'data: {"id":"%s","object":"text_completion","created":%d,"model":%s,"choices":[{"index":0,"text":' % (
            rid.encode(), created, self.model_j)
        mid = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        end = b',"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % finish.encode()
        last, after = n - 1, self._openai_end(body, rid, "text_completion", created, p, n)
        return await self._stream(request, n, [], lambda i: head + tj[i] + (end if i == last else mid), after, p)

    def _response(self, rid: str, created: int, body: dict[str, Any], status: str, output: list[Any],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "metadata": body.get("metadata"), "model": self.model, "output": output,
                "parallel_tool_calls": True, "previous_response_id": body.get("previous_response_id"),
                "temperature": body.get("temperature", 1.0), "text": {"format": {"type": "text"}},
                "tool_choice": "auto", "tools": [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
                "usage": usage}

    async def responses(self, request: Request) -> Reply:
        body = await self._body(request)
        if body.get("input") is None:
            raise SimError(400, "input: Field required", param="input")
        n, cut = self._length(body, "max_output_tokens")
        p = _words(body["input"]) + _words(body.get("instructions") or "")
        uid, created = _uid(), int(time.time())
        rid, mid, status = "resp_" + uid, "msg_" + uid, "incomplete" if cut else "completed"
        tok, tj = self._text()

        def final(seq: int | None = None) -> Any:  # the response (seq None), else its closing events
            text = "".join(tok[:n])
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item = {"id": mid, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
            usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + n}
            done = self._response(rid, created, body, status, [item], usage)
            if seq is None:
                return done
            at = {"item_id": mid, "output_index": 0, "content_index": 0}
            return [_event({"type": "response.output_text.done", "sequence_number": seq, **at,
                            "text": text, "logprobs": []}),
                    _event({"type": "response.content_part.done", "sequence_number": seq + 1, **at, "part": part}),
                    _event({"type": "response.output_item.done", "sequence_number": seq + 2, "output_index": 0,
                            "item": item}),
                    _event({"type": "response.completed", "sequence_number": seq + 3, "response": done})]
        if not body.get("stream"):
            return await self._generate(n, final)
        started = self._response(rid, created, body, "in_progress", [], None)
        before = [
            _event({"type": "response.created", "sequence_number": 0, "response": started}),
            _event({"type": "response.in_progress", "sequence_number": 1, "response": started}),
            _event({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
                    "item": {"id": mid, "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}}),
            _event({"type": "response.content_part.added", "sequence_number": 3, "item_id": mid, "output_index": 0,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})]
        head = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":'
        mid_b = b',"item_id":"%s","output_index":0,"content_index":0,"delta":' % mid.encode()
        return await self._stream(request, n, before,
                                  lambda i: head + b"%d" % (4 + i) + mid_b + tj[i] + b',"logprobs":[]}\n\n',
                                  lambda: final(4 + n))

    async def messages(self, request: Request) -> Reply:
        body = await self._body(request)
        if not isinstance(body.get("messages"), list):
            raise SimError(400, "messages: Field required", param="messages")
        if body.get("max_tokens") is None:
            raise SimError(400, "max_tokens: Field required", param="max_tokens")
        n, cut = self._length(body, "max_tokens")
        p = _words(body["messages"]) + _words(body.get("system") or "")
        mid, stop = "msg_" + _uid(), "max_tokens" if cut else "end_turn"
        tok, tj = self._text()
        if not body.get("stream"):
            return await self._generate(n, lambda: {
                "id": mid, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": "".join(tok[:n])}], "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": p, "output_tokens": n}})
        before = [
            _event({"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "content": [], "model": self.model,
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": p, "output_tokens": 0}}}),
            _event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})]
        head = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                b'"delta":{"type":"text_delta","text":')
        # vLLM ends its Anthropic stream with a bare "data: [DONE]" too; clients ignore it.
        return await self._stream(request, n, before, lambda i: head + tj[i] + b"}}\n\n", lambda: [
            _event({"type": "content_block_stop", "index": 0}),
            _event({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"input_tokens": p, "output_tokens": n}}),
            _event({"type": "message_stop"}), _DONE])

    def _vector(self, key: str, dim: int) -> list[float]:
        r = random.Random(("garbage\x00" if self.mem.garbage else "") + key)
        v = [r.uniform(-1.0, 1.0) for _ in range(dim)]
        norm = sum(x * x for x in v) ** 0.5 or 1.0
        return [x / norm for x in v]

    async def embeddings(self, request: Request) -> Reply:
        body = await self._body(request)
        inp = body.get("input")
        if isinstance(inp, str) or (isinstance(inp, list) and inp and all(isinstance(x, int) for x in inp)):
            inp = [inp]
        if not isinstance(inp, list) or not inp:
            raise SimError(400, "input: Field required", param="input")
        dim = body.get("dimensions") or self.opts.embedding_dim
        if not isinstance(dim, int) or dim < 1:
            raise SimError(400, f"dimensions must be a positive integer, got {dim!r}", param="dimensions")
        b64 = body.get("encoding_format") == "base64"
        data = []
        for i, x in enumerate(inp):
            v = self._vector(x if isinstance(x, str) else orjson.dumps(x).decode(), dim)
            data.append({"index": i, "object": "embedding",
                         "embedding": base64.b64encode(array.array("f", v).tobytes()).decode() if b64 else v})
        p = _words(inp)
        return await self._generate(1, lambda: {
            "id": "embd-" + _uid(), "object": "list", "created": int(time.time()), "model": self.model,
            "data": data, "usage": {"prompt_tokens": p, "total_tokens": p, "completion_tokens": 0,
                                    "prompt_tokens_details": None}})

    def _score(self, a: str, b: str) -> float:
        return random.Random(f"{'garbage' if self.mem.garbage else ''}\x00{a}\x00{b}").random()

    async def rerank(self, request: Request) -> Reply:
        body = await self._body(request)
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list):
            raise SimError(400, "query and documents are required", param="documents")
        texts = [d.get("text", "") if isinstance(d, dict) else str(d) for d in docs]
        scored: list[dict[str, Any]] = [{"index": i, "document": {"text": t}, "relevance_score": self._score(query, t)}
                                        for i, t in enumerate(texts)]
        results = sorted(scored, key=lambda r: -r["relevance_score"])
        top = body.get("top_n") or len(results)
        if not isinstance(top, int) or top < 0:
            raise SimError(400, f"top_n must be a non-negative integer, got {top!r}", param="top_n")
        tokens = _words(query) * len(texts) + _words(texts)
        return await self._generate(1, lambda: {"id": "rerank-" + _uid(), "model": self.model,
                                                "usage": {"total_tokens": tokens}, "results": results[:top]})

    async def score(self, request: Request) -> Reply:
        body = await self._body(request)
        a, b = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        if a is None or b is None:
            raise SimError(400, "text_1 and text_2 are required", param="text_2")
        a, b = a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]
        if len(a) == 1:
            a = a * len(b)
        if len(a) != len(b):
            raise SimError(400, "text_1 and text_2 must have the same length, or text_1 a single text")
        p = _words(a) + _words(b)
        return await self._generate(1, lambda: {
            "id": "score-" + _uid(), "object": "list", "created": int(time.time()), "model": self.model,
            "data": [{"index": i, "object": "score", "score": self._score(x, y)}
                     for i, (x, y) in enumerate(zip(a, b, strict=False))],
            "usage": {"prompt_tokens": p, "total_tokens": p, "completion_tokens": 0, "prompt_tokens_details": None}})

    async def transcriptions(self, request: Request) -> Reply:
        if request.content_type != "multipart/form-data":
            raise SimError(400, "Expected multipart/form-data with a file field", param="file")
        from email.parser import BytesParser  # here: it costs startup time, and this route is rare
        raw = await request.read()
        msg = BytesParser().parsebytes(
            b"Content-Type: " + request.headers["Content-Type"].encode() + b"\r\n\r\n" + raw)
        fields = {part.get_param("name", header="content-disposition"): part for part in msg.get_payload() or []
                  if not isinstance(part, str)}
        if "file" not in fields:
            raise SimError(400, "file: Field required", param="file")
        # decode=True gives a leaf part's bytes (typeshed allows a Message too).
        model = cast(bytes, fields["model"].get_payload(decode=True)).decode() if "model" in fields else None
        if model and model != self.model and self.vllm:
            raise SimError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        size = len(fields["file"].get_payload(decode=True) or b"")
        said = f"simulated transcription of {size} bytes"
        fmt = (cast(bytes, fields["response_format"].get_payload(decode=True)).decode()
               if "response_format" in fields else "json")
        return await self._generate(1, lambda: text(said) if fmt == "text" else {"text": said})

