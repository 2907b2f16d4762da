#!/usr/bin/env bash
# vLLM (GPU) serving a drafter trained here, in the speculators format (docs/interop.md):
#   1. with --export: python -m dspark_jax.export EXPORT --target TARGET --format speculators --out DIR --dtype bfloat16
#   2. vllm serve TARGET --speculative-config '{"method": "dspark", "model": DIR, "num_speculative_tokens": N}'
#   EXPORT=runs/qwen3-8b/export TARGET=/models/Qwen3-8B bash serve/vllm.sh --export --port 8000
# EXPORT: the drafter export (default runs/qwen3-8b/export); TARGET: the target's Hugging Face directory or Hub id
# (default Qwen/Qwen3-8B); DIR (default runs/qwen3-8b-speculators); BLOCK_SIZE: num_speculative_tokens, the drafter's
# block size (default 7). Other arguments go to vllm serve. --dry-run prints the commands and exits.
set -euo pipefail
EXPORT="${EXPORT:-runs/qwen3-8b/export}" TARGET="${TARGET:-Qwen/Qwen3-8B}" DIR="${DIR:-runs/qwen3-8b-speculators}"
BLOCK_SIZE="${BLOCK_SIZE:-7}"
DRY_RUN=0 DO_EXPORT=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY_RUN=1 ;;
    --export) DO_EXPORT=1 ;;
    *) ARGS+=("$a") ;;
  esac
done
SPEC="{\"method\": \"dspark\", \"model\": \"$DIR\", \"num_speculative_tokens\": $BLOCK_SIZE}"
EXPORT_CMD=("${PYTHON:-python}" -m dspark_jax.export "$EXPORT" --target "$TARGET" --format speculators --out "$DIR"
  --dtype bfloat16)
SERVE_CMD=(vllm serve "$TARGET" --speculative-config "$SPEC" "${ARGS[@]}")
if ((DRY_RUN)); then
  if ((DO_EXPORT)); then echo "export: $(printf '%q ' "${EXPORT_CMD[@]}")"; fi
  echo "serve: vllm serve $TARGET --speculative-config '$SPEC' ${ARGS[*]}"
  exit 0
fi
if ((DO_EXPORT)); then "${EXPORT_CMD[@]}"; fi
exec "${SERVE_CMD[@]}"
