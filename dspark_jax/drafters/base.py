"""The drafter interface: what decoding, training, serving and export need of a drafter.

Two kinds implement it (docs/design.md#drafter and docs/design.md#baselines):

* :class:`~dspark_jax.drafters.dspark.DSparkDrafter` (``variant`` ``dspark`` / ``dflash``): one
  parallel backbone pass predicts a whole block, sequential Markov and confidence heads sample
  it (paper Sections 4-6); it is a :class:`BlockDrafter`;
* :class:`~dspark_jax.drafters.eagle.EagleDrafter` (``eagle3``): the autoregressive baseline,
  one decoder-layer step per draft token; a :class:`Drafter` only.

Callers program against :class:`Drafter` (every kind) and check :class:`BlockDrafter` where
they need the block pass itself (the serving engine adds its logit bias to the block's base
logits; ``num_speculative_tokens="auto"`` reads calibrated confidences). Both protocols are
``runtime_checkable``. :func:`~dspark_jax.drafters.build.build_drafter` builds the kind of a
config; this module holds the shared output types, :func:`check_compatible` and
:func:`prepare_drafter` (the check, the drafter's decode-time state and its placement beside the
target's arrays, what decoding entry points call).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.models.sampling import SamplingArrays
from dspark_jax.models.target import Target


class BlockOutput(NamedTuple):
    """Hidden states and base logits of drafting blocks.

    Attributes:
      hidden: ``[..., block_size, d]`` final-normed hidden state per predicted position.
      logits: ``[..., block_size, N]`` float32 base logits ``U_k`` (no Markov bias) over the draft
        vocabulary: N = V, or ``cfg.draft_vocab_size`` (map with
        :meth:`BlockDrafter.to_target_probs`).
    """

    hidden: jax.Array
    logits: jax.Array


class Draft(NamedTuple):
    """One drafted block per row.

    Attributes:
      tokens: ``[B, block_size]`` int32 draft tokens x_1..x_gamma (target ids).
      probs: ``[B, block_size, V]`` float32, the exact distribution q_k each draft token
        was sampled from (handed to the verifier unchanged), in target ids: exact zeros
        off a draft vocabulary.
      confidence: ``[B, block_size]`` float32 c_k in (0, 1], the predicted probability
        that position k is accepted given that verification reached it
        (calibrated: ``sigmoid(z_k / T_k + b_k)``; 1 for a drafter without a confidence head).
      confidence_logit: ``[B, block_size]`` float32 raw confidence logits z_k (before
        calibration; ``+inf`` for a drafter without a confidence head).
    """

    tokens: jax.Array
    probs: jax.Array
    confidence: jax.Array
    confidence_logit: jax.Array


@runtime_checkable
class Drafter(Protocol):
    """Any drafter kind: an ``nnx.Module`` owning only its own weights (the target's embedding
    and LM head come from the :class:`~dspark_jax.models.target.Target` passed to each call).

    Attributes:
      cfg: its :class:`~dspark_jax.config.DrafterConfig` (``variant``, block size ``block_size``,
        tapped target layers, the target it was built for).
      dtype: parameter and compute dtype.
      calibration / calibration_greedy: per-position confidence temperatures (sampled rows /
        rows at T = 0) recorded in exports; None without calibration or confidence head.
      calibration_bias / calibration_greedy_bias: the per-position logit biases beside them;
        None: zero.
      draft_vocab: the draft vocabulary's target ids recorded in exports, or None (full V).
    """

    cfg: DrafterConfig
    dtype: Any
    calibration: tuple[float, ...] | None
    calibration_greedy: tuple[float, ...] | None
    calibration_bias: tuple[float, ...] | None
    calibration_greedy_bias: tuple[float, ...] | None
    draft_vocab: tuple[int, ...] | None

    def init_cache(self, batch: int, length: int) -> Any:
        """Empty context cache (a pytree of arrays) of ``batch`` rows and ``length`` positions."""
        ...

    def extend_cache(
        self,
        cache: Any,
        features: jax.Array,
        positions: jax.Array,
        *,
        target: Target | None = None,
        tokens: jax.Array | None = None,
    ) -> Any:
        """Writes verified context: tapped target ``features [B, T, n_taps * H]`` of the tokens
        ``tokens [B, T]`` at ``positions [B, T]`` (out of range or ``-1``: dropped)."""
        ...

    def write_context(
        self,
        cache: Any,
        features: jax.Array,
        rows: jax.Array,
        positions: jax.Array,
        *,
        target: Target | None = None,
        tokens: jax.Array | None = None,
    ) -> Any:
        """:meth:`extend_cache` for ``K`` packed tokens of any rows: ``features [K, n_taps * H]``,
        ``rows [K]``, ``positions [K]`` (``< 0``: nothing written), ``tokens [K]``."""
        ...

    def draft(
        self,
        target: Target,
        anchors: jax.Array,
        anchor_pos: jax.Array,
        cache: Any,
        keys: jax.Array,
        sampling: SamplingArrays,
        step_keys: jax.Array | None = None,
    ) -> Draft:
        """One drafting round per row: ``anchors [B]`` (last confirmed tokens) at ``anchor_pos [B]``
        (context = cache positions before it), per-row ``keys [B, 2]`` (or per-position
        ``step_keys [B, block_size, 2]``) -> :class:`Draft` of ``block_size`` tokens."""
        ...

    def train_blocks(
        self, target: Target, features: jax.Array, tokens: jax.Array, anchors: jax.Array, *, remat: bool = False
    ) -> BlockOutput:
        """Training blocks of ``anchors [B, A]`` of sequences ``tokens [B, L]`` with their tapped
        features ``[B, L, n_taps * H]`` -> :class:`BlockOutput` ``[B, A, block_size, ...]``;
        ``remat``: recompute activations in the backward pass instead of storing them."""
        ...

    def base_logits(self, target: Target, h: jax.Array) -> jax.Array:
        """``[..., d]`` hidden states -> ``[..., N]`` float32 logits via the target's frozen LM head."""
        ...

    def set_calibration(self, temperatures: Any, greedy: bool = False, bias: Any = None) -> None:
        """Installs (or clears, with None) confidence temperatures and logit biases (None: zero).

        Raises:
          ValueError: a calibration for a drafter without a confidence head, or bad values.
        """
        ...

    def set_draft_vocab(self, ids: Any) -> None:
        """Installs the draft vocabulary's target ids.

        Raises:
          ValueError: a drafter that drafts over the full vocabulary, or bad ids.
        """
        ...

    def prepare_decoding(self, target: Target) -> None:
        """Installs decode-time state derived from ``target`` and the drafter's weights (the draft
        vocabulary's LM-head rows, per-layer weight copies on the CPU:
        :mod:`dspark_jax.drafters.decode_head`; a no-op for a drafter without such state), once per
        (target, drafter): idempotent, replaced for another target or new weights. Outside ``jit``."""
        ...

    def release_decoding(self) -> None:
        """Drops the state of :meth:`prepare_decoding` (never trained or exported in any case)."""
        ...


@runtime_checkable
class BlockDrafter(Drafter, Protocol):
    """A drafter that predicts a whole block in one backbone pass (:meth:`draft_block`) and
    samples it with sequential heads (:func:`dspark_jax.drafters.markov.sample_block`): the
    pieces callers that change the block's logits or read its confidences use."""

    def draft_block(self, target: Target, anchors: jax.Array, anchor_pos: jax.Array, cache: Any) -> BlockOutput:
        """Backbone pass of one block per row: :class:`BlockOutput` ``[B, block_size, ...]``."""
        ...

    def markov_init(self, batch_shape: tuple[int, ...]) -> jax.Array | None:
        """Sequential-head state before position 1 (None for a stateless head)."""
        ...

    def markov_step(
        self, state: jax.Array | None, prev: jax.Array, h: jax.Array
    ) -> tuple[jax.Array | None, jax.Array | None, jax.Array | float]:
        """One position of the sequential head: ``(state, e_k, bias [..., N])``."""
        ...

    def teacher_forced_heads(self, hidden: jax.Array, prev: jax.Array) -> tuple[jax.Array | float, jax.Array | None]:
        """Sequential-head bias and embeddings of whole blocks given the true previous tokens."""
        ...

    def confidence_logit(self, h: jax.Array, e: jax.Array | None) -> jax.Array:
        """Pre-sigmoid confidence ``[...]`` float32 (``+inf`` without a confidence head)."""
        ...

    def confidence_temperatures(self, greedy: bool = False) -> jax.Array:
        """``[block_size]`` float32 confidence temperatures in use."""
        ...

    def confidence_biases(self, greedy: bool = False) -> jax.Array | None:
        """``[block_size]`` float32 confidence logit biases in use, or None (no bias at all)."""
        ...

    def draft_vocab_ids(self) -> jax.Array | None:
        """``[N]`` int32 target ids of the draft vocabulary, or None (full vocabulary)."""
        ...

    def draft_index(self, tokens: jax.Array) -> jax.Array:
        """Target ids -> draft-vocabulary indices (N outside it)."""
        ...

    def to_target_ids(self, draft_tokens: jax.Array) -> jax.Array:
        """Draft-vocabulary indices -> target ids."""
        ...

    def to_target_probs(self, q: jax.Array) -> jax.Array:
        """``[..., N]`` draft-space probabilities -> ``[..., V]`` (zeros off the draft vocabulary)."""
        ...

    def to_target_logits(self, logits: jax.Array) -> jax.Array:
        """``[..., N]`` draft-space logits -> ``[..., V]`` (``-inf`` off the draft vocabulary)."""
        ...


def prepare_drafter(target: Target, drafter: Drafter) -> None:
    """What every decoding entry point does with a (target, drafter) pair before decoding:
    :func:`check_compatible`, then :func:`place_like_target` (a target on a device mesh takes its
    drafter along), then ``drafter.prepare_decoding(target)`` (decode-time state: the restricted LM
    head of a draft vocabulary, computed once instead of in every drafting round; per-layer copies
    of the placed weights on the CPU), then :func:`place_like_target` again for that state. Idempotent.

    Raises:
      DSparkInputError: as :func:`check_compatible`.
    """
    check_compatible(target, drafter)
    place_like_target(target, drafter)
    drafter.prepare_decoding(target)
    place_like_target(target, drafter)


def place_like_target(target: Target, drafter: Drafter) -> bool:
    """Puts every array of ``drafter`` (parameters and decode-time state) on the target's devices,
    so that one jitted program takes both (docs/design.md#device-mesh).

    A target whose weights carry a ``NamedSharding`` (``Target(mesh=...)``,
    ``load_target(spec, mesh=...)``): the drafter goes on the same mesh, laid out by the sharding
    rules (:func:`~dspark_jax.models.sharding.tree_shardings`: its heads, MLP and feature
    projection over ``model`` where the mesh divides them, everything else replicated), as the
    serving engine lays it out. A target on one device: the drafter on that device when it is not
    already there.
    The layout is a function of the target's mesh and the drafter's shapes only, so a second call
    moves nothing. Call outside ``jit``.

    Returns:
      True when arrays were moved, False when the drafter already lay where it belongs.
    """
    state = nnx.state(drafter)
    leaves = jax.tree.leaves(state)
    ref = target.embed[...]
    sharding = getattr(ref, "sharding", None)
    if not leaves or sharding is None:
        return False
    mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None
    if isinstance(mesh, jax.sharding.Mesh):
        want = shd.tree_shardings(state, mesh, drafter.cfg)
        wanted = jax.tree.leaves(want)
        if all(getattr(x, "sharding", None) == s for x, s in zip(leaves, wanted)):
            return False
    else:
        devices = sharding.device_set
        if len(devices) != 1:  # laid out by hand (no mesh to read rules from): left to the caller
            return False
        if all(getattr(x, "sharding", None) is not None and x.sharding.device_set == devices for x in leaves):
            return False
        want = jax.sharding.SingleDeviceSharding(next(iter(devices)))
    nnx.update(drafter, shd.place(state, want))
    return True


def check_compatible(target: Target, drafter: Drafter) -> None:
    """Refuses a drafter built for another target (:func:`check_compatible_config` of their
    configs and the target's weights fingerprint).

    Raises:
      DSparkInputError: vocab size, hidden size, depth/tapped layers or weights
        fingerprint differ between the drafter's recorded target and ``target``.
    """
    check_compatible_config(target.cfg, drafter.cfg, getattr(target, "fingerprint", ""))


def check_compatible_config(t: TargetConfig, d: DrafterConfig, fingerprint: str = "") -> None:
    """:func:`check_compatible` on configs alone (no weights: a dry run reads only the target's
    config and the drafter's metadata); the weights fingerprint is checked when given.

    Raises:
      DSparkInputError: as :func:`check_compatible`.
    """
    if d.vocab_size != t.vocab_size:
        raise DSparkInputError(
            f"drafter was trained for a vocabulary of {d.vocab_size} tokens but the target has {t.vocab_size}"
        )
    if d.hidden_size != t.hidden_size:
        raise DSparkInputError(f"drafter expects target hidden size {d.hidden_size} but the target has {t.hidden_size}")
    if (d.target_num_layers and d.target_num_layers != t.num_layers) or max(d.taps) >= t.num_layers:
        raise DSparkInputError(
            f"drafter taps layers {list(d.taps)} of a {d.target_num_layers}-layer target but the "
            f"target has {t.num_layers} layers"
        )
    fp = fingerprint
    if d.target_fingerprint and fp and d.target_fingerprint != fp:
        raise DSparkInputError(
            f"drafter was trained for target '{d.target_name}' (weights {d.target_fingerprint}) but "
            f"these target weights are {fp}: train a drafter for this target"
        )


def checked_calibration(
    cfg: DrafterConfig, temperatures: Any, bias: Any
) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """``(temperatures, biases)`` of :meth:`Drafter.set_calibration` as tuples of floats, checked;
    ``(None, None)`` for ``temperatures`` None; biases None where not given or all zero (the
    temperature-only program).

    Raises:
      ValueError: a bias without temperatures, wrong lengths, non-positive / non-finite
        temperatures, non-finite biases, or a drafter without a confidence head.
    """
    if temperatures is None:
        if bias is not None:
            raise ValueError("calibration biases need temperatures")
        return None, None
    temps = tuple(float(t) for t in temperatures)
    biases = None if bias is None else tuple(float(b) for b in bias)
    if not cfg.has_confidence:
        raise ValueError("this drafter has no confidence head to calibrate")
    g = cfg.block_size
    if len(temps) != g or (biases is not None and len(biases) != g):
        n = len(temps) if len(temps) != g else len(biases or ())
        raise ValueError(f"calibration needs {g} temperatures and biases (one per block position), got {n}")
    if not all(0 < t < float("inf") for t in temps):
        raise ValueError(f"calibration temperatures must be positive and finite, got {list(temps)}")
    if biases is not None and not all(abs(b) < float("inf") for b in biases):
        raise ValueError(f"calibration biases must be finite, got {list(biases)}")
    return temps, (biases if biases is not None and any(biases) else None)
