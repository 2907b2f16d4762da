"""The DSpark drafter: KV-injected parallel backbone + Markov head + confidence head.

Implements DESIGN.md "Drafter" (paper Sections 4-6 and Appendix A3/A4):

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
4. sequential (Markov) head adding a bias to ``U_k`` (see :mod:`dspark_jax.drafters.markov`), of
   type ``cfg.markov_head`` (paper Section 6; DeepSpec's GatedMarkovHead / RNNHead), with
   the Markov embedding ``e = W1[x_{k-1}]``:

   * ``vanilla``: ``B_k = e W2``;
   * ``gated``: ``g = sigmoid(W_g [h_k; e] + b_g)``, ``B_k = (g * e) W2``;
   * ``rnn``: ``s_0 = 0``, ``[a; c; o] = split3(W [s_{k-1}; e; h_k] + b)``,
     ``u = sigmoid(a)``, ``s_k = u * s_{k-1} + (1 - u) * tanh(c)``, ``B_k = tanh(o) W2``
     (carries the whole in-block prefix);
   * ``gated_v0`` / ``rnn_v0``: the first variants of this project (gate from ``h_k`` alone;
     a GRU state added to ``e``), kept so that their exports still load;

5. confidence head: ``c_k = sigmoid(w . [h_k ; e_k] + b)``, optionally
   calibrated per position by sequential temperature scaling
   (``c_k = sigmoid(z_k / T_k)``, :attr:`Drafter.calibration`, fit by
   :mod:`dspark_jax.training.calibration`).

The module owns only its own weights. Target pieces (embedding, LM head) come
from the :class:`~dspark_jax.models.target.Target` passed to each call.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models.layers import KVCache, apply_rope, block_attention, cache_write, rms_norm, swiglu
from dspark_jax.models.target import Target


class BlockOutput(NamedTuple):
    """Backbone output for drafting blocks.

    Attributes:
      hidden: ``[..., gamma, d]`` final-normed hidden state per predicted position.
      logits: ``[..., gamma, N]`` float32 base logits ``U_k`` (no Markov bias) over the draft
        vocabulary: N = V, or ``cfg.draft_vocab_size`` (map with :meth:`Drafter.to_target_probs`).
    """

    hidden: jax.Array
    logits: jax.Array


class Drafter(nnx.Module):
    """DSpark (or DFlash) drafter weights and their forward functions.

    Args:
      cfg: :class:`DrafterConfig`.
      rngs: ``nnx.Rngs`` for initialisation.
      dtype: parameter and compute dtype.
    """

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        d, n, big_h = cfg.model_width, cfg.num_layers, cfg.hidden_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        f_in = len(cfg.taps) * cfg.hidden_size
        init = nnx.initializers.lecun_normal()

        def w(*shape, in_axis=-2, out_axis=-1):
            fn = nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
            )
            return nnx.Param(fn(rngs.params(), shape, dtype))

        self.fc = nnx.Param(init(rngs.params(), (f_in, d), dtype))
        self.ctx_norm = nnx.Param(jnp.ones((d,), dtype))
        self.mask_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (d,), dtype))
        self.layers = nnx.Dict(
            attn_norm=nnx.Param(jnp.ones((n, d), dtype)),
            wq=w(n, d, qd),
            wk=w(n, d, kd),
            wv=w(n, d, kd),
            # Residual branches start near zero so the untrained block is stable.
            wo=nnx.Param(jnp.zeros((n, qd, d), dtype)),
            mlp_norm=nnx.Param(jnp.ones((n, d), dtype)),
            w_gate=w(n, d, cfg.intermediate_size),
            w_up=w(n, d, cfg.intermediate_size),
            w_down=nnx.Param(jnp.zeros((n, cfg.intermediate_size, d), dtype)),
        )
        self.final_norm = nnx.Param(jnp.ones((d,), dtype))
        # Width adapters around the target's frozen embedding (H) and LM head (H): only when d != H.
        self.embed_in = w(big_h, d) if d != big_h else None
        self.proj_out = w(d, big_h) if d != big_h else None
        w1 = w2 = gate_w = gate_b = rnn_wx = rnn_wh = rnn_b = None
        if cfg.markov:
            r = cfg.markov_rank
            # With a draft vocabulary, W1 has one row per draft token plus one shared row for
            # every previous token outside it (an anchor can be any target token).
            n_w1 = cfg.draft_size + (1 if cfg.draft_vocab_size else 0)
            w1 = nnx.Param(jax.random.normal(rngs.params(), (n_w1, r), dtype) / jnp.sqrt(r))
            # W2 = 0: the Markov correction starts as exactly zero (pure DFlash).
            w2 = nnx.Param(jnp.zeros((r, cfg.draft_size), dtype))
            if cfg.markov_head in ("gated", "gated_v0"):
                gate_in = d + r if cfg.markov_head == "gated" else d
                gate_w = nnx.Param(jnp.zeros((gate_in, r), dtype))
                # Gate starts mostly open (sigmoid(2) ~ 0.88): close to the vanilla head.
                gate_b = nnx.Param(jnp.full((r,), 2.0, dtype))
            elif cfg.markov_head == "rnn":
                rnn_wx = w(2 * r + d, 3 * r)  # W over [s_{k-1}; e; h_k]
                rnn_b = nnx.Param(jnp.zeros((3 * r,), dtype))
            elif cfg.markov_head == "rnn_v0":
                rnn_wx, rnn_wh = w(r, 3 * r), w(r, 3 * r)
                rnn_b = nnx.Param(jnp.zeros((3 * r,), dtype))
        # Each attribute is assigned once (NNX fixes an attribute's data/static status on first set).
        self.markov_w1, self.markov_w2 = w1, w2
        self.markov_gate_w, self.markov_gate_b = gate_w, gate_b
        self.markov_rnn_wx, self.markov_rnn_wh, self.markov_rnn_b = rnn_wx, rnn_wh, rnn_b
        if cfg.has_confidence:
            c_in = d + (cfg.markov_rank if cfg.markov else 0)
            self.conf_w = nnx.Param(jnp.zeros((c_in,), dtype))
            self.conf_b = nnx.Param(jnp.full((), 2.0, dtype))
        else:
            self.conf_w = None
            self.conf_b = None
        # Per-position confidence temperatures T_1..T_gamma (sequential temperature scaling,
        # paper A5) or None (uncalibrated). A static tuple of floats, part of the graph
        # definition (not a parameter): set by `load_drafter` from the export's
        # `calibration` field, or with `set_calibration`.
        self.calibration: tuple[float, ...] | None = None
        # Temperatures fit on greedy acceptance (argmax agreement), used for rows decoding at
        # T = 0; None: greedy rows use `calibration` too.
        self.calibration_greedy: tuple[float, ...] | None = None
        # Draft vocabulary (cfg.draft_vocab_size > 0): the N target ids the drafter drafts over,
        # ascending. Static like `calibration` (set by `load_drafter` from the export, or by the
        # trainer from its data with `set_draft_vocab`).
        self.draft_vocab: tuple[int, ...] | None = None

    # -- draft vocabulary ---------------------------------------------------------

    def set_draft_vocab(self, ids) -> None:
        """Installs the draft vocabulary (DESIGN.md "Drafter" 5).

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
        self.draft_vocab = ids

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
        cfg = self.cfg
        b, t, _ = ctx.shape
        k = jnp.einsum("btd,nde->nbte", ctx, self.layers["wk"][...])
        v = jnp.einsum("btd,nde->nbte", ctx, self.layers["wv"][...])
        k = k.reshape(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
        k = jax.vmap(lambda kk: apply_rope(kk, positions, cfg.rope_theta))(k)
        return k, v

    def init_cache(self, batch: int, length: int) -> KVCache:
        """Empty per-layer context K/V cache ``[N, B, length, kvh, hd]``."""
        c = self.cfg
        return KVCache.zeros(c.num_layers, batch, length, c.num_kv_heads, c.head_dim, self.dtype)

    # -- backbone -----------------------------------------------------------------

    def backbone(self, x, positions, ctx_k, ctx_v, ctx_mask) -> jax.Array:
        """N layers over draft blocks with injected context keys/values.

        Args:
          x: ``[B, A, S, d]`` slot inputs of A blocks (anchor / mask embeddings).
          positions: ``[B, A, S]`` int32 RoPE positions of the slots.
          ctx_k, ctx_v: ``[N, B, C, kvh, hd]`` injected context keys/values.
          ctx_mask: ``[B, A, S, C]`` bool, context entries each slot sees.
            Slots of one block always see each other (bidirectional).
        Returns:
          ``[B, A, S, d]`` final-normed hidden states.
        """
        cfg = self.cfg
        params = {k: v[...] for k, v in self.layers.items()}
        b, a, s, d = x.shape
        flat_pos = positions.reshape(b, a * s)

        def heads(y, n):
            return y.reshape(b, a, s, n, cfg.head_dim)

        def rope(y):
            n = y.shape[-2]
            return apply_rope(y.reshape(b, a * s, n, cfg.head_dim), flat_pos, cfg.rope_theta).reshape(y.shape)

        def layer(h, xs):
            p, ck, cv = xs
            u = rms_norm(h, p["attn_norm"], cfg.rms_eps)
            q = rope(heads(u @ p["wq"], cfg.num_heads))
            k = rope(heads(u @ p["wk"], cfg.num_kv_heads))
            v = heads(u @ p["wv"], cfg.num_kv_heads)
            h = h + block_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), ctx_mask, k, v) @ p["wo"]
            m = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
            return h + swiglu(m, p["w_gate"], p["w_up"], p["w_down"]), None

        # `remat` (a static attribute the trainer sets on its compute copy, see
        # trainer.Trainer): store only each layer's input, recompute the rest in the backward pass.
        body = jax.checkpoint(layer, prevent_cse=False) if getattr(self, "remat", False) else layer
        h, _ = jax.lax.scan(body, x.astype(self.dtype), (params, ctx_k, ctx_v))
        return rms_norm(h, self.final_norm[...], cfg.rms_eps)

    def block_inputs(self, target: Target, anchors: jax.Array) -> jax.Array:
        """``[...]`` anchor ids -> ``[..., num_slots, d]``: anchor embedding then mask embeddings.

        The anchor's target embedding (width H) is projected to d when ``cfg.width`` differs.
        """
        a = target.embed_tokens(anchors).astype(self.dtype)[..., None, :]
        if self.embed_in is not None:
            a = a @ self.embed_in[...]
        m = jnp.broadcast_to(self.mask_embed[...], anchors.shape + (self.cfg.num_slots - 1, a.shape[-1]))
        return jnp.concatenate([a, m], axis=-2)

    def predicted_slots(self, h: jax.Array) -> jax.Array:
        """Selects the gamma slots that predict draft tokens 1..gamma (axis -2)."""
        g = self.cfg.gamma
        return h[..., :g, :] if self.cfg.variant == "dspark" else h[..., 1 : g + 1, :]

    def base_logits(self, target: Target, h: jax.Array) -> jax.Array:
        """``[..., d]`` -> ``[..., N]`` float32 via the target's frozen LM head (N = V, or the draft
        vocabulary's size: those columns of the head only).

        A drafter narrower or wider than the target (``cfg.width``) projects ``d -> H`` first.
        """
        if self.proj_out is not None:
            h = h @ self.proj_out[...]
        ids = self.draft_vocab_ids()
        if ids is not None:  # only the draft vocabulary's rows of the head: [N, H]
            rows = jax.lax.stop_gradient(target.lm_head_rows(ids)).astype(h.dtype)
            return jnp.einsum("...h,nh->...n", h, rows, preferred_element_type=jnp.float32)
        w = jax.lax.stop_gradient(target.lm_head_weight())
        return jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)

    # -- heads ---------------------------------------------------------------------

    def markov_embedding(self, prev: jax.Array) -> jax.Array | None:
        """``[...]`` previous-token ids -> ``[..., r]`` Markov embeddings ``W1[x]``.

        The table lookup shared by every head type; the embedding ``e_k`` the
        heads actually use comes from :meth:`markov_step` / :meth:`teacher_forced_heads`
        (identical to this for ``markov_head="vanilla"``).
        """
        if not self.cfg.markov:
            return None
        return jnp.take(self.markov_w1[...], self.draft_index(prev), axis=0)

    def markov_init(self, batch_shape: tuple[int, ...]) -> jax.Array | None:
        """Sequential-head state before position 1: ``[*batch_shape, r]`` zeros (rnn) or None."""
        if not (self.cfg.markov and self.cfg.markov_head in ("rnn", "rnn_v0")):
            return None
        return jnp.zeros(tuple(batch_shape) + (self.cfg.markov_rank,), self.dtype)

    def _rnn(self, s: jax.Array, e: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """DeepSpec's RNN head, one position: ``(s_{k-1}, e, h_k) -> (s_k, tanh(o))``, each ``[..., r]``."""
        r = self.cfg.markov_rank
        z = jnp.concatenate([s, e, h.astype(e.dtype)], axis=-1) @ self.markov_rnn_wx[...] + self.markov_rnn_b[...]
        u = jax.nn.sigmoid(z[..., :r])
        s = u * s + (1.0 - u) * jnp.tanh(z[..., r : 2 * r])
        return s, jnp.tanh(z[..., 2 * r :])

    def _gru(self, s: jax.Array, x: jax.Array) -> jax.Array:
        """``rnn_v0``: one GRU update ``[..., r], [..., r] -> [..., r]`` (reset gate on the recurrent term)."""
        r = self.cfg.markov_rank
        gx = x @ self.markov_rnn_wx[...] + self.markov_rnn_b[...]
        gh = s @ self.markov_rnn_wh[...]
        reset = jax.nn.sigmoid(gx[..., :r] + gh[..., :r])
        update = jax.nn.sigmoid(gx[..., r : 2 * r] + gh[..., r : 2 * r])
        cand = jnp.tanh(gx[..., 2 * r :] + reset * gh[..., 2 * r :])
        return (1.0 - update) * cand + update * s

    def markov_step(
        self, state: jax.Array | None, prev: jax.Array, h: jax.Array
    ) -> tuple[jax.Array | None, jax.Array | None, jax.Array | float]:
        """One position of the sequential head (paper Section 6; variants in the module doc).

        Args:
          state: head state from :meth:`markov_init` or the previous step (rnn), else None.
          prev: ``[...]`` int32 previous token x_{k-1} (the anchor at k = 1).
          h: ``[..., d]`` backbone hidden state h_k (read by the gated head).
        Returns:
          ``(state, e_k [..., r], bias [..., N] float32)``; ``(state, None, 0.0)``
          for a drafter without a Markov head.
        """
        if not self.cfg.markov:
            return state, None, 0.0
        x = self.markov_embedding(prev)
        kind = self.cfg.markov_head
        if kind == "gated":
            z = jnp.concatenate([h.astype(x.dtype), x], axis=-1)
            e = jax.nn.sigmoid(z @ self.markov_gate_w[...] + self.markov_gate_b[...]) * x
        elif kind == "gated_v0":
            gate = jax.nn.sigmoid(h.astype(x.dtype) @ self.markov_gate_w[...] + self.markov_gate_b[...])
            e = gate * x
        elif kind == "rnn":
            state, e = self._rnn(state, x, h)
        elif kind == "rnn_v0":
            state = self._gru(state, x)
            e = x + state
        else:
            e = x
        return state, e, self.markov_bias(e)

    def teacher_forced_heads(self, hidden: jax.Array, prev: jax.Array) -> tuple[jax.Array | float, jax.Array | None]:
        """Markov bias and embeddings of whole blocks given their true previous tokens (training).

        Args:
          hidden: ``[..., gamma, d]`` backbone hidden states.
          prev: ``[..., gamma]`` int32 true previous tokens (``prev[..., 0]`` = anchor).
        Returns:
          ``(bias [..., gamma, N] float32, e [..., gamma, r])``, or ``(0.0, None)``
          without a Markov head. Equals running :meth:`markov_step` left to right.
        """
        if not self.cfg.markov:
            return 0.0, None
        kind = self.cfg.markov_head
        if kind not in ("rnn", "rnn_v0"):
            _, e, bias = self.markov_step(None, prev, hidden)
            return bias, e
        x = self.markov_embedding(prev)  # [..., g, r]
        xs = jnp.moveaxis(x, -2, 0)  # [g, ..., r]
        init = self.markov_init(prev.shape[:-1])
        if kind == "rnn":
            hs = jnp.moveaxis(hidden, -2, 0)
            _, es = jax.lax.scan(lambda s, xh: self._rnn(s, *xh), init, (xs, hs))
            e = jnp.moveaxis(es, 0, -2)
        else:
            _, states = jax.lax.scan(lambda s, xk: (self._gru(s, xk),) * 2, init, xs)
            e = x + jnp.moveaxis(states, 0, -2)
        return self.markov_bias(e), e

    def markov_bias(self, e: jax.Array | None) -> jax.Array | float:
        """Markov embedding ``[..., r]`` -> ``[..., N]`` float32 logit correction ``e @ W2`` (draft space)."""
        if e is None:
            return 0.0
        return jnp.dot(e, self.markov_w2[...], preferred_element_type=jnp.float32)

    def confidence_logit(self, h: jax.Array, e: jax.Array | None) -> jax.Array:
        """Pre-sigmoid confidence ``w . [h ; e] + b``; ``[..., d]`` -> ``[...]`` float32.

        For DFlash (no confidence head) returns +inf, i.e. confidence 1.
        """
        if not self.cfg.has_confidence:
            return jnp.full(h.shape[:-1], jnp.inf, jnp.float32)
        z = h if e is None else jnp.concatenate([h, e.astype(h.dtype)], axis=-1)
        return (jnp.dot(z, self.conf_w[...]) + self.conf_b[...]).astype(jnp.float32)

    def set_calibration(self, temperatures, greedy: bool = False) -> None:
        """Sets (or clears, with ``None``) the per-position confidence temperatures.

        Args:
          temperatures: ``gamma`` positive finite floats ``T_1..T_gamma``; confidences
            become ``sigmoid(z_k / T_k)``. Only confidence values change, never the
            draft tokens or their distributions.
          greedy: set the temperatures of rows decoding at T = 0 (fit on greedy acceptance,
            argmax agreement, which differs from sampled acceptance ``1 - TV``) instead of
            the default ones.
        Raises:
          ValueError: wrong length, non-positive/non-finite values, or a drafter
            without a confidence head.
        """
        if temperatures is None:
            if greedy:
                self.calibration_greedy = None
            else:
                self.calibration = None
            return
        temps = tuple(float(t) for t in temperatures)
        if not self.cfg.has_confidence:
            raise ValueError("this drafter has no confidence head to calibrate")
        if len(temps) != self.cfg.gamma:
            raise ValueError(
                f"calibration needs {self.cfg.gamma} temperatures (one per block position), got {len(temps)}"
            )
        if not all(t > 0 and t < float("inf") for t in temps):
            raise ValueError(f"calibration temperatures must be positive and finite, got {list(temps)}")
        if greedy:
            self.calibration_greedy = temps
        else:
            self.calibration = temps

    def confidence_temperatures(self, greedy: bool = False) -> jax.Array:
        """``[gamma]`` float32 temperatures in use (ones when uncalibrated); ``greedy``: those of
        rows at T = 0 (the greedy fit when there is one)."""
        temps = self.calibration_greedy if greedy and self.calibration_greedy is not None else self.calibration
        if temps is None:
            return jnp.ones((self.cfg.gamma,), jnp.float32)
        return jnp.asarray(temps, jnp.float32)

    # -- decoding ------------------------------------------------------------------

    def draft_block(self, target: Target, anchors: jax.Array, anchor_pos: jax.Array, cache: KVCache) -> BlockOutput:
        """Backbone pass for one drafting round per row (decode time).

        Args:
          target: the frozen target (embedding and LM head).
          anchors: ``[B]`` int32 last confirmed token.
          anchor_pos: ``[B]`` int32 its position P; context = cache positions < P.
          cache: context K/V ``[N, B, S, kvh, hd]`` filled by :meth:`extend_cache`.
        Returns:
          :class:`BlockOutput` with ``[B, gamma, d]`` and ``[B, gamma, N]``.
        """
        s = self.cfg.num_slots
        x = self.block_inputs(target, anchors)[:, None]  # [B, 1, S, d]
        pos = (anchor_pos[:, None] + jnp.arange(s, dtype=jnp.int32))[:, None]  # [B, 1, S]
        slots = jnp.arange(cache.length, dtype=jnp.int32)
        ctx_mask = jnp.broadcast_to(slots < anchor_pos[:, None, None, None], (anchors.shape[0], 1, s, cache.length))
        h = self.predicted_slots(self.backbone(x, pos, cache.k, cache.v, ctx_mask)[:, 0])
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
          target / tokens: unused here (KV injection reads features only); accepted so
            callers can treat every drafter kind alike (the eagle3 drafter needs them).
        """
        k, v = self.context_kv(self.context_features(features), positions)
        return KVCache(
            jax.vmap(cache_write, in_axes=(0, 0, None))(cache.k, k, positions),
            jax.vmap(cache_write, in_axes=(0, 0, None))(cache.v, v, positions),
        )

    # -- training ------------------------------------------------------------------

    def train_blocks(self, target: Target, features: jax.Array, tokens: jax.Array, anchors: jax.Array) -> BlockOutput:
        """Backbone over many anchor blocks of each sequence in one pass.

        Block-sparse attention: block j sees context positions < anchor_j and its
        own slots (DESIGN.md "Training").

        Args:
          features: ``[B, L, n_taps * H]`` tapped target states of the sequence.
          tokens: ``[B, L]`` int32 sequence.
          anchors: ``[B, A]`` int32 anchor positions (0 <= a < L).
        Returns:
          :class:`BlockOutput` with ``[B, A, gamma, d]`` and ``[B, A, gamma, N]``.
        """
        b, l = tokens.shape
        s = self.cfg.num_slots
        ctx = self.context_features(features)
        ctx_pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        ck, cv = self.context_kv(ctx, ctx_pos)
        anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
        x = self.block_inputs(target, anchor_tok)  # [B, A, S, d]
        pos = anchors[:, :, None] + jnp.arange(s, dtype=jnp.int32)  # [B, A, S]
        ctx_mask = ctx_pos[:, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, L]
        ctx_mask = jnp.broadcast_to(ctx_mask, (b, anchors.shape[1], s, l))
        h = self.predicted_slots(self.backbone(x, pos, ck, cv, ctx_mask))
        return BlockOutput(h, self.base_logits(target, h))


def build_drafter(cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
    """The drafter module for ``cfg.variant``: :class:`Drafter` (dspark / dflash) or
    :class:`~dspark_jax.drafters.eagle.EagleDrafter` (eagle3)."""
    if cfg.variant == "eagle3":
        from dspark_jax.drafters.eagle import EagleDrafter  # eagle builds on this module's BlockOutput

        return EagleDrafter(cfg, rngs, dtype=dtype)
    return Drafter(cfg, rngs, dtype=dtype)
