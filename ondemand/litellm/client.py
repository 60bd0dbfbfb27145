"""LiteLLM's admin API as ondemand uses it: the HTTP client and the entries.

This module owns everything ondemand says to LiteLLM's proxy (``litellm_sync`` decides
when and what):

- ``LiteLLMClient``: ``GET /model/info``, ``POST /model/new`` (verified by a read),
  ``PATCH /model/{id}/update`` (a change of warmth, verified by a read) and
  ``POST /model/delete``, with the master key, and LiteLLM's answers turned into
  ``LiteLLMError`` codes (``litellm_unreachable``, ``litellm_unauthorized``,
  ``litellm_no_db``, ``litellm_not_stored``, ``litellm_error``).
- ``ondemand_entry`` / ``always_on_entry``: the entries, exactly as BEHAVIOUR.md, "LiteLLM
  registration", describes them; ``entry_change``: what it takes to turn one into another.

Our entries are the ones whose ``model_info`` carries ``dgxmm_id`` and our instance's
``dgxmm_instance`` (several boxes may share one LiteLLM: ``entry_owned``); nothing else in
LiteLLM is ever touched. A change of warmth alone (``litellm_params.order`` and
``model_info.dgxmm_state``) is written in place with ``PATCH /model/{id}/update``
(patch_model), which merges both and keeps the entry's LiteLLM id, so its spend records,
cooldown and health state carry over; the older ``POST /model/update`` (update_model) merges
litellm_params only and keeps the stored model_info, so it is never used. Any other change
(what LiteLLM calls: key, address, model, timeouts) replaces the entry (add, then delete),
which works on every release and keeps the name served throughout; so does a change of
warmth on a LiteLLM without the PATCH route (404/405).
Facts about LiteLLM relied on here are cited by file and function of BerriAI/litellm
(``proxy_server.py``, ``management_endpoints/model_management_endpoints.py``, ``health_check.py``,
``types/router.py``, ``router.py``, ``utils.py``), read in the source of 1.106.12.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
import orjson

from ..errors import OndemandError
from ..gateway.keys import fingerprint
from ..http.headers import HEALTH_HEADER

log = logging.getLogger(__name__)

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

# The text of LiteLLM's answers we recognise. add_new_model / delete_model
# (management_endpoints/model_management_endpoints.py, older: proxy_server.py) raise
# HTTPException(500, {"error": "No DB Connected. Here's how to do it - ..."}) without a
# database and HTTPException(500, {"error": "Set `'STORE_MODEL_IN_DB='True'` in your env
# to enable this feature."}) when models are not stored in it; both end up as
# ProxyException(message=str(detail), type="auth_error", code="500"). patch_model raises
# HTTPException(500, {"error": CommonProxyErrors.db_not_connected_error}) ("DB not
# connected. This endpoint needs a database; ...", rendered by FastAPI as {"detail": ...})
# and, with store_model_in_db off, ProxyException(400, "Model updates only supported for
# DB-stored models").
_NO_DB_MARKERS = ("No DB Connected", "STORE_MODEL_IN_DB", "DB not connected",
                  "Model updates only supported for DB-stored models")
# model_info_v1 (proxy_server.py) answers 500 "LLM Router is not loaded in ..." (older:
# "LLM Model List not loaded in ...") while the proxy has no model at all: that is an
# empty list, not an outage.
_NO_ROUTER_MARKERS = ("LLM Router is not loaded in", "LLM Model List not loaded in")
# delete_model: HTTPException(400, {"error": f"Model with id={id} not found in db"}).
_NOT_FOUND_MARKER = "not found in db"

# What patch_warmth found: the entry rewritten in place; LiteLLM has no PATCH route; the
# entry is not (or no longer) in LiteLLM's database.
PatchOutcome = Literal["patched", "no_route", "gone"]


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
        # Whether LiteLLM has PATCH /model/{id}/update: None until tried, False once it
        # answered 404/405 for it (then never tried again by this client), True once it worked.
        self.patch_route: bool | None = None

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

    async def patch_warmth(self, model_id: str, order: int, dgxmm_state: str) -> PatchOutcome:
        """Rewrite an entry's warmth in place: ``PATCH /model/{model_id}/update``.

        patch_model (management_endpoints/model_management_endpoints.py) takes an
        updateDeployment (types/router.py: model_name, litellm_params, model_info, blocked,
        all optional; model_name is not needed), needs the database (prisma_client, else
        HTTPException 500 "DB not connected ...") and store_model_in_db (else 400 "Model
        updates only supported for DB-stored models"), reads the row by model_id
        (get_db_model: a config model is 400 "Cannot edit config-based model ...", an
        unknown id ProxyException 404 "Model {id} not found on proxy."), then update_db_model
        merges: litellm_params = the stored ones updated with the patch's non-None fields,
        model_info likewise. It writes the row under the same model_id, reloads the router
        (clear_cache) and answers the updated row. The patch's model_info goes through
        ModelInfo(), which makes a fresh uuid4 id when none is given; the router takes the
        id from the row's model_id anyway (proxy_server.py get_model_info_with_id), but the
        id is sent so the stored model_info says the same.

        Returns "patched" once a read shows the new warmth, "no_route" when LiteLLM has no
        such route (404 or 405 from the framework: {"detail": "Not Found" | "Method Not
        Allowed"}, not patch_model's own {"error": ...}; remembered in ``patch_route``),
        "gone" when LiteLLM does not hold the entry. Raises ``LiteLLMError`` otherwise
        (``litellm_not_stored`` when LiteLLM answered 200 but does not list the change).
        """
        path = f"/model/{quote(str(model_id), safe='')}/update"
        payload = {"litellm_params": {"order": order},
                   "model_info": {"id": str(model_id), "dgxmm_state": dgxmm_state}}
        status, body = await self._request("PATCH", path, json=payload)
        if status in (404, 405) and not (isinstance(body, dict) and "error" in body):
            self.patch_route = False
            return "no_route"
        if status == 404:  # patch_model's own answer: the route is there
            self.patch_route = True
            return "gone"
        if status >= 400:
            raise self._error(f"PATCH {path}", status, body)
        self.patch_route = True
        for attempt in range(self._verify_attempts):
            if attempt:
                await asyncio.sleep(self._verify_delay_s)
            for entry in await self.list_models():
                if entry_id(entry) == str(model_id):
                    info = entry.get("model_info") or {}
                    if entry_order(entry) == order and info.get("dgxmm_state") == dgxmm_state:
                        return "patched"
                    break
        raise LiteLLMError(
            "litellm_not_stored",
            f"LiteLLM accepted the warmth of {model_id} (200) but does not list it",
            detail=f"{path} answered {str(body)[:300]}")

    async def delete_model(self, model_id: str) -> bool:
        """Delete by LiteLLM's id (``POST /model/delete`` {"id"}); False when already gone."""
        status, body = await self._request("POST", "/model/delete", json={"id": str(model_id)})
        if status == 400 and _NOT_FOUND_MARKER in self._message(body):
            return False
        if status >= 400:
            raise self._error("POST /model/delete", status, body)
        return True
