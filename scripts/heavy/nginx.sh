#!/usr/bin/env bash
# nginx for the benchmark's side-by-side (scripts/bench.py runs it as a reverse proxy in
# front of the same engine). Idempotent. Last stdout line: the nginx binary, or exit 2
# with "nginx unavailable: ..." (the bench then says so and goes on without it).
set -euo pipefail
HEAVY_NAME=nginx
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  ( apt_install nginx-light ) || ( apt_install nginx ) || { echo "nginx unavailable: apt could not install it"; exit 2; }
fi
command -v nginx 2>/dev/null || echo /usr/sbin/nginx
