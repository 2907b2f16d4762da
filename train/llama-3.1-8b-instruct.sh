#!/usr/bin/env bash
# A DSpark drafter for Llama-3.1-8B-Instruct (recipe dspark_jax/recipes/llama-3.1-8b-instruct.yaml) on one host: all of its chips or GPUs.
# Extra arguments are key=value overrides or flags of `python -m dspark_jax.train`:
#
#   bash train/llama-3.1-8b-instruct.sh target=/models/Llama-3.1-8B-Instruct prompts_file=prompts.jsonl     # TPU v5p-8, or 8 x H100 80 GB
#   bash train/llama-3.1-8b-instruct.sh target=/models/Llama-3.1-8B-Instruct prompts_file=prompts.jsonl mesh=fsdp:2,model:4   # TPU v5e-8
#   bash train/llama-3.1-8b-instruct.sh --dry-run --devices 8 --mesh fsdp:2,model:4 --device-memory-gib 16   # plan it, no weights
#
# Several hosts: the same command with --distributed on every TPU pod worker, or --coordinator-address/--num-processes/
# --process-id per GPU node (train/qwen3-8b-tpu-pod.sh and train/qwen3-8b-gpu-multinode.sh show both).
set -euo pipefail
exec "${PYTHON:-python}" -m dspark_jax.train --preset llama-3.1-8b-instruct "$@"
