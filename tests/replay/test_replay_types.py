"""The replay's policies as typed: each kind, its seconds, and every wrong form named."""
import pytest

from ondemand.replay.types import Policy


@pytest.mark.parametrize("text,kind,seconds", [
    ("current", "current", None), ("always-on", "always-on", None), ("adaptive", "adaptive", None),
    ("ttl=300", "ttl", 300), ("sleep-ttl=60", "sleep-ttl", 60), ("fixed=1800", "fixed", 1800),
])
def test_a_policy_is_parsed_as_typed(text, kind, seconds):
    p = Policy.parse(text)
    assert (p.name, p.kind, p.seconds) == (text, kind, seconds)


@pytest.mark.parametrize("text,says", [
    ("bogus", "unknown policy 'bogus'"), ("ttl", "ttl takes seconds"), ("fixed=", "whole seconds"),
    ("ttl=0", "1 or more"), ("ttl=1.5", "whole seconds"), ("current=3", "takes no value"),
])
def test_a_wrong_policy_is_named(text, says):
    with pytest.raises(ValueError, match=says) as e:
        Policy.parse(text)
    assert repr(text) in str(e.value)
