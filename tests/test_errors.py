"""ondemand/errors.py: the errors that carry data and their one JSON form, on the module alone
(it imports nothing of ours): the envelope every client and admin reads (``message``, ``type``,
``code``), OpenAI's type for each status, the shared refusals (404, a defect of ours, an Upgrade,
the other stack's request) and the fit check's refusal."""
import orjson
import pytest

from ondemand import errors
from ondemand.errors import InsufficientMemory, OndemandError


def test_the_body_is_the_envelope_and_nothing_else():
    err = OndemandError(429, "rate_limited", "Too many failed keys", headers={"Retry-After": "60"},
                        detail="peer 10.0.0.1")
    assert orjson.loads(err.body()) == err.envelope() == {
        "error": {"message": "Too many failed keys", "type": "rate_limit_error", "code": "rate_limited"}}
    assert err.headers == {"Retry-After": "60"} and b"10.0.0.1" not in err.body()  # detail: the log's only
    assert str(err) == "Too many failed keys" and repr(err) == "OndemandError(429, 'rate_limited', 'Too many failed keys')"
    assert OndemandError(400, "x", "y").headers == {}


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (409, "invalid_request_error"), (413, "invalid_request_error"),
    (421, "invalid_request_error"), (429, "rate_limit_error"), (500, "server_error"), (502, "server_error"),
    (503, "server_error"), (504, "server_error")])
def test_the_type_is_openais_for_the_status(status, kind):
    assert OndemandError(status, "c", "m").type == kind
    assert OndemandError(status, "c", "m", type="custom").type == "custom"  # unless told


def test_the_shared_refusals():
    assert errors.not_found().envelope()["error"] == {"message": "Not found", "type": "not_found_error",
                                                       "code": "not_found"}
    for status in (500, 504):  # a defect of ours: no traceback in the answer
        err = errors.internal_error(status)
        assert (err.status, err.code, err.type) == (status, "internal_error", "server_error")
        assert "see its log" in err.message
    up = errors.upgrade_refused()
    assert (up.status, up.code) == (400, "invalid_request") and "Upgrade" in up.message
    other = errors.misdirected("A gateway request")
    assert (other.status, other.code) == (421, "misdirected_request")
    assert other.message == "A gateway request: send it on a connection of its own"


def test_the_fit_checks_refusal_says_the_figures():
    err = InsufficientMemory(12.5, 4.0, 24.0)
    assert str(err) == "needs 12.5 GiB, 4 GiB free of 24 GiB on-demand capacity"
    assert (err.need, err.free, err.capacity, err.fit) == (12.5, 4.0, 24.0, None)
    assert str(InsufficientMemory(1, 0, 1, fit="per GPU", message="GPU 1 is full")) == "GPU 1 is full"
    assert issubclass(errors.DeploymentBusy, errors.DeployerError) and issubclass(errors.NameTaken, errors.DeployerError)
