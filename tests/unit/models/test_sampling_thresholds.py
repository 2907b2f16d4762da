"""The sort-free top-k / top-p filter (threshold searches) against the sort-based one it replaced.

The reference below is ``dspark_jax.models.sampling._filter_top_k_top_p`` as of commit e2dc73b (a
stable sort, a cumsum, a lexicographic ``(logit, id)`` cut), kept here and nowhere in the package.
Top-k must agree exactly; the nucleus may differ only where the mass before a disputed token is
within ``1e-6`` of ``top_p`` (the sort-free masses are sums over V, the reference's a cumsum, so the
two round differently there). Those cases are counted; the count is part of the report.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dspark_jax.models import sampling
from dspark_jax.models.sampling import process_logits, sampling_arrays

pytestmark = pytest.mark.exactness

BOUNDARY_TOL = 1e-6


def sort_filter_reference(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The sort-based filter (commit e2dc73b), verbatim but for the docstring."""
    v = scaled.shape[-1]
    scaled = jnp.where(scaled == 0.0, jnp.zeros_like(scaled), scaled)
    ids = lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    neg_sorted, ids_sorted = lax.sort((-scaled, ids), dimension=scaled.ndim - 1, is_stable=True, num_keys=1)
    sorted_logits = -neg_sorted
    k_eff = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)
    rank = lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    in_top_k = rank < k_eff
    topk_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
    probs_sorted = jax.nn.softmax(topk_logits, axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    exclusive = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    n_p = jnp.sum((exclusive < top_p) & in_top_k, axis=-1, keepdims=True, dtype=jnp.int32)
    n_p = jnp.where(top_p >= 1.0, v, n_p)
    n_keep = jnp.clip(jnp.minimum(k_eff, n_p), 1, v)
    cut = n_keep - 1
    thr_logit = jnp.take_along_axis(sorted_logits, cut, axis=-1)
    thr_id = jnp.take_along_axis(ids_sorted, cut, axis=-1)
    keep = (scaled > thr_logit) | ((scaled == thr_logit) & (ids <= thr_id))
    return jnp.where(keep, scaled, -jnp.inf)


_REF = jax.jit(sort_filter_reference)
_NEW = jax.jit(sampling.filter_top_k_top_p)


def _random_case(rng: np.random.Generator, b: int, v: int, style: str):
    """Scaled logits ``[b, 2, v]`` (temperature applied) and per-row ``top_k [b,1,1]``, ``top_p [b,1,1]``."""
    logits = rng.normal(size=(b, 2, v)) * rng.choice([0.5, 2.0, 6.0])
    if style == "ties":  # few distinct values: long runs of equal logits at every cut
        logits = np.round(logits * 2.0) / 2.0
        logits[logits == 0.0] = rng.choice([0.0, -0.0], size=int((logits == 0.0).sum()))
    if style == "banned":  # -inf entries, at least one finite per distribution
        logits[rng.random(logits.shape) < 0.4] = -np.inf
        logits[..., rng.integers(v)] = 1.0
    temperature = rng.choice([0.3, 0.7, 1.0, 1.5], size=(b, 1, 1))
    scaled = (logits / temperature).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5, 40, v - 1, v, v + 3], size=(b, 1, 1)).astype(np.int32)
    top_k[rng.random((b, 1, 1)) < 0.3] = 0
    top_p = rng.choice([0.0, 0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0], size=(b, 1, 1)).astype(np.float32)
    return scaled, top_k, top_p


def _boundary_top_p(rng: np.random.Generator, scaled: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Per row, ``top_p`` set to a cumulative mass of the full distribution (adversarial cuts)."""
    out = top_p.copy()
    for r in range(scaled.shape[0]):
        x = scaled[r, 0].astype(np.float64)
        order = np.argsort(-x, kind="stable")
        pr = np.exp(x[order] - x.max())
        cum = np.cumsum(pr / pr.sum())
        out[r] = np.float32(cum[rng.integers(min(8, x.size))])
    return out


def _excused(scaled, top_k, top_p, ref_keep, new_keep) -> bool:
    """Whether a disagreeing distribution is a near-boundary one: both masks are prefixes of the
    ranking and the exact (float64) mass before each disputed token is within BOUNDARY_TOL of top_p."""
    v = scaled.size
    order = np.argsort(-scaled.astype(np.float64), kind="stable")
    n_ref, n_new = int(ref_keep.sum()), int(new_keep.sum())
    if not (ref_keep[order[:n_ref]].all() and new_keep[order[:n_new]].all()):
        return False
    k_eff = v if (top_k <= 0 or top_k >= v) else int(top_k)
    x = scaled[order[:k_eff]].astype(np.float64)
    pr = np.exp(x - x.max())
    exclusive = np.concatenate([[0.0], np.cumsum(pr / pr.sum())])
    disputed = exclusive[min(n_ref, n_new) : max(n_ref, n_new)]
    return bool(np.all(np.abs(disputed - float(top_p)) <= BOUNDARY_TOL))


def _compare(scaled, top_k, top_p) -> tuple[int, int]:
    """(distributions compared, near-boundary disagreements); fails on any other disagreement."""
    ref = np.asarray(_REF(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p)))
    new = np.asarray(_NEW(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p)))
    # what is observable: which finite tokens are kept (a -inf token reads -inf either way)
    ref_keep, new_keep = ref > -np.inf, new > -np.inf
    np.testing.assert_array_equal(np.where(new_keep, new, 0.0), np.where(new_keep, scaled, 0.0))
    near = 0
    for r, g in zip(*np.nonzero(np.any(ref_keep != new_keep, axis=-1)), strict=True):
        assert top_p[r, 0, 0] < 1.0, "top-k alone must agree exactly"
        assert _excused(scaled[r, g], top_k[r, 0, 0], top_p[r, 0, 0], ref_keep[r, g], new_keep[r, g]), (r, g)
        near += 1
    return ref_keep.shape[0] * ref_keep.shape[1], near


@pytest.mark.parametrize("v", [2, 7, 100, 1000, 49152])
def test_sort_free_filter_equals_the_sort_based_one(v):
    """Random logits (plain, tied, with -inf), temperatures, per-row k and p, adversarial p at a
    prefix mass: equal masks but for near-boundary nuclei, which are counted and stay rare."""
    rng = np.random.default_rng(v)
    b = 8 if v == 49152 else 64
    rounds = 2 if v == 49152 else 4
    counts = {"random": [0, 0], "at a prefix mass": [0, 0]}
    for i in range(rounds):
        for style in ("plain", "ties", "banned"):
            scaled, top_k, top_p = _random_case(rng, b, v, style)
            kind = "at a prefix mass" if i % 2 else "random"
            if i % 2:
                top_p = _boundary_top_p(rng, scaled, top_p)
            n, d = _compare(scaled, top_k, top_p)
            counts[kind][0] += n
            counts[kind][1] += d
    for kind, (n, d) in counts.items():
        print(f"V={v} top_p {kind}: {d} near-boundary disagreements in {n} distributions")


def test_process_logits_per_row_params_match_the_sort_based_filter():
    """Through ``process_logits`` (jit, per-row traced top_k / top_p, a middle axis): the same zero
    pattern as softmax of the sort-based filter, and the same probabilities up to rounding."""
    rng = np.random.default_rng(0)
    b, v = 16, 1000
    scaled, top_k, top_p = _random_case(rng, b, v, "ties")
    top_p = np.where(np.arange(b)[:, None, None] % 2 == 0, 1.0, 0.9).astype(np.float32)  # no prefix mass at 0.9
    params = sampling_arrays(b, temperature=1.0, top_k=top_k[:, 0, 0], top_p=top_p[:, 0, 0])
    expected = np.asarray(jax.jit(lambda s, k, p: jax.nn.softmax(_REF(s, k, p), axis=-1))(scaled, top_k, top_p))
    probs = np.asarray(process_logits(scaled, params))
    np.testing.assert_array_equal(probs > 0.0, expected > 0.0)
    np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=0.0)
    assert 0 < int((probs > 0).sum()) < probs.size


def test_ties_and_edges_of_the_threshold_search():
    """Hand-made cuts: ties straddling the top-k and nucleus cuts, -0.0 / +0.0, top_p <= 0, a top_p
    the whole mass falls short of, -inf inside the top-k, and k = V - 1."""
    x = np.array(
        [
            [1.0, 3.0, 3.0, 3.0, 0.0, 3.0],
            [0.0, -0.0, 0.0, -0.0, -1.0, -0.0],
            [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
            [0.5, -np.inf, 0.5, -np.inf, -np.inf, 0.1],
            [np.log(0.25), np.log(0.25), np.log(0.5), -5.0, -5.0, -5.0],
        ],
        np.float32,
    )[:, None, :]
    for k, p in [(2, 1.0), (5, 1.0), (0, 0.6), (3, 0.4), (0, 0.0), (0, -1.0), (0, 0.99999994), (5, 0.9), (4, 0.5)]:
        top_k = np.full((5, 1, 1), k, np.int32)
        top_p = np.full((5, 1, 1), p, np.float32)
        ref = np.asarray(_REF(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
        new = np.asarray(_NEW(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
        np.testing.assert_array_equal(new, ref, err_msg=f"k={k} p={p}")
    # two tokens of a quarter each tied at a 0.6 nucleus: the lower id is kept, the other dropped
    kept = np.isfinite(np.asarray(_NEW(jnp.asarray(x[4:]), jnp.zeros((1, 1, 1), jnp.int32), jnp.full((1, 1, 1), 0.6))))
    np.testing.assert_array_equal(kept[0, 0], [True, False, True, False, False, False])


def _primitives(jaxpr, under_cond: bool = False, out: set[tuple[str, bool]] | None = None) -> set[tuple[str, bool]]:
    """``(primitive name, whether it runs inside a cond branch)`` for every equation, nested jaxprs included."""
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        out.add((eqn.primitive.name, under_cond))
        inside = under_cond or eqn.primitive.name == "cond"
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _primitives(sub, inside, out)
    return out


def test_no_sort_and_each_search_behind_a_cond():
    """The filter is sort-free, and its loops (``fori_loop``: a ``scan``) run only inside
    ``lax.cond`` branches, skipped when no row filters."""
    prims = _primitives(jax.make_jaxpr(process_logits)(jnp.zeros((2, 8)), sampling_arrays(2)).jaxpr)
    names = {name for name, _ in prims}
    assert "cond" in names and "scan" in names and not names & {"sort", "cumsum", "top_k"}
    assert ("scan", False) not in prims
    k, p = jnp.ones((2, 1), jnp.int32), jnp.ones((2, 1))
    inner = _primitives(jax.make_jaxpr(sampling.filter_top_k_top_p)(jnp.zeros((2, 8)), k, p).jaxpr)
    assert ("scan", True) in inner and ("scan", False) not in inner
