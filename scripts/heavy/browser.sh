#!/usr/bin/env bash
# A headless browser for the web page's test: Debian's chromium and npm's
# playwright-core (which drives a browser it does not download). Idempotent;
# the npm part is cached outside the clone. Last stdout line: the node_modules
# directory to put on NODE_PATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
HEAVY_NAME=browser
source "$here/lib.sh"
cache="${ONDEMAND_CACHE:-$HOME/.cache/ondemand}/browser"
pin="1.65.1"

if ! command -v chromium >/dev/null 2>&1; then
  log "installing Debian's chromium"
  apt_install chromium
fi
if [ ! -f "$cache/node_modules/playwright-core/package.json" ] || \
   ! grep -q "\"version\": \"$pin\"" "$cache/node_modules/playwright-core/package.json"; then
  log "installing playwright-core $pin into $cache"
  mkdir -p "$cache"
  (cd "$cache" && npm install --no-audit --no-fund --silent "playwright-core@$pin" >&2)
fi
echo "$cache/node_modules"
