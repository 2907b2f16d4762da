#!/usr/bin/env bash
# The OpenAI-compatible server on the target alone (no drafter): python -m dspark_jax.serve --policy plain.
#   bash serve/plain.sh                                  # stories260k on 127.0.0.1:8000
#   TARGET=smollm2-135m-instruct bash serve/plain.sh --num-slots 16 --cache-len 2048 --port 8080
# TARGET: a preset or a model path (default stories260k). Other arguments are flags of python -m dspark_jax.serve;
# --dry-run prints the resolved plan (no weights loaded) and exits.
set -euo pipefail
exec "${PYTHON:-python}" -m dspark_jax.serve --target "${TARGET:-stories260k}" --policy plain "$@"
