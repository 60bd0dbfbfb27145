"""The simulator's answers (ondemand/sim/replies.py), made directly: an error in vLLM's shape
with its status, JSON and text with their content types, an empty answer with none, and the
error a route raises (``SimError``) with what it says. No server: what a client then reads of
them is the routes' files' (test_sim_routes.py, test_sim_generation.py)."""
from __future__ import annotations

import orjson

from ondemand.sim import replies


def test_an_error_is_vllms_shape_with_its_status():
    r = replies.error(404, "The model `x` does not exist.", "NotFoundError", "model")
    assert (r.status, dict(r.headers)) == (404, {"Content-Type": "application/json"})
    assert orjson.loads(r.body) == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                              "param": "model", "code": 404}}
    assert orjson.loads(replies.error(400, "bad", "BadRequestError").body)["error"]["param"] is None


def test_each_answer_has_its_content_type_and_an_empty_one_none():
    j = replies.answer({"a": [1, None]}, 201)
    assert (j.status, j.body, dict(j.headers)) == (201, b'{"a":[1,null]}', {"Content-Type": "application/json"})
    assert replies.answer(None).body == b"null" and replies.answer(None).status == 200  # SGLang's 200 null
    t = replies.text("é 1\n")
    assert (t.status, t.body, dict(t.headers)) == (200, "é 1\n".encode(), {"Content-Type": "text/plain; charset=utf-8"})
    for e, status in ((replies.empty(), 200), (replies.empty(204), 204), (replies.Reply(), 200)):
        assert (e.status, e.body, dict(e.headers)) == (status, b"", {})
    assert replies.STREAMED.status == 0  # no answer of its own: the route answered on the call


def test_a_routes_error_says_its_status_message_type_and_param():
    e = replies.SimError(400, "level must be 1 or 2", param="level")
    assert (str(e), e.status, e.message, e.type, e.param, e.body) == (
        "level must be 1 or 2", 400, "level must be 1 or 2", "BadRequestError", "level", None)
    sglang = replies.SimError(400, "asleep", body={"success": False})
    assert sglang.body == {"success": False}
