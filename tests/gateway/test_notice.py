"""The queued notice, directly: who gets one, and what it does to the bytes
(BEHAVIOUR.md, "The queued notice"). The gateway's tests show it end to end."""
import orjson
import pytest

from ondemand.gateway import notice

CHAT = {"model": "M", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("route, body, expected", [
    ("chat/completions", {**CHAT, "stream": True}, notice.STREAM_NOTICE),
    ("completions", {"prompt": "x", "stream": True}, notice.STREAM_NOTICE),
    ("chat/completions", CHAT, notice.PREPEND),
    ("completions", {"prompt": "x"}, notice.PREPEND),
    ("responses", {"input": "x"}, notice.PREPEND),
    ("responses", {"input": "x", "stream": True}, notice.NONE),  # typed events start with response.created
    ("messages", {**CHAT, "stream": True}, notice.NONE),  # Anthropic: message_start first
    ("messages", CHAT, notice.NONE),
    ("embeddings", {"input": "x"}, notice.NONE),
    ("chat/completions", None, notice.NONE),  # multipart or unparsed
])
def test_who_gets_a_notice(route, body, expected):
    assert notice.mode(route, body) == expected


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}}, {"tools": []}, {"tool_choice": "auto"},
    {"functions": []}, {"function_call": "auto"}, {"structured_outputs": {"json": {}}},
    {"guided_json": {}}, {"guided_choice": ["a"]}, {"text": {"format": {"type": "json_schema"}}},
])
def test_structured_output_gets_none_streaming_or_not(extra):
    assert notice.is_structured({**CHAT, **extra})
    assert notice.mode("chat/completions", {**CHAT, **extra, "stream": True}) is notice.NONE
    assert notice.mode("chat/completions", {**CHAT, **extra}) is notice.NONE


@pytest.mark.parametrize("extra", [{}, {"response_format": None}, {"guided_json": None},
                                   {"text": {"format": {"type": "text"}}}, {"text": {}}])
def test_unset_or_plain_text_fields_are_not_structured(extra):
    assert not notice.is_structured({**CHAT, **extra})


def test_the_streamed_chunk_has_the_shape_of_the_route():
    for route, obj in (("chat/completions", "chat.completion.chunk"), ("completions", "text_completion")):
        raw = notice.queued_chunk(route, "Big")
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        chunk = orjson.loads(raw[6:])
        assert chunk["id"] == "ondemand-queued" and chunk["object"] == obj and chunk["model"] == "Big"
        choice = chunk["choices"][0]
        text = choice["delta"]["content"] if route == "chat/completions" else choice["text"]
        assert "Big" in text and choice["finish_reason"] is None
        if route == "chat/completions":
            assert "role" not in choice["delta"]  # the engine's first chunk carries the role


def test_errors_after_the_notice_are_sse_events_then_done():
    raw = notice.error_events({"error": {"message": "m", "type": "t", "code": "c"}})
    first, done = raw.split(b"\n\n")[:2]
    assert orjson.loads(first[6:])["error"]["code"] == "c" and done == b"data: [DONE]"


def test_prepend_puts_the_notice_before_the_text():
    text = notice.notice_text("M")
    chat = {"choices": [{"message": {"role": "assistant", "content": "answer"}}]}
    out = orjson.loads(notice.prepend("chat/completions", orjson.dumps(chat), "M"))
    assert out["choices"][0]["message"]["content"] == text + "answer"
    comp = {"choices": [{"text": "answer"}]}
    assert orjson.loads(notice.prepend("completions", orjson.dumps(comp), "M"))["choices"][0]["text"] == text + "answer"
    resp = {"output": [{"type": "reasoning"}, {"type": "message", "content": [
        {"type": "refusal"}, {"type": "output_text", "text": "answer"}, {"type": "output_text", "text": "more"}]}]}
    parts = orjson.loads(notice.prepend("responses", orjson.dumps(resp), "M"))["output"][1]["content"]
    assert [p.get("text") for p in parts] == [None, text + "answer", "more"]  # the first text part only


@pytest.mark.parametrize("route, body", [
    ("chat/completions", {"choices": [{"message": {"content": None, "tool_calls": [{}]}}]}),  # tool calls
    ("chat/completions", {"choices": []}),
    ("completions", {"choices": [{"text": None}]}),
    ("responses", {"output": [{"type": "function_call"}]}),
    ("responses", {"output": None}),
    ("chat/completions", "not an object"),
])
def test_prepend_leaves_answers_without_a_place_unchanged(route, body):
    raw = orjson.dumps(body)
    assert notice.prepend(route, raw, "M") == raw
    assert notice.prepend(route, b"{broken", "M") == b"{broken"
