"""LiteLLM's admin API as ondemand uses it: the HTTP client and the entries.

This module owns everything ondemand says to LiteLLM's proxy (``litellm_sync`` decides
when and what):

- ``LiteLLMClient``: ``GET /model/info``, ``POST /model/new`` (verified by a read) and
  ``POST /model/delete``, with the master key, and LiteLLM's answers turned into
  ``LiteLLMError`` codes (``litellm_unreachable``, ``litellm_unauthorized``,
  ``litellm_no_db``, ``litellm_not_stored``, ``litellm_error``).
- ``ondemand_entry`` / ``always_on_entry``: the entries, exactly as BEHAVIOUR.md, "LiteLLM registration",
  ("LiteLLM registration") describes them.

Our entries are the ones whose ``model_info`` carries ``dgxmm_id`` and our instance's
``dgxmm_instance`` (several boxes may share one LiteLLM: ``entry_owned``); nothing else in
LiteLLM is ever touched. Entries are replaced (add, then delete), never edited: the old
``POST /model/update`` (update_model) merges litellm_params only and keeps the stored
model_info, so a fingerprint would never change, and ``PATCH /model/{id}/update`` is
recent; add-then-delete works on every release and keeps the name served throughout.
Facts about LiteLLM relied on here are cited by file and function of BerriAI/litellm
(``proxy_server.py``, ``management_endpoints/model_management_endpoints.py``, ``health_check.py``, ``types/router.py``).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from .errors import OndemandError
from .http.headers import HEALTH_HEADER
from .keys import fingerprint

log = logging.getLogger(__name__)

HEALTH_CHECK_HEADER = HEALTH_HEADER
# Warm-first routing (BEHAVIOUR.md, "Several boxes"): LiteLLM's router keeps, of the
# deployments of a name that passed its health and cooldown filters, only those of the
# lowest litellm_params.order (router.py "ORDER FILTERING", after the cooldown filter;
# utils.py get_order_filtered_deployments). So a ready engine's entry gets 1, an entry
# that would need a start 2: a cold box is chosen only while no ready one is available.
ORDER_READY = 1
ORDER_COLD = 2
# LiteLLM needs *some* key for an openai/ entry; the engines behind always-on entries
# take none, so a harmless placeholder is sent (it never reaches a secret check).
ALWAYS_ON_API_KEY = "none"

# The text of LiteLLM's answers we recognise. add_new_model / delete_model
# (management_endpoints/model_management_endpoints.py, older: proxy_server.py) raise
# HTTPException(500, {"error": "No DB Connected. Here's how to do it - ..."}) without a
# database and HTTPException(500, {"error": "Set `'STORE_MODEL_IN_DB='True'` in your env
# to enable this feature."}) when models are not stored in it; both end up as
# ProxyException(message=str(detail), type="auth_error", code="500").
_NO_DB_MARKERS = ("No DB Connected", "STORE_MODEL_IN_DB")
# model_info_v1 (proxy_server.py) answers 500 "LLM Router is not loaded in ..." (older:
# "LLM Model List not loaded in ...") while the proxy has no model at all: that is an
# empty list, not an outage.
_NO_ROUTER_MARKERS = ("LLM Router is not loaded in", "LLM Model List not loaded in")
# delete_model: HTTPException(400, {"error": f"Model with id={id} not found in db"}).
_NOT_FOUND_MARKER = "not found in db"


class LiteLLMError(OndemandError):
    """LiteLLM could not do what was asked; ``code`` says why (502 for the admin API)."""

    def __init__(self, code: str, message: str, *, detail: str | None = None):
        super().__init__(502, code, message, detail=detail, type="server_error")

    def __repr__(self) -> str:
        return f"LiteLLMError({self.code!r}, {self.message!r})"


# ---------------------------------------------------------------------------
# Entries


def params_fingerprint(litellm_params: dict[str, Any], model_info: dict[str, Any]) -> str:
    """Fingerprint of what an on-demand entry adds to an always-on one.

    LiteLLM normalises what it returns (GenericLiteLLMParams in types/router.py types
    ``timeout`` as float, so 1500 comes back as 1500.0, and /model/info never returns
    api_key), so the entry is not compared field by field: this value, stored in
    model_info (kept verbatim: ModelInfo has extra="allow"), is.
    """
    covered = {
        "api_base": litellm_params.get("api_base"),
        "timeout": litellm_params.get("timeout"),
        "stream_timeout": litellm_params.get("stream_timeout"),
        "num_retries": litellm_params.get("num_retries"),
        "health_check_params": model_info.get("health_check_params"),
    }
    return fingerprint(orjson.dumps(covered, option=orjson.OPT_SORT_KEYS))


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
    ready = dep.get("state") == "ready"
    litellm_params: dict[str, Any] = {
        "model": f"openai/{served}",
        "api_base": f"{internal_url.rstrip('/')}/ondemand/{dep_id}/v1",
        "api_key": key,
        "timeout": timeout,
        "stream_timeout": timeout,
        # LiteLLM must not retry or fail over a request the gateway is holding.
        "num_retries": 0,
        "order": ORDER_READY if ready else ORDER_COLD,
    }
    # health_check.py _update_litellm_params_for_health_check merges
    # model_info.health_check_params into the probe's litellm_params only, so the marker
    # header rides on health checks and never on traffic.
    health_check_params = {"extra_headers": {HEALTH_CHECK_HEADER: "1"}}
    model_info: dict[str, Any] = {
        "dgxmm_id": dep_id,
        "dgxmm_instance": instance,
        "dgxmm_state": "ready" if ready else "cold",
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
    "order", "this"}]}]`` sorted by name, ready entries first. An entry not written by
    ondemand under the same name is listed with instance null and state "external".
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
    rank = {"ready": 0, "cold": 1, "unknown": 2, "external": 3}
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
    """"ready" or "cold" as the entry says (dgxmm_state, else its order), else "unknown"."""
    info = entry.get("model_info")
    state = info.get("dgxmm_state") if isinstance(info, dict) else None
    if state in ("ready", "cold"):
        return str(state)
    return {ORDER_READY: "ready", ORDER_COLD: "cold"}.get(entry_order(entry) or 0, "unknown")


def entry_matches(existing: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether an entry LiteLLM lists is the one we want (then nothing is written)."""
    have_p = existing.get("litellm_params") or {}
    want_p = wanted["litellm_params"]
    have_i = existing.get("model_info") or {}
    want_i = wanted["model_info"]
    return (
        existing.get("model_name") == wanted["model_name"]
        and have_p.get("model") == want_p["model"]
        and _norm_base(have_p.get("api_base")) == _norm_base(want_p["api_base"])
        and have_i.get("dgxmm_instance") == want_i.get("dgxmm_instance")
        and have_i.get("dgxmm_state") == want_i.get("dgxmm_state")
        and entry_order(existing) == entry_order(wanted)
        # Always-on entries carry neither fingerprint: both sides None.
        and have_i.get("dgxmm_key_fp") == want_i.get("dgxmm_key_fp")
        and have_i.get("dgxmm_params_fp") == want_i.get("dgxmm_params_fp")
    )


# ---------------------------------------------------------------------------
# Client


class LiteLLMClient:
    """LiteLLM's model-management API, with the master key as Bearer token."""

    def __init__(self, base_url: str, master_key: str, *, timeout_s: float = 10.0,
                 session_factory: Callable[[], aiohttp.ClientSession] | None = None,
                 verify_attempts: int = 3, verify_delay_s: float = 0.5):
        self.base_url = base_url.rstrip("/")
        self._master_key = master_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._verify_attempts = max(1, verify_attempts)
        self._verify_delay_s = verify_delay_s

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = (self._session_factory() if self._session_factory
                             else aiohttp.ClientSession())
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def _request(self, method: str, path: str, *, json: Any = None) -> tuple[int, Any]:
        """One call; returns (status, parsed body) or raises for transport failures."""
        headers = {"Authorization": f"Bearer {self._master_key}"}
        if json is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._get_session().request(
                method, self.base_url + path, headers=headers,
                data=None if json is None else orjson.dumps(json),
                timeout=self._timeout,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise LiteLLMError("litellm_unreachable", f"LiteLLM is unreachable at {self.base_url}",
                               detail=repr(exc)) from exc
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = raw.decode(errors="replace")
        return status, body

    @staticmethod
    def _message(body: Any) -> str:
        """The message of LiteLLM's error shape (proxy_server.py openai_exception_handler:
        {"error": {"message", "type", "param", "code"}}; FastAPI's own: {"detail": ...})."""
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and err.get("message") is not None:
                return str(err["message"])
            if err is not None:
                return str(err)
            if body.get("detail") is not None:
                return str(body["detail"])
        return str(body)[:500] if body is not None else ""

    def _error(self, what: str, status: int, body: Any) -> LiteLLMError:
        message = self._message(body)
        if status in (401, 403):
            return LiteLLMError("litellm_unauthorized",
                                f"LiteLLM refused the master key ({status}) on {what}", detail=message)
        if any(marker in message for marker in _NO_DB_MARKERS):
            return LiteLLMError("litellm_no_db",
                                "LiteLLM has no database to store models in (set DATABASE_URL "
                                "and STORE_MODEL_IN_DB=True)", detail=message)
        if status in (502, 503, 504):
            return LiteLLMError("litellm_unreachable", f"LiteLLM answered {status} on {what}",
                                detail=message)
        return LiteLLMError("litellm_error", f"LiteLLM answered {status} on {what}: {message[:300]}",
                            detail=message)

    async def list_models(self, *, ours_only: bool = False) -> list[dict[str, Any]]:
        """Every entry LiteLLM serves (``GET /model/info``), or only ours (with dgxmm_id).

        model_info_v1 (proxy_server.py) answers {"data": [deployment, ...]} for the master
        key: the router's deployments with api_key removed
        (remove_sensitive_info_from_deployment) and model_info.id = the DB row's model_id.
        It lists what the router serves, not the DB: a row that failed to load is absent.
        """
        status, body = await self._request("GET", "/model/info")
        if status >= 400:
            if status == 500 and any(m in self._message(body) for m in _NO_ROUTER_MARKERS):
                return []
            raise self._error("GET /model/info", status, body)
        data = body.get("data") if isinstance(body, dict) else None
        if isinstance(data, dict):  # the single-model shape (litellm_model_id / user_model)
            data = [data]
        if not isinstance(data, list):
            raise LiteLLMError("litellm_error", "LiteLLM's /model/info has no data list",
                               detail=str(body)[:500])
        entries = [e for e in data if isinstance(e, dict)]
        if ours_only:
            entries = [e for e in entries if entry_dgxmm_id(e) is not None]
        return entries

    async def add_model(self, model_name: str, litellm_params: dict[str, Any],
                        model_info: dict[str, Any]) -> dict[str, Any]:
        """Add an entry and prove it is served; returns LiteLLM's entry as /model/info lists it.

        add_new_model answers the created DB row (LiteLLM_ProxyModelTable: model_id, and
        litellm_params encrypted by encrypt_value_helper, so unreadable). Some versions
        answer 200 with nothing stored or loaded (the row creation's or the router reload's
        exception swallowed and logged, the body null or a row the router never loaded), so
        success is only what a following read shows.
        """
        payload = {"model_name": model_name, "litellm_params": litellm_params,
                   "model_info": model_info}
        status, body = await self._request("POST", "/model/new", json=payload)
        if status >= 400:
            raise self._error("POST /model/new", status, body)
        model_id = body.get("model_id") if isinstance(body, dict) else None
        wanted = {"model_name": model_name, "litellm_params": litellm_params,
                  "model_info": model_info}
        for attempt in range(self._verify_attempts):
            if attempt:
                # A reload may still be running; a pod behind a balancer may poll later.
                await asyncio.sleep(self._verify_delay_s)
            for entry in await self.list_models():
                if model_id is not None:
                    if entry_id(entry) == str(model_id):
                        return entry
                elif (entry_dgxmm_id(wanted) is not None
                      and entry_dgxmm_id(entry) == entry_dgxmm_id(wanted)
                      and entry_matches(entry, wanted)):
                    return entry
        raise LiteLLMError(
            "litellm_not_stored",
            f"LiteLLM accepted {model_name!r} (200) but does not list it",
            detail=f"/model/new answered {str(body)[:300]}")

    async def delete_model(self, model_id: str) -> bool:
        """Delete by LiteLLM's id (``POST /model/delete`` {"id"}); False when already gone."""
        status, body = await self._request("POST", "/model/delete", json={"id": str(model_id)})
        if status == 400 and _NOT_FOUND_MARKER in self._message(body):
            return False
        if status >= 400:
            raise self._error("POST /model/delete", status, body)
        return True
