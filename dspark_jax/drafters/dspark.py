"""The DSpark drafter: KV-injected parallel backbone + Markov head + confidence head.

Implements docs/design.md#drafter (paper Sections 4-6 and Appendix A3/A4):

1. context features: tapped target hidden states, concatenated, projected to
   width d and RMS-normalised (``context_features``);
2. backbone: N transformer layers over one block (anchor embedding followed by
   mask embeddings); in every layer keys/values projected from the context
   features are prepended to the block's own (KV injection); block slots attend
   bidirectionally to each other and to every context position before the
   anchor; RoPE puts context tokens at their absolute positions and block slot i
   at anchor position + i;
3. base logits ``U_k`` through the drafter's final norm and the *target's* LM
   head (frozen, passed in);
4. sequential (Markov) head adding a bias to ``U_k``: one
   :class:`~dspark_jax.drafters.markov.MarkovHead` of type ``cfg.markov_head`` (vanilla,
   gated, rnn and the legacy gated_v0 / rnn_v0; paper Section 6, DeepSpec's heads) built by
   :func:`~dspark_jax.drafters.markov.build_markov_head`, reading the Markov embedding
   ``W1[x_{k-1}]``;

5. confidence head: ``c_k = sigmoid(w . [h_k ; e_k] + b)``, optionally
   calibrated per position by sequential temperature scaling with a logit bias
   (``c_k = sigmoid(z_k / T_k + b_k)``, :attr:`DSparkDrafter.calibration` and
   ``calibration_bias``, fit by :mod:`dspark_jax.training.calibration`).

The module owns only its own weights. Target pieces (embedding, LM head) come
from the :class:`~dspark_jax.models.target.Target` passed to each call, unless the drafter
carries frozen copies of its own (``cfg.own_embeddings``: DeepSeek's Gemma 4 drafters). The
layer, its per-family differences as config data, is :mod:`~dspark_jax.drafters.draft_layer`.
It implements the :class:`~dspark_jax.drafters.base.BlockDrafter` protocol.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import dspark_jax.drafters.decode_head as decode_state
import dspark_jax.drafters.draft_layer as draft_layer
from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.base import BlockOutput, Draft, checked_calibration
from dspark_jax.drafters.markov import build_markov_head, sample_block
from dspark_jax.models import layers
from dspark_jax.models.head import row_reduce_head, tied_head_row_reduce
from dspark_jax.models.layer_stack import run_layers
from dspark_jax.models.layers import KVCache, apply_rope, block_attention, kv_scatter, rms_norm
from dspark_jax.models.sampling import SamplingArrays
from dspark_jax.models.target import Target


class DSparkDrafter(nnx.Module):
    """DSpark (or DFlash) drafter weights and their forward functions (module doc).

    Implements :class:`~dspark_jax.drafters.base.BlockDrafter`. ``markov_head`` is the
    sequential head (None for DFlash or ``markov_rank=0``).

    Args:
      cfg: :class:`DrafterConfig`.
      rngs: ``nnx.Rngs`` for initialisation.
      dtype: parameter and compute dtype.
    """

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        d, big_h = cfg.model_width, cfg.hidden_size
        f_in = len(cfg.taps) * cfg.hidden_size
        init = nnx.initializers.lecun_normal()

        def w(*shape, in_axis=-2, out_axis=-1):
            fn = nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
            )
            return nnx.Param(fn(rngs.params(), shape, dtype))

        self.fc = nnx.Param(init(rngs.params(), (f_in, d), dtype))
        self.ctx_norm = nnx.Param(jnp.ones((d,), dtype))
        # The mask slots' input: the target's frozen embedding row cfg.mask_token_id, or (the
        # first architecture) a learned vector. The draw happens either way, so the weights that
        # follow get the same initial values in both architectures.
        mask = 0.02 * jax.random.normal(rngs.params(), (d,), dtype)
        self.mask_embed = nnx.Param(mask) if cfg.mask_token_id < 0 else None
        self.layers = draft_layer.layer_params(cfg, w, dtype)
        self.final_norm = nnx.Param(jnp.ones((d,), dtype))
        # Width adapters around the target's frozen embedding (H) and LM head (H): only when d != H.
        self.embed_in = w(big_h, d) if d != big_h else None
        self.proj_out = w(d, big_h) if d != big_h else None
        self.markov_head = build_markov_head(cfg, rngs, dtype)
        if cfg.has_confidence:
            c_in = d + (cfg.markov_rank if cfg.markov else 0)
            self.conf_w = nnx.Param(jnp.zeros((c_in,), dtype))
            self.conf_b = nnx.Param(jnp.full((), 2.0, dtype))
        else:
            self.conf_w = None
            self.conf_b = None
        # Own frozen embedding [V, H] and LM head [H, V] (cfg.own_embeddings), else the target's.
        own = cfg.own_embeddings
        self.embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, big_h), dtype)) if own else None
        self.lm_head = w(big_h, cfg.vocab_size) if own else None
        if own and cfg.draft_vocab_size:
            raise ValueError("a drafter with its own LM head drafts over the full vocabulary (draft_vocab_size=0)")
        # Per-position confidence temperatures T_1..T_gamma (sequential temperature scaling, paper A5)
        # or None (uncalibrated). A static tuple of floats, part of the graph definition (not a
        # parameter): set by `load_drafter` from the export's `calibration`, or `set_calibration`.
        self.calibration: tuple[float, ...] | None = None
        # Temperatures fit on greedy acceptance (argmax agreement), used for rows decoding at
        # T = 0; None: greedy rows use `calibration` too.
        self.calibration_greedy: tuple[float, ...] | None = None
        # Per-position logit biases b_k beside each set of temperatures (c_k = sigmoid(z_k / T_k + b_k));
        # None: zero (exports that store temperatures only). Static like the temperatures.
        self.calibration_bias: tuple[float, ...] | None = None
        self.calibration_greedy_bias: tuple[float, ...] | None = None
        # Draft vocabulary (cfg.draft_vocab_size > 0): the N target ids the drafter drafts over, ascending.
        # Static like `calibration` (set by `load_drafter`, or by the trainer with `set_draft_vocab`).
        self.draft_vocab: tuple[int, ...] | None = None
        # Decode-time state (prepare_decoding; variables, not parameters): a draft vocabulary's
        # [N, H] LM-head rows and the static identity of their target; on the CPU, per-layer copies.
        self.decode_head: decode_state.DecodeHead | None = nnx.data(None)
        self.decode_head_key: tuple | None = None
        self.decode_layers: nnx.List | None = nnx.data(None)

    # -- draft vocabulary ---------------------------------------------------------

    def set_draft_vocab(self, ids) -> None:
        """Installs the draft vocabulary (docs/design.md#draft-vocabulary).

        Args:
          ids: ``draft_vocab_size`` distinct target token ids (any order; stored ascending,
            so ties between equal logits break towards the lower target id exactly as
            :func:`~dspark_jax.models.sampling.process_logits` does on the full vocabulary).
        Raises:
          ValueError: the drafter has no draft vocabulary, wrong count, duplicates or ids
            outside ``[0, V)``.
        """
        n, v = self.cfg.draft_vocab_size, self.cfg.vocab_size
        if not n:
            raise ValueError("this drafter drafts over the full vocabulary (draft_vocab_size=0)")
        ids = tuple(sorted(int(i) for i in ids))
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError(
                f"draft vocabulary needs {n} distinct token ids, got {len(ids)} ({len(set(ids))} distinct)"
            )
        if ids[0] < 0 or ids[-1] >= v:
            raise ValueError(f"draft vocabulary ids must lie in [0, {v}), got {ids[0]}..{ids[-1]}")
        if ids != self.draft_vocab:
            self.release_decoding()  # rows of another vocabulary
        self.draft_vocab = ids

    def prepare_decoding(self, target: Target) -> None:
        """Installs the decode-time state for ``target`` (:mod:`dspark_jax.drafters.decode_head`): the
        draft vocabulary's ``[N, H]`` LM-head rows, gathered once here instead of in every drafting
        round (none without a draft vocabulary or a target weights fingerprint: the rows are then
        gathered per call), and on the CPU each backbone layer's weights in buffers of their own.
        Idempotent; replaces a head of another target and copies of replaced weights. Decoding entry
        points call it (through :func:`~dspark_jax.drafters.base.prepare_drafter`); outside ``jit``.

        Raises:
          ValueError: ``draft_vocab_size > 0`` but no draft vocabulary installed.
        """
        decode_state.install_decode_state(self, target)

    def release_decoding(self) -> None:
        """Drops the decode-time state of :meth:`prepare_decoding` (base logits gather again)."""
        decode_state.release_decode_state(self)

    def draft_vocab_ids(self) -> jax.Array | None:
        """``[N]`` int32 target ids of the draft vocabulary (ascending), or None (full vocabulary).

        Raises:
          ValueError: ``draft_vocab_size > 0`` but no vocabulary was installed.
        """
        if not self.cfg.draft_vocab_size:
            return None
        if self.draft_vocab is None:
            raise ValueError(
                f"drafter has draft_vocab_size={self.cfg.draft_vocab_size} but no draft "
                "vocabulary installed (load it with load_drafter or call set_draft_vocab)"
            )
        return jnp.asarray(self.draft_vocab, jnp.int32)

    def draft_index(self, tokens: jax.Array) -> jax.Array:
        """``[...]`` target ids -> ``[...]`` int32 draft-vocabulary indices (N for ids outside it;
        the identity without a draft vocabulary)."""
        ids = self.draft_vocab_ids()
        if ids is None:
            return tokens.astype(jnp.int32)
        n = self.cfg.draft_vocab_size
        table = jnp.full((self.cfg.vocab_size,), n, jnp.int32).at[ids].set(jnp.arange(n, dtype=jnp.int32))
        return table[tokens]

    def to_target_ids(self, draft_tokens: jax.Array) -> jax.Array:
        """``[...]`` draft-vocabulary indices -> target token ids."""
        ids = self.draft_vocab_ids()
        return draft_tokens.astype(jnp.int32) if ids is None else ids[draft_tokens]

    def to_target_probs(self, q: jax.Array) -> jax.Array:
        """``[..., N]`` draft-space probabilities -> ``[..., V]`` with exact zeros off the draft
        vocabulary (the q the verifier sees; the identity without a draft vocabulary)."""
        ids = self.draft_vocab_ids()
        if ids is None:
            return q
        return jnp.zeros(q.shape[:-1] + (self.cfg.vocab_size,), q.dtype).at[..., ids].set(q)

    def to_target_logits(self, logits: jax.Array) -> jax.Array:
        """``[..., N]`` draft-space logits -> ``[..., V]`` with ``-inf`` off the draft vocabulary."""
        ids = self.draft_vocab_ids()
        if ids is None:
            return logits
        return jnp.full(logits.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, logits.dtype).at[..., ids].set(logits)

    # -- context (KV injection) -------------------------------------------------

    def context_features(self, features: jax.Array) -> jax.Array:
        """``[B, T, n_taps * H]`` tapped target states -> ``[B, T, d]`` context vectors."""
        x = features.astype(self.dtype) @ self.fc[...]
        return rms_norm(x, self.ctx_norm[...], self.cfg.rms_eps)

    def context_kv(self, ctx: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-layer injected keys/values of context vectors.

        Args:
          ctx: ``[B, T, d]`` from :meth:`context_features`.
          positions: ``[B, T]`` int32 absolute positions of the context tokens.
        Returns:
          ``(k, v)``, each ``[N, B, T, n_kv_heads, head_dim]``; keys carry RoPE.
        """
        cfg, layers = self.cfg, decode_state.decode_layer_params(self)
        params = {k: v[...] for k, v in self.layers.items()}
        return draft_layer.context_kv(
            cfg, params, ctx, lambda k: apply_rope(k, positions, cfg.rope_theta, cfg.rope_scaling), layers
        )

    def init_cache(self, batch: int, length: int) -> KVCache:
        """Empty per-layer context K/V cache ``[N, B, length, kvh, hd]``."""
        c = self.cfg
        return KVCache.zeros(c.num_layers, batch, length, c.num_kv_heads, c.head_dim, self.dtype)

    # -- backbone -----------------------------------------------------------------

    def backbone(self, x, positions, ctx_k, ctx_v, ctx_mask, *, remat: bool = False, ctx_end=None) -> jax.Array:
        """N layers over draft blocks with injected context keys/values.

        Args:
          x: ``[B, A, S, d]`` slot inputs of A blocks (anchor / mask embeddings).
          positions: ``[B, A, S]`` int32 RoPE positions of the slots.
          ctx_k, ctx_v: ``[N, B, C, kvh, hd]`` injected context keys/values.
          ctx_mask: ``[B, A, S, C]`` bool, context entries each slot sees, or None with ``ctx_end``.
            Slots of one block always see each other (bidirectional).
          remat: store only each layer's input and recompute the rest in the backward pass
            (the trainer's ``remat`` option).
          ctx_end: instead of ``ctx_mask`` (decode time), ``[B, A]`` int32: block ``a`` sees the context
            slots ``< ctx_end[b, a]``, live blocks only (:func:`~dspark_jax.models.layers.block_attention_cached`).
        Returns:
          ``[B, A, S, d]`` final-normed hidden states.
        """
        cfg = self.cfg
        b, a, s, d = x.shape
        flat_pos = positions.reshape(b, a * s)

        def rope(y):
            n = y.shape[-2]
            return apply_rope(y.reshape(b, a * s, n, cfg.head_dim), flat_pos, cfg.rope_theta, cfg.rope_scaling).reshape(
                y.shape
            )

        def layer(carry, xs):
            # training scans each layer's injected context beside its weights; decoding reads the caches in place
            (h, li), (p, (ck, cv)) = carry, (xs if ctx_end is None else (xs, (ctx_k, ctx_v)))

            def attend(q, k, v, scale):
                if ctx_end is None:
                    return block_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), ctx_mask, k, v, scale)
                # the caches are read in place, not mapped as scan xs
                return layers.block_attention_cached(q, ctx_k, ctx_v, li, ctx_end, k, v, scale)

            return (draft_layer.layer(cfg, p, h, rope, attend), li + 1), None

        # decode time beside a per-layer target: the per-layer copies, no layer copied out of the stacks
        params = decode_state.decode_layer_params(self) if ctx_end is not None else None
        params = {k: v[...] for k, v in self.layers.items()} if params is None else params
        body = jax.checkpoint(layer, prevent_cse=False) if remat else layer
        extra = (ctx_k, ctx_v) if ctx_end is None else None
        (h, _), _ = run_layers(body, (x.astype(self.dtype), jnp.int32(0)), params, extra)
        return rms_norm(h, self.final_norm[...], cfg.rms_eps)

    def block_inputs(self, target: Target, anchors: jax.Array) -> jax.Array:
        """``[...]`` anchor ids -> ``[..., num_block_positions, d]``: anchor embedding then mask embeddings.

        The mask slots' input is the target's embedding row ``cfg.mask_token_id`` (or the
        learned ``mask_embed`` when it is -1). Target rows (width H) are projected to d when
        ``cfg.width`` differs. With ``cfg.own_embeddings`` the rows are the drafter's own, scaled.
        """
        a = self._embed(target, anchors).astype(self.dtype)[..., None, :]
        if self.mask_embed is not None:
            m = self.mask_embed[...]
        else:  # the frozen row of cfg.mask_token_id, through the same width adapter
            m = jax.lax.stop_gradient(self._embed(target, jnp.asarray(self.cfg.mask_token_id, jnp.int32)))
            m = m.astype(self.dtype)
            if self.embed_in is not None:
                m = m @ self.embed_in[...]
        if self.embed_in is not None:
            a = a @ self.embed_in[...]
        m = jnp.broadcast_to(m, anchors.shape + (self.cfg.num_block_positions - 1, a.shape[-1]))
        return jnp.concatenate([a, m], axis=-2)

    def _embed(self, target: Target, ids: jax.Array) -> jax.Array:
        """``[...]`` ids -> ``[..., H]``: the target's embedding rows, or the drafter's own frozen rows
        times ``cfg.embed_scale`` cast to their dtype (``cfg.own_embeddings``)."""
        if self.embed is None:
            return target.embed_tokens(ids)
        rows = jax.lax.stop_gradient(self.embed[...])[ids]
        return rows * jnp.asarray(self.cfg.embed_scale, rows.dtype)

    def predicted_slots(self, h: jax.Array) -> jax.Array:
        """Selects the block_size slots that predict draft tokens 1..block_size (axis -2)."""
        g = self.cfg.block_size
        return h[..., :g, :] if self.cfg.variant == "dspark" else h[..., 1 : g + 1, :]

    def base_logits(self, target: Target, h: jax.Array) -> jax.Array:
        """``[..., d]`` -> ``[..., N]`` float32 via the target's frozen LM head (N = V, or the draft
        vocabulary's size: those columns of the head only), soft-capped as the target's logits are
        (:meth:`~dspark_jax.models.target.Target.cap_logits`, Gemma's final soft-cap); or via the
        drafter's own head, soft-capped by ``cfg.final_logit_softcap`` (``cfg.own_embeddings``).

        A drafter narrower or wider than the target (``cfg.width``) projects ``d -> H`` first. With a draft
        vocabulary the rows come from the head :meth:`prepare_decoding` installed (bit-identical to gathering them).

        Raises:
          DSparkInputError: the installed head belongs to another target.
        """
        if self.proj_out is not None:
            h = h @ self.proj_out[...]
        if self.lm_head is not None:  # the drafter's own frozen head, soft-capped (cfg.final_logit_softcap)
            w = jax.lax.stop_gradient(self.lm_head[...]).astype(h.dtype)
            return layers.soft_cap(jnp.dot(h, w, preferred_element_type=jnp.float32), self.cfg.final_logit_softcap)
        ids = self.draft_vocab_ids()
        if ids is not None:  # only the draft vocabulary's rows of the head: [N, H]
            rows = r if (r := decode_state.decode_head_rows(self, target)) is not None else target.lm_head_rows(ids)
        elif target.lm_head is None:
            rows = target.embed[...]
        else:
            w = jax.lax.stop_gradient(target.lm_head_weight())
            return target.cap_logits(jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32))
        rows = jax.lax.stop_gradient(rows).astype(h.dtype)
        if row_reduce_head(h):  # a drafting round's few rows on the CPU: each head row streamed once
            return target.cap_logits(tied_head_row_reduce(h, rows))
        return target.cap_logits(jnp.einsum("...h,nh->...n", h, rows, preferred_element_type=jnp.float32))

    # -- heads ---------------------------------------------------------------------

    @property
    def markov_w1(self) -> nnx.Param | None:
        """The Markov head's ``W1`` ``[cfg.markov_w1_size, r]`` (``markov_head.w1``; None without a Markov head)."""
        return None if self.markov_head is None else self.markov_head.w1

    @property
    def markov_w2(self) -> nnx.Param | None:
        """The Markov head's ``W2`` ``[r, N]`` (``markov_head.w2``; None without a Markov head)."""
        return None if self.markov_head is None else self.markov_head.w2

    def markov_embedding(self, prev: jax.Array) -> jax.Array | None:
        """``[...]`` previous-token ids -> ``[..., r]`` Markov embeddings ``W1[x]`` (None without a head).

        The table lookup shared by every head type; the embedding ``e_k`` the
        heads actually use comes from :meth:`markov_step` / :meth:`teacher_forced_heads`
        (identical to this for ``markov_head="vanilla"``).
        """
        if self.markov_head is None:
            return None
        return self.markov_head.embedding(self.markov_index(prev))

    def markov_index(self, prev: jax.Array) -> jax.Array:
        """``[...]`` target ids -> ``[...]`` int32 rows of ``W1``: the ids themselves
        (``cfg.markov_w1_size == V``), else draft-vocabulary indices (N for ids outside it)."""
        if self.cfg.markov_w1_size == self.cfg.vocab_size:
            return prev.astype(jnp.int32)
        return self.draft_index(prev)

    def markov_init(self, batch_shape: tuple[int, ...]) -> jax.Array | None:
        """Sequential-head state before position 1: ``[*batch_shape, r]`` zeros (rnn heads) or None."""
        if self.markov_head is None:
            return None
        return self.markov_head.init_state(batch_shape, self.dtype)

    def markov_step(
        self, state: jax.Array | None, prev: jax.Array, h: jax.Array
    ) -> tuple[jax.Array | None, jax.Array | None, jax.Array | float]:
        """One position of the sequential head (paper Section 6; head types in
        :mod:`dspark_jax.drafters.markov`).

        Args:
          state: head state from :meth:`markov_init` or the previous step (rnn), else None.
          prev: ``[...]`` int32 previous token x_{k-1} (the anchor at k = 1).
          h: ``[..., d]`` backbone hidden state h_k (read by the gated and rnn heads).
        Returns:
          ``(state, e [..., r], bias [..., N] float32)`` with ``e`` the confidence head's Markov
          input (``W1[x_{k-1}]`` or ``e_k``, ``cfg.confidence_input``); ``(state, None, 0.0)``
          for a drafter without a Markov head.
        """
        head = self.markov_head
        if head is None:
            return state, None, 0.0
        x = head.embedding(self.markov_index(prev))
        state, e = head.step(state, x, h)
        return state, self._confidence_embedding(x, e), head.bias(e)

    def _confidence_embedding(self, x: jax.Array, e: jax.Array) -> jax.Array:
        """The Markov input of the confidence head: ``W1[x_{k-1}]`` (``confidence_input="raw"``)
        or the head's output ``e_k``."""
        return x if self.cfg.confidence_input == "raw" else e

    def teacher_forced_heads(self, hidden: jax.Array, prev: jax.Array) -> tuple[jax.Array | float, jax.Array | None]:
        """Markov bias and embeddings of whole blocks given their true previous tokens (training).

        Args:
          hidden: ``[..., block_size, d]`` backbone hidden states.
          prev: ``[..., block_size]`` int32 true previous tokens (``prev[..., 0]`` = anchor).
        Returns:
          ``(bias [..., block_size, N] float32, e [..., block_size, r])`` (``e`` as in
          :meth:`markov_step`), or ``(0.0, None)`` without a Markov head. Equals running
          :meth:`markov_step` left to right.
        """
        head = self.markov_head
        if head is None:
            return 0.0, None
        x = head.embedding(self.markov_index(prev))  # [..., g, r]
        e = head.teacher_forced(self.markov_init(prev.shape[:-1]), x, hidden)
        return head.bias(e), self._confidence_embedding(x, e)

    def confidence_logit(self, h: jax.Array, e: jax.Array | None) -> jax.Array:
        """Pre-sigmoid confidence ``w . [h ; e] + b``; ``[..., d]`` -> ``[...]`` float32.

        For DFlash (no confidence head) returns +inf, i.e. confidence 1.
        """
        if self.conf_w is None or self.conf_b is None:  # no confidence head (cfg.has_confidence)
            return jnp.full(h.shape[:-1], jnp.inf, jnp.float32)
        z = h if e is None else jnp.concatenate([h, e.astype(h.dtype)], axis=-1)
        return (jnp.dot(z, self.conf_w[...]) + self.conf_b[...]).astype(jnp.float32)

    def set_calibration(self, temperatures, greedy: bool = False, bias=None) -> None:
        """Sets (or clears, with ``None``) the per-position confidence temperatures and biases.

        Args:
          temperatures: ``block_size`` positive finite floats ``T_1..T_gamma``; confidences
            become ``sigmoid(z_k / T_k + b_k)``. Only confidence values change, never the
            draft tokens or their distributions.
          greedy: set the calibration of rows decoding at T = 0 (fit on greedy acceptance,
            argmax agreement, which differs from sampled acceptance ``1 - TV``) instead of
            the default one.
          bias: ``block_size`` finite floats ``b_1..b_gamma``, or None (all zero: temperature
            scaling alone). Cleared with the temperatures.
        Raises:
          ValueError: wrong length, non-positive/non-finite values, a bias without
            temperatures, or a drafter without a confidence head.
        """
        temps, biases = checked_calibration(self.cfg, temperatures, bias)
        if greedy:
            self.calibration_greedy, self.calibration_greedy_bias = temps, biases
        else:
            self.calibration, self.calibration_bias = temps, biases

    def confidence_temperatures(self, greedy: bool = False) -> jax.Array:
        """``[block_size]`` float32 temperatures in use (ones when uncalibrated); ``greedy``: those of
        rows at T = 0 (the greedy fit when there is one)."""
        temps = self.calibration_greedy if greedy and self.calibration_greedy is not None else self.calibration
        if temps is None:
            return jnp.ones((self.cfg.block_size,), jnp.float32)
        return jnp.asarray(temps, jnp.float32)

    def confidence_biases(self, greedy: bool = False) -> jax.Array | None:
        """``[block_size]`` float32 logit biases in use beside :meth:`confidence_temperatures`, or
        None when neither calibration has a bias (then no bias enters the program)."""
        if self.calibration_bias is None and self.calibration_greedy_bias is None:
            return None
        if greedy and self.calibration_greedy is not None:
            biases = self.calibration_greedy_bias
        else:
            biases = self.calibration_bias
        return jnp.asarray(biases if biases is not None else (0.0,) * self.cfg.block_size, jnp.float32)

    # -- decoding ------------------------------------------------------------------

    def draft_block(self, target: Target, anchors: jax.Array, anchor_pos: jax.Array, cache: KVCache) -> BlockOutput:
        """Backbone pass for one drafting round per row (decode time).

        Args:
          target: the frozen target (embedding and LM head).
          anchors: ``[B]`` int32 last confirmed token.
          anchor_pos: ``[B]`` int32 its position P; context = cache positions < P.
          cache: context K/V ``[N, B, S, kvh, hd]`` filled by :meth:`extend_cache`.
        Returns:
          :class:`BlockOutput` with ``[B, block_size, d]`` and ``[B, block_size, N]``.
        """
        s = self.cfg.num_block_positions
        x = self.block_inputs(target, anchors)[:, None]  # [B, 1, S, d]
        pos = (anchor_pos[:, None] + jnp.arange(s, dtype=jnp.int32))[:, None]  # [B, 1, S]
        h = self.predicted_slots(self.backbone(x, pos, cache.k, cache.v, None, ctx_end=anchor_pos[:, None])[:, 0])
        return BlockOutput(h, self.base_logits(target, h))

    def extend_cache(
        self,
        cache: KVCache,
        features: jax.Array,
        positions: jax.Array,
        *,
        target: Target | None = None,
        tokens: jax.Array | None = None,
    ) -> KVCache:
        """Projects new target features and writes their K/V at ``positions``.

        Args:
          cache: ``[N, B, S, kvh, hd]``.
          features: ``[B, T, n_taps * H]`` from a target prefill/verify pass.
          positions: ``[B, T]`` int32; out-of-range positions are dropped.
          target / tokens: unused here (KV injection reads features only); part of the
            :class:`~dspark_jax.drafters.base.Drafter` protocol (the eagle3 drafter needs them).
        """
        k, v = self.context_kv(self.context_features(features), positions)
        n, b = cache.k.shape[:2]
        wpos = jnp.where(positions < 0, cache.length, positions)  # out of range: dropped writes
        index = (jnp.arange(n)[:, None, None], jnp.arange(b)[None, :, None], wpos[None])
        return KVCache(kv_scatter(cache.k, index, k, flat=True), kv_scatter(cache.v, index, v, flat=True))

    def write_context(
        self,
        cache: KVCache,
        features: jax.Array,
        rows: jax.Array,
        positions: jax.Array,
        *,
        target: Target | None = None,
        tokens: jax.Array | None = None,
    ) -> KVCache:
        """:meth:`extend_cache` for packed tokens of any rows (the serving engine's layout).

        Args:
          cache: ``[N, R, S, kvh, hd]``.
          features: ``[K, n_taps * H]`` tapped target states of K tokens.
          rows / positions: ``[K]`` int32 cache row and absolute position of each token;
            ``positions < 0`` marks padding (nothing written).
          target / tokens: unused here (as in :meth:`extend_cache`).
        """
        ck, cv = self.context_kv(self.context_features(features[None]), jnp.maximum(positions, 0)[None])
        wpos = jnp.where(positions >= 0, positions, cache.length)  # out of range: dropped writes
        index = (jnp.arange(cache.k.shape[0])[:, None], rows[None], wpos[None])
        return KVCache(kv_scatter(cache.k, index, ck[:, 0], flat=True), kv_scatter(cache.v, index, cv[:, 0], flat=True))

    def draft(
        self,
        target: Target,
        anchors: jax.Array,
        anchor_pos: jax.Array,
        cache: KVCache,
        keys: jax.Array,
        sampling: SamplingArrays,
        step_keys: jax.Array | None = None,
    ) -> Draft:
        """One drafting round per row: the backbone pass (:meth:`draft_block`) then the
        sequential sampler (:func:`~dspark_jax.drafters.markov.sample_block`, which documents
        ``keys`` / ``step_keys``).

        Returns:
          :class:`~dspark_jax.drafters.base.Draft` with ``tokens [B, block_size]`` and ``probs [B, block_size, V]``.
        """
        block = self.draft_block(target, anchors, anchor_pos, cache)
        return sample_block(self, block, anchors, keys, sampling, step_keys=step_keys)

    # -- training ------------------------------------------------------------------

    def train_blocks(
        self, target: Target, features: jax.Array, tokens: jax.Array, anchors: jax.Array, *, remat: bool = False
    ) -> BlockOutput:
        """Backbone over many anchor blocks of each sequence in one pass.

        Block-sparse attention: block j sees context positions < anchor_j and its
        own slots (docs/design.md#training).

        Args:
          features: ``[B, L, n_taps * H]`` tapped target states of the sequence.
          tokens: ``[B, L]`` int32 sequence.
          anchors: ``[B, A]`` int32 anchor positions (0 <= a < L).
          remat: rematerialise each backbone layer in the backward pass (:meth:`backbone`).
        Returns:
          :class:`BlockOutput` with ``[B, A, block_size, d]`` and ``[B, A, block_size, N]``.
        """
        b, l = tokens.shape
        s = self.cfg.num_block_positions
        ctx = self.context_features(features)
        ctx_pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        ck, cv = self.context_kv(ctx, ctx_pos)
        anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
        x = self.block_inputs(target, anchor_tok)  # [B, A, S, d]
        pos = anchors[:, :, None] + jnp.arange(s, dtype=jnp.int32)  # [B, A, S]
        ctx_mask = ctx_pos[:, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, L]
        ctx_mask = jnp.broadcast_to(ctx_mask, (b, anchors.shape[1], s, l))
        h = self.predicted_slots(self.backbone(x, pos, ck, cv, ctx_mask, remat=remat))
        return BlockOutput(h, self.base_logits(target, h))
