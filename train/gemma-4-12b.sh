#!/usr/bin/env bash
# A DSpark drafter for Gemma 4 12B (recipe dspark_jax/recipes/gemma-4-12b.yaml) on one host: all of its chips or GPUs.
# Extra arguments are key=value overrides or flags of `python -m dspark_jax.train`:
#
#   bash train/gemma-4-12b.sh target=/models/gemma-4-12b-it prompts_file=prompts.jsonl     # TPU v5p-8, or 8 x H100 80 GB
#   bash train/gemma-4-12b.sh target=/models/gemma-4-12b-it prompts_file=prompts.jsonl mesh=fsdp:2,model:4   # TPU v5e-8
#   bash train/gemma-4-12b.sh --dry-run --devices 8 --mesh fsdp:2,model:4 --device-memory-gib 16   # plan it, no weights
#
# Several hosts: the same command with --distributed on every TPU pod worker, or --coordinator-address/--num-processes/
# --process-id per GPU node (train/qwen3-8b-tpu-pod.sh and train/qwen3-8b-gpu-multinode.sh show both).
set -euo pipefail
exec "${PYTHON:-python}" -m dspark_jax.train --preset gemma-4-12b "$@"
