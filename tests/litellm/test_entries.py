"""The entries ondemand registers in LiteLLM (ondemand/litellm/entries.py), exactly as
BEHAVIOUR.md, "LiteLLM registration", describes them: every field of a gateway entry and of a
direct one, their warmth (order 1 ready, 2 asleep, 3 cold; outside the parameters' fingerprint),
what it takes to turn one entry into another (same, warmth, replace), and the reads of an entry
LiteLLM lists: its state, whose it is, which boxes serve a name. Pure, so asked directly; the
sync that writes them to the LiteLLM double is test_sync.py's."""
from __future__ import annotations

import hashlib
import json

import pytest
from sync_world import BOX, INTERNAL, INTERNAL_B, dep, fp

from ondemand.litellm.entries import (
    ORDER_ASLEEP,
    ORDER_COLD,
    ORDER_READY,
    always_on_entry,
    entry_change,
    entry_dgxmm_id,
    entry_id,
    entry_instance,
    entry_order,
    entry_owned,
    entry_state,
    entry_warmth,
    names_view,
    ondemand_entry,
    params_fingerprint,
    warmth_order,
)
from ondemand.model import State


def params_fp(api_base: str, timeout: int) -> str:
    covered = {"api_base": api_base, "health_check_params": {"extra_headers": {"x-dgxmm-health-check": "1"}},
               "num_retries": 0, "stream_timeout": timeout, "timeout": timeout}
    return fp(json.dumps(covered, sort_keys=True, separators=(",", ":")))


# ---------------------------------------------------------------------------
# The entries


def test_ondemand_entry_every_field():
    entry = ondemand_entry(dep(7, "qwen", served_name="Qwen/Qwen3-8B"), "secret-key", INTERNAL, 900, instance=BOX)
    api_base = "http://dgxmm:8090/dgxmm/ondemand/7/v1"
    assert entry == {
        "model_name": "Qwen/Qwen3-8B",
        "litellm_params": {
            "model": "openai/Qwen/Qwen3-8B",
            "api_base": api_base,
            "api_key": "secret-key",
            "timeout": 1500,
            "stream_timeout": 1500,
            "num_retries": 0,
            "order": 3,  # stopped: cold
        },
        "model_info": {
            "dgxmm_id": 7,
            "dgxmm_instance": BOX,
            "dgxmm_state": "cold",
            "dgxmm_key_fp": hashlib.sha256(b"secret-key").hexdigest()[:12],
            "dgxmm_params_fp": params_fp(api_base, 1500),
            "health_check_params": {"extra_headers": {"x-dgxmm-health-check": "1"}},
        },
    }
    # The floor is 1200 s; above it, the queue limit plus 600 s.
    assert ondemand_entry(dep(7, "q"), "k", INTERNAL, 60, instance=BOX)["litellm_params"]["timeout"] == 1200
    long = ondemand_entry(dep(7, "q"), "k", INTERNAL + "/", 1000, instance=BOX)
    assert long["litellm_params"]["stream_timeout"] == 1600
    assert long["litellm_params"]["api_base"] == api_base
    assert long["model_info"]["dgxmm_params_fp"] == params_fp(api_base, 1600)


def test_always_on_entry_every_field():
    entry = always_on_entry(dep(3, "llama", mode="always_on", served_name="llama-3"), "http://dgxmm-llama:8000", instance=BOX)
    assert entry == {
        "model_name": "llama-3",
        "litellm_params": {"model": "openai/llama-3", "api_base": "http://dgxmm-llama:8000/v1",
                           "api_key": "none", "order": 1},
        "model_info": {"dgxmm_id": 3, "dgxmm_instance": BOX, "dgxmm_state": "ready"},
    }


# ---------------------------------------------------------------------------
# Warmth: order 1 ready, 2 asleep, 3 cold (issue 22)


def test_warmth_order_and_state_of_each_deployment_state():
    assert (ORDER_READY, ORDER_ASLEEP, ORDER_COLD) == (1, 2, 3)
    for state in State:
        want = {"ready": ("ready", 1), "asleep": ("asleep", 2)}.get(state.value, ("cold", 3))
        assert (entry_warmth(state), warmth_order(entry_warmth(state))) == want, state
        assert entry_warmth(state.value) == want[0]
        entry = ondemand_entry(dep(1, "a", state=state.value), "k", INTERNAL, 900, instance=BOX)
        assert (entry["model_info"]["dgxmm_state"], entry["litellm_params"]["order"]) == want, state
        assert (entry_state(entry), entry_order(entry)) == want
    assert entry_warmth(None) == "cold"


def test_warmth_is_outside_the_params_fingerprint():
    entries = {s: ondemand_entry(dep(1, "a", state=s), "k", INTERNAL, 900, instance=BOX)
               for s in ("ready", "asleep", "stopped")}
    fps = {e["model_info"]["dgxmm_params_fp"] for e in entries.values()}
    assert len(fps) == 1
    e = entries["ready"]
    assert params_fingerprint(dict(e["litellm_params"], order=3), dict(e["model_info"], dgxmm_state="cold")) \
        == params_fingerprint(e["litellm_params"], e["model_info"])
    # What LiteLLM calls is inside it.
    assert params_fingerprint(dict(e["litellm_params"], timeout=1), e["model_info"]) not in fps
    assert params_fingerprint(dict(e["litellm_params"], api_base="http://x/v1"), e["model_info"]) not in fps


def test_entry_change_patches_warmth_and_replaces_what_litellm_calls():
    ready, asleep, cold = (ondemand_entry(dep(1, "a", state=s), "k", INTERNAL, 900, instance=BOX)
                           for s in ("ready", "asleep", "stopped"))
    assert entry_change(ready, ready) == "same"
    assert entry_change(ready, asleep) == entry_change(asleep, cold) == entry_change(cold, ready) == "warmth"
    # Order alone, or state alone: still warmth (LiteLLM normalised one, an old box wrote the other).
    assert entry_change(dict(ready, litellm_params=dict(ready["litellm_params"], order=2)), ready) == "warmth"
    assert entry_change(dict(ready, model_info=dict(ready["model_info"], dgxmm_state="cold")), ready) == "warmth"
    # Another key, address, timeout, name, model or instance: replaced, whatever the warmth.
    for other in (ondemand_entry(dep(1, "a", state="ready"), "k2", INTERNAL, 900, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready"), "k", INTERNAL_B, 900, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready"), "k", INTERNAL, 1200, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready", served_name="b"), "k", INTERNAL, 900, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready"), "k", INTERNAL, 900, instance="box-b")):
        assert entry_change(other, ready) == entry_change(other, cold) == "replace"
    direct = always_on_entry(dep(1, "a", mode="always_on", state="ready"), "http://e:8000", instance=BOX)
    assert entry_change(direct, direct) == "same" and entry_change(ready, direct) == "replace"


def test_entry_state_reads_dgxmm_state_else_the_order():
    assert entry_state({"model_info": {"dgxmm_state": "ready"}, "litellm_params": {"order": 2}}) == "ready"
    assert entry_state({"model_info": {"dgxmm_state": "asleep"}, "litellm_params": {"order": 2}}) == "asleep"
    # An old box's entry: 2 meant cold, with or without its dgxmm_state.
    assert entry_state({"model_info": {"dgxmm_state": "cold"}, "litellm_params": {"order": 2}}) == "cold"
    assert entry_state({"model_info": {}, "litellm_params": {"order": 2.0}}) == "cold"
    assert entry_state({"model_info": {}, "litellm_params": {"order": 3}}) == "cold"
    assert entry_state({"model_info": {"order": 1}, "litellm_params": {}}) == "ready"
    assert entry_state({"model_info": {"dgxmm_state": "odd"}, "litellm_params": {"order": 7}}) == "unknown"
    assert entry_state({"litellm_params": {"model": "x"}}) == "unknown"
    assert entry_order({"litellm_params": {"order": True}}) is None


# ---------------------------------------------------------------------------
# Whose an entry is, and which boxes serve a name


@pytest.mark.parametrize("raw, want", [
    (7, 7), ("7", 7), (7.0, 7), (" 7 ", 7),  # our int, as a hand edit or another serialisation left it
    (7.5, "7.5"), (" seven ", "seven"),  # set, but no id of ours: still ours, and never wanted
    (None, None), (True, None), (False, None),  # unset, or a flag: not ours
])


def test_our_id_of_an_entry_is_read_whatever_became_of_the_int_we_wrote(raw, want):
    assert entry_dgxmm_id({"model_name": "a", "model_info": {"dgxmm_id": raw}}) == want
    assert entry_dgxmm_id({"model_name": "a", "model_info": {}}) is None
    assert entry_dgxmm_id({"model_name": "a"}) is None and entry_dgxmm_id({"model_info": "7"}) is None
    # LiteLLM's own id of it, always a string (what a delete or a patch names).
    assert entry_id({"model_info": {"id": 12, "dgxmm_id": raw}}) == "12"
    assert entry_id({"model_info": {"dgxmm_id": raw}}) is None and entry_id({}) is None


def test_an_entry_is_a_boxs_own_by_its_instance_else_by_its_address_under_the_boxs_gateway():
    """BEHAVIOUR.md, "Several boxes": a box's entries carry its instance; one written before
    instances (our id, no instance) is the box's whose gateway address it is under; anything
    without our id is nobody's, whatever it says."""
    mine = ondemand_entry(dep(1, "a"), "k", INTERNAL, 900, instance=BOX)
    theirs = ondemand_entry(dep(1, "a"), "k", INTERNAL_B, 900, instance="box-b")
    assert entry_instance(mine) == BOX and entry_owned(mine, BOX, INTERNAL)
    assert not entry_owned(theirs, BOX, INTERNAL) and entry_owned(theirs, "box-b", INTERNAL_B)
    # The instance decides, not the address: box-b's entry under box-a's gateway stays box-b's.
    assert not entry_owned(ondemand_entry(dep(1, "a"), "k", INTERNAL, 900, instance="box-b"), BOX, INTERNAL)
    old = {**mine, "model_info": {k: v for k, v in mine["model_info"].items() if k != "dgxmm_instance"}}
    assert entry_instance(old) is None and entry_instance({**old, "model_info": {"dgxmm_instance": ""}}) is None
    assert entry_owned(old, BOX, INTERNAL) and entry_owned(old, BOX, INTERNAL + "/")
    assert not entry_owned(old, "box-b", INTERNAL_B)
    lookalike = {**old, "litellm_params": {**old["litellm_params"], "api_base": f"{INTERNAL}-old/ondemand/1/v1"}}
    assert not entry_owned(lookalike, BOX, INTERNAL)  # a prefix of the address is not a path under it
    hand = {"model_name": "a-served", "litellm_params": dict(mine["litellm_params"]),
            "model_info": {"dgxmm_instance": BOX}}
    assert not entry_owned(hand, BOX, INTERNAL)


def test_names_list_the_boxes_serving_each_name_warmest_first_and_others_entries_as_external():
    """``names_view``: each name with an entry of ondemand's, its entries ready first, then
    asleep, then cold, then another's (instance null, "external"); which instances serve it
    ready ("?" for an entry written before instances); a name with no entry of ours is left out."""
    entries = [
        {"model_name": "a-served", "litellm_params": {"model": "openai/x", "order": 3}, "model_info": {}},
        ondemand_entry(dep(1, "a", state="stopped"), "k", INTERNAL, 900, instance=BOX),
        ondemand_entry(dep(4, "a", state="asleep"), "k", INTERNAL_B, 900, instance="box-b"),
        always_on_entry(dep(2, "a", mode="always_on", state="ready"), "http://e:8000", instance="box-c"),
        {"model_name": "b-served", "litellm_params": {"order": 1}, "model_info": {"dgxmm_id": 3}},
        {"model_name": "gpt-4o", "litellm_params": {"model": "openai/gpt-4o"}},  # no entry of ours: left out
        {"litellm_params": {"order": 1}, "model_info": {"dgxmm_id": 9}},  # no name: nothing to list it under
    ]
    assert names_view(entries, BOX) == [
        {"name": "a-served", "ready": ["box-c"], "entries": [
            {"instance": "box-c", "dgxmm_id": 2, "order": 1, "state": "ready", "this": False},
            {"instance": "box-b", "dgxmm_id": 4, "order": 2, "state": "asleep", "this": False},
            {"instance": BOX, "dgxmm_id": 1, "order": 3, "state": "cold", "this": True},
            {"instance": None, "dgxmm_id": None, "order": 3, "state": "external", "this": False}]},
        {"name": "b-served", "ready": ["?"], "entries": [
            {"instance": None, "dgxmm_id": 3, "order": 1, "state": "ready", "this": False}]}]
