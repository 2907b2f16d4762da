"""The target's two weight layouts (dspark_jax.models.layer_stack): per-layer buffers under an
unrolled layer loop (the CPU default, with fused, transposed copies of the projections for one-row
passes) and stacked ``[L, ...]`` weights under a scan give the same logits, features and caches (bit
for bit for passes of several rows, to float32 rounding for a one-row step, whose fused products sum
in another order), on a plain Llama layer stack and on one with sliding windows, per-layer RoPE,
qk-norm and sparse (MoE) layers, and the stacked view of the buffers is the stack bit for bit; and the
per-layer decode program no longer copies each layer's weights out of a stack, the copy the layout
exists to avoid.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import sharding as shd
from dspark_jax.models.target import Target, random_params
from tests.helpers.tiny import TARGET_SCALE, TINY_TARGET

MIXED = dataclasses.replace(
    TINY_TARGET,
    name="tiny-windows",
    qk_norm=True,
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    sliding_window=3,
    sliding_rope_theta=100.0,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


def _pair(cfg):
    params = random_params(cfg, seed=3, scale=TARGET_SCALE)
    return (Target(cfg, params, layer_layout=lay) for lay in ("stacked", "per_layer"))


def _passes(target: Target):
    """Cache-less pass with taps, a cached prefill then a one-token step, and a packed pass."""
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(0, target.cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    full = target(tok, pos, taps=(0, 1))
    cache = target.init_cache(2, 16)
    pre = target(tok[:, :8], pos[:, :8], cache)
    step = target(tok[:, 8:], pos[:, 8:], pre.cache, taps=(1,))
    rows, cols = jnp.asarray([0, 0, 1], jnp.int32), jnp.asarray([0, 1, 0], jnp.int32)
    packed = target.forward_packed(
        tok[0, :3], rows, cols, jnp.asarray([8, 9, 8], jnp.int32), step.cache, num_rows=2, width=2, taps=(1,)
    )
    one = target(tok[:1, 8:], pos[:1, 8:], jax.tree.map(lambda a: a[:, :1], pre.cache), taps=(1,))  # one row
    return [full.logits, full.features, pre.logits, step.logits, step.features, step.cache.k, packed.logits] + [
        one.logits,
        one.features,
        one.cache.v,
    ]


@pytest.mark.exactness
@pytest.mark.parametrize("cfg", [TINY_TARGET, MIXED], ids=["llama", "windows-qknorm-moe"])
def test_per_layer_buffers_give_the_stacked_results(cfg):
    stacked, per_layer = _pair(cfg)
    assert not stacked.per_layer and per_layer.per_layer
    assert isinstance(per_layer.layers, nnx.List) and len(per_layer.layers) == cfg.num_layers
    one_row = {"wqkv_t", "wo_t"} | (set() if cfg.num_experts else {"w_gate_up_t", "w_down_t"})
    assert one_row | {"wq", "wo"} <= set(per_layer.layers[0])
    outs = list(zip(_passes(stacked), _passes(per_layer), strict=True))
    for a, b in outs[:-3]:  # several rows: the [in, out] kernels, as the scan
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in outs[-3:]:  # one row: the fused copies; rounding of reordered sums only (a wrong split is O(1))
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * float(np.abs(a).max()))
    for k, v in stacked.layer_weights().items():  # the stacked view of the buffers is the stack
        np.testing.assert_array_equal(np.asarray(per_layer.layer_weights()[k]), np.asarray(v))


def _weight_slices(target: Target) -> int:
    """Slices of a stacked weight in the optimized one-token decode step (copies on XLA's CPU)."""
    graph, state = nnx.split(target)
    cache = target.init_cache(1, 16)
    tok, pos = jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 5, jnp.int32)

    def step(state, cache):
        return nnx.merge(graph, state)(tok, pos, cache).logits

    hlo = jax.jit(step).lower(state, cache).compile().as_text()
    one_layer = f"= f32[1,{TINY_TARGET.hidden_size},{TINY_TARGET.intermediate_size}]{{2,1,0}} dynamic-slice("
    return sum(one_layer in line for line in hlo.splitlines())  # w_gate / w_up of one layer


def test_per_layer_decode_step_reads_weights_in_place():
    stacked, per_layer = _pair(TINY_TARGET)
    assert _weight_slices(stacked) > 0  # the scan slices w_gate / w_up out of the stack
    assert _weight_slices(per_layer) == 0


def test_layout_choice_and_refusals():
    params = random_params(TINY_TARGET, seed=3, scale=TARGET_SCALE)
    assert Target(TINY_TARGET, params).per_layer == (jax.default_backend() == "cpu")
    assert not Target(TINY_TARGET, params, dtype=jnp.bfloat16).per_layer
    with pytest.raises(ValueError, match="layer_layout must be one of"):
        Target(TINY_TARGET, params, layer_layout="rows")
    mesh = shd.make_mesh("model:1", jax.devices()[:1])
    with pytest.raises(ValueError, match="per_layer.*not implemented with a device mesh"):
        Target(TINY_TARGET, params, mesh=mesh, layer_layout="per_layer")
    assert not Target(TINY_TARGET, params, mesh=mesh).per_layer
