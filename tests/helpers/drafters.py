"""The drafters of the decode-equality tests and their check.

:func:`random_drafter` acts through every part (backbone, Markov head, confidence head);
:func:`bigram_drafter` holds the target's bigram logits (a good, not perfect, proposal);
:func:`assert_same_outputs` compares a speculative result with the autoregressive one.
Every helper takes any target; the drafters are built for it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.models.target import Target


def random_drafter(
    target: Target,
    *,
    block_size=4,
    seed=0,
    variant="dspark",
    markov_rank=None,
    num_layers=1,
    intermediate_size=64,
    scale=0.5,
    draft_vocab=None,
    width=0,
) -> DSparkDrafter:
    """A randomly initialised drafter whose zero-initialised parts (residual output
    projections, Markov W2, confidence weights) are randomised too, so that the
    backbone, the Markov correction and the confidence head all act. ``draft_vocab``:
    target ids of a reduced draft vocabulary; ``width``: a backbone width other than H."""
    t = target.cfg
    cfg = DrafterConfig.for_target(
        t,
        block_size=block_size,
        variant=variant,
        num_layers=num_layers,
        intermediate_size=intermediate_size,
        markov_rank=t.vocab_size if markov_rank is None else markov_rank,
        target_fingerprint=getattr(target, "fingerprint", ""),
        draft_vocab_size=len(draft_vocab) if draft_vocab is not None else 0,
        width=width,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(seed))
    if draft_vocab is not None:
        d.set_draft_vocab(draft_vocab)
    rng = np.random.default_rng(seed + 1000)

    def rnd(var, s):
        var[...] = jnp.asarray(rng.standard_normal(var[...].shape).astype(np.float32) * s)

    rnd(d.layers["wo"], scale / np.sqrt(cfg.num_heads * cfg.head_dim))
    rnd(d.layers["w_down"], scale / np.sqrt(cfg.intermediate_size))
    if cfg.markov:
        rnd(d.markov_w2, 2.0)
    if cfg.has_confidence:
        rnd(d.conf_w, 0.3)
    return d


def bigram_table(target: Target, bos: int | None = None) -> np.ndarray:
    """``[V, V]`` target logits of the next token given a one-token context ``[x]``
    (or ``[bos, x]``)."""
    v = target.cfg.vocab_size
    x = np.arange(v, dtype=np.int32)[:, None]
    if bos is not None:
        x = np.concatenate([np.full_like(x, bos), x], axis=1)
    pos = np.broadcast_to(np.arange(x.shape[1], dtype=np.int32), x.shape)
    return np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1])


def bigram_drafter(target: Target, *, alpha=1.0, base_scale=0.1, bos=None, **kw) -> DSparkDrafter:
    """A drafter whose Markov head holds the target's bigram logits (``W1 = I``,
    ``W2 = alpha * bigram``): a good, but not perfect, proposal. ``base_scale`` scales the
    backbone's base logits (0: none, the proposal is the bigram alone)."""
    d = random_drafter(target, **kw)
    assert d.cfg.markov_rank == target.cfg.vocab_size
    d.markov_w1[...] = jnp.eye(target.cfg.vocab_size, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(alpha * bigram_table(target, bos))
    d.final_norm[...] = d.final_norm[...] * base_scale
    return d


def assert_same_outputs(ar, sp, rows=None):
    """Asserts that the generations of two results (``rows`` of them, all by default) have the same
    tokens and finish reasons: speculative against autoregressive."""
    rows = range(len(ar.generations)) if rows is None else rows
    for i in rows:
        a, s = ar.generations[i], sp.generations[i]
        assert s.token_ids == a.token_ids, f"row {i}: speculative {s.token_ids} != autoregressive {a.token_ids}"
        assert s.finish_reason == a.finish_reason, f"row {i}"
