"""The Markov-head sampler: sequential draft sampling over one block with ``lax.scan``.

Implements DESIGN.md "Drafter" step 3 (paper Section 6, Appendix A4):
``p_draft_k = process(U_k + e_k @ W2)`` with ``x_0`` = the anchor and ``e_k`` the
sequential head's embedding (vanilla: ``W1[x_{k-1}]``; gated / rnn variants:
:meth:`~dspark_jax.drafters.dspark.Drafter.markov_step`), one row lookup and one ``r x V``
matvec per step, plus the confidence head
``c_k = sigmoid(w . [h_k ; e_k] + b)`` (step 4), divided per position by the
calibration temperature ``T_k`` before the sigmoid (sequential temperature scaling,
:mod:`dspark_jax.training.calibration`); the temperatures never touch the sampled tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.drafters.dspark import BlockOutput, Drafter
from dspark_jax.models.sampling import SamplingArrays, process_logits, sample


class Draft(NamedTuple):
    """One drafted block per row.

    Attributes:
      tokens: ``[B, gamma]`` int32 draft tokens x_1..x_gamma.
      probs: ``[B, gamma, V]`` float32, the exact distribution q_k each draft token
        was sampled from (handed to the verifier unchanged), in target ids: exact zeros
        off a draft vocabulary.
      confidence: ``[B, gamma]`` float32 c_k in (0, 1], the predicted probability
        that position k is accepted given that verification reached it
        (calibrated: ``sigmoid(z_k / T_k)``).
      confidence_logit: ``[B, gamma]`` float32 raw confidence logits z_k (before
        calibration; ``+inf`` for a drafter without a confidence head).
    """

    tokens: jax.Array
    probs: jax.Array
    confidence: jax.Array
    confidence_logit: jax.Array


def sample_block(
    drafter: Drafter,
    block: BlockOutput,
    anchors: jax.Array,
    keys: jax.Array,
    sampling: SamplingArrays,
    conf_temperature: jax.Array | None = None,
    step_keys: jax.Array | None = None,
) -> Draft:
    """Samples x_1..x_gamma left to right with the Markov correction.

    Args:
      drafter: supplies the Markov and confidence heads.
      block: backbone output, ``hidden [B, gamma, d]`` and ``logits [B, gamma, N]`` (N = V or
        the draft vocabulary's size; tokens and ``probs`` come back in target ids).
      anchors: ``[B]`` int32 x_0.
      keys: ``[B, 2]`` uint32 per-row PRNG keys for this round; step k uses
        ``fold_in(key, k)`` so a row's draft depends only on its own key.
      sampling: per-row temperature / top-k / top-p, the same processing the
        verifier applies to the target's logits.
      conf_temperature: optional ``[gamma]`` per-position confidence temperatures
        ``T_k`` (``c_k = sigmoid(z_k / T_k)``); default: the drafter's own
        calibration (:attr:`Drafter.calibration`; :attr:`Drafter.calibration_greedy` for
        rows at temperature 0 when it has one), ones when it has none. Only the
        confidences change, never the tokens or ``probs``.
      step_keys: optional ``[B, gamma, 2]`` uint32 keys, one per draft position,
        used instead of ``fold_in(keys, k)`` (``keys`` is then ignored). The serving
        engine passes the keys the target samples the same positions with, which
        couples draft and target draws (same Gumbel noise).
    Returns:
      :class:`Draft`. When every row is greedy (temperature 0), a batch-level ``lax.cond``
      takes an argmax path with no softmax or random draw over the vocabulary (same tokens
      and the same one-hot q as the sampled path would give).
    """
    hidden = jnp.swapaxes(block.hidden, 0, 1)  # [gamma, B, d]
    logits = jnp.swapaxes(block.logits, 0, 1)  # [gamma, B, V]
    steps = jnp.arange(hidden.shape[0], dtype=jnp.uint32)
    g, b = hidden.shape[0], hidden.shape[1]
    if conf_temperature is None:  # per row: the greedy fit for rows at T = 0
        row_greedy = jnp.broadcast_to(jnp.asarray(sampling.temperature) <= 0.0, (b,))
        temps = jnp.where(
            row_greedy[None, :],
            drafter.confidence_temperatures(greedy=True)[:, None],
            drafter.confidence_temperatures()[:, None],
        )  # [gamma, B]
    else:
        temps = jnp.broadcast_to(jnp.asarray(conf_temperature, jnp.float32)[:, None], (g, b))

    if step_keys is None:
        step_keys = jax.vmap(lambda k: jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, k), out_axes=1)(steps)
    step_keys = jnp.swapaxes(step_keys, 0, 1)  # [gamma, B, 2]

    vocab = drafter.cfg.vocab_size
    all_greedy = jnp.all(jnp.asarray(sampling.temperature) <= 0.0)

    def greedy(logits, kk):
        # Exactly what process_logits + sample give a greedy row (one-hot at the first argmax),
        # without the softmax and the random draw over the vocabulary.
        x = drafter.to_target_ids(jnp.argmax(logits, axis=-1))
        return x, jax.nn.one_hot(x, vocab, dtype=jnp.float32)

    def sampled(logits, kk):
        # Sampled in target space (zeros off the draft vocabulary) so the draw consumes the
        # same per-token noise as the target's with the same key (the engine's coupled draws).
        q = drafter.to_target_probs(process_logits(logits, sampling))
        return jax.vmap(sample)(kk, q).astype(jnp.int32), q

    def step(carry, xs):
        prev, state = carry
        h, u, kk, t = xs
        state, e, bias = drafter.markov_step(state, prev, h)
        x, q = jax.lax.cond(all_greedy, greedy, sampled, u + bias, kk)
        z = drafter.confidence_logit(h, e)
        c = jax.nn.sigmoid(z / t)  # t: [B]
        return (x, state), (x, q, c, z)

    init = (anchors.astype(jnp.int32), drafter.markov_init(anchors.shape))
    _, (tokens, probs, conf, zs) = jax.lax.scan(step, init, (hidden, logits, step_keys, temps))
    sw = lambda a: jnp.swapaxes(a, 0, 1)
    return Draft(sw(tokens), sw(probs), sw(conf), sw(zs))
