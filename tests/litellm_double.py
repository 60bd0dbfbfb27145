"""A LiteLLM proxy double: a real aiohttp server answering LiteLLM's model-management API.

Only what ondemand uses, with the shapes and status codes of BerriAI/litellm's source:

- ``POST /model/new``: add_new_model (management_endpoints/model_management_endpoints.py;
  older releases: proxy_server.py) answers the created DB row (LiteLLM_ProxyModelTable,
  litellm_params encrypted by encrypt_value_helper) and reloads the router.
- ``PATCH /model/{model_id}/update``: patch_model (management_endpoints/
  model_management_endpoints.py): an updateDeployment body (types/router.py: model_name,
  litellm_params, model_info, all optional); the row is found by model_id (unknown:
  ProxyException 404 "Model <id> not found on proxy.", type not_found_error; a config model:
  400 "Cannot edit config-based model. ..."); update_db_model merges the patch's non-None
  litellm_params and model_info into the stored ones, keeps model_id, reloads the router
  (which sets model_info.id = model_id, db_model = True: get_model_info_with_id) and answers
  the updated row. Without a database: HTTPException 500, rendered by FastAPI as
  {"detail": {"error": "DB not connected. ..."}}; with store_model_in_db off: 400 "Model
  updates only supported for DB-stored models" (type validation_error, param null).
- ``POST /model/delete`` {"id"}: delete_model, {"message": "Model: <id> deleted
  successfully"}; an unknown id is 400 ``{'error': 'Model with id=<id> not found in db'}``.
- ``GET /model/info`` and ``/v1/model/info``: model_info_v1 (proxy_server.py),
  {"data": [router deployments]} with api_key removed (remove_sensitive_info_from_deployment)
  and model_info.id / db_model set; 500 "LLM Router is not loaded in ..." with no router.
- ``GET /v2/model/info``: model_info_v2 (proxy_server.py), the same {"data": [...]}.
- Every error as openai_exception_handler (proxy_server.py) renders a ProxyException
  (proxy/_types.py: message=str(message), code=str(code)):
  {"error": {"message", "type", "param", "code"}}; the auth failure as
  UserAPIKeyAuthExceptionHandler._handle_authentication_error (proxy/auth/
  auth_exception_handler.py): 401, "Authentication Error, ...", type "auth_error".

Knobs: ``down`` (True/"500": plain 500 to everything; "close": the connection is dropped),
``no_db`` (no prisma_client: writes answer 500 "No DB Connected ..."), ``no_store``
(a DB but STORE_MODEL_IN_DB unset), ``no_router`` (no model at all yet: /model/info 500),
``store_silently_fails`` (True: /model/new answers 200 with a row that is never served;
"null": 200 with a null body, as releases that swallowed the DB error did), ``patch_route``
(None: LiteLLM without the PATCH route, as FastAPI answers an unknown path: 404 {"detail":
"Not Found"}; 405: a release where the path exists for another method, {"detail": "Method
Not Allowed"}), ``patch_silently_fails`` (PATCH answers 200 and changes nothing).
"""
from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

# add_new_model / delete_model: HTTPException details, rendered with str() by ProxyException.
NO_DB_DETAIL = {"error": "No DB Connected. Here's how to do it - https://docs.litellm.ai/docs/proxy/virtual_keys"}
NO_STORE_DETAIL = {"error": "Set `'STORE_MODEL_IN_DB='True'` in your env to enable this feature."}
# patch_model without a database: CommonProxyErrors.db_not_connected_error in an HTTPException.
DB_NOT_CONNECTED = ("DB not connected. This endpoint needs a database; set DATABASE_URL to a PostgreSQL "
                    "connection string (postgresql://...) to enable it. See https://docs.litellm.ai/docs/proxy/virtual_keys")
# model_info_v1 without a router.
NO_ROUTER_DETAIL = {"error": "LLM Router is not loaded in. Make sure you passed models in your "
                             "config.yaml or on the LiteLLM Admin UI. - https://docs.litellm.ai/docs/proxy/configs"}
# remove_sensitive_info_from_deployment (proxy/common_utils/openai_endpoint_utils.py).
SENSITIVE_PARAMS = ("api_key", "client_secret", "vertex_credentials", "aws_access_key_id",
                    "aws_secret_access_key")
# GenericLiteLLMParams (types/router.py) types these as float | str: ints come back float.
FLOAT_PARAMS = ("timeout", "stream_timeout")
# The request body, parsed once by the middleware that logs every call.
BODY = web.RequestKey("body", object)
TOKEN = web.RequestKey("token", str)


def proxy_error(status: int, message: Any, type_: str = "auth_error", param: str | None = "None") -> web.Response:
    """openai_exception_handler's rendering of ProxyException(message, type, param, code)."""
    return web.json_response(
        {"error": {"message": str(message), "type": type_, "param": param, "code": str(status)}},
        status=status)


def _encrypted(value: Any) -> Any:
    """encrypt_value_helper: strings become an opaque base64 token, the rest stays."""
    if isinstance(value, str):
        return base64.b64encode(b"nacl:" + value.encode()).decode()
    return value


class LiteLLMDouble:
    def __init__(self, master_key: str, *, no_db: bool = False):
        self.master_key = master_key
        self.url = ""
        self.calls: list[tuple[str, str, Any]] = []
        self.down: bool | str = False
        self.no_db = no_db
        self.no_store = False
        self.no_router = False
        self.store_silently_fails: bool | str = False
        self.patch_route: int | None = 200  # 200: served; None: 404 (no route); 405
        self.patch_silently_fails = False
        self._models: list[dict] = []  # the router's deployments, api_key included
        # Several callers (boxes), each with a key of its own: who added and deleted what.
        self.other_keys: set[str] = set()
        self.adds: list[tuple[str, dict]] = []  # (caller's key, entry as stored)
        self.deletes: list[tuple[str, dict]] = []  # (caller's key, entry as it was)
        self.patches: list[tuple[str, dict]] = []  # (caller's key, entry as patched)

    # -- test helpers ---------------------------------------------------------

    @property
    def models(self) -> list[dict]:
        """The entries LiteLLM serves now (deep copies, api_key included)."""
        return copy.deepcopy(self._models)

    def seed(self, model_name: str, litellm_params: dict, model_info: dict | None = None,
             *, db_model: bool = True) -> str:
        """Put an entry in place without a call (a config model with db_model=False)."""
        info = dict(model_info or {})
        model_id = str(info.pop("id", None) or uuid.uuid4())
        self._models.append({"model_name": model_name, "litellm_params": dict(litellm_params),
                             "model_info": {"id": model_id, "db_model": db_model, **info}})
        return model_id

    def writes(self) -> list[tuple[str, str, Any]]:
        return [c for c in self.calls if c[0] in ("POST", "PATCH")]

    # -- the server -----------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post("/model/new", self._model_new)
        app.router.add_post("/model/delete", self._model_delete)
        app.router.add_route("*", "/model/{model_id}/update", self._model_patch)
        app.router.add_get("/model/info", self._model_info)
        app.router.add_get("/v1/model/info", self._model_info)
        app.router.add_get("/v2/model/info", self._model_info_v2)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = await request.text()
        self.calls.append((request.method, request.path, body))
        if self.down == "close":
            request.transport.abort()
            raise ConnectionResetError("LiteLLM double is down")
        if self.down:
            return web.Response(status=500, text="Internal Server Error")
        # user_api_key_auth: Authorization: Bearer <key> (also "bearer "); the master key
        # is compared with secrets.compare_digest; a wrong key ends as a 401 ProxyException.
        auth = request.headers.get("Authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not token:
            return proxy_error(401, "Authentication Error, No api key passed in.")
        if token != self.master_key and token not in self.other_keys:
            return proxy_error(
                401, "Authentication Error, Invalid proxy server token passed. Received API Key = "
                     f"{token[:3]}...{token[-4:]}, Unable to find token in cache or "
                     "`LiteLLM_VerificationTokenTable`")
        request[BODY] = body
        request[TOKEN] = token
        return await handler(request)

    def _write_refusal(self) -> web.Response | None:
        # add_new_model / delete_model: HTTPException(500, detail) re-raised as
        # ProxyException(message=detail, type=auth_error, code=500).
        if self.no_db:
            return proxy_error(500, NO_DB_DETAIL)
        if self.no_store:
            return proxy_error(500, NO_STORE_DETAIL)
        return None

    async def _model_new(self, request: web.Request) -> web.Response:
        refusal = self._write_refusal()
        if refusal is not None:
            return refusal
        body = request[BODY]
        # FastAPI's validation of Deployment: model_name and litellm_params.model required.
        missing = []
        if not isinstance(body, dict) or not isinstance(body.get("model_name"), str):
            missing.append(["body", "model_name"])
        params = body.get("litellm_params") if isinstance(body, dict) else None
        if not isinstance(params, dict) or not isinstance(params.get("model"), str):
            missing.append(["body", "litellm_params", "model"])
        if missing:
            return web.json_response({"detail": [{"type": "missing", "loc": loc, "msg": "Field required"}
                                                 for loc in missing]}, status=422)
        info = dict(body.get("model_info") or {})
        # ModelInfo.__init__ (types/router.py): a uuid4 when no id, an int id as str.
        model_id = str(info.pop("id", None) or uuid.uuid4())
        stored_params = {k: v for k, v in params.items() if v is not None}
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        row = {
            "model_id": model_id,
            "model_name": body["model_name"],
            "litellm_params": {k: _encrypted(v) for k, v in stored_params.items()},
            "model_info": {"id": model_id, "db_model": False, **info},
            "created_at": now, "created_by": "default_user_id",
            "updated_at": now, "updated_by": "default_user_id",
        }
        if self.store_silently_fails == "null":
            return web.json_response(None)
        if self.store_silently_fails:
            return web.json_response(row)
        for name in FLOAT_PARAMS:
            if isinstance(stored_params.get(name), int):
                stored_params[name] = float(stored_params[name])
        # proxy_config.add_deployment reloads DB rows into the router: model_info gets
        # id = model_id and db_model = True (get_model_info_with_id).
        self._models.append({"model_name": body["model_name"], "litellm_params": stored_params,
                             "model_info": {"id": model_id, "db_model": True, **info}})
        self.adds.append((request[TOKEN], copy.deepcopy(self._models[-1])))
        return web.json_response(row)

    async def _model_delete(self, request: web.Request) -> web.Response:
        refusal = self._write_refusal()
        if refusal is not None:
            return refusal
        body = request[BODY]
        model_id = body.get("id") if isinstance(body, dict) else None
        if not isinstance(model_id, str):
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", "id"],
                                                  "msg": "Field required"}]}, status=422)
        for i, model in enumerate(self._models):
            if model["model_info"]["id"] == model_id and model["model_info"].get("db_model"):
                self.deletes.append((request[TOKEN], copy.deepcopy(model)))
                del self._models[i]
                return web.json_response({"message": f"Model: {model_id} deleted successfully"})
        return proxy_error(400, {"error": f"Model with id={model_id} not found in db"})

    async def _model_patch(self, request: web.Request) -> web.Response:
        # What LiteLLM without the route answers (FastAPI's own 404/405), or the wrong method.
        if self.patch_route is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.patch_route == 405 or request.method != "PATCH":
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        if self.no_db:
            return web.json_response({"detail": {"error": DB_NOT_CONNECTED}}, status=500)
        if self.no_store:
            return proxy_error(400, "Model updates only supported for DB-stored models",
                               "validation_error", None)
        body = request[BODY]
        # updateDeployment: every field optional, but a body is required and must be an object.
        if body is None:
            return web.json_response({"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required"}]},
                                     status=422)
        if not isinstance(body, dict):
            return web.json_response({"detail": [{"type": "model_attributes_type", "loc": ["body"],
                                                  "msg": "Input should be a valid dictionary or object"}]},
                                     status=422)
        model_id = request.match_info["model_id"]
        model = next((m for m in self._models if m["model_info"]["id"] == model_id), None)
        if model is None:
            return proxy_error(404, f"Model {model_id} not found on proxy.", "not_found_error", None)
        if not model["model_info"].get("db_model"):
            return proxy_error(400, "Cannot edit config-based model. Store model in DB via /model/new first.",
                               "validation_error", None)
        if self.patch_silently_fails:
            return web.json_response({"model_id": model_id, "model_name": model["model_name"]})
        # update_db_model: the stored values updated with the patch's non-None ones.
        params = {k: v for k, v in (body.get("litellm_params") or {}).items() if v is not None}
        for name in FLOAT_PARAMS:
            if isinstance(params.get(name), int):
                params[name] = float(params[name])
        model["litellm_params"].update(params)
        info = {k: v for k, v in (body.get("model_info") or {}).items() if v is not None}
        model["model_info"].update(info)
        # The reload: the router's id is the row's model_id (get_model_info_with_id).
        model["model_info"].update({"id": model_id, "db_model": True})
        if isinstance(body.get("model_name"), str):
            model["model_name"] = body["model_name"]
        self.patches.append((request[TOKEN], copy.deepcopy(model)))
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return web.json_response({
            "model_id": model_id, "model_name": model["model_name"],
            "litellm_params": {k: _encrypted(v) for k, v in model["litellm_params"].items()},
            "model_info": model["model_info"], "updated_at": now, "updated_by": "default_user_id"})

    def _listing(self) -> list[dict]:
        listed = copy.deepcopy(self._models)
        for model in listed:
            for name in SENSITIVE_PARAMS:
                model["litellm_params"].pop(name, None)
        return listed

    async def _model_info(self, request: web.Request) -> web.Response:
        if self.no_router and not self._models:
            return proxy_error(500, NO_ROUTER_DETAIL)
        model_id = request.query.get("litellm_model_id")
        if model_id is not None:
            for model in self._listing():
                if model["model_info"]["id"] == model_id:
                    return web.json_response({"data": model})
            return proxy_error(404, {"error": f"Model id = {model_id} not found on litellm proxy"})
        return web.json_response({"data": self._listing()})

    async def _model_info_v2(self, request: web.Request) -> web.Response:
        if self.no_router and not self._models:
            return proxy_error(500, {"error": "No model list passed, models=None. You can add a model "
                                              "through the config.yaml or on the LiteLLM Admin UI."})
        listed = self._listing()
        model = request.query.get("model")
        if model is not None:
            listed = [m for m in listed if m["model_name"] == model]
        return web.json_response({"data": listed})


@contextlib.asynccontextmanager
async def litellm_double(master_key: str = "sk-master", no_db: bool = False) -> AsyncIterator[LiteLLMDouble]:
    double = LiteLLMDouble(master_key, no_db=no_db)
    runner = web.AppRunner(double.app(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    double.url = f"http://{host}:{port}"
    try:
        yield double
    finally:
        await runner.cleanup()
