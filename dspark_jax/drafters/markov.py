"""DSpark's sequential (Markov) heads and the sampler that drafts a block with them.

Implements docs/design.md#markov-head (paper Section 6, Appendix A4). A head turns the
Markov embedding ``x = W1[x_{k-1}]`` of the previous token (and, depending on its type, the
backbone hidden state ``h_k`` and a state carried along the block) into the embedding
``e_k``; its logit correction is ``B_k = e_k W2`` and the draft distribution
``p_draft_k = process(U_k + B_k)``. One class per ``DrafterConfig.markov_head``, built by
:func:`build_markov_head` (DeepSpec's GatedMarkovHead / RNNHead for ``gated`` / ``rnn``):

* ``vanilla`` (:class:`MarkovHead`): ``e = x``;
* ``gated`` (:class:`GatedMarkovHead`): ``g = sigmoid(W_g [h_k; x] + b_g)``, ``e = g * x``;
* ``rnn`` (:class:`RNNMarkovHead`): ``s_0 = 0``, ``[a; c; o] = split3(W [s_{k-1}; x; h_k] + b)``,
  ``u = sigmoid(a)``, ``s_k = u * s_{k-1} + (1 - u) * tanh(c)``, ``e = tanh(o)`` (carries the
  whole in-block prefix);
* ``gated_v0`` / ``rnn_v0`` (:class:`GatedV0MarkovHead`, :class:`RNNV0MarkovHead`): the first
  variants of this project (gate from ``h_k`` alone; a GRU state added to ``x``), kept so that
  their exports still load.

:func:`sample_block` samples ``x_1..x_gamma`` left to right with ``lax.scan`` (one row lookup
and one ``r x N`` matvec per step) plus the confidence head ``c_k = sigmoid(w . [h_k ; e_k] + b)``
(step 4), divided per position by the calibration temperature ``T_k`` and shifted by its bias
``b_k`` before the sigmoid (:mod:`dspark_jax.training.calibration`); the calibration never
touches the sampled tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.base import BlockDrafter, BlockOutput, Draft
from dspark_jax.models.sampling import SamplingArrays, first_argmax, process_logits, sample, sample_subset


def _fan_in(rngs: nnx.Rngs, dtype, *shape: int) -> nnx.Param:
    """``[..., fan_in, fan_out]`` truncated-normal weights scaled by ``1 / sqrt(fan_in)``."""
    fn = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)
    return nnx.Param(fn(rngs.params(), shape, dtype))


def _carried(state: jax.Array | None) -> jax.Array:
    """The state of a recurrent head (from its ``init_state``; never None)."""
    if state is None:
        raise ValueError("a recurrent Markov head needs its state: start from init_state()")
    return state


class MarkovHead(nnx.Module):
    """The vanilla head: ``e_k = W1[x_{k-1}]``, bias ``B_k = e_k W2`` (a rank-r bigram).

    Every head holds ``w1 [cfg.markov_w1_size, r]`` (one row per target token, or, with
    ``markov_w1_rows="draft"``, one per draft-vocabulary token plus one shared row for every
    previous token outside it: an anchor can be any target token) and ``w2 [r, N]``. ``W2 = 0``
    at initialisation: the correction starts as exactly zero (pure DFlash).

    Args:
      cfg: :class:`DrafterConfig` with ``markov_rank`` r > 0.
      rngs: ``nnx.Rngs`` for initialisation.
      dtype: parameter dtype.
    """

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        r = cfg.markov_rank
        self.rank = r
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (cfg.markov_w1_size, r), dtype) / jnp.sqrt(r))
        self.w2 = nnx.Param(jnp.zeros((r, cfg.draft_size), dtype))

    def init_state(self, batch_shape: tuple[int, ...], dtype) -> jax.Array | None:
        """State before position 1: None (this head carries none)."""
        return None

    def embedding(self, index: jax.Array) -> jax.Array:
        """``[...]`` int32 row indices (:meth:`DSparkDrafter.markov_index`) -> ``[..., r]`` rows of ``W1``."""
        return jnp.take(self.w1[...], index, axis=0)

    def step(self, state: jax.Array | None, x: jax.Array, h: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        """One position: ``(s_{k-1}, x [..., r], h_k [..., d]) -> (s_k, e_k [..., r])``."""
        return state, x

    def teacher_forced(self, state: jax.Array | None, x: jax.Array, hidden: jax.Array) -> jax.Array:
        """``e`` of whole blocks: ``x [..., block_size, r]``, ``hidden [..., block_size, d]`` ->
        ``[..., block_size, r]``, equal to :meth:`step` left to right from ``state`` (:meth:`init_state`)."""
        return self.step(state, x, hidden)[1]

    def bias(self, e: jax.Array) -> jax.Array:
        """``[..., r]`` -> ``[..., N]`` float32 logit correction ``e W2`` (draft space)."""
        return jnp.dot(e, self.w2[...], preferred_element_type=jnp.float32)


class GatedMarkovHead(MarkovHead):
    """``gated``: ``e = sigmoid(W_g [h_k; x] + b_g) * x`` (DeepSpec's GatedMarkovHead).

    ``W_g = 0``, ``b_g = 2``: the gate starts mostly open (``sigmoid(2) ~ 0.88``), close to the
    vanilla head.
    """

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs, dtype)
        self.gate_w = nnx.Param(jnp.zeros((self._gate_inputs(cfg), cfg.markov_rank), dtype))
        self.gate_b = nnx.Param(jnp.full((cfg.markov_rank,), 2.0, dtype))

    @staticmethod
    def _gate_inputs(cfg: DrafterConfig) -> int:
        return cfg.model_width + cfg.markov_rank

    def step(self, state, x, h):
        z = jnp.concatenate([h.astype(x.dtype), x], axis=-1)
        return state, jax.nn.sigmoid(z @ self.gate_w[...] + self.gate_b[...]) * x


class GatedV0MarkovHead(GatedMarkovHead):
    """``gated_v0`` (format-1 exports' ``gated``): ``e = sigmoid(W_g h_k + b_g) * x``."""

    @staticmethod
    def _gate_inputs(cfg: DrafterConfig) -> int:
        return cfg.model_width

    def step(self, state, x, h):
        gate = jax.nn.sigmoid(h.astype(x.dtype) @ self.gate_w[...] + self.gate_b[...])
        return state, gate * x


class RNNMarkovHead(MarkovHead):
    """``rnn``: DeepSpec's RNNHead (module doc), ``W [2r + d, 3r]``, ``b [3r]``; state ``s_0 = 0``."""

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs, dtype)
        r = cfg.markov_rank
        self.rnn_wx = _fan_in(rngs, dtype, 2 * r + cfg.model_width, 3 * r)  # W over [s_{k-1}; x; h_k]
        self.rnn_b = nnx.Param(jnp.zeros((3 * r,), dtype))

    def init_state(self, batch_shape, dtype):
        """``[*batch_shape, r]`` zeros."""
        return jnp.zeros(tuple(batch_shape) + (self.rank,), dtype)

    def step(self, state, x, h):
        r, state = self.rank, _carried(state)
        z = jnp.concatenate([state, x, h.astype(x.dtype)], axis=-1) @ self.rnn_wx[...] + self.rnn_b[...]
        u = jax.nn.sigmoid(z[..., :r])
        state = u * state + (1.0 - u) * jnp.tanh(z[..., r : 2 * r])
        return state, jnp.tanh(z[..., 2 * r :])

    def teacher_forced(self, state, x, hidden):
        xs = jnp.moveaxis(x, -2, 0)  # [g, ..., r]
        hs = jnp.moveaxis(hidden, -2, 0)
        _, es = jax.lax.scan(lambda s, xh: self.step(s, *xh), state, (xs, hs))
        return jnp.moveaxis(es, 0, -2)


class RNNV0MarkovHead(MarkovHead):
    """``rnn_v0`` (format-1 exports' ``rnn``): a GRU over the block, ``e = x + s_k``, with
    ``W_x, W_h [r, 3r]``, ``b [3r]`` (reset gate on the recurrent term); state ``s_0 = 0``."""

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs, dtype)
        r = cfg.markov_rank
        self.rnn_wx, self.rnn_wh = _fan_in(rngs, dtype, r, 3 * r), _fan_in(rngs, dtype, r, 3 * r)
        self.rnn_b = nnx.Param(jnp.zeros((3 * r,), dtype))

    def init_state(self, batch_shape, dtype):
        """``[*batch_shape, r]`` zeros."""
        return jnp.zeros(tuple(batch_shape) + (self.rank,), dtype)

    def _gru(self, s: jax.Array, x: jax.Array) -> jax.Array:
        r = self.rank
        gx = x @ self.rnn_wx[...] + self.rnn_b[...]
        gh = s @ self.rnn_wh[...]
        reset = jax.nn.sigmoid(gx[..., :r] + gh[..., :r])
        update = jax.nn.sigmoid(gx[..., r : 2 * r] + gh[..., r : 2 * r])
        cand = jnp.tanh(gx[..., 2 * r :] + reset * gh[..., 2 * r :])
        return (1.0 - update) * cand + update * s

    def step(self, state, x, h):
        state = self._gru(_carried(state), x)
        return state, x + state

    def teacher_forced(self, state, x, hidden):
        def gru(s: jax.Array, xk: jax.Array) -> tuple[jax.Array, jax.Array]:
            s = self._gru(s, xk)
            return s, s

        xs = jnp.moveaxis(x, -2, 0)  # [g, ..., r]
        _, states = jax.lax.scan(gru, _carried(state), xs)
        return x + jnp.moveaxis(states, 0, -2)


MARKOV_HEAD_TYPES: dict[str, type[MarkovHead]] = {
    "vanilla": MarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RNNMarkovHead,
    "gated_v0": GatedV0MarkovHead,
    "rnn_v0": RNNV0MarkovHead,
}


def build_markov_head(cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32) -> MarkovHead | None:
    """The sequential head of ``cfg.markov_head``, or None for a drafter without one
    (``dflash``, or ``markov_rank=0``).

    Raises:
      KeyError: an unknown head type (:class:`DrafterConfig` refuses those first).
    """
    if not cfg.markov:
        return None
    return MARKOV_HEAD_TYPES[cfg.markov_head](cfg, rngs, dtype)


def _confidence_calibration(
    drafter: BlockDrafter, sampling: SamplingArrays, conf_temperature: jax.Array | None, g: int, b: int
) -> tuple[jax.Array, jax.Array | None]:
    """``[block_size, B]`` float32 temperatures and biases (None: no bias) of each position and
    row (:func:`sample_block`)."""
    if conf_temperature is not None:
        return jnp.broadcast_to(jnp.asarray(conf_temperature, jnp.float32)[:, None], (g, b)), None
    # Per row: the greedy fit for rows at T = 0.
    row_greedy = jnp.broadcast_to(jnp.asarray(sampling.temperature) <= 0.0, (b,))[None, :]
    temps = jnp.where(
        row_greedy, drafter.confidence_temperatures(greedy=True)[:, None], drafter.confidence_temperatures()[:, None]
    )
    bias, bias_greedy = drafter.confidence_biases(), drafter.confidence_biases(greedy=True)
    if bias is None or bias_greedy is None:
        return temps, None
    return temps, jnp.where(row_greedy, bias_greedy[:, None], bias[:, None])


def _draws(ids: jax.Array | None, vocab: int, sampling: SamplingArrays):
    """``(greedy, sampled)``: one position's draw ``(logits [B, N], keys [B, 2]) -> (x [B], q [B, N])``,
    greedy when every row is at T = 0, else sampled (:func:`sample_block`'s ``lax.cond``).

    ``ids`` None: the full vocabulary (N = V, x target ids). A draft vocabulary (``ids [N]``):
    x are draft-vocabulary indices and q stays in draft space (zeros to V once per block).
    """

    def greedy(logits, kk):
        # Exactly what process_logits + sample give a greedy row (one-hot at the first argmax),
        # without the softmax and the random draw over the vocabulary; first_argmax: argmax's
        # result, several times cheaper on the CPU.
        x = first_argmax(logits)
        return x, jax.nn.one_hot(x, logits.shape[-1], dtype=jnp.float32)

    def sampled(logits, kk):
        q = process_logits(logits, sampling)
        if ids is not None:
            # Draft space, with the Gumbel noise the target's draw over the full vocabulary uses
            # at these ids (the engine's coupled draws), computed at the N ids only.
            return sample_subset(kk, q, ids, vocab), q
        return jax.vmap(sample)(kk, q).astype(jnp.int32), q

    return greedy, sampled


def sample_block(
    drafter: BlockDrafter,
    block: BlockOutput,
    anchors: jax.Array,
    keys: jax.Array,
    sampling: SamplingArrays,
    conf_temperature: jax.Array | None = None,
    step_keys: jax.Array | None = None,
) -> Draft:
    """Samples x_1..x_gamma left to right with the Markov correction.

    Args:
      drafter: a block drafter; supplies the Markov and confidence heads.
      block: backbone output, ``hidden [B, block_size, d]`` and ``logits [B, block_size, N]`` (N = V or
        the draft vocabulary's size; tokens and ``probs`` come back in target ids).
      anchors: ``[B]`` int32 x_0.
      keys: ``[B, 2]`` uint32 per-row PRNG keys for this round; step k uses
        ``fold_in(key, k)`` so a row's draft depends only on its own key.
      sampling: per-row temperature / top-k / top-p, the same processing the
        verifier applies to the target's logits.
      conf_temperature: optional ``[block_size]`` per-position confidence temperatures
        ``T_k`` (``c_k = sigmoid(z_k / T_k)``, no bias); default: the drafter's own
        calibration (``c_k = sigmoid(z_k / T_k + b_k)`` with ``drafter.calibration`` and
        ``drafter.calibration_bias``; the greedy ones for rows at temperature 0 when it has
        them), ones and no bias when it has none. Only the confidences change, never the
        tokens or ``probs``.
      step_keys: optional ``[B, block_size, 2]`` uint32 keys, one per draft position,
        used instead of ``fold_in(keys, k)`` (``keys`` is then ignored). The serving
        engine passes the keys the target samples the same positions with, which
        couples draft and target draws (same Gumbel noise).
    Returns:
      :class:`Draft`. When every row is greedy (temperature 0), a batch-level ``lax.cond``
      takes an argmax path with no softmax or random draw over the vocabulary (same tokens
      and the same one-hot q as the sampled path would give). With a draft vocabulary every
      step works on its N entries (draws by :func:`~dspark_jax.models.sampling.sample_subset`:
      the same tokens as a draw over the zero-padded V-vector with the same key) and ``probs``
      is scattered to V once, after the scan.
    """
    hidden = jnp.swapaxes(block.hidden, 0, 1)  # [block_size, B, d]
    logits = jnp.swapaxes(block.logits, 0, 1)  # [block_size, B, V]
    steps = jnp.arange(hidden.shape[0], dtype=jnp.uint32)
    temps, biases = _confidence_calibration(drafter, sampling, conf_temperature, hidden.shape[0], hidden.shape[1])
    if step_keys is None:
        step_keys = jax.vmap(lambda k: jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, k), out_axes=1)(steps)
    step_keys = jnp.swapaxes(step_keys, 0, 1)  # [block_size, B, 2]

    ids = drafter.draft_vocab_ids()  # None: the full vocabulary
    all_greedy = jnp.all(jnp.asarray(sampling.temperature) <= 0.0)
    greedy, sampled = _draws(ids, drafter.cfg.vocab_size, sampling)

    def step(carry, xs):
        prev, state = carry
        h, u, kk, t, cb = xs
        state, e, bias = drafter.markov_step(state, prev, h)
        x, q = jax.lax.cond(all_greedy, greedy, sampled, u + bias, kk)
        if ids is not None:
            x = ids[x]  # target ids; q stays [B, N] until the scan is done
        z = drafter.confidence_logit(h, e)
        c = jax.nn.sigmoid(z / t if cb is None else z / t + cb)  # t, cb: [B]
        return (x, state), (x, q, c, z)

    init = (anchors.astype(jnp.int32), drafter.markov_init(anchors.shape))
    _, (tokens, probs, conf, zs) = jax.lax.scan(step, init, (hidden, logits, step_keys, temps, biases))
    if ids is not None:
        probs = drafter.to_target_probs(probs)  # [block_size, B, V], exact zeros off the draft vocabulary
    sw = lambda a: jnp.swapaxes(a, 0, 1)
    return Draft(sw(tokens), sw(probs), sw(conf), sw(zs))
