"""Worker for tests/integration/test_pallas_sharded.py: the ``pallas_tpu`` path under ``shard_map``.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.pallas_shard_worker

On 8 forced CPU devices, :func:`~dspark_jax.models.pallas_tpu.pallas_tpu_attention` runs inside
``jit`` with the KV cache placed by :func:`~dspark_jax.models.sharding.cache_sharding` and a
vectorised stand-in for the kernel (same arguments and rules as JAX's ``ref_ragged_paged_attention``,
which loops over concrete metadata in Python and so cannot run under ``jit``): 8 query heads with
4 KV heads on ``model:4`` (one a device), 2 KV heads (``model_kv x model_rep``: each KV head on two
devices), 6 query / 3 KV heads (not split: whole on every device) and ``data:2,model:4``; with Gemma's query scale
and soft-cap and a static window. Prints one JSON object: the largest difference from the
``xla`` path and the heads each kernel call saw.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models import sharding as shd
from dspark_jax.models.layers import cached_attention
from dspark_jax.models.pallas_tpu import pallas_tpu_attention

SEEN: list[tuple[int, int]] = []  # (query heads, KV heads) of each kernel call, at trace time


def dense_kernel(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None
):
    """``ref_ragged_paged_attention`` for one query per sequence, without Python loops: query ``n``
    sees the first ``kv_lens[n]`` keys of its pages (the last ``sliding_window`` of them)."""
    del cu_q_lens, num_seqs
    n, nh, hd = q.shape
    SEEN.append((nh, kv_pages.shape[2] // 2))
    kv = kv_pages[page_indices].reshape(n, -1, kv_pages.shape[2], hd)  # [N, S, 2 kvh, hd]
    g = nh // (kv.shape[2] // 2)
    k, v = jnp.repeat(kv[:, :, 0::2], g, axis=2), jnp.repeat(kv[:, :, 1::2], g, axis=2)
    s = jnp.einsum("nhd,nshd->nhs", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    slot, last = jnp.arange(k.shape[1])[None, :], kv_lens[:, None] - 1
    seen = slot <= last if sliding_window is None else (slot <= last) & (slot > last - sliding_window)
    p = jax.nn.softmax(jnp.where(seen[:, None, :], s, -jnp.inf), axis=-1)
    return jnp.einsum("nhs,nshd->nhd", p, v.astype(jnp.float32)).astype(q.dtype)


def case(mesh_spec: str, kv_heads: int, nh: int = 8, **opts) -> dict:
    rng = np.random.default_rng(kv_heads)
    b, t, hd, s_len, layers = 2, 3, 16, 64, 2
    mesh = shd.make_mesh(mesh_spec, devices=jax.devices()[:8] if "data" in mesh_spec else jax.devices()[:4])
    shape = (layers, b + 1, s_len, kv_heads, hd)
    sh = shd.cache_sharding(mesh, kv_heads, shape)
    k, v = (jax.device_put(jnp.asarray(rng.standard_normal(shape), jnp.float32), sh) for _ in range(2))
    q = jax.device_put(jnp.asarray(rng.standard_normal((b, t, nh, hd)), jnp.float32), shd.replicated(mesh))
    q_pos = jnp.asarray([[0, 17, -1], [40, 41, 63]], jnp.int32)
    SEEN.clear()
    got = jax.jit(lambda *a: pallas_tpu_attention(*a, page_size=16, kernel=dense_kernel, **opts))(q, k, v, 1, q_pos)
    host = [jnp.asarray(np.asarray(x)) for x in (q, k, v)]  # the reference on one device
    want = jax.jit(lambda *a: cached_attention(*a, **opts))(*host, 1, q_pos)
    return {"max_diff": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))), "kernel_heads": SEEN[:1]}


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {
        "model4_kv4": case("model:4", 4),
        "model4_kv2": case("model:4", 2),
        "model4_kv3": case("model:4", 3, nh=6),
        "data2_model4_kv4": case("data:2,model:4", 4),
        "gemma_kv2": case("model:4", 2, scale=0.1, softcap=5.0, window=9),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
