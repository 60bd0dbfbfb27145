#!/usr/bin/env bash
# make run-real: ondemand in the foreground with a real engine, for a person to try.
#
#   - llama-server and the Gemma-3-270M GGUF come from scripts/heavy/ (cached after
#     the first build: ~9 min cold, instant warm), or from $LLAMA_SERVER / $GEMMA_GGUF;
#   - the config is packaging/real.toml, written to state/real/ondemand.toml with an
#     absolute state_dir (process backend, static 8 GiB budget, 127.0.0.1:8091,
#     loopback clients only, idle models stopped after 120 s);
#   - the on-demand key is created on the first run (`ondemand key init`);
#   - the server starts, then the on-demand llama.cpp deployment is created through
#     the admin socket if it is not there yet (replaced if its command changed);
#   - curl lines to try are printed; Ctrl-C stops the server and its engine.
#
# The deployment rests `stopped`: the first request through the gateway starts
# llama-server, and 120 s without requests stop it again.
#
# Environment: LLAMA_SERVER, GEMMA_GGUF (skip the heavy scripts), PYTHON (default:
# .venv/bin/python, else python3), REAL_LLAMA_ARGS (extra llama-server arguments,
# e.g. "-t 1" on a busy machine: llama.cpp's threads spin while they wait).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { echo "[run-real] $*" >&2; }
die() { echo "[run-real] ERROR: $*" >&2; exit 1; }

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
command -v curl >/dev/null || die "curl is needed"

# --- engine and model ---------------------------------------------------------
if [[ -z "${LLAMA_SERVER:-}" ]]; then
  say "locating llama-server (scripts/heavy/llama-server.sh; ~9 min the first time)"
  LLAMA_SERVER="$(bash scripts/heavy/llama-server.sh | tail -1)" || die "scripts/heavy/llama-server.sh failed"
fi
if [[ -z "${GEMMA_GGUF:-}" ]]; then
  say "locating the Gemma GGUF (scripts/heavy/gemma-model.sh)"
  GEMMA_GGUF="$(bash scripts/heavy/gemma-model.sh | tail -1)" || die "scripts/heavy/gemma-model.sh failed"
fi
[[ -x "$LLAMA_SERVER" ]] || die "LLAMA_SERVER=$LLAMA_SERVER is not an executable file"
[[ -f "$GEMMA_GGUF" ]] || die "GEMMA_GGUF=$GEMMA_GGUF is not a file"

# --- configuration and key ----------------------------------------------------
STATE="$ROOT/state/real"
CFG="$STATE/ondemand.toml"
SOCK="$STATE/admin.sock"
mkdir -p "$STATE"
sed "s|^state_dir = .*|state_dir = \"$STATE\"|" packaging/real.toml >"$CFG.tmp"
mv -f "$CFG.tmp" "$CFG"
od() { "$PY" -m ondemand --config "$CFG" "$@"; }

# The listener and base path, as ondemand reads them (an ONDEMAND_LISTEN in the
# environment wins over the file, like for the server itself).
read -r LISTEN BASE KEY_FILE < <("$PY" -c '
import sys
from ondemand import config
c = config.load(sys.argv[1])
print(c.listen, c.base_path or "", c.key_file)' "$CFG") || die "cannot read $CFG"
URL="http://${LISTEN}${BASE}"
ADMIN="http://localhost${BASE}/api"

if ! od key show >/dev/null 2>&1; then
  od key init >&2
fi

admin() {  # admin METHOD PATH [JSON]: the admin API over the Unix socket (no token needed)
  local args=(-sS --fail-with-body --max-time 30 --unix-socket "$SOCK" -X "$1" "$ADMIN$2")
  [[ $# -ge 3 ]] && args+=(-H 'Content-Type: application/json' --data-binary "$3")
  curl "${args[@]}"
}

if [[ -S "$SOCK" ]] && admin GET /host >/dev/null 2>&1; then
  die "an ondemand already serves $STATE (its admin socket answers); stop it first"
fi

# --- the server ---------------------------------------------------------------
say "starting: $PY -m ondemand --config $CFG serve"
"$PY" -m ondemand --config "$CFG" serve &   # a simple command: $! is the server itself
SERVER_PID=$!
# shellcheck disable=SC2317  # called by the traps
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server INT TERM
trap 'stop_server; wait "$SERVER_PID" 2>/dev/null || true' EXIT

for _ in $(seq 1 300); do
  kill -0 "$SERVER_PID" 2>/dev/null || { wait "$SERVER_PID" || true; die "the server exited (its output is above)"; }
  if [[ -S "$SOCK" ]] && admin GET /host >/dev/null 2>&1; then break; fi
  sleep 0.1
done
admin GET /host >/dev/null || die "the admin socket $SOCK does not answer after 30 s"

# --- the deployment -----------------------------------------------------------
NAME=gemma-270m
SERVED=gemma-3-270m
# shellcheck disable=SC2086  # REAL_LLAMA_ARGS is a list of words on purpose
BODY="$("$PY" -c '
import json, sys
name, served, llama, gguf, *extra = sys.argv[1:]
command = [llama, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}",
           "--no-jinja", "--chat-template", "gemma",   # built-in template names need --no-jinja
           "--metrics",  # llamacpp:requests_* for the sampler: without them the model never reads idle
           "-c", "2048", "-np", "2", *extra, "--alias", served]
print(json.dumps({"name": name, "served_name": served, "engine": "llamacpp", "command": command,
                  "memory_gib": 1, "mode": "on_demand"}))' \
  "$NAME" "$SERVED" "$LLAMA_SERVER" "$GEMMA_GGUF" ${REAL_LLAMA_ARGS:-})"

EXISTING="$(admin GET /deployments | "$PY" -c '
import json, sys
want = json.loads(sys.argv[2])
for d in json.load(sys.stdin):
    if d["name"] == sys.argv[1]:
        same = d["command"] == want["command"] and d["engine"] == want["engine"] and d["mode"] == "on_demand"
        print(d["id"], "same" if same else "changed")' "$NAME" "$BODY")"
read -r DEP_ID HOW <<<"${EXISTING:-none none}"
if [[ "$HOW" == changed ]]; then
  say "deployment $NAME ($DEP_ID) has another command or mode: replacing it"
  admin DELETE "/deployments/$DEP_ID" >/dev/null
  HOW=none
fi
if [[ "$HOW" == none ]]; then
  DEP_ID="$(admin POST /deployments "$BODY" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["id"])')" \
    || die "creating the deployment failed"
  say "created the on-demand deployment $NAME (id $DEP_ID)"
else
  say "deployment $NAME (id $DEP_ID) is there already"
fi

# --- what to try --------------------------------------------------------------
GW="$URL/ondemand/$DEP_ID/v1"
AUTH="Authorization: Bearer \$(cat $KEY_FILE)"
cat >&2 <<EOF

ondemand serves $URL (config $CFG).
Deployment $DEP_ID "$SERVED" is on demand: the first request starts llama-server
(a second or two), 120 s without requests stop it. Try, from another terminal:

  # chat (a cold start the first time)
  curl -s $GW/chat/completions -H "$AUTH" -H 'Content-Type: application/json' \\
    -d '{"model": "$SERVED", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32}'

  # streamed chat (SSE chunks, then data: [DONE])
  curl -sN $GW/chat/completions -H "$AUTH" -H 'Content-Type: application/json' \\
    -d '{"model": "$SERVED", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 200, "stream": true}'

  # the models list (answered by ondemand: never starts the engine)
  curl -s $GW/models -H "$AUTH"

  # the admin API on the Unix socket: state, phase, in-flight counts, engine metrics
  curl -s --unix-socket $SOCK http://localhost$BASE/api/deployments
  curl -s --unix-socket $SOCK http://localhost$BASE/api/audit

  # the engine's output
  tail -f $STATE/logs/$NAME.log

Ctrl-C stops ondemand and the engine.
EOF

# Wait for the server; a trapped Ctrl-C interrupts `wait`, so wait again until it is gone.
rc=0
while kill -0 "$SERVER_PID" 2>/dev/null; do
  wait "$SERVER_PID" && rc=0 || rc=$?
done
trap - EXIT
exit "$rc"
