#!/usr/bin/env bash
# Debian's Prometheus (2.42 on Debian 12) for the /metrics test: installed with apt
# when /usr/bin/prometheus is absent. Idempotent. Last stdout line: the binary.
# Nothing is started here: the test runs its own Prometheus on loopback with a
# temporary storage directory, and stops it.
set -euo pipefail
HEAVY_NAME=prometheus
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bin=/usr/bin/prometheus
if [[ ! -x "$bin" ]]; then
  log "installing Debian's prometheus"
  # The package's service is not wanted (no systemd here, or one the test does not use).
  apt_install prometheus
fi
[[ -x "$bin" ]] || die "$bin still missing after installing prometheus"
log "$("$bin" --version 2>&1 | head -1)"
echo "$bin"
