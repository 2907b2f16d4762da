"""The mixture-of-experts feed-forward of a target's sparse layers (Qwen3-MoE, Mixtral).

Routing is transformers' ``qwen3_moe``: router logits ``x @ W_router`` in the compute dtype, a
float32 softmax over all E experts, the top k, optionally renormalised to sum to 1
(``norm_topk_prob``; Mixtral's softmax over its top-k logits is the same number), and the
weights cast back to the compute dtype. Each expert is a SwiGLU MLP; a token's output is the
weighted sum of its k experts' outputs.

The cost follows the experts a token uses, never all E:

* up to :func:`gather_limit` (token, expert) pairs, e.g. a batch-1 decode step or a
  verification pass, each pair's expert matrices are gathered (``jnp.take`` on the expert axis:
  with the experts split over devices a gather stays on the owning device, where a dynamic slice
  all-gathered every expert) and applied to its token, so a step reads only the chosen experts'
  weights;
* above it (prefill, a wide engine step) the pairs are sorted by expert and run through
  ``jax.lax.ragged_dot``, a grouped matrix product (native on TPU and GPU; XLA's CPU backend
  expands it over every expert, so a long CPU prefill pays E / k times the active compute).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.models.layer_stack import dense_mlp
from dspark_jax.models.weights import DENSE_MLP_KEYS, MOE_KEYS, layer_members

# With dense and sparse layers mixed, a layer's MLP weights sit at this index of its group's stack
# (split_mixed_mlp), and this flag says which group: both ride in the scan's per-layer inputs.
MLP_SLOT_KEY, MLP_SPARSE_KEY = "mlp_slot", "mlp_sparse"


def gather_limit(num_experts: int, k: int) -> int:
    """Up to this many (token, expert) pairs each pair's expert is sliced out and applied on its own
    (the slices are unrolled at trace time, so the bound keeps the program small); above it the
    grouped product runs. At least ``k`` (one token), at most ``min(E, 32)`` otherwise."""
    return max(min(num_experts, 32), k)


def route(x: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of ``x [N, H]`` with ``router [H, E]``.

    Returns:
      ``(weights [N, k]`` in ``x``'s dtype, ``experts [N, k]`` int32), best first.
    """
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), idx.astype(jnp.int32)


def _gathered(xs: jax.Array, e: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Pair ``t`` (token row ``xs[t]``, expert ``e[t]``) through its expert, reading only the
    ``len(e)`` chosen experts' matrices (a gather each): ``[P, H]`` -> ``[P, H]``.

    One ``[1, H]`` row product per pair, unrolled (at most :func:`gather_limit` pairs). On XLA's CPU
    backend this ran 1.0 ms at 4 pairs and 27 ms at 16 for one 32-expert layer (H 1024, Im 256),
    against 1.0 / 32 ms for a batched product over weights gathered as ``[P, H, Im]``, and 56 ms at
    16 pairs with ``[H]`` vectors (2 shared cores)."""
    rows = []
    for t in range(xs.shape[0]):

        def pick(w, t=t):
            # a gather, not a dynamic slice: with the experts split over devices, XLA's partitioner
            # gathers from each device's own experts (masked, then summed) where a dynamic slice
            # would first all-gather every expert
            return jnp.take(w, e[t], axis=0, mode="clip")

        x = xs[t : t + 1]
        rows.append((jax.nn.silu(x @ pick(gate)) * (x @ pick(up))) @ pick(down))
    return jnp.concatenate(rows)


def _grouped(xs: jax.Array, e: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """:func:`_gathered` as grouped products: the pairs sorted by expert, ``jax.lax.ragged_dot``
    over the experts' groups, then put back in pair order."""
    order = jnp.argsort(e)
    sizes = jnp.bincount(e, length=gate.shape[0]).astype(jnp.int32)
    xs_sorted = xs[order]
    g = jax.lax.ragged_dot(xs_sorted, gate, sizes)
    u = jax.lax.ragged_dot(xs_sorted, up, sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, down, sizes)
    return jnp.zeros_like(y).at[order].set(y)


def moe_mlp(x: jax.Array, p: dict[str, jax.Array], k: int, norm_topk_prob: bool) -> jax.Array:
    """The sparse feed-forward of ``x [..., H]`` (already normed).

    Args:
      p: one layer's ``moe_router [H, E]``, ``moe_gate`` / ``moe_up [E, H, Im]``, ``moe_down [E, Im, H]``.
      k / norm_topk_prob: static routing settings (:func:`route`).
    Returns:
      ``[..., H]`` in ``x``'s dtype.
    """
    lead, hidden = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, hidden)
    n = flat.shape[0]
    w, idx = route(flat, p["moe_router"], k, norm_topk_prob)
    xs = jnp.repeat(flat, k, axis=0)  # [N * k, H], pair t = (token t // k, its (t % k)-th expert)
    experts = p["moe_gate"], p["moe_up"], p["moe_down"]
    run = _gathered if n * k <= gather_limit(p["moe_gate"].shape[0], k) else _grouped
    y = run(xs, idx.reshape(-1), *experts).reshape(n, k, hidden)
    return jnp.sum(y * w[..., None], axis=1).astype(x.dtype).reshape(*lead, hidden)


def split_mixed_mlp(cfg: Any, p: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The per-layer scan inputs and the indexed MLP stacks of a target's stacked weights ``p``.

    A scan needs every per-layer input stacked over all L layers, but with dense and sparse
    layers mixed (``cfg.mixed_mlp``) the two groups' MLP weights are stacked over their own layers.
    Then they leave the scan inputs for the stacks (``{w_gate: [Ld, H, I], ..., moe_gate: [Ls, E,
    H, Im], ...}``), replaced by ``MLP_SLOT_KEY`` ``[L]`` int32 (the layer's index in its group) and
    ``MLP_SPARSE_KEY`` ``[L]`` bool. Otherwise ``(p, {})``: nothing changes.
    """
    if not cfg.mixed_mlp:
        return p, {}
    xs = {k: v for k, v in p.items() if k not in DENSE_MLP_KEYS + MOE_KEYS}
    members, sparse = layer_members(cfg), cfg.sparse_layers()
    xs[MLP_SLOT_KEY] = jnp.asarray([members["moe_gate" if s else "w_gate"].index(i) for i, s in enumerate(sparse)])
    xs[MLP_SPARSE_KEY] = jnp.asarray(sparse)
    return xs, {k: p[k] for k in DENSE_MLP_KEYS + MOE_KEYS}


def feed_forward(cfg: Any, p: dict[str, jax.Array], x: jax.Array, stacks: dict[str, jax.Array]) -> jax.Array:
    """A target layer's feed-forward of the normed ``x [..., H]``: the gated MLP, or on a sparse
    layer the experts (:func:`moe_mlp`). With both kinds mixed, the layer's weights are taken from
    ``stacks`` at ``p[MLP_SLOT_KEY]`` (:func:`split_mixed_mlp`) and ``lax.cond`` runs its kind only."""

    def dense(x, q):
        return dense_mlp(q, x, cfg.mlp_activation)

    def sparse(x, q):
        return moe_mlp(x, q, cfg.num_experts_per_tok, cfg.norm_topk_prob)

    if not cfg.mixed_mlp:
        return sparse(x, p) if cfg.num_sparse_layers else dense(x, p)

    def pick(keys):
        return {k: jax.lax.dynamic_index_in_dim(stacks[k], p[MLP_SLOT_KEY], keepdims=False) for k in keys}

    return jax.lax.cond(
        p[MLP_SPARSE_KEY], lambda x: sparse(x, pick(MOE_KEYS)), lambda x: dense(x, pick(DENSE_MLP_KEYS)), x
    )
