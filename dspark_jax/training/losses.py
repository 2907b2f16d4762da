"""The drafter's training loss (docs/design.md#loss; paper Section 5 and Appendix A4).

For ``A`` anchor blocks per sequence (:func:`sample_anchors`), all run in one drafter pass
(``train_blocks`` of the :class:`~dspark_jax.drafters.base.Drafter` protocol) with the
teacher-forced Markov correction (``x_{k-1}`` = the true previous token), the per-position
terms are

* ``CE``: cross-entropy of the true next token under the draft distribution ``q``;
* ``TV = 0.5 ||q - p_target||_1``: exactly one minus the acceptance probability;
* ``BCE(c_k, sg(1 - TV_k))``: the confidence head's loss, minus the label's entropy (0 at
  the optimum);

weighted by ``w_k = exp(-(k-1)/pos_decay)`` (:func:`position_weights`) and combined as
``ce_weight * CE + l1_weight * TV + conf_weight * BCE``. :func:`loss_sums` returns weighted
*sums* (never means) so that micro-batches and devices add up exactly to the global batch;
:func:`finalize_loss` divides them by the global weight.

The target side is ``p_target`` on the drafter's vocabulary only (:func:`target_draft_probs`): a
drafter with a draft vocabulary of N ids needs the target's probabilities of those N ids (its mass
outside them is ``1 - sum``). From a feature cache that also holds the target's full-vocabulary
logsumexp per position (:mod:`dspark_jax.training.feature_cache`), those are
``exp(logit_i - logsumexp)`` with the logits of the N ids alone: ``N x H`` multiply-adds per
position instead of ``V x H`` (SmolLM2: 8,192 of 49,152 ids), with the same numbers.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from dspark_jax.drafters.base import BlockDrafter, Drafter
from dspark_jax.models.target import Target

# The drafters the loss trains: every kind (block drafters, dspark / dflash, with their
# sequential and confidence heads and draft vocabulary; the eagle3 baseline without them).
TrainableDrafter = Drafter


class LossConfig(Protocol):
    """The loss settings read from a run config (:class:`~dspark_jax.training.train_config.TrainConfig`)."""

    @property
    def anchors_per_seq(self) -> int: ...
    @property
    def pos_decay(self) -> float: ...
    @property
    def ce_weight(self) -> float: ...
    @property
    def l1_weight(self) -> float: ...
    @property
    def conf_weight(self) -> float: ...


class LossTerms(NamedTuple):
    """Weighted means of the loss terms over a batch (float32 scalars unless noted)."""

    loss: jax.Array
    ce: jax.Array
    tv: jax.Array
    bce: jax.Array
    conf_err: jax.Array
    tau_est: jax.Array
    acc_by_pos: jax.Array  # [block_size] mean 1 - TV per position


def sample_anchors(key: jax.Array, lengths: jax.Array, prompt_lengths: jax.Array, num: int) -> jax.Array:
    """``[B, num]`` int32 anchors uniform in ``[prompt_len - 1, length - 2]`` (>= 0).

    Anchors start at the last prompt token so every predicted token is target-generated.
    """
    lo = jnp.maximum(prompt_lengths - 1, 0)
    hi = jnp.maximum(lengths - 2, lo)
    u = jax.random.uniform(key, (lengths.shape[0], num))
    return (lo[:, None] + jnp.floor(u * (hi - lo + 1)[:, None])).astype(jnp.int32)


def position_weights(anchors: jax.Array, lengths: jax.Array, block_size: int, pos_decay: float) -> jax.Array:
    """``[B, A, block_size]`` float32 loss weights ``exp(-(k-1)/pos_decay)``, 0 past a sequence's end."""
    k = jnp.arange(block_size, dtype=jnp.int32)
    valid = (anchors[..., None] + k + 1) < lengths[:, None, None]
    return jnp.exp(-k.astype(jnp.float32) / pos_decay) * valid


def _target_features(
    target: Target, tokens: jax.Array, taps: tuple[int, ...], cached: tuple[jax.Array, ...] | None
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """The frozen target's side of the loss: ``(features [B, L, n_taps * H], logits [B, L, V] or None,
    cached last hidden [B, L, H] or None, cached logsumexp [B, L] or None)``, all without gradient.

    Without ``cached`` the target runs over ``tokens``; with it the cached features are cast to the
    target's dtype and the logits are left to the gathered positions (see :func:`loss_sums`).

    Raises:
      ValueError: ``cached`` features do not have ``len(taps) * H`` columns or the tokens' shape.
    """
    if cached is None:
        out = target(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), taps=taps)
        assert out.features is not None  # taps are never empty for a drafter
        return jax.lax.stop_gradient(out.features), jax.lax.stop_gradient(out.logits), None, None
    c_feats, c_hidden, *rest = cached
    want = len(taps) * target.cfg.hidden_size
    if c_feats.shape[:2] != tokens.shape or c_feats.shape[-1] != want:
        raise ValueError(
            f"cached features {c_feats.shape} do not fit tokens {tokens.shape} and "
            f"{len(taps)} taps x {target.cfg.hidden_size}"
        )
    c_lse = rest[0] if rest else None
    return jax.lax.stop_gradient(c_feats.astype(target.dtype)), None, c_hidden, c_lse


def target_draft_probs(
    drafter: BlockDrafter | None,
    target: Target,
    t_logits: jax.Array | None,
    hidden: jax.Array | None,
    lse: jax.Array | None,
) -> jax.Array:
    """``p_target`` on the drafter's vocabulary ``[..., N]`` float32 at the gathered positions, without
    gradient (docs/design.md#loss): N = V without a draft vocabulary, else the target's probabilities
    of the draft vocabulary's ids (their sum is ``1 -`` the mass outside it).

    Args:
      drafter: the block drafter (its draft vocabulary), None for one over the full vocabulary (eagle3).
      t_logits: ``[..., V]`` float32 target logits (the target ran in the step), or None with ``hidden``.
      hidden: ``[..., H]`` cached last hidden states (before the final norm), or None with ``t_logits``.
      lse: ``[...]`` float32 cached logsumexp of the target's logits over all V ids at those positions,
        or None. With it and a draft vocabulary only the N ids' logits are computed (exact
        ``exp(logit - lse)``, their sum capped at 1 against rounding); otherwise the logits over V
        and their softmax, the reference path.
    Raises:
      ValueError: a drafter with ``draft_vocab_size > 0`` but no draft vocabulary installed.
    """
    ids = None if drafter is None else drafter.draft_vocab_ids()
    if t_logits is None and ids is not None and lse is not None:
        assert hidden is not None
        h = target.final_normed(hidden.astype(target.dtype))
        rows = target.lm_head_rows(ids)  # [N, H]
        logits = target.cap_logits(jnp.einsum("...h,nh->...n", h, rows, preferred_element_type=jnp.float32))
        p = jnp.exp(logits - lse.astype(jnp.float32)[..., None])
        # The cached logsumexp comes from another program's matrix product (and exp is rounded):
        # where nearly all the mass lies on the draft vocabulary its sum can come out a few 1e-6
        # over 1, TV over 1 and the confidence label below 0. The mass is at most 1, as with the
        # softmax's own normalisation: divide by the sum where it exceeds 1.
        return jax.lax.stop_gradient(p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1.0))
    if t_logits is None:
        assert hidden is not None
        t_logits = target.unembed(hidden.astype(target.dtype))
    p_t = jax.nn.softmax(t_logits, axis=-1)
    return jax.lax.stop_gradient(p_t if ids is None else jnp.take(p_t, ids, axis=-1))


def _ce_tv(
    drafter: BlockDrafter | None, logq: jax.Array, p_in: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(CE, TV)`` per position ``[B, A, block_size]`` from the draft log-probabilities ``logq [.., N]``
    (draft space) and the target's probabilities on the same N ids ``p_in [.., N]``
    (:func:`target_draft_probs`); ``drafter``: the block drafter (its draft vocabulary), None for one
    drafting over the full vocabulary (eagle3)."""
    ids = None if drafter is None else drafter.draft_vocab_ids()
    if drafter is None or ids is None:
        ce = -jnp.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]
        tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(logq) - p_in), axis=-1)
        return ce, tv
    # q is zero off the draft vocabulary, so the target's mass there counts in full
    # towards TV; a label off the vocabulary cannot be predicted and has no CE term.
    n = drafter.cfg.draft_vocab_size
    li = drafter.draft_index(labels)
    inside = li < n
    ce = jnp.where(inside, -jnp.take_along_axis(logq, jnp.minimum(li, n - 1)[..., None], axis=-1)[..., 0], 0.0)
    tv = 0.5 * (jnp.sum(jnp.abs(jnp.exp(logq) - p_in), axis=-1) + jnp.maximum(1.0 - jnp.sum(p_in, -1), 0.0))
    return ce, tv


def _confidence_terms(
    drafter: BlockDrafter | None, hidden: jax.Array, e: jax.Array | None, tv: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(BCE, |c - (1 - TV)|)`` per position of the confidence head against the label ``sg(1 - TV)``;
    zeros for drafters without a confidence head (DFlash; eagle3, passed as None)."""
    if drafter is None or not drafter.cfg.has_confidence:
        return jnp.zeros_like(tv), jnp.zeros_like(tv)
    z = drafter.confidence_logit(hidden, e)
    soft = jax.lax.stop_gradient(1.0 - tv)
    bce = optax.sigmoid_binary_cross_entropy(z, soft) - optax.sigmoid_binary_cross_entropy(
        jnp.log(soft + 1e-6) - jnp.log1p(-soft + 1e-6), soft
    )  # minus the label entropy: 0 at optimum
    conf_err = jnp.abs(jax.nn.sigmoid(z) - soft)
    return bce, conf_err


def _loss_head(
    drafter: TrainableDrafter,
    target: Target,
    hidden: jax.Array,
    base_logits: jax.Array | None,
    p_in: jax.Array,
    prev: jax.Array,
    labels: jax.Array,
    remat: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The vocabulary-sized part of the loss: ``(CE, TV, BCE, conf_err)`` per position ``[B, A, block_size]``.

    Args:
      hidden: ``[B, A, block_size, d]`` drafter hidden states; base_logits: their ``[.., N]`` float32
        base logits, or None with ``remat`` (recomputed from ``hidden`` instead of stored).
      p_in: ``[B, A, block_size, N]`` target probabilities on the drafter's vocabulary at the
        predicted positions (:func:`target_draft_probs`).
      prev / labels: ``[B, A, block_size]`` int32 true previous and next tokens (teacher forcing).
    """
    if remat:  # recompute the [.., N] base logits from the hidden states instead of storing them
        base_logits = drafter.base_logits(target, hidden)
    assert base_logits is not None
    # Sequential / confidence heads and a draft vocabulary: block drafters only (not eagle3).
    block = drafter if isinstance(drafter, BlockDrafter) else None
    bias, e = (0.0, None) if block is None else block.teacher_forced_heads(hidden, prev)
    logq = jax.nn.log_softmax(base_logits + bias, axis=-1)  # [..., N] draft space
    ce, tv = _ce_tv(block, logq, p_in, labels)
    bce, conf_err = _confidence_terms(block, hidden, e, tv)
    return ce, tv, bce, conf_err


def _weighted_sums(
    cfg: LossConfig, w: jax.Array, valid: jax.Array, ce: jax.Array, tv: jax.Array, bce: jax.Array, conf_err: jax.Array
) -> dict[str, jax.Array]:
    """The additive statistics of :func:`loss_sums` from the per-position terms ``[B, A, block_size]``."""
    ws = lambda x: jnp.sum(w * x)
    vf = valid.astype(jnp.float32)
    full = jnp.all(valid, axis=-1, keepdims=True)  # analytic tau on complete blocks only
    surv = jnp.cumprod(1.0 - tv, axis=-1)
    return {
        "objective": cfg.ce_weight * ws(ce) + cfg.l1_weight * ws(tv) + cfg.conf_weight * ws(bce),
        "w": jnp.sum(w),
        "ce": ws(ce),
        "tv": ws(tv),
        "bce": ws(bce),
        "conf_err": ws(conf_err),
        "acc_num": jnp.sum((1.0 - tv) * vf, axis=(0, 1)),
        "acc_den": jnp.sum(vf, axis=(0, 1)),
        "tau_num": jnp.sum(jnp.sum(surv, -1, keepdims=True) * full),
        "tau_den": jnp.sum(full).astype(jnp.float32),
    }


def loss_sums(
    drafter: TrainableDrafter,
    target: Target,
    tokens: jax.Array,
    lengths: jax.Array,
    anchors: jax.Array,
    cfg: LossConfig,
    remat: bool = False,
    cached: tuple[jax.Array, ...] | None = None,
) -> dict[str, jax.Array]:
    """Additive loss statistics of a (micro-)batch: weighted sums, never means.

    Summing these over micro-batches or devices and then :func:`finalize_loss`
    gives exactly the statistics of the whole batch (the denominator ``w`` is
    summed too). ``objective`` is ``sum_k w_k (ce_weight CE + l1_weight TV +
    conf_weight BCE)``; the loss is ``objective / w``.

    Args:
      tokens: ``[B, L]`` int32; lengths: ``[B]`` int32; anchors: ``[B, A]`` int32.
      remat: recompute the drafter's layers (``train_blocks(remat=True)``) and the
        vocabulary-sized loss head in the backward pass.
      cached: optional ``(tap_features [B, L, n_taps * H], last_hidden [B, L, H], target_lse [B, L])``
        of the target from a feature cache (:mod:`dspark_jax.training.feature_cache`; features any
        float dtype, cast to the target's; the float32 logsumexp of the target's logits over all V
        ids may be left out): the target forward is skipped and ``p_target`` is computed only at
        the ``B * A * block_size`` gathered positions from the last hidden state, on the draft
        vocabulary's ids only when the logsumexp is there (:func:`target_draft_probs`), else
        ``target.unembed`` over all V ids and a softmax (the same numbers, V / N times the work).
    Returns:
      dict of float32 scalars (``acc_num``/``acc_den``: ``[block_size]``).
    Raises:
      ValueError: ``cached`` features do not have the drafter's ``len(taps) * H`` columns.
    """
    block_size = drafter.cfg.block_size
    feats, t_logits, c_hidden, c_lse = _target_features(target, tokens, drafter.cfg.taps, cached)
    block = drafter.train_blocks(target, feats, tokens, anchors, remat=remat)
    k = jnp.arange(block_size, dtype=jnp.int32)
    src = anchors[..., None] + k  # position whose next token is predicted
    valid = (src + 1) < lengths[:, None, None]  # [B, A, block_size]
    src_c = jnp.minimum(src, tokens.shape[1] - 1)
    tgt_c = jnp.minimum(src + 1, tokens.shape[1] - 1)
    bidx = jnp.arange(tokens.shape[0])[:, None, None]
    prev = tokens[bidx, src_c]  # teacher forcing: x_{k-1} is the true token
    labels = tokens[bidx, tgt_c]
    w = position_weights(anchors, lengths, block_size, cfg.pos_decay)
    # Only the gathered positions: [B, A, block_size, N] instead of [B, L, V].
    p_in = target_draft_probs(
        drafter if isinstance(drafter, BlockDrafter) else None,
        target,
        None if t_logits is None else t_logits[bidx, src_c],
        None if c_hidden is None else c_hidden[bidx, src_c],
        None if c_lse is None else c_lse[bidx, src_c],
    )

    def head(hidden, base_logits, p_in):
        return _loss_head(drafter, target, hidden, base_logits, p_in, prev, labels, remat)

    if remat:
        ce, tv, bce, conf_err = jax.checkpoint(head, prevent_cse=False)(block.hidden, None, p_in)
    else:
        ce, tv, bce, conf_err = head(block.hidden, block.logits, p_in)
    return _weighted_sums(cfg, w, valid, ce, tv, bce, conf_err)


def finalize_loss(s: dict[str, jax.Array]) -> LossTerms:
    """Means of the summed statistics of :func:`loss_sums` (the weighted means over the batch)."""
    denom = jnp.maximum(s["w"], 1e-6)
    return LossTerms(
        s["objective"] / denom,
        s["ce"] / denom,
        s["tv"] / denom,
        s["bce"] / denom,
        s["conf_err"] / denom,
        1.0 + s["tau_num"] / jnp.maximum(s["tau_den"], 1.0),
        s["acc_num"] / jnp.maximum(s["acc_den"], 1.0),
    )


def drafter_loss(
    drafter: TrainableDrafter,
    target: Target,
    tokens: jax.Array,
    lengths: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: LossConfig,
) -> LossTerms:
    """DSpark training loss on a batch (docs/design.md#loss; paper Appendix A4).

    Args:
      tokens: ``[B, L]`` int32 target-generated sequences (0-padded).
      lengths / prompt_lengths: ``[B]`` int32 valid and prompt lengths [tokens].
      key: PRNG key for the anchor positions.
    Returns:
      :class:`LossTerms` (scalars float32, ``acc_by_pos [block_size]``).
    """
    anchors = sample_anchors(key, lengths, prompt_lengths, cfg.anchors_per_seq)
    return finalize_loss(loss_sums(drafter, target, tokens, lengths, anchors, cfg))
