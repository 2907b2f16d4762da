#!/usr/bin/env bash
# The server with a trained drafter (speculative decoding, the DSpark scheduler by default):
#   bash serve/speculative.sh                            # stories260k + runs/stories260k/export (train/stories260k.sh)
#   TARGET=smollm2-135m-instruct DRAFTER=runs/smollm2-135m-instruct/export POLICY=threshold:0.5 bash serve/speculative.sh
# TARGET: preset or model path (default stories260k); DRAFTER: an export directory, a DeepSpec/speculators directory or
# a Hub id (default runs/stories260k/export); POLICY: dspark | greedy | fixed:G | threshold:C (default dspark). Other
# arguments are flags of python -m dspark_jax.serve; --dry-run prints the resolved plan (no weights loaded) and exits.
set -euo pipefail
exec "${PYTHON:-python}" -m dspark_jax.serve --target "${TARGET:-stories260k}" \
  --drafter "${DRAFTER:-runs/stories260k/export}" --policy "${POLICY:-dspark}" "$@"
