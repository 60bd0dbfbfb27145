#!/usr/bin/env bash
# Build, locally and without any image registry, the Docker image
# `ondemand-sim-engine:<tag>` that runs the engine simulator:
#     python3 -m ondemand.sim.engine --host 0.0.0.0 --port 8000 --model X
#
# How (no registry is reachable, so no FROM/pull):
#   1. rootfs: `debootstrap --variant=minbase --include=python3 bookworm` from
#      the Debian mirror configured for apt on this machine, saved as a plain tar
#      in $CACHE/engine-image/ (keyed by suite/variant/packages; ~1 min, once).
#   2. libs: `pip install --target` of the pinned aiohttp/orjson/uvloop/httptools as cp311
#      manylinux wheels (bookworm's python3 is 3.11, glibc 2.36), cached per pin set.
#   3. the whole `ondemand/` package dir is copied to /opt/ondemand/lib.
#   4. `docker import` of rootfs + /opt/ondemand with ENV/CMD/EXPOSE set.
# The tag is a hash of the inputs (rootfs key, pins, every file of ondemand/,
# this recipe's version), so a changed simulator gives a new image; the image is
# also tagged `ondemand-sim-engine:latest`. Older tags beyond the newest 5 are removed.
#
# Output contract: last stdout line = the image name, ondemand-sim-engine:<tag>.
# Options: --smoke   also run the image on a user-defined network and fetch
#                    /v1/models from a second container on that network.
# Cold: ~70 s (debootstrap ~55 s, pip ~5 s, import+check ~5 s). Warm: ~0.2 s;
# after a change under ondemand/ (new tag, rootfs and libs cached): ~2-5 s.
# Needs a running engine: run scripts/heavy/docker-up.sh first (exit 2 passes through).
set -euo pipefail
HEAVY_NAME=engine-image
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"
REPO="$(cd "$HERE/../.." && pwd)"

RECIPE=1                      # bump when the image layout below changes
SUITE=bookworm                # python3 3.11 == the cp311 wheels below
INCLUDE=python3
# The simulator's runtime pins, read from setup.cfg (the one place that pins them): it serves on
# the lean front (httptools, and aiohttp's multidict) and no longer imports aiohttp itself.
mapfile -t PINS < <(python3 "$REPO/scripts/requirements.py" | grep -E '^(aiohttp|orjson|uvloop|httptools)==')
[[ ${#PINS[@]} -eq 4 ]] || die "could not read the aiohttp, orjson, uvloop and httptools pins from setup.cfg"
IMAGE=ondemand-sim-engine
PKG_DIR="$REPO/ondemand"
DIR="$CACHE/engine-image"
SMOKE=0
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE=1 ;;
    *) die "unknown argument: $a (usage: $0 [--smoke])" ;;
  esac
done

[[ -f "$PKG_DIR/__init__.py" ]] || die "no ondemand package at $PKG_DIR"
mkdir -p "$DIR"

# --- docker --------------------------------------------------------------------
if ! timeout 10 docker info >/dev/null 2>&1; then
  log "docker engine not answering: running docker-up.sh"
  rc=0; "$HERE/docker-up.sh" >/dev/null || rc=$?
  ((rc == 0)) || { echo "docker unavailable: docker-up.sh exited $rc" >&2; exit "$rc"; }
fi

# --- input hash / tag ----------------------------------------------------------
ROOTFS_KEY="$SUITE-minbase-$(echo "$INCLUDE" | tr ', ' '__')"
PIN_KEY="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-12)"
pkg_hash() {
  # Content + relative path of every file of the package (no caches), sorted.
  (cd "$PKG_DIR" && find . -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
     | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-64
}
TAG="$(printf '%s\n' "recipe=$RECIPE" "rootfs=$ROOTFS_KEY" "${PINS[@]}" "pkg=$(pkg_hash)" \
        | sha256sum | cut -c1-12)"
REF="$IMAGE:$TAG"

smoke() {
  local net="ondemand-smoke-$$" srv="ondemand-smoke-srv-$$" cli="ondemand-smoke-cli-$$" out
  log "smoke test: $REF on user-defined network $net"
  docker network create "$net" >/dev/null
  # shellcheck disable=SC2064
  trap "docker rm -f '$srv' '$cli' >/dev/null 2>&1 || true; docker network rm '$net' >/dev/null 2>&1 || true" EXIT
  docker run -d --name "$srv" --network "$net" --network-alias engine "$REF" \
    python3 -m ondemand.sim.engine --host 0.0.0.0 --port 8000 --model smoke-model >/dev/null
  docker run -d --name "$cli" --network "$net" "$REF" sleep 120 >/dev/null
  local code='import sys,time,urllib.request
for i in range(100):
    try:
        print(urllib.request.urlopen("http://engine:8000/v1/models", timeout=2).read().decode()); sys.exit(0)
    except Exception as e:
        err = e; time.sleep(0.2)
sys.exit("no answer from engine:8000: %r" % (err,))'
  if ! out="$(docker exec "$cli" python3 -c "$code" 2>&1)"; then
    docker logs "$srv" >&2 2>&1 || true
    die "smoke test failed: $out"
  fi
  grep -q smoke-model <<<"$out" || die "smoke test: unexpected answer: $out"
  log "smoke test ok: $out"
}

finish() {
  docker tag "$REF" "$IMAGE:latest"
  ((SMOKE)) && smoke
  echo "$REF"
  exit 0
}

if docker image inspect "$REF" >/dev/null 2>&1; then
  log "cached: $REF"
  finish
fi

# --- 1. rootfs -----------------------------------------------------------------
ROOTFS_TAR="$DIR/rootfs-$ROOTFS_KEY.tar"
if [[ ! -s "$ROOTFS_TAR" ]]; then
  apt_install debootstrap
  # Mirror: the first non-security Debian URI that apt uses here (deb822
  # .sources or one-line .list), so this works wherever apt works.
  MIRROR="${DEBOOTSTRAP_MIRROR:-}"
  if [[ -z "$MIRROR" ]]; then
    MIRROR="$(
      {
        for f in /etc/apt/sources.list.d/*.sources; do
          [[ -f "$f" ]] && awk '/^[[:space:]]*#/ {next} tolower($1)=="uris:" {for (i=2;i<=NF;i++) print $i}' "$f"
        done
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
          [[ -f "$f" ]] && awk '$1=="deb" {for (i=2;i<=NF;i++) if ($i ~ /^[a-z+]+:\/\//) {print $i; break}}' "$f"
        done
      } | grep -i debian | grep -v -e security -e debug | head -1 || true
    )"
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
  fi
  log "debootstrap --variant=minbase --include=$INCLUDE $SUITE from $MIRROR (~1 min)"
  work="$(mktemp -d "$DIR/debootstrap.XXXXXX")"
  if ! debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$work/root" "$MIRROR" \
       >"$DIR/debootstrap.log" 2>&1; then
    tail -20 "$DIR/debootstrap.log" >&2
    rm -rf "$work"
    die "debootstrap failed (log: $DIR/debootstrap.log)"
  fi
  [[ -x "$work/root/usr/bin/python3" ]] || { rm -rf "$work"; die "debootstrap made no /usr/bin/python3"; }
  log "rootfs python: $(chroot "$work/root" python3 --version 2>&1)"
  # Trim what a container never needs.
  rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"* \
         "$work/root/usr/share/doc/"* "$work/root/usr/share/man/"* "$work/root/usr/share/info/"* \
         "$work/root/usr/share/locale/"*
  # /dev, /proc, /sys contents are provided by the container runtime.
  tar --numeric-owner -C "$work/root" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
      -cf "$ROOTFS_TAR.tmp" .
  mv -f "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
  rm -rf "$work"
  log "rootfs saved: $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1))"
else
  log "rootfs cached: $ROOTFS_TAR"
fi

# --- 2. pinned libraries ---------------------------------------------------------
LIB="$DIR/lib-$PIN_KEY"
if [[ ! -f "$LIB/.done" ]]; then
  log "pip install --target (cp311 manylinux wheels): ${PINS[*]}"
  rm -rf "$LIB"
  # Explicit target interpreter/platform: independent of the host python.
  # Bookworm has glibc 2.36: accept every manylinux tag up to that (pip 23 does
  # not expand manylinux_2_N tags by itself, only the legacy manylinux2014 alias).
  plats=(--platform manylinux2014_x86_64)
  for v in $(seq 17 36); do plats+=(--platform "manylinux_2_${v}_x86_64"); done
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$LIB/opt/ondemand/lib" --only-binary=:all: \
    "${plats[@]}" --python-version 3.11 --implementation cp --abi cp311 \
    "${PINS[@]}" >&2 || die "pip install --target failed for ${PINS[*]}"
  touch "$LIB/.done"
else
  log "libs cached: $LIB"
fi

# --- 3 + 4. package + import ---------------------------------------------------------
log "assembling $REF"
work="$(mktemp -d "$DIR/image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp "$ROOTFS_TAR" "$work/image.tar"
mkdir -p "$work/stage/opt/ondemand"
cp -a "$LIB/opt/ondemand/lib" "$work/stage/opt/ondemand/lib"
tar -C "$REPO" --exclude='__pycache__' --exclude='*.pyc' -cf - ondemand \
  | tar -C "$work/stage/opt/ondemand/lib" -xf -
tar --numeric-owner --owner=0 --group=0 -C "$work/stage" -rf "$work/image.tar" ./opt/ondemand  # ./opt itself is in the rootfs
docker import \
  --change 'ENV PYTHONPATH=/opt/ondemand/lib' \
  --change 'ENV PYTHONUNBUFFERED=1' \
  --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /' \
  --change 'EXPOSE 8000' \
  --change "LABEL ondemand.sim-engine=1 ondemand.inputs=$TAG" \
  --change 'CMD ["python3", "-m", "ondemand.sim.engine", "--host", "0.0.0.0", "--port", "8000", "--model", "sim-model"]' \
  --message "ondemand sim engine, inputs $TAG" \
  "$work/image.tar" "$REF" >/dev/null || die "docker import failed"
rm -rf "$work"
trap - EXIT

# Sanity: the package imports inside the image.
docker run --rm "$REF" python3 -c 'import multidict, orjson, uvloop, httptools, ondemand.sim.engine' \
  || die "image $REF: importing multidict/orjson/uvloop/httptools/ondemand.sim.engine failed"

# Keep the newest 5 input tags (plus whatever :latest points to).
docker images "$IMAGE" --format '{{.Tag}} {{.CreatedAt}}' | grep -v '^latest ' \
  | sort -k2 -r | awk 'NR>5 {print $1}' | while read -r old; do
    [[ "$old" == "$TAG" ]] || docker rmi "$IMAGE:$old" >/dev/null 2>&1 || true
  done
log "built $REF"
finish
