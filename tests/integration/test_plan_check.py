"""The serving planner (``train --dry-run --serve``) against the TPU compiler: the engine's step of a
tiny DSpark target and drafter, compiled for ``v5e:2x2`` on ``model:4`` (``benchmarks.plan_check``),
needs per device within 10% of the memory the planner gives it. Compiled on this CPU with ``libtpu``
(the ``test`` extra), no TPU needed.

Skips when ``libtpu`` is not importable, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import dataclasses

from tests.helpers.tpu_compiler import require_libtpu

require_libtpu()


def test_serving_plan_is_within_ten_percent_of_the_compiled_engine_step():
    """8 slots x 4096 positions, the step's largest bucket (8 rows, a full block each), 32 query heads
    as Qwen3-8B: weights, both KV caches and the step's vocabulary-sized sampling buffers, as the
    compiler lays them out (attention scores over one block of keys at a time, not the whole cache:
    counting the whole cache put the plan 23% high)."""
    from benchmarks import plan_check, tpu_compile
    from dspark_jax.config import DrafterConfig
    from dspark_jax.models import sharding as shd
    from dspark_jax.models.presets import builtin_target_config
    from dspark_jax.training.dry_run import estimate_serving_memory

    small = dict(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024, num_heads=32, head_dim=128)
    tcfg = dataclasses.replace(builtin_target_config("qwen3-8b"), num_kv_heads=4, **small)
    dcfg = DrafterConfig.for_target(tcfg, block_size=7, num_layers=1)
    mesh = shd.make_mesh("model:4", devices=tpu_compile.topology_devices("v5e:2x2"))
    slots, length = 8, 4096
    lowered = plan_check.engine_step(tcfg, dcfg, mesh, num_slots=slots, cache_len=length, tokens=slots * 8)
    _, hbm = plan_check.compile_with_hbm(lowered)
    est = estimate_serving_memory(
        tcfg, dcfg, num_slots=slots, max_len=length, dtype="bfloat16", devices=4, mesh="model:4"
    )
    assert 0.9 <= est["total_bytes"] / hbm <= 1.1, (est, hbm)
