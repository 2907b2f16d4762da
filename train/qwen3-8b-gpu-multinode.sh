#!/usr/bin/env bash
# A DSpark drafter for Qwen3-8B (recipe dspark_jax/recipes/qwen3-8b.yaml) on several GPU nodes: one process per node,
# each `python -m dspark_jax.train --preset qwen3-8b --coordinator-address ... --num-processes N --process-id I`
# owning all of its node's GPUs. Start it on every node, by hand or with SLURM:
#
#   # by hand, on node i of N (node 0's address and a free port as COORDINATOR):
#   COORDINATOR=node0:12345 NUM_NODES=2 NODE_RANK=0 bash train/qwen3-8b-gpu-multinode.sh target=/models/Qwen3-8B \
#       data_dir=/nfs/qwen3-8b/data workdir=/nfs/qwen3-8b
#   # SLURM: one task per node; rank, count and coordinator come from SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST
#   srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 bash train/qwen3-8b-gpu-multinode.sh data_dir=... workdir=...
#   bash train/qwen3-8b-gpu-multinode.sh --num-nodes 2 --gpus-per-node 8 --dry-run
#
# Settings (flag or environment): --coordinator/COORDINATOR (HOST:PORT; SLURM: first node, port COORDINATOR_PORT or
# 12345), --num-nodes/NUM_NODES, --node-rank/NODE_RANK, --gpus-per-node/GPUS_PER_NODE (default 8). grad_accum_steps is
# set so the recipe's global batch of 64 splits over the GPUs (GRAD_ACCUM overrides it). workdir and data_dir must be
# on a filesystem every node sees. Other arguments are key=value overrides or flags of `python -m dspark_jax.train`.
# --dry-run prints the command each node runs (stderr) and the trainer's own --dry-run plan for this topology (here,
# no GPU needed), then exits.
set -euo pipefail
COORDINATOR="${COORDINATOR:-}" NUM_NODES="${NUM_NODES:-${SLURM_NTASKS:-}}" NODE_RANK="${NODE_RANK:-${SLURM_PROCID:-}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
DRY_RUN=0
ARGS=()
while (($#)); do
  case "$1" in
    --coordinator) COORDINATOR="$2"; shift 2 ;;
    --num-nodes) NUM_NODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --gpus-per-node) GPUS_PER_NODE="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [[ -z "$COORDINATOR" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
  COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):${COORDINATOR_PORT:-12345}"
fi
NUM_NODES="${NUM_NODES:-2}"
DEVICES=$((NUM_NODES * GPUS_PER_NODE))
ACCUM="${GRAD_ACCUM:-$((32 / DEVICES > 0 ? 32 / DEVICES : 1))}"
TRAIN=(-m dspark_jax.train --preset qwen3-8b "grad_accum_steps=$ACCUM" "${ARGS[@]}")
DIST=(--coordinator-address "${COORDINATOR:-HOST:PORT}" --num-processes "$NUM_NODES" --process-id "${NODE_RANK:-RANK}")
if ((DRY_RUN)); then
  echo "would run on each node: $(printf '%q ' "${PYTHON:-python}" "${TRAIN[@]}" "${DIST[@]}")" >&2
  exec "${PYTHON:-python}" "${TRAIN[@]}" --dry-run --devices "$DEVICES" --num-processes "$NUM_NODES"
fi
if [[ -z "$COORDINATOR" || -z "$NODE_RANK" ]]; then
  echo "error: set COORDINATOR=HOST:PORT and NODE_RANK (and NUM_NODES), or start the script with srun" >&2
  exit 2
fi
exec "${PYTHON:-python}" "${TRAIN[@]}" "${DIST[@]}"
