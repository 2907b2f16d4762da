#!/usr/bin/env bash
# The main job: a DSpark drafter for stories260K (recipe dspark_jax/recipes/stories260k.yaml), exported to
# runs/stories260k/export. Extra arguments are key=value overrides or flags of `python -m dspark_jax.train`
# (e.g. workdir=DIR, time_budget_s=300, --dry-run).
set -euo pipefail
export DSPARK_MODELS="${DSPARK_MODELS:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data/models}"
exec "${PYTHON:-python}" -m dspark_jax.train --preset stories260k "$@"
