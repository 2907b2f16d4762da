#!/usr/bin/env bash
# A DSpark drafter for Qwen3-8B (recipe dspark_jax/recipes/qwen3-8b.yaml) on a TPU VM pod slice: the same
# `python -m dspark_jax.train --preset qwen3-8b --distributed ...` started on every worker through
#   gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command="..."
# (jax.distributed.initialize() reads the pod's topology from the TPU metadata). Every worker needs this repository
# at REPO_DIR with its environment, the Qwen3-8B weights, and a workdir/data_dir on a filesystem all workers see.
#
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a bash train/qwen3-8b-tpu-pod.sh target=/mnt/models/Qwen3-8B \
#       data_dir=/mnt/nfs/qwen3-8b/data workdir=/mnt/nfs/qwen3-8b
#   bash train/qwen3-8b-tpu-pod.sh --tpu-name my-v5p-32 --zone us-east5-a --workers 4 --dry-run
#
# Settings (flag or environment): --tpu-name/TPU_NAME, --zone/ZONE, --project/PROJECT (optional), --workers/WORKERS
# (hosts of the slice, default 4), --chips-per-worker/CHIPS_PER_WORKER (default 4: v4, v5p), --repo-dir/REPO_DIR
# (the checkout on the workers, default ~/dspark_jax), --remote-python/REMOTE_PYTHON (default python3).
# grad_accum_steps is set so the recipe's global batch of 64 splits over the chips (GRAD_ACCUM overrides it).
# Other arguments are key=value overrides or flags of `python -m dspark_jax.train`. --dry-run prints the gcloud
# command (stderr) and runs the trainer's own --dry-run plan for this topology here (no gcloud, no TPU), then exits.
set -euo pipefail
TPU_NAME="${TPU_NAME:-}" ZONE="${ZONE:-}" PROJECT="${PROJECT:-}" WORKERS="${WORKERS:-4}"
CHIPS_PER_WORKER="${CHIPS_PER_WORKER:-4}" REPO_DIR="${REPO_DIR:-~/dspark_jax}" REMOTE_PYTHON="${REMOTE_PYTHON:-python3}"
DRY_RUN=0
ARGS=()
while (($#)); do
  case "$1" in
    --tpu-name) TPU_NAME="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --workers) WORKERS="$2"; shift 2 ;;
    --chips-per-worker) CHIPS_PER_WORKER="$2"; shift 2 ;;
    --repo-dir) REPO_DIR="$2"; shift 2 ;;
    --remote-python) REMOTE_PYTHON="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
DEVICES=$((WORKERS * CHIPS_PER_WORKER))
ACCUM="${GRAD_ACCUM:-$((32 / DEVICES > 0 ? 32 / DEVICES : 1))}"
TRAIN=(-m dspark_jax.train --preset qwen3-8b "grad_accum_steps=$ACCUM" "${ARGS[@]}")
# REPO_DIR stays unquoted so the worker's shell expands a leading ~.
REMOTE="cd $REPO_DIR && $REMOTE_PYTHON $(printf '%q ' "${TRAIN[@]}")--distributed"
GCLOUD=(gcloud compute tpus tpu-vm ssh "${TPU_NAME:-TPU_NAME}" --zone "${ZONE:-ZONE}")
if [[ -n "$PROJECT" ]]; then GCLOUD+=(--project "$PROJECT"); fi
if ((DRY_RUN)); then
  echo "would run: ${GCLOUD[*]} --worker=all --command=\"$REMOTE\"" >&2
  exec "${PYTHON:-python}" "${TRAIN[@]}" --dry-run --devices "$DEVICES" --num-processes "$WORKERS"
fi
if [[ -z "$TPU_NAME" || -z "$ZONE" ]]; then
  echo "error: set the pod slice with --tpu-name NAME --zone ZONE (or TPU_NAME / ZONE)" >&2
  exit 2
fi
exec "${GCLOUD[@]}" --worker=all --command="$REMOTE"
