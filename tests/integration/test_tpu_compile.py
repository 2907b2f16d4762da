"""Every cache-writing program compiled by the TPU compiler for ``v5e:2x2`` on a ``model:4`` mesh
writes the KV cache in place: no copy or transpose of a whole per-device K or V cache in the
optimised HLO (``benchmarks.tpu_compile``, tiny shapes: one KV head per device, as Qwen3-8B on
``model:8``). Compiled on this CPU with ``libtpu`` (the ``test`` extra), no TPU needed.

Skips when ``libtpu`` is not importable, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest

# Several pytest-xdist workers may load libtpu at once; deviceless compiles need no TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("libtpu is not installed (the test extra pins it): the TPU compile check cannot run", pytrace=False)
    pytest.skip("libtpu is not installed: no TPU compiler to compile for", allow_module_level=True)


@pytest.fixture(scope="module")
def builder():
    from benchmarks import tpu_compile
    from dspark_jax.models import sharding as shd
    from dspark_jax.models.presets import builtin_target_config

    cfg = dataclasses.replace(
        builtin_target_config("qwen3-8b"),
        num_layers=2,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=1024,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
    )
    devices = tpu_compile.topology_devices("v5e:2x2")
    return tpu_compile.Builder(cfg, shd.make_mesh("model:4", devices=devices))


def _programs(b):
    return [
        b.step(2048, 1),
        b.step(2048, 8, taps=(0, 1)),
        b.engine(1, 2048),
        b.engine(8, 2048),
        b.prefill_chunk(2048, tokens=64, lanes=2),
        b.drafter_context(2048, rows=4, tokens=16),
    ]


def test_cache_writing_programs_write_in_place_on_a_model_mesh(builder):
    from benchmarks import tpu_compile

    found = {}
    for p in _programs(builder):
        hlo = tpu_compile.compile_program(p, unroll=False).as_text() or ""
        # the per-device cache (one KV head of four) is what the detector looks for, and it is in the program
        assert p.cache_elements % (2048 * 128) == 0
        assert ",2048,1,128]" in hlo, p.name
        found[p.name] = tpu_compile.cache_copies(hlo, p.cache_elements)
    assert found == {name: [] for name in found}, found
