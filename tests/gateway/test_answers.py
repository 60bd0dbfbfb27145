"""The answer kinds (ondemand/gateway/answers.py), each with its own exchange with the engine:
plain, the queued notice prepended to a non-streaming answer, and the engine's SSE after the
notice. Against real loopback engine doubles (tests/http/engine_double.py) through the real
pool; the client's side is a recorder of what a kind writes, as the lean front's ``Call``
takes it."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from engine_double import Engine, ok_answer

from ondemand.control.ticket import Ticket
from ondemand.errors import OndemandError
from ondemand.gateway import answers, notice
from ondemand.http.limits import READ_SIZE
from ondemand.http.pool import Upstreams
from ondemand.model import Deployment, State

LOOPS = ("asyncio", "uvloop")
PATH = "/v1/chat/completions"
BODY = orjson.dumps({"model": "A", "messages": [{"role": "user", "content": "hi"}]})
WAIT = notice.Wait(12.0, (1, 2), None)


@pytest.fixture
async def ups():
    pools = Upstreams()
    yield pools
    await pools.close()


class Client:
    """What an answer kind writes to its client, in order: the head (status, the engine's
    header lines) once, then the body's bytes; whether it ended, or was cut."""

    def __init__(self, method: str = "POST", started: bool = False):
        self.method = method
        self.raw_headers = [(b"Content-Type", b"application/json")]
        self.rid = "req-1"
        self.status = 200 if started else 0  # started: the notice's head went out already
        self.lines = b""
        self.body = b""
        self.heads = 0
        self.ended = self.aborted = False

    def _head(self, status: int, lines: bytes) -> None:
        assert not self.status, "a second head"
        self.status, self.lines, self.heads = status, lines, self.heads + 1

    async def send(self, status, headers, body, *, reason=None, lines=b"", close=False) -> None:
        self._head(status, lines)
        self.body += body
        self.ended = True

    async def start(self, status, headers, *, reason=None, length=None, lines=b"", body=b"") -> None:
        self._head(status, lines)
        self.body += body

    async def write(self, data: bytes) -> None:
        assert self.status and not self.ended
        self.body += data

    def write_now(self, data: bytes) -> bool:
        self.body += data
        return True

    async def end(self, data: bytes = b"") -> None:
        self.body += data
        self.ended = True

    def abort(self) -> None:
        self.aborted = True


def ticket(base: str | None) -> Ticket:
    dep = Deployment(id=1, name="a", served_name="A", memory_gib=1, state=State.READY)
    return Ticket(dep, base)


def answer_with(status: bytes, body: bytes, *headers: bytes):
    async def answer(req, writer):
        head = b"HTTP/1.1 " + status + b"\r\n" + b"".join(h + b"\r\n" for h in headers)
        writer.write(head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    return answer


def sse_in_pieces(*pieces: bytes):
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.02)  # the engine double's pace: each piece on its own
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    return answer


def unreachable_url() -> str:
    from helpers import free_port
    return f"http://127.0.0.1:{free_port()}"


CHAT_ANSWER = orjson.dumps({"id": "c1", "object": "chat.completion", "model": "A", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}]})


# --- plain ------------------------------------------------------------------------------------

async def test_plain_is_the_engines_answer_whole_and_its_connection_goes_back_to_the_pool(ups):
    async with Engine(answer_with(b"201 Created", b'{"made": 1}', b"Content-Type: application/json",
                                  b"X-Engine: yes")) as eng:
        for _ in range(2):
            client = Client()
            await answers.plain(client, ups, ticket(eng.url), PATH, BODY)
            assert (client.status, client.body, client.heads, client.ended) == (201, b'{"made": 1}', 1, True)
            assert b"X-Engine: yes\r\n" in client.lines and b"Content-Length" not in client.lines
        assert eng.accepted == 1 and [r["body"] for r in eng.requests] == [BODY, BODY]  # one connection, reused
        assert eng.requests[0]["target"] == PATH


async def test_plain_streams_an_answer_as_it_comes_and_a_head_has_no_body(ups):
    async with Engine(sse_in_pieces(b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n")) as eng:
        client = Client()
        await answers.plain(client, ups, ticket(eng.url), PATH, BODY)
        assert client.status == 200 and client.ended and not client.aborted
        assert client.body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    async with Engine(ok_answer) as eng:
        client = Client("HEAD")
        await answers.plain(client, ups, ticket(eng.url), "/v1/models/A", None)
        assert (client.status, client.body, client.ended) == (200, b"", True)


@pytest.mark.parametrize("kind", ["plain", "prepended"])
async def test_an_engine_not_reached_is_502_before_anything_is_written(ups, kind):
    for base, why in ((None, "the engine has no address"), (unreachable_url(), "the engine did not answer")):
        client = Client()
        with pytest.raises(OndemandError) as exc:
            if kind == "plain":
                await answers.plain(client, ups, ticket(base), PATH, BODY)
            else:
                await answers.prepended(client, ups, ticket(base), PATH, BODY, "chat/completions", WAIT)
        assert (exc.value.status, exc.value.code) == (502, "ondemand_upstream_error") and why in exc.value.message
        assert client.status == 0 and client.body == b""


# --- the notice prepended ----------------------------------------------------------------------

async def test_prepended_puts_the_notice_before_the_text_of_a_200_json_answer(ups):
    async with Engine(answer_with(b"200 OK", CHAT_ANSWER, b"Content-Type: application/json")) as eng:
        client = Client()
        await answers.prepended(client, ups, ticket(eng.url), PATH, BODY, "chat/completions", WAIT)
    content = orjson.loads(client.body)["choices"][0]["message"]["content"]
    assert content == notice.notice_text("A", *WAIT) + "Hello."
    assert content.startswith("[ondemand] A is waiting for GPU memory (place 1 of 2, about 12 s)")
    assert client.status == 200 and client.ended and b"Content-Length" not in client.lines  # recomputed


async def test_prepended_leaves_any_other_answer_exactly_the_engines(ups):
    error = b'{"error": {"message": "no", "type": "BadRequestError", "code": 400}}'
    async with Engine(answer_with(b"400 Bad Request", error, b"Content-Type: application/json")) as eng:
        client = Client()
        await answers.prepended(client, ups, ticket(eng.url), PATH, BODY, "chat/completions", WAIT)
        assert (client.status, client.body) == (400, error)
    async with Engine(answer_with(b"200 OK", b"plain words", b"Content-Type: text/plain")) as eng:
        client = Client()
        await answers.prepended(client, ups, ticket(eng.url), PATH, BODY, "chat/completions", WAIT)
        assert (client.status, client.body) == (200, b"plain words")


async def test_prepended_of_an_answer_broken_off_is_502(ups):
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\":")
        await writer.drain()
        return False
    async with Engine(answer) as eng:
        client = Client()
        with pytest.raises(OndemandError) as exc:
            await answers.prepended(client, ups, ticket(eng.url), PATH, BODY, "chat/completions", WAIT)
    assert exc.value.code == "ondemand_upstream_error" and "broke off" in exc.value.message and client.status == 0


# --- the engine's SSE after the notice -------------------------------------------------------

async def test_after_the_notice_the_engines_events_follow_as_they_come(ups):
    async with Engine(sse_in_pieces(b"data: one\n\n", b"data: [DONE]\n\n")) as eng:
        client = Client(started=True)
        await answers.after_notice(client, ups, ticket(eng.url), PATH, BODY)
    assert client.heads == 0 and client.body == b"data: one\n\ndata: [DONE]\n\n" and client.ended


async def test_after_the_notice_an_engine_error_answer_becomes_an_error_event(ups):
    error = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    async with Engine(answer_with(b"400 Bad Request", orjson.dumps(error), b"Content-Type: application/json")) as eng:
        client = Client(started=True)
        await answers.after_notice(client, ups, ticket(eng.url), PATH, BODY)
    assert client.body == notice.error_events(error) and client.ended
    garbage = b"x" * (READ_SIZE + 10)
    async with Engine(answer_with(b"500 Internal Server Error", garbage)) as eng:
        client = Client(started=True)
        await answers.after_notice(client, ups, ticket(eng.url), PATH, BODY)
    event = orjson.loads(client.body.split(b"\n\n")[0][6:])
    assert event["error"]["code"] == 500 and event["error"]["message"] == "x" * 2000  # read up to its bound


async def test_after_the_notice_an_engine_error_in_pieces_is_passed_whole(ups):
    error = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    raw = orjson.dumps(error)

    async def answer(req, writer):
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(raw), raw[:20]))
        await writer.drain()
        await asyncio.sleep(0.05)  # the engine double's behaviour: the error in two pieces
        writer.write(raw[20:])
        await writer.drain()
    async with Engine(answer) as eng:
        client = Client(started=True)
        await answers.after_notice(client, ups, ticket(eng.url), PATH, BODY)
    assert client.body == b"data: " + raw + b"\n\ndata: [DONE]\n\n" and client.ended, client.body


async def test_after_the_notice_an_engine_breaking_off_its_error_is_an_upstream_error(ups):
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        return False
    async with Engine(answer) as eng:
        client = Client(started=True)
        await answers.after_notice(client, ups, ticket(eng.url), PATH, BODY)
    assert b'"ondemand_upstream_error"' in client.body and b"broke off" in client.body and client.ended


async def test_after_the_notice_an_engine_not_reached_is_an_error_event_not_an_exception(ups):
    for base, why in ((None, "the engine has no address"), (unreachable_url(), "the engine did not answer")):
        client = Client(started=True)
        await answers.after_notice(client, ups, ticket(base), PATH, BODY)
        first, done = client.body.split(b"\n\n")[:2]
        error = orjson.loads(first[6:])["error"]
        assert error["code"] == "ondemand_upstream_error" and why in error["message"]
        assert done == b"data: [DONE]" and client.ended and client.heads == 0
