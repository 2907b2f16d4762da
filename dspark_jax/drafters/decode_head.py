"""A drafter's decode-time state: the restricted LM head of a draft vocabulary and, on the CPU,
per-layer copies of the backbone's stacked layer weights.

docs/design.md#draft-vocabulary (draft vocabulary): a drafter that drafts over N target ids computes its
base logits with only those N rows of the target's frozen LM head. Gathering the rows inside
every jitted drafting round costs N x H reads and writes before the matmul (on a CPU more than
the matmul itself), yet they change only with the target's weights. So decoding computes them
once per (target, drafter) and the drafter carries them as a :class:`DecodeHead` variable:

* :func:`install_decode_head` (``DSparkDrafter.prepare_decoding``; decoding entry points call it through
  :func:`~dspark_jax.drafters.base.prepare_drafter`) gathers the rows and records the target's
  identity :func:`head_key` (weights fingerprint, dtype, vocabulary and hidden sizes); it is
  idempotent (nothing recomputed while the same target weights are installed) and replaces
  the rows for another target;
* ``base_logits`` reads the rows when the key matches the target it is called with and refuses
  (:class:`~dspark_jax.errors.DSparkInputError`) a head installed for other weights; without a
  head it gathers as before (training, low-level callers);
* a target without a weights fingerprint cannot be told apart from another one, so it gets no
  installed head (the drafter gathers).

:class:`DecodeHead` is an ``nnx.Variable`` but not an ``nnx.Param``: exports
(``nnx.state(drafter, nnx.Param)``) and the optimizer never see it; the trainer drops it
(:func:`without_decode_state`). It travels with ``nnx.split(drafter)`` into the jitted decoding
programs as an argument (never baked into the program as a constant).

Per-layer weights (:func:`install_decode_layers`, with a target that keeps per-layer weights itself:
float32 on a CPU without a mesh, :mod:`~dspark_jax.models.layer_stack`): the backbone's parameters are stacked
``[N, ...]`` (one array per weight; training scans over them, checkpoints store them). XLA's CPU
backend copies a layer's slice of a stack into a fresh buffer before each dot, static slice or
dynamic, and in a drafting round those copies cost more than the dots. Decoding therefore
reads each layer's weights from its own buffers, :class:`DecodeLayer` copies made once per
drafter (the drafter's layer memory twice over on the CPU), refreshed when the stacked arrays
are no longer the ones they were copied from (at the next ``prepare_decoding``) and dropped
with the head (:func:`release_decode_head`, :func:`without_decode_state`).
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target

__all__ = [
    "DecodeHead",
    "DecodeLayer",
    "decode_head_rows",
    "decode_layer_params",
    "head_key",
    "install_decode_head",
    "install_decode_layers",
    "install_decode_state",
    "release_decode_head",
    "release_decode_state",
    "without_decode_state",
]

# drafter -> weak reference to the target array its head was gathered from: a second install with
# the same key but other arrays (e.g. two targets given the same fingerprint by hand) re-gathers.
_SOURCES: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()
# drafter -> {name: weak reference to the stacked [N, ...] array its DecodeLayer copies came from}.
_LAYER_SOURCES: weakref.WeakKeyDictionary[Any, dict[str, weakref.ref]] = weakref.WeakKeyDictionary()


class DecodeHead(nnx.Variable):
    """``[N, H]`` rows of the target's LM head for a drafter's draft vocabulary, in the target's
    dtype (exactly what ``target.lm_head_rows(ids)`` gives). Derived decode-time state, not a
    parameter: never trained, exported or given optimizer state."""


class DecodeLayer(nnx.Variable):
    """One layer's copy of a stacked backbone weight (``layers[name][i]``, same dtype and values) for
    decoding on the CPU (module doc). Derived decode-time state, not a parameter."""


def head_key(target: Target) -> tuple[str, str, int, int, bool]:
    """Static identity of a target's LM head: ``(fingerprint, dtype, V, H, tied)``.

    Readable on a target merged inside ``jit`` (static attributes only).
    """
    c = target.cfg
    return (target.fingerprint, jnp.dtype(target.dtype).name, c.vocab_size, c.hidden_size, c.tie_embeddings)


def _source(target: Target) -> jax.Array:
    """The array the rows are gathered from (the embedding when tied, else the LM head)."""
    return target.embed[...] if target.lm_head is None else target.lm_head[...]


def install_decode_head(drafter: Any, target: Target) -> None:
    """Gathers and installs ``drafter``'s decode head for ``target`` (module doc); releases it when
    the drafter has no draft vocabulary or the target no fingerprint. Call outside ``jit``.

    Raises:
      ValueError: ``draft_vocab_size > 0`` but no draft vocabulary installed.
    """
    ids = drafter.draft_vocab_ids()
    if ids is None or not target.fingerprint:
        release_decode_head(drafter)
        return
    key, src = head_key(target), _source(target)
    ref = _SOURCES.get(drafter)
    if drafter.decode_head is not None and drafter.decode_head_key == key and ref is not None and ref() is src:
        return  # already installed for these weights
    rows = jax.block_until_ready(target.lm_head_rows(ids))
    drafter.decode_head = DecodeHead(rows)
    drafter.decode_head_key = key
    _SOURCES[drafter] = weakref.ref(src)


def install_decode_layers(drafter: Any, per_layer: bool) -> None:
    """Installs ``drafter.decode_layers``, one ``nnx.Dict`` of :class:`DecodeLayer` per backbone layer,
    when ``per_layer`` (the target's ``per_layer``: module doc); else drops them. Idempotent while the
    stacked arrays are the ones copied. Call outside ``jit``."""
    stacked = {k: v.get_value() for k, v in drafter.layers.items()}
    if not per_layer:
        drafter.decode_layers = None
        _LAYER_SOURCES.pop(drafter, None)
        return
    refs = _LAYER_SOURCES.get(drafter)
    if drafter.decode_layers is not None and refs is not None and all(refs[k]() is a for k, a in stacked.items()):
        return  # already copied from these arrays
    n = drafter.cfg.num_layers
    drafter.decode_layers = nnx.List(
        [nnx.Dict(**{k: DecodeLayer(jax.block_until_ready(a[i])) for k, a in stacked.items()}) for i in range(n)]
    )
    _LAYER_SOURCES[drafter] = {k: weakref.ref(a) for k, a in stacked.items()}


def decode_layer_params(drafter: Any) -> list[dict[str, jax.Array]] | None:
    """Each layer's weights ``{name: array}`` from :func:`install_decode_layers` (works inside
    ``jit``), or None when none are installed (the backbone scans the stacked arrays)."""
    if getattr(drafter, "decode_layers", None) is None:
        return None
    return [{k: v[...] for k, v in p.items()} for p in drafter.decode_layers]


def install_decode_state(drafter: Any, target: Target) -> None:
    """:func:`install_decode_head` then :func:`install_decode_layers` (``prepare_decoding``)."""
    install_decode_head(drafter, target)
    install_decode_layers(drafter, bool(getattr(target, "per_layer", False)))


def release_decode_head(drafter: Any) -> None:
    """Drops ``drafter``'s decode head (a no-op without one)."""
    drafter.decode_head = None
    drafter.decode_head_key = None
    _SOURCES.pop(drafter, None)


def release_decode_state(drafter: Any) -> None:
    """Drops all of ``drafter``'s decode-time state: its decode head and per-layer copies."""
    release_decode_head(drafter)
    drafter.decode_layers = None
    _LAYER_SOURCES.pop(drafter, None)


def decode_head_rows(drafter: Any, target: Target) -> jax.Array | None:
    """``[N, H]`` installed rows for ``target`` (works inside ``jit``), or None without a head.

    Raises:
      DSparkInputError: a head installed for another target (fingerprint, dtype or shape).
    """
    if drafter.decode_head is None:
        return None
    key = head_key(target)
    if drafter.decode_head_key != key:
        raise DSparkInputError(
            f"the drafter's decode head was prepared for target {drafter.decode_head_key} but is used "
            f"with target {key}: call drafter.prepare_decoding(target) for this target"
        )
    return drafter.decode_head[...]


def without_decode_state(drafter: Any) -> Any:
    """``drafter`` itself when it carries no decode head, else a clone without it (the caller's
    drafter is not modified): the trainer's ``nnx.split(drafter, nnx.Param)`` needs parameters only."""
    if getattr(drafter, "decode_head", None) is None and getattr(drafter, "decode_layers", None) is None:
        return drafter
    clone = nnx.clone(drafter)
    clone.release_decoding()
    return clone
