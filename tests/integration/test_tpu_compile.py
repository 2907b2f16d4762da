"""Every cache-writing program compiled by the TPU compiler for ``v5e:2x2`` on a ``model:4`` mesh
writes the KV cache in place: no copy or transpose of a whole per-device K or V cache in the
optimised HLO (``benchmarks.tpu_compile``, tiny shapes: one KV head per device, as Qwen3-8B on
``model:8``). Compiled on this CPU with ``libtpu`` (the ``test`` extra), no TPU needed.

Skips when ``libtpu`` is not importable, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.tpu_compiler import require_libtpu

require_libtpu()


def _tiny(preset: str, **fields):
    """A 2-layer, 8-head (head size 128) version of a built-in config, with ``fields`` replaced;
    attention on ``xla`` unless ``attention_backend`` is given."""
    from dspark_jax.models.presets import builtin_target_config

    small = dict(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024, num_heads=8, head_dim=128)
    small["attention_backend"] = "xla"
    return dataclasses.replace(builtin_target_config(preset), **{**small, **fields})


def _model4():
    """``model:4`` over a deviceless v5e:2x2."""
    from benchmarks import tpu_compile
    from dspark_jax.models import sharding as shd

    return shd.make_mesh("model:4", devices=tpu_compile.topology_devices("v5e:2x2"))


@pytest.fixture(scope="module")
def builder():
    from benchmarks import tpu_compile

    return tpu_compile.Builder(_tiny("qwen3-8b", num_kv_heads=4), _model4())


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


def test_moe_decode_reads_only_the_routed_experts():
    """A tiny mixture-of-experts target (32 experts, top 2): the batch-1 decode step under the
    project's rule (each expert's hidden units over ``model``) reads within 1.5x the dense weights,
    the two routed experts' shards and the live KV (layer-unrolled compile, ``bytes accessed``; 1.18x
    when written; 4.97x with the experts over ``model``, the rule before), and no program copies the
    whole per-device cache, under either rule."""
    from benchmarks import tpu_compile

    cfg = _tiny(
        "qwen3-30b-a3b",
        hidden_size=512,
        intermediate_size=6144,  # the preset's dense width (every layer is sparse)
        num_kv_heads=4,
        num_experts=32,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
    )
    mesh = _model4()
    b = tpu_compile.Builder(cfg, mesh)  # the project's rule: each expert's hidden units over model
    # all 32 experts' shards are 8x the two routed ones: reading them all could not pass
    assert b.expert_bytes >= 8 * (b.active_weight_bytes(1) - b.weight_bytes)
    r = tpu_compile.measure(b.step(2048, 1), None)
    assert r["cache_copies"] == 0 and r["bytes_vs_ideal"] <= 1.5, r
    verify = tpu_compile.Builder(cfg, mesh, rules=tpu_compile.expert_rules("experts")).step(2048, 8, taps=(0, 1))
    hlo = tpu_compile.compile_program(verify, unroll=False).as_text() or ""
    assert tpu_compile.cache_copies(hlo, verify.cache_elements) == []


def test_fewer_kv_heads_than_model_devices_write_in_place():
    """2 KV heads on ``model:4`` (as Qwen3-30B-A3B's 4 on ``model:8``): each KV head is kept on 2
    devices (the cache's head axis over a 2-way split of ``model``), so decode-1, verify-8 and the
    engine step read and write one head a device, with no all-gather and copy of a replicated
    cache after the step."""
    from benchmarks import tpu_compile

    b = tpu_compile.Builder(_tiny("qwen3-8b", num_kv_heads=2), _model4())
    found, per_device = {}, {}
    for p in (b.step(2048, 1), b.step(2048, 8, taps=(0, 1)), b.engine(1, 2048)):
        per_device[p.name] = p.cache_elements
        hlo = tpu_compile.compile_program(p, unroll=False).as_text() or ""
        # a replicated cache's copies are of both heads: look for either size
        found[p.name] = tpu_compile.cache_copies(hlo, p.cache_elements) + tpu_compile.cache_copies(
            hlo, 2 * p.cache_elements
        )
    assert found == {name: [] for name in found}, found
    assert per_device == {name: 2 * 2048 * 128 for name in found}  # one KV head a device, 2 layers


def _kernel_heads(hlo: str) -> list[str]:
    """The output shapes of the Pallas kernel calls in an optimised HLO (``bf16[N,heads,128]``)."""
    return [ln.split(" = ")[1].split("{")[0] for ln in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in ln]


def test_pallas_tpu_compiles_sharded_on_a_model_mesh():
    """``pallas_tpu`` on ``model:4`` (4 KV heads: one a device; 2: each on two devices): the
    decode and verification passes compile with the Mosaic kernel under ``shard_map`` (2 of the 8
    query heads a device), at cache 8192 (the whole-row KV block overflowed VMEM before), with
    no whole-cache copy. Before, the kernel read its block sizes from ``jax.devices()[0]`` (the
    CPU: "TPU version must be 4 or higher") and could not be partitioned on a mesh. One chip of
    the topology (8 KV heads, no split) compiles too."""
    from benchmarks import tpu_compile
    from dspark_jax.models import sharding as shd

    found = {}
    for kv_heads in (4, 2):
        b = tpu_compile.Builder(_tiny("qwen3-8b", num_kv_heads=kv_heads, attention_backend="pallas_tpu"), _model4())
        for p in (b.step(8192, 1),) if kv_heads == 4 else (b.step(8192, 1), b.step(8192, 8, taps=(0, 1))):
            hlo = tpu_compile.compile_program(p, unroll=False).as_text() or ""
            found[(kv_heads, p.name)] = (_kernel_heads(hlo), len(tpu_compile.cache_copies(hlo, p.cache_elements)))
    one_chip = shd.make_mesh("model:1", devices=tpu_compile.topology_devices("v5e:2x2")[:1])
    # 3 layers: a layer's K and V interleaved into the kernel's pages (a copy per layer, the path's
    # known cost) has as many elements as a 2-layer cache and would read as a whole-cache copy
    cfg = _tiny("qwen3-8b", num_layers=3, num_kv_heads=8, attention_backend="pallas_tpu")
    p = tpu_compile.Builder(cfg, one_chip).step(8192, 1)
    hlo = tpu_compile.compile_program(p, unroll=False).as_text() or ""
    found[(8, "one chip")] = (_kernel_heads(hlo), len(tpu_compile.cache_copies(hlo, p.cache_elements)))
    assert found == {
        (8, "one chip"): (["bf16[1,8,128]"], 0),  # Mosaic read the CPU's kind off a mesh-less call before
        (4, "decode-1"): (["bf16[1,2,128]"], 0),
        (2, "decode-1"): (["bf16[1,2,128]"], 0),
        (2, "verify-8"): (["bf16[8,2,128]"], 0),
    }


def test_a_named_backend_that_cannot_serve_a_tpu_program_is_refused():
    """Compiled for a TPU topology (on this CPU: the platform is the mesh's, not
    ``jax.default_backend()``'s), ``pallas_tpu`` by name where the kernel cannot serve (head size
    64: not a multiple of the 128 lanes) and ``cudnn`` on a TPU are one-line errors naming the
    backend and the reason, raised while tracing; before, both compiled ``xla`` without a word."""
    from benchmarks import tpu_compile
    from dspark_jax.errors import DSparkInputError

    cases = {
        "pallas_tpu": (64, "'pallas_tpu' cannot run this program: head_dim 64 is not a multiple of 128"),
        "cudnn": (128, "'cudnn' cannot run this program: cuDNN needs a CUDA GPU .platform tpu."),
    }
    for backend, (head_dim, message) in cases.items():
        cfg = _tiny("qwen3-8b", num_kv_heads=4, head_dim=head_dim, attention_backend=backend)
        with pytest.raises(DSparkInputError, match=message):
            tpu_compile.compile_program(tpu_compile.Builder(cfg, _model4()).step(1024, 1), unroll=False)
