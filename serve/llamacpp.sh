#!/usr/bin/env bash
# llama.cpp (CPU or GPU) serving a drafter trained here with --spec-type draft-dspark (docs/interop.md). The export
# step writes the speculators format: llama.cpp reads it right for tied and untied targets alike (its converter drops
# the full-vocabulary lm_head of a DeepSpec export, and its loader then drafts with token_embd as the head):
#   1. with --export: python -m dspark_jax.export EXPORT --target TARGET --format speculators --out DIR --dtype bfloat16
#   2. with --convert: python LLAMA_CPP/convert_hf_to_gguf.py TARGET --outtype bf16 --outfile TARGET_GGUF
#        python LLAMA_CPP/convert_hf_to_gguf.py DIR --target-model-dir TARGET --outtype bf16 --outfile DRAFTER_GGUF
#   3. llama-server -m TARGET_GGUF -md DRAFTER_GGUF --spec-type draft-dspark --spec-draft-n-max BLOCK_SIZE
#   LLAMA_CPP=~/llama.cpp EXPORT=runs/qwen3-8b/export TARGET=/models/Qwen3-8B bash serve/llamacpp.sh --export --convert
# LLAMA_CPP: a built llama.cpp (default $DSPARK_LLAMA_CPP; convert_hf_to_gguf.py in it or in its src/, llama-server in
# build/bin/); EXPORT: the drafter export (default runs/qwen3-8b/export); TARGET: the target's local Hugging Face
# directory (default Qwen3-8B); DIR (default runs/qwen3-8b-speculators); TARGET_GGUF / DRAFTER_GGUF (default DIR.target.gguf,
# DIR.gguf); BLOCK_SIZE: drafts per round, at most the drafter's block size (default 7). Other arguments go to
# llama-server. --dry-run prints the commands and exits.
set -euo pipefail
LLAMA_CPP="${LLAMA_CPP:-${DSPARK_LLAMA_CPP:-.}}"
EXPORT="${EXPORT:-runs/qwen3-8b/export}" TARGET="${TARGET:-Qwen3-8B}" DIR="${DIR:-runs/qwen3-8b-speculators}"
TARGET_GGUF="${TARGET_GGUF:-$DIR.target.gguf}" DRAFTER_GGUF="${DRAFTER_GGUF:-$DIR.gguf}" BLOCK_SIZE="${BLOCK_SIZE:-7}"
CONVERT="$LLAMA_CPP/convert_hf_to_gguf.py"
if [[ -f "$LLAMA_CPP/src/convert_hf_to_gguf.py" ]]; then CONVERT="$LLAMA_CPP/src/convert_hf_to_gguf.py"; fi
SERVER="$LLAMA_CPP/build/bin/llama-server"
DRY_RUN=0 DO_EXPORT=0 DO_CONVERT=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY_RUN=1 ;;
    --export) DO_EXPORT=1 ;;
    --convert) DO_CONVERT=1 ;;
    *) ARGS+=("$a") ;;
  esac
done
PY="${PYTHON:-python}"
EXPORT_CMD=("$PY" -m dspark_jax.export "$EXPORT" --target "$TARGET" --format speculators --out "$DIR" --dtype bfloat16)
TARGET_CMD=("$PY" "$CONVERT" "$TARGET" --outtype bf16 --outfile "$TARGET_GGUF")
DRAFTER_CMD=("$PY" "$CONVERT" "$DIR" --target-model-dir "$TARGET" --outtype bf16 --outfile "$DRAFTER_GGUF")
SERVE_CMD=("$SERVER" -m "$TARGET_GGUF" -md "$DRAFTER_GGUF" --spec-type draft-dspark --spec-draft-n-max "$BLOCK_SIZE"
  "${ARGS[@]}")
if ((DRY_RUN)); then
  if ((DO_EXPORT)); then echo "export: ${EXPORT_CMD[*]}"; fi
  if ((DO_CONVERT)); then echo "convert target: ${TARGET_CMD[*]}" && echo "convert drafter: ${DRAFTER_CMD[*]}"; fi
  echo "serve: ${SERVE_CMD[*]}"
  exit 0
fi
if ((DO_EXPORT)); then "${EXPORT_CMD[@]}"; fi
if ((DO_CONVERT)); then "${TARGET_CMD[@]}" && "${DRAFTER_CMD[@]}"; fi
exec "${SERVE_CMD[@]}"
