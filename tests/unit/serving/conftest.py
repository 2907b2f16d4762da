"""Fixtures of the serving tests on stories260K: the target, its tokenizer and a drafter whose
Markov head holds the target's bigram logits (block size 3), built once per module."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint

BLOCK_SIZE = 3


@pytest.fixture(scope="module")
def target(stories260k):
    cfg, params, _ = stories260k
    return Target(cfg, params, fingerprint=params_fingerprint(params))


@pytest.fixture(scope="module")
def tokenizer(stories260k):
    return stories260k[2]


@pytest.fixture(scope="module")
def drafter(target):
    """A drafter whose Markov head holds the target's bigram logits (W1 = I, W2 = bigram):
    good enough that drafts get accepted, so every acceptance path runs."""
    v = target.cfg.vocab_size
    cfg = DrafterConfig.for_target(
        target.cfg,
        block_size=BLOCK_SIZE,
        num_layers=1,
        intermediate_size=64,
        markov_rank=v,
        target_fingerprint=target.fingerprint,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(0))
    x = np.stack([np.full(v, 1), np.arange(v)], axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(2, dtype=np.int32), x.shape)
    bigram = np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1])
    d.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(bigram)
    d.final_norm[...] = d.final_norm[...] * 0.1
    rng = np.random.default_rng(0)
    d.conf_w[...] = jnp.asarray(rng.standard_normal(d.conf_w[...].shape).astype(np.float32) * 0.1)
    return d
