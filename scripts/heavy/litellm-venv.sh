#!/usr/bin/env bash
# A separate venv with the LiteLLM proxy and the OpenAI SDK, for the tests that
# drive ondemand through LiteLLM (kept out of the project venv: litellm[proxy]
# pulls in ~150 packages with their own pins).
#
# Output contract: last stdout line = the venv's python, $CACHE/litellm-venv/bin/python
# (the proxy CLI is next to it: $CACHE/litellm-venv/bin/litellm).
# Options: --smoke  also start `litellm --config` (no database, master key, one
#                   model entry) on a free loopback port and check /health/liveliness.
# Cold: ~95 s (pip resolve + download + install, ~740 MB venv). Warm: <0.1 s.
set -euo pipefail
HEAVY_NAME=litellm-venv
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

# Pinned: the versions this was verified with (pip resolved the rest).
# Not newer: litellm 1.110.x's [proxy] extra needs `litellm-proxy`, and 1.108.x /
# 1.109.x need litellm-proxy-extras / litellm-enterprise releases that the PyPI
# reachable here does not serve; 1.106.12 resolves completely.
PINS=("litellm[proxy]==1.106.12" "openai==2.54.0")
# litellm fetches its model cost map from GitHub at import (3 tries with back-off
# when offline): use the copy bundled in the package instead.
export LITELLM_LOCAL_MODEL_COST_MAP=True
VENV="$CACHE/litellm-venv"
PY="$VENV/bin/python"
STAMP="$VENV/.ondemand-pins"
SMOKE=0
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE=1 ;;
    *) die "unknown argument: $a (usage: $0 [--smoke])" ;;
  esac
done

want="$(printf '%s\n' "${PINS[@]}")"
if venv_ready "$VENV" "$want"; then
  log "cached: $VENV (${PINS[*]})"
else
  start=$SECONDS
  venv_begin "$VENV"
  log "pip install ${PINS[*]} (~1.5 min cold)"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check \
    "${PINS[@]}" >&2 || die "pip install ${PINS[*]} failed"
  "$PY" -c 'import litellm, litellm.proxy.proxy_server, openai' >&2 \
    || die "litellm/openai do not import in $VENV"
  echo "$want" >"$STAMP"
  log "installed in $((SECONDS - start)) s: $("$PY" -m pip show litellm 2>/dev/null | grep ^Version)"
fi

if ((SMOKE)); then
  tmp="$(mktemp -d)"
  PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  cat >"$tmp/cfg.yaml" <<'EOF'
model_list:
  - model_name: demo
    litellm_params:
      model: openai/demo
      api_base: http://127.0.0.1:9/v1
      api_key: x
general_settings:
  master_key: sk-smoke-1234
EOF
  log "smoke: litellm --config $tmp/cfg.yaml on 127.0.0.1:$PORT (log: $tmp/proxy.log)"
  # No DATABASE_URL: the proxy runs without a database.
  env -u DATABASE_URL LITELLM_LOG=ERROR "$VENV/bin/litellm" --config "$tmp/cfg.yaml" \
    --host 127.0.0.1 --port "$PORT" >"$tmp/proxy.log" 2>&1 &
  ppid=$!
  trap 'kill "$ppid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
  "$PY" - "$PORT" >&2 <<'EOF' || { tail -30 "$tmp/proxy.log" >&2; die "litellm proxy smoke test failed"; }
import sys, time, urllib.request
port = sys.argv[1]; t0 = time.time()
while True:
    try:
        r = urllib.request.urlopen(f"http://127.0.0.1:{port}/health/liveliness", timeout=2)
        print(f"/health/liveliness -> {r.status} {r.read().decode()!r} after {time.time()-t0:.1f} s")
        break
    except Exception as e:
        if time.time() - t0 > 90:
            sys.exit(f"proxy did not answer /health/liveliness in 90 s: {e!r}")
        time.sleep(0.5)
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                             headers={"Authorization": "Bearer sk-smoke-1234"})
print("/v1/models ->", urllib.request.urlopen(req, timeout=10).read().decode())
EOF
  kill "$ppid" 2>/dev/null || true; wait "$ppid" 2>/dev/null || true
  rm -rf "$tmp"; trap - EXIT
  log "smoke ok"
fi
echo "$PY"
