"""LiteLLM's admin API as ondemand uses it: the HTTP client and its errors.

This module owns everything ondemand says to LiteLLM's proxy (``litellm.sync`` decides
when and what):

- ``LiteLLMClient``: ``GET /model/info``, ``POST /model/new`` (verified by a read),
  ``PATCH /model/{id}/update`` (a change of warmth, verified by a read) and
  ``POST /model/delete``, with the master key, and LiteLLM's answers turned into
  ``LiteLLMError`` codes (``litellm_unreachable``, ``litellm_unauthorized``,
  ``litellm_no_db``, ``litellm_not_stored``, ``litellm_error``).
- ``entries``: the entries themselves (``ondemand_entry`` / ``always_on_entry``,
  ``entry_change``, whose an entry is).

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
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
import orjson

from ..errors import OndemandError
from .entries import entry_dgxmm_id, entry_id, entry_matches, entry_order

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
