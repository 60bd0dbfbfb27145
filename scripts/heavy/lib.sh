# Shared helpers for scripts/heavy/*.sh (sourced, not executed).
# shellcheck shell=bash

ONDEMAND_CACHE="${ONDEMAND_CACHE:-$HOME/.cache/ondemand}"
# shellcheck disable=SC2034  # used by the sourcing scripts
CACHE="$ONDEMAND_CACHE"

# Every script sets HEAVY_NAME before sourcing; all chatter goes to stderr so
# that stdout carries only the result (its last line is the script's contract).
log() { echo "[${HEAVY_NAME:-heavy}] $*" >&2; }
die() { echo "[${HEAVY_NAME:-heavy}] ERROR: $*" >&2; exit 1; }

# apt_install PKG...: installs the Debian packages that are not installed yet.
# Runs `apt-get update` first only when something is missing and the package
# lists are absent or older than 6 hours.
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  export DEBIAN_FRONTEND=noninteractive
  mkdir -p "$ONDEMAND_CACHE"
  local alog="$ONDEMAND_CACHE/apt.log"
  if [[ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -360 2>/dev/null | head -1)" ]]; then
    log "apt-get update (log: $alog)"
    apt-get update -q >>"$alog" 2>&1 || { tail -20 "$alog" >&2; die "apt-get update failed"; }
  fi
  log "apt-get install ${missing[*]} (log: $alog)"
  apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$alog" 2>&1 \
    || { tail -20 "$alog" >&2; die "apt-get install ${missing[*]} failed"; }
}

# A cached venv of its own (litellm-venv.sh, vllm-cpu.sh): its stamp file says what it was
# installed with, and an install in progress has none.
# venv_ready VENV WANT: true when VENV is installed and its stamp says WANT.
venv_ready() { [[ -x "$1/bin/python" && -f "$1/.ondemand-pins" && "$(cat "$1/.ondemand-pins")" == "$2" ]]; }
# venv_begin VENV: makes VENV when it has no python yet, and drops its stamp.
venv_begin() {
  if [[ ! -x "$1/bin/python" ]]; then
    log "creating venv $1"
    rm -rf "$1"
    python3 -m venv "$1" || die "python3 -m venv $1 failed"
  fi
  rm -f "$1/.ondemand-pins"
}
