"""The one-token decode step compiled for 4 H100s without a GPU (``benchmarks.tpu_compile``'s
``h100:<n>``, needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at jax's version; skipped
without them) looks up its token's embedding where the row lives: no all-gather of the
vocabulary-sharded embedding table."""

from __future__ import annotations

import dataclasses
import re

import pytest

from benchmarks.tpu_compile import cuda_plugin_installed

pytestmark = pytest.mark.skipif(not cuda_plugin_installed(), reason="jax-cuda12-plugin not installed")


def test_one_token_step_does_not_gather_the_embedding_table():
    from benchmarks import tpu_compile
    from dspark_jax.models import sharding as shd
    from dspark_jax.models.presets import builtin_target_config

    small = dict(num_layers=1, hidden_size=256, intermediate_size=512, vocab_size=1024, num_heads=8, head_dim=128)
    cfg = dataclasses.replace(builtin_target_config("qwen3-8b"), num_kv_heads=4, attention_backend="xla", **small)
    mesh = shd.make_mesh("model:4", devices=tpu_compile.topology_devices("h100:4"))
    b = tpu_compile.Builder(cfg, mesh)
    for tokens in (1, 8):
        hlo = tpu_compile.compile_program(b.step(512, tokens), unroll=False).as_text() or ""
        # the embedding is [1024, 256] split 4 ways over the vocabulary: an all-gather would rebuild it whole
        assert not re.search(r"bf16\[1024,256\][^\n]* all-gather(-start)?\(", hlo), tokens
