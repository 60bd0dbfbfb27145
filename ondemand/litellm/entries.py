"""The entries ondemand registers in LiteLLM, exactly as BEHAVIOUR.md, "LiteLLM registration",
describes them: ``ondemand_entry`` / ``always_on_entry``; ``entry_change``: what it takes to turn
one into another; and the reads of an entry LiteLLM lists (ours, whose, its warmth).

Our entries are the ones whose ``model_info`` carries ``dgxmm_id`` and our instance's
``dgxmm_instance`` (several boxes may share one LiteLLM: ``entry_owned``); nothing else in
LiteLLM is ever touched. A change of warmth alone (``litellm_params.order`` and
``model_info.dgxmm_state``) is patched in place (``client.LiteLLMClient.patch_warmth``); any
other change (what LiteLLM calls: key, address, model, timeouts) replaces the entry (add, then
delete). Facts about LiteLLM relied on here are cited by file and function of BerriAI/litellm,
read in the source of 1.106.12 (``client``'s docstring names the files).
"""
from __future__ import annotations

from typing import Any, Literal

import orjson

from ..gateway.keys import fingerprint
from ..http.headers import HEALTH_HEADER

HEALTH_CHECK_HEADER = HEALTH_HEADER
# Warm-first routing (BEHAVIOUR.md, "Several boxes"): LiteLLM's router keeps, of the
# deployments of a name that passed its health and cooldown filters, only those of the
# lowest litellm_params.order (router.py async_get_healthy_deployments /
# get_available_deployment, "ORDER FILTERING", after the cooldown filter;
# utils.py get_order_filtered_deployments: min() over get_deployment_order, which reads
# litellm_params.order, else model_info.order; entries without one are dropped while any
# has one). So a name's traffic goes to a box where the model is awake (1), else to one
# where it sleeps (2: a wake in seconds), and only then to a cold one (3: a start).
# Before issue 22, 2 meant cold: an old box's cold entry ranks with a new box's asleep one.
ORDER_READY = 1
ORDER_ASLEEP = 2
ORDER_COLD = 3
_WARMTH = {"ready": ORDER_READY, "asleep": ORDER_ASLEEP, "cold": ORDER_COLD}
# LiteLLM needs *some* key for an openai/ entry; the engines behind always-on entries
# take none, so a harmless placeholder is sent (it never reaches a secret check).
ALWAYS_ON_API_KEY = "none"


def params_fingerprint(litellm_params: dict[str, Any], model_info: dict[str, Any]) -> str:
    """Fingerprint of what an on-demand entry adds to an always-on one.

    LiteLLM normalises what it returns (GenericLiteLLMParams in types/router.py types
    ``timeout`` as float, so 1500 comes back as 1500.0, and /model/info never returns
    api_key), so the entry is not compared field by field: this value, stored in
    model_info (kept verbatim: ModelInfo has extra="allow"), is. It leaves out the warmth
    (``order``, ``dgxmm_state``): a change of warmth alone is patched in place
    (``entry_change``), a change of anything covered here replaces the entry.
    """
    covered = {
        "api_base": litellm_params.get("api_base"),
        "timeout": litellm_params.get("timeout"),
        "stream_timeout": litellm_params.get("stream_timeout"),
        "num_retries": litellm_params.get("num_retries"),
        "health_check_params": model_info.get("health_check_params"),
    }
    return fingerprint(orjson.dumps(covered, option=orjson.OPT_SORT_KEYS))


def entry_warmth(state: Any) -> str:
    """The ``dgxmm_state`` of an on-demand entry for a deployment state: ``ready``,
    ``asleep``, else ``cold`` (its order: ``ORDER_READY``, ``ORDER_ASLEEP``, ``ORDER_COLD``)."""
    value = getattr(state, "value", state)  # a model.State or its string
    return str(value) if value in ("ready", "asleep") else "cold"


def warmth_order(dgxmm_state: str) -> int:
    """The routing order of a ``dgxmm_state``: 1 ready, 2 asleep, 3 cold."""
    return _WARMTH[dgxmm_state]


def _served_name(dep: dict[str, Any]) -> str:
    name: str = dep.get("served_name") or dep["name"]
    return name


def ondemand_timeout(queue_timeout_s: int) -> int:
    """A request may wait the whole queue limit for memory, plus the start."""
    return max(1200, int(queue_timeout_s) + 600)


def ondemand_entry(dep: dict[str, Any], key: str, internal_url: str, queue_timeout_s: int, *,
                   instance: str) -> dict[str, Any]:
    """The gateway entry of an on-demand deployment (BEHAVIOUR.md, "LiteLLM registration")."""
    dep_id = int(dep["id"])
    served = _served_name(dep)
    timeout = ondemand_timeout(queue_timeout_s)
    state = entry_warmth(dep.get("state"))
    litellm_params: dict[str, Any] = {
        "model": f"openai/{served}",
        "api_base": f"{internal_url.rstrip('/')}/ondemand/{dep_id}/v1",
        "api_key": key,
        "timeout": timeout,
        "stream_timeout": timeout,
        # LiteLLM must not retry or fail over a request the gateway is holding.
        "num_retries": 0,
        "order": _WARMTH[state],
    }
    # health_check.py _update_litellm_params_for_health_check merges
    # model_info.health_check_params into the probe's litellm_params only, so the marker
    # header rides on health checks and never on traffic.
    health_check_params = {"extra_headers": {HEALTH_CHECK_HEADER: "1"}}
    model_info: dict[str, Any] = {
        "dgxmm_id": dep_id,
        "dgxmm_instance": instance,
        "dgxmm_state": state,
        "dgxmm_key_fp": fingerprint(key),
        "dgxmm_params_fp": "",
        "health_check_params": health_check_params,
    }
    model_info["dgxmm_params_fp"] = params_fingerprint(litellm_params, model_info)
    return {"model_name": served, "litellm_params": litellm_params, "model_info": model_info}


def always_on_entry(dep: dict[str, Any], engine_base_url: str, *, instance: str) -> dict[str, Any]:
    """The direct entry of an always-on deployment: LiteLLM calls the engine itself."""
    served = _served_name(dep)
    return {
        "model_name": served,
        "litellm_params": {
            "model": f"openai/{served}",
            "api_base": f"{engine_base_url.rstrip('/')}/v1",
            "api_key": ALWAYS_ON_API_KEY,
            "order": ORDER_READY,  # written only while its engine is ready
        },
        "model_info": {"dgxmm_id": int(dep["id"]), "dgxmm_instance": instance, "dgxmm_state": "ready"},
    }


def entry_dgxmm_id(entry: dict[str, Any]) -> int | str | None:
    """Our id of a LiteLLM entry, or None when the entry is not ours.

    We write an int; LiteLLM keeps extra model_info keys as given (types/router.py
    ModelInfo, extra="allow") but a hand edit or another serialisation may turn it into
    a string, so "7", 7 and 7.0 are the same deployment. Anything else that is set is
    still ours (kept as the raw string) and simply never wanted.
    """
    info = entry.get("model_info")
    if not isinstance(info, dict):
        return None
    raw = info.get("dgxmm_id")
    if raw is None or isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    text = str(raw).strip()
    try:
        return int(text)
    except ValueError:
        return text


def entry_instance(entry: dict[str, Any]) -> str | None:
    """The instance (box) that wrote an entry, or None (not ours, or written before instances)."""
    info = entry.get("model_info")
    raw = info.get("dgxmm_instance") if isinstance(info, dict) else None
    return raw if isinstance(raw, str) and raw else None


def entry_owned(entry: dict[str, Any], instance: str, internal_url: str) -> bool:
    """Whether a sync of ``instance`` may touch this entry (BEHAVIOUR.md, "Several boxes").

    Its own entries carry its instance. An entry written before instances existed
    (``dgxmm_id`` but no ``dgxmm_instance``) is its own when its api_base is under this
    instance's internal_url: the gateway entries it wrote then. Every other entry, another
    box's old ones included, belongs to someone else.
    """
    if entry_dgxmm_id(entry) is None:
        return False
    owner = entry_instance(entry)
    if owner is not None:
        return owner == instance
    base = _norm_base((entry.get("litellm_params") or {}).get("api_base"))
    return base is not None and base.startswith(internal_url.rstrip("/") + "/")


def names_view(entries: list[dict[str, Any]], instance: str) -> list[dict[str, Any]]:
    """Each name with an ondemand entry in LiteLLM: which instances serve it, in what state.

    ``[{"name", "ready": [instances], "entries": [{"instance", "dgxmm_id", "state",
    "order", "this"}]}]`` sorted by name, ready entries first, then asleep, then cold. An
    entry not written by ondemand under the same name is listed with instance null and
    state "external".
    """
    by_name: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        name = entry.get("model_name")
        if not isinstance(name, str):
            continue
        dep_id = entry_dgxmm_id(entry)
        owner = entry_instance(entry)
        by_name.setdefault(name, []).append({
            "instance": owner, "dgxmm_id": dep_id, "order": entry_order(entry),
            "state": entry_state(entry) if dep_id is not None else "external",
            "this": owner == instance,
        })
    rank = {"ready": 0, "asleep": 1, "cold": 2, "unknown": 3, "external": 4}
    out = []
    for name, rows in sorted(by_name.items()):
        if all(r["dgxmm_id"] is None for r in rows):
            continue
        rows.sort(key=lambda r: (rank[r["state"]], r["instance"] or "", str(r["dgxmm_id"])))
        ready = sorted({r["instance"] or "?" for r in rows if r["state"] == "ready" and r["dgxmm_id"] is not None})
        out.append({"name": name, "ready": ready, "entries": rows})
    return out


def entry_id(entry: dict[str, Any]) -> str | None:
    """LiteLLM's own id of an entry: model_info.id (the DB row's model_id for DB models)."""
    info = entry.get("model_info")
    if isinstance(info, dict) and info.get("id") is not None:
        return str(info["id"])
    return None


def _norm_base(url: Any) -> str | None:
    return url.rstrip("/") if isinstance(url, str) else None


def entry_order(entry: dict[str, Any]) -> int | None:
    """An entry's routing order as LiteLLM reads it (get_deployment_order: litellm_params,
    then model_info), as an int; None when it has none."""
    for where in ("litellm_params", "model_info"):
        part = entry.get(where)
        raw = part.get("order") if isinstance(part, dict) else None
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return int(raw)
    return None


def entry_state(entry: dict[str, Any]) -> str:
    """"ready", "asleep" or "cold" as the entry says, else "unknown".

    ``model_info.dgxmm_state`` when it is one of those; else the order as the box that
    wrote it meant it: 1 ready, 2 cold (before issue 22, 2 meant cold; an entry with
    dgxmm_state never relies on this), 3 cold.
    """
    info = entry.get("model_info")
    state = info.get("dgxmm_state") if isinstance(info, dict) else None
    if state in _WARMTH:
        return str(state)
    return {ORDER_READY: "ready", 2: "cold", ORDER_COLD: "cold"}.get(entry_order(entry) or 0, "unknown")


EntryChange = Literal["same", "warmth", "replace"]


def entry_change(existing: dict[str, Any], wanted: dict[str, Any]) -> EntryChange:
    """What it takes to turn an entry LiteLLM lists into the one we want.

    ``same``: nothing is written. ``warmth``: only ``litellm_params.order`` and
    ``model_info.dgxmm_state`` differ, so the entry is patched in place and keeps its
    LiteLLM id. ``replace``: what LiteLLM calls differs (name, model, api_base, the key's
    and the parameters' fingerprints) or the entry is not labelled as ours the way we
    write it now (instance): a new entry is added and this one deleted.
    """
    have_p = existing.get("litellm_params") or {}
    want_p = wanted["litellm_params"]
    have_i = existing.get("model_info") or {}
    want_i = wanted["model_info"]
    if not (
        existing.get("model_name") == wanted["model_name"]
        and have_p.get("model") == want_p["model"]
        and _norm_base(have_p.get("api_base")) == _norm_base(want_p["api_base"])
        and have_i.get("dgxmm_instance") == want_i.get("dgxmm_instance")
        # Always-on entries carry neither fingerprint: both sides None.
        and have_i.get("dgxmm_key_fp") == want_i.get("dgxmm_key_fp")
        and have_i.get("dgxmm_params_fp") == want_i.get("dgxmm_params_fp")
    ):
        return "replace"
    if (have_i.get("dgxmm_state") == want_i.get("dgxmm_state")
            and entry_order(existing) == entry_order(wanted)):
        return "same"
    return "warmth"


def entry_matches(existing: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether an entry LiteLLM lists is the one we want (then nothing is written)."""
    return entry_change(existing, wanted) == "same"
