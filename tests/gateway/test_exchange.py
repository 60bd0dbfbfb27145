"""ondemand/gateway/exchange.py: one gateway request as the metrics and the access log see it, on
the module alone (it imports nothing of ours): where its request id comes from and which values
are never taken, the ids it makes, and an Exchange before the gateway fills it in. The ids on the
wire, end to end: test_request_ids.py; what the access log writes of an Exchange: test_access_log.py."""
from ondemand.gateway import exchange
from ondemand.gateway.exchange import Exchange, request_id, valid_id


def test_request_id_sources_and_validation():
    assert request_id({"x-request-id": "abc-1", "x-litellm-call-id": "lite"}) == "abc-1"
    assert request_id({"x-litellm-call-id": "lite"}) == "lite"
    assert request_id({"x-request-id": "bad\nid", "x-litellm-call-id": "lite"}) == "lite"
    made = request_id({})
    assert len(made) == 32 and int(made, 16) >= 0 and made != request_id({})
    for bad in ("", "x" * 129, "é", "a\tb", "a\x7fb", "a\x00b", "line\r\ninjected"):
        assert not valid_id(bad), bad
        assert request_id({"x-request-id": bad}) != bad
    assert valid_id("x" * 128) and valid_id("a b=\"c\"")



def test_made_ids_are_this_processs_prefix_and_a_counter():
    ids = [exchange.new_id() for _ in range(3)]
    assert len(set(ids)) == 3 and all(len(i) == 32 and valid_id(i) for i in ids)
    assert len({i[:16] for i in ids}) == 1  # one prefix for the process
    counts = [int(i[16:], 16) for i in ids]
    assert counts == [counts[0], counts[0] + 1, counts[0] + 2]


def test_an_exchange_starts_empty_and_a_memory_wait_marks_it():
    ex = Exchange("rid", "POST", "10.0.0.1", 12.5)
    assert (ex.rid, ex.method, ex.peer, ex.arrival) == ("rid", "POST", "10.0.0.1", 12.5)
    assert (ex.deployment, ex.route, ex.status, ex.bytes_in, ex.bytes_out) == ("", "", 0, 0, 0)
    assert (ex.queued_s, ex.waited_start, ex.waited_memory, ex.health) == (None, False, False, False)
    ex.memory_wait()
    assert ex.waited_memory and not ex.waited_start
