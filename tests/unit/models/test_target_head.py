"""The target's LM head: a tied head unembeds 2-32 positions on the CPU as a row reduction
(:func:`dspark_jax.models.head.tied_head_row_reduce`), equal to the dot up to round-off."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import head as head_mod
from dspark_jax.models.head import ROW_REDUCE_MAX_TOKENS, tied_head_row_reduce
from dspark_jax.models.layers import rms_norm
from dspark_jax.models.target import Target, random_params
from tests.helpers.tiny import TINY_TARGET, tiny_target


def _primitives(fn, *args) -> set[str]:
    return {str(e.primitive) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


@pytest.fixture(scope="module")
def tied():
    return tiny_target()


@pytest.mark.parametrize("n", [1, 2, 3, 9, ROW_REDUCE_MAX_TOKENS, ROW_REDUCE_MAX_TOKENS + 1])
def test_unembed_equals_the_dot_and_takes_the_row_reduction_for_2_to_32_positions(tied, n):
    h = jnp.asarray(np.random.default_rng(n).standard_normal((1, n, TINY_TARGET.hidden_size)), jnp.float32)
    want = jnp.dot(rms_norm(h, tied.final_norm[...], TINY_TARGET.rms_eps), tied.embed[...].T)
    np.testing.assert_allclose(np.asarray(tied.unembed(h)), np.asarray(want), rtol=1e-5, atol=1e-5)
    prims = _primitives(tied.unembed, h)
    row_reduce = 1 < n <= ROW_REDUCE_MAX_TOKENS
    assert ("dot_general" in prims) != row_reduce  # (the norm's own reduction is there either way)


def test_an_untied_head_always_takes_the_dot():
    cfg = dataclasses.replace(TINY_TARGET, tie_embeddings=False)
    t = Target(cfg, random_params(cfg, seed=3))
    h = jnp.ones((3, cfg.hidden_size), jnp.float32)
    assert "dot_general" in _primitives(t.unembed, h)


def test_row_reduction_keeps_leading_shape_and_accepts_bfloat16_weights():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    e = jnp.asarray(rng.standard_normal((16, 8)), jnp.bfloat16)
    out = tied_head_row_reduce(h, e)
    assert out.shape == (2, 3, 16) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(h @ e.astype(jnp.float32).T), rtol=1e-5, atol=1e-5)


def test_other_platforms_keep_the_dot(tied, monkeypatch):
    monkeypatch.setattr(head_mod, "current_platform", lambda: "tpu")
    assert "dot_general" in _primitives(tied.unembed, jnp.ones((3, TINY_TARGET.hidden_size), jnp.float32))
