#!/usr/bin/env bash
# SGLang (GPU; sglang-jax on TPU takes the same checkpoint) serving a drafter trained here. SGLang's DSpark loads
# DeepSeek's DeepSpec format (docs/interop.md), so the export step writes that one:
#   1. with --export: python -m dspark_jax.export EXPORT --target TARGET --format deepspec --out DIR --dtype bfloat16
#   2. python -m sglang.launch_server --model-path TARGET --speculative-algorithm DSPARK
#        --speculative-draft-model-path DIR
#   EXPORT=runs/qwen3-8b/export TARGET=/models/Qwen3-8B bash serve/sglang.sh --export --port 30000
# EXPORT: the drafter export (default runs/qwen3-8b/export); TARGET: the target's Hugging Face directory or Hub id
# (default Qwen/Qwen3-8B); DIR (default runs/qwen3-8b-deepspec). Other arguments go to sglang.launch_server.
# --dry-run prints the commands and exits.
set -euo pipefail
EXPORT="${EXPORT:-runs/qwen3-8b/export}" TARGET="${TARGET:-Qwen/Qwen3-8B}" DIR="${DIR:-runs/qwen3-8b-deepspec}"
DRY_RUN=0 DO_EXPORT=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY_RUN=1 ;;
    --export) DO_EXPORT=1 ;;
    *) ARGS+=("$a") ;;
  esac
done
EXPORT_CMD=("${PYTHON:-python}" -m dspark_jax.export "$EXPORT" --target "$TARGET" --format deepspec --out "$DIR"
  --dtype bfloat16)
SERVE_CMD=(python -m sglang.launch_server --model-path "$TARGET" --speculative-algorithm DSPARK
  --speculative-draft-model-path "$DIR" "${ARGS[@]}")
if ((DRY_RUN)); then
  if ((DO_EXPORT)); then echo "export: $(printf '%q ' "${EXPORT_CMD[@]}")"; fi
  echo "serve: ${SERVE_CMD[*]}"
  exit 0
fi
if ((DO_EXPORT)); then "${EXPORT_CMD[@]}"; fi
exec "${SERVE_CMD[@]}"
