"""Warm starts: a drafter's backbone layers initialised from the target's own layers.

A DSpark drafter's layers have a target layer's shapes whenever the drafter is as wide as its
target (``drafter_width`` and ``drafter_intermediate_size`` at 0, the default): the same
attention projections, norms and SwiGLU MLP (:meth:`~dspark_jax.config.DrafterConfig.for_target`).
Its output goes through the target's frozen LM head, so the natural source is the target's *last*
layers, whose residual updates are already written in the basis that head reads
(``init_from_target_layers=-2,-1`` for a two-layer drafter); the drafter's final norm is then the
target's as well. Norms the target lacks (the q/k norms of the interop architecture over a Llama
target) keep their initial weight 1. Everything else (the context projection ``fc``, the Markov and confidence
heads, width adapters) keeps its random initialisation. The DFlash drafter has the same layers;
Eagle3's first layer reads twice the width and has no target counterpart.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.errors import DSparkInputError


def check_init_from_target_layers(drafter, target, layers: Sequence[int]) -> list[int]:
    """The target layer indices (non-negative) a warm start copies; reads shapes only, so
    ``drafter`` may be abstract (``nnx.eval_shape``) and a run refuses a bad warm start before it
    generates any data. Arguments and errors as :func:`init_from_target_layers`."""
    mine = getattr(drafter, "layers", None)
    if mine is None or drafter.cfg.variant == "eagle3":
        raise DSparkInputError("init_from_target_layers: only DSpark and DFlash drafters have target-shaped layers")
    tc = target.cfg
    if tc.num_sparse_layers:
        raise DSparkInputError(
            "init_from_target_layers: a mixture-of-experts target's layers have no dense MLP to copy"
        )
    if tc.sandwich_norms or tc.mlp_activation != "silu" or tc.norm_offset:
        raise DSparkInputError(
            "init_from_target_layers: the target's layers (Gemma: 1 + w norms, sandwich norms, GELU MLP) "
            "compute differently from a drafter's; warm starts copy Llama/Qwen-style layers only"
        )
    n, big_l = drafter.cfg.num_layers, target.cfg.num_layers
    idx = [int(i) for i in layers]
    if len(idx) != n:
        raise DSparkInputError(f"init_from_target_layers names {len(idx)} target layers; the drafter has {n}")
    if bad := [i for i in idx if not -big_l <= i < big_l]:
        raise DSparkInputError(f"init_from_target_layers: layer(s) {bad} outside the target's {big_l} layers")
    theirs = jax.eval_shape(target.layer_weights)
    for key in _shared(drafter, target):
        want, got = tuple(mine[key].shape)[1:], tuple(theirs[key].shape)[1:]
        if got != want:
            raise DSparkInputError(
                f"init_from_target_layers: the drafter's {key} is {want} per layer, the target's {got}; a warm "
                "start needs a drafter of the target's shapes (drafter_width=0, drafter_intermediate_size=0)"
            )
    return [i % big_l for i in idx]


def _shared(drafter, target) -> list[str]:
    """Per-layer parameters both have: a Llama target has no q/k norms, which an interop drafter
    has (they keep their initial weight 1)."""
    return [k for k in drafter.layers if k in jax.eval_shape(target.layer_weights)]


def init_from_target_layers(drafter, target, layers: Sequence[int]) -> None:
    """Copies target layers ``layers`` into the drafter's backbone layers (in place), and the
    target's final norm into the drafter's.

    Args:
      drafter: a :class:`~dspark_jax.drafters.dspark.DSparkDrafter` (DSpark or DFlash) with
        ``len(layers)`` backbone layers; its per-layer parameters ``drafter.layers[key]`` are
        ``[num_layers, ...]`` float arrays of the target's per-layer shapes.
      target: the :class:`~dspark_jax.models.target.Target`; ``target.layer_weights()[key]`` is ``[L, ...]``.
      layers: target layer indices, one per drafter layer in order (Python-style: ``-1`` is the last).

    Raises:
      DSparkInputError: a drafter without backbone layers (Eagle3), a count or index that does not
        fit, or a parameter whose shape differs from the target's (a drafter wider or narrower
        than its target: ``drafter_width`` / ``drafter_intermediate_size`` set), or a
        mixture-of-experts target (its sparse layers have no dense MLP).
    """
    idx = np.asarray(check_init_from_target_layers(drafter, target, layers))
    theirs = target.layer_weights()
    for key in _shared(drafter, target):
        param = drafter.layers[key]
        param[...] = jnp.asarray(np.asarray(theirs[key])[idx], param[...].dtype)
    final = np.asarray(target.final_norm[...])
    if final.shape == tuple(drafter.final_norm[...].shape):
        drafter.final_norm[...] = jnp.asarray(final, drafter.final_norm[...].dtype)
