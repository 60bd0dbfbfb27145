#!/usr/bin/env bash
# Make sure a Docker engine is running on this machine.
#
#   - installs Debian's `docker.io` (dockerd + containerd + runc) when `dockerd`
#     is missing. /usr/local/bin/docker on these machines is only a client
#     (28.x); it talks fine to Debian's 20.10 daemon (API version negotiation).
#   - if `docker info` fails, starts `dockerd` in the background (no systemd
#     here), logging to $CACHE/docker/dockerd.log, and waits up to
#     $DOCKER_UP_TIMEOUT (60) s for it.
#   - last stdout line: the engine socket as a DOCKER_HOST URL,
#     e.g. unix:///var/run/docker.sock
#   - exit 2 with a message starting "docker unavailable:" when no engine can be
#     had, so test suites can skip with that reason; exit 0 otherwise.
#
# Machine quirks (Debian 12 in a Firecracker VM, kernel 6.x, cgroup v1, root on
# ext4, nf_tables): plain `dockerd` with no flags works here: overlay2 storage,
# iptables (nft backend) and the docker0 bridge all come up, and containers on
# user-defined networks reach each other. The fallbacks below exist for machines
# of other kinds: first `--iptables=false` (kernels or sandboxes without
# netfilter; containers still get bridge IPs and can talk to each other on one
# network, they just have no NAT to the outside, which nothing here needs), then
# additionally `--storage-driver=vfs` (no overlayfs, e.g. root fs on overlay
# itself; slow and disk hungry, but works). ONDEMAND_DOCKERD_FLAGS overrides all
# of it with one exact flag set.
set -euo pipefail
HEAVY_NAME=docker-up
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

TIMEOUT="${DOCKER_UP_TIMEOUT:-60}"
LOGDIR="$CACHE/docker"
LOG="$LOGDIR/dockerd.log"
SOCK_URL="${DOCKER_HOST:-unix:///var/run/docker.sock}"

unavailable() { echo "docker unavailable: $*" >&2; echo "docker unavailable: $*"; exit 2; }

docker_ok() { timeout 10 docker info >/dev/null 2>&1; }

dockerd_pid() {
  # The pid dockerd wrote, if that process is still a dockerd.
  local pid
  pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
  [[ -n "$pid" && -r "/proc/$pid/comm" && "$(cat "/proc/$pid/comm")" == dockerd ]] && echo "$pid"
  return 0
}

if docker_ok; then
  log "engine already running"
  echo "$SOCK_URL"
  exit 0
fi

# --- install -------------------------------------------------------------------
if ! command -v dockerd >/dev/null 2>&1; then
  log "dockerd not found: installing Debian's docker.io"
  ( apt_install docker.io ) || unavailable "could not install docker.io with apt"
fi
command -v dockerd >/dev/null 2>&1 || unavailable "dockerd still missing after installing docker.io"
if ! command -v docker >/dev/null 2>&1; then
  unavailable "no docker client on PATH (docker.io should provide /usr/bin/docker)"
fi

mkdir -p "$LOGDIR"

# wait_up PID: waits until `docker info` answers; fails early if PID dies.
wait_up() {
  local pid="$1" deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    docker_ok && return 0
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
      return 1
    fi
    sleep 1
  done
  return 1
}

# A dockerd that is still starting up (e.g. launched by a parallel run): wait.
pid="$(dockerd_pid)"
if [[ -n "$pid" ]]; then
  log "dockerd (pid $pid) is running but not answering yet; waiting up to ${TIMEOUT}s"
  if wait_up "$pid"; then echo "$SOCK_URL"; exit 0; fi
  unavailable "dockerd pid $pid runs but 'docker info' fails after ${TIMEOUT}s (log: $LOG)"
fi

if [[ -n "${ONDEMAND_DOCKERD_FLAGS+x}" ]]; then
  attempts=("$ONDEMAND_DOCKERD_FLAGS")
else
  attempts=("" "--iptables=false" "--iptables=false --storage-driver=vfs")
fi

for flags in "${attempts[@]}"; do
  log "starting: dockerd $flags (log: $LOG)"
  echo "=== $(date -u +%FT%TZ) dockerd $flags" >>"$LOG"
  # setsid + nohup: dockerd must outlive this script and the make/CI step.
  # shellcheck disable=SC2086
  setsid nohup dockerd $flags </dev/null >>"$LOG" 2>&1 &
  pid=$!
  if wait_up "$pid"; then
    log "engine up (pid $pid, flags: ${flags:-none}) in $SECONDS s"
    echo "$SOCK_URL"
    exit 0
  fi
  log "dockerd $flags did not come up; last log lines:"
  tail -5 "$LOG" >&2 || true
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
done

# Reason: from the last attempt's section of the log only.
last="$(awk '/^=== /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$LOG" 2>/dev/null || true)"
reason="$(grep -E 'level=(fatal|error)|failed to start daemon' <<<"$last" | tail -1 | sed 's/^.*msg=//' || true)"
[[ -n "$reason" ]] || reason="$(grep -v -e '^\s*$' -e '^=== ' <<<"$last" | tail -2 | tr '\n' ' ' || true)"
unavailable "dockerd would not start (tried: ${attempts[*]:-default}); ${reason:-see $LOG}"
