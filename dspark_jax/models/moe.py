"""The mixture-of-experts feed-forward of a target's sparse layers (Qwen3-MoE, Mixtral).

Routing is transformers' ``qwen3_moe``: router logits ``x @ W_router`` in the compute dtype, a
float32 softmax over all E experts, the top k, optionally renormalised to sum to 1
(``norm_topk_prob``; Mixtral's softmax over its top-k logits is the same number), and the
weights cast back to the compute dtype. Each expert is a SwiGLU MLP; a token's output is the
weighted sum of its k experts' outputs.

The cost follows the experts a token uses, never all E:

* up to :func:`gather_limit` (token, expert) pairs, e.g. a batch-1 decode step or a
  verification pass, each pair's expert matrices are gathered (``jnp.take`` on the expert axis)
  and applied to its token, so a step reads only the chosen experts' weights;
* above it (prefill, a wide engine step) the pairs are sorted by expert and run through
  ``jax.lax.ragged_dot``, a grouped matrix product (native on TPU and GPU; XLA's CPU backend
  expands it over every expert, so a long CPU prefill pays E / k times the active compute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_limit(num_experts: int) -> int:
    """Above this many (token, expert) pairs the grouped product replaces the gather: the gather
    materialises one copy of an expert's weights per pair, at most E (one layer's experts)."""
    return max(num_experts, 8)


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
    ``len(e)`` chosen experts' matrices: ``[P, H]`` -> ``[P, H]``."""
    g = jnp.einsum("th,thi->ti", xs, jnp.take(gate, e, axis=0))
    u = jnp.einsum("th,thi->ti", xs, jnp.take(up, e, axis=0))
    return jnp.einsum("ti,tih->th", jax.nn.silu(g) * u, jnp.take(down, e, axis=0))


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
    run = _gathered if n * k <= gather_limit(p["moe_gate"].shape[0]) else _grouped
    y = run(xs, idx.reshape(-1), *experts).reshape(n, k, hidden)
    return jnp.sum(y * w[..., None], axis=1).astype(x.dtype).reshape(*lead, hidden)
