#!/usr/bin/env bash
# Tensor-parallel serving on one host: weights, KV caches and the drafter sharded over MODEL_PARALLEL devices.
#   TARGET=/models/Qwen3-8B DRAFTER=runs/qwen3-8b/export MODEL_PARALLEL=8 bash serve/mesh.sh --num-slots 64
# TARGET: preset or model path (default qwen3-8b); DRAFTER: optional (unset or empty: plain decoding);
# MODEL_PARALLEL: devices on the 'model' axis (default 8; -1: every device); DTYPE (default bfloat16).
# Plan the memory first: python -m dspark_jax.train --config qwen3-8b --dry-run --serve --devices 8 --mesh model:8.
# Other arguments are flags of python -m dspark_jax.serve; --dry-run prints the resolved plan (no weights) and exits.
set -euo pipefail
ARGS=(--target "${TARGET:-qwen3-8b}" --mesh "model:${MODEL_PARALLEL:-8}" --dtype "${DTYPE:-bfloat16}")
if [[ -n "${DRAFTER:-}" ]]; then ARGS+=(--drafter "$DRAFTER"); fi
exec "${PYTHON:-python}" -m dspark_jax.serve "${ARGS[@]}" "$@"
