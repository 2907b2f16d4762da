"""The serving engine's device state: per-row KV caches and decoding state, a prefilled
request's arrays, their initial values and their layout on a ``model`` mesh.

Everything here lives on the device between steps and is donated to every program
(:mod:`dspark_jax.serving.engine.step_programs`). Rows are physical decode rows (``B = num_slots``), ``S``
the cache length; docs/design.md#serving and docs/design.md#device-mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decoding.validation import INT32_MIN
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd

__all__ = [
    "CACHE_FIELDS",
    "DecodeState",
    "PackedTokens",
    "PrefixArrays",
    "init_state",
    "serving_mesh",
    "state_shardings",
]

# KV caches ([L, B, S, kvh, hd]: the row is axis 1); every other field has the row on axis 0.
CACHE_FIELDS = ("tk", "tv", "dk", "dv")


class DecodeState(NamedTuple):
    """Per-row device state of the engine (``B`` rows, ``S`` cache positions)."""

    tk: Any  # [L, B, S, kvh, hd] target keys
    tv: Any
    dk: Any  # [N, B, S, kvh, hd] drafter context keys (None without drafter)
    dv: Any
    anchor: jax.Array  # [B] int32 last confirmed token (not yet in the target cache)
    pos: jax.Array  # [B] int32 its position
    key: jax.Array  # [B, 2] uint32 request keys
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] f32
    draft: jax.Array  # [B, G'] int32 next block's drafts (G' = max(block_size, 1))
    conf: jax.Array  # [B, G'] f32 their raw confidence logits
    # Sparse additive logit bias (logit_bias and min_tokens' stop masking), applied to the
    # logits predicting the token after position ``pos`` iff ``pos < bias_until``:
    bias_ids: jax.Array  # [B, NB] int32 token ids (padding: id 0, until INT32_MIN)
    bias_val: jax.Array  # [B, NB] f32 additive bias (-inf masks)
    bias_until: jax.Array  # [B, NB] int32
    qprob: Any  # [B, G, V] f32 q of the drafts (rejection mode only, else None)


class PrefixArrays(NamedTuple):
    """Device arrays of one prefilled request (``P`` the prefill bucket length)."""

    tk: Any  # [L, 1, P, kvh, hd]
    tv: Any
    dk: Any  # [N, 1, P, kvh, hd] or None
    dv: Any
    key: jax.Array  # [2] uint32 request key
    token: jax.Array  # [] int32 first token
    draft: jax.Array  # [G'] int32 first block's drafts
    conf: jax.Array  # [G'] f32 their raw confidence logits
    qprob: Any  # [G, V] (rejection mode) or None


class PackedTokens(NamedTuple):
    """Tokens of up to ``R`` decode rows packed into ``K`` slots, the layout of
    :meth:`~dspark_jax.models.target.Target.forward_packed` (a pytree: host numpy arrays or
    device arrays; its leaves, in field order, are a program's parameters).

    Attributes:
      tok: ``[K]`` int32 token ids.
      row: ``[K]`` int32 decode row of each token.
      col: ``[K]`` int32 its column in that row's block (``0 .. width - 1``).
      pos: ``[K]`` int32 its position; ``-1`` marks padding (nothing read or written).
    """

    tok: Any
    row: Any
    col: Any
    pos: Any


def init_state(target, drafter, num_slots: int, cache_len: int, nb: int, keep_q: bool) -> DecodeState:
    """Empty state of ``num_slots`` rows: zero caches and drafts, temperature / top-p 1, an
    empty bias table of ``nb`` entries per row, and a ``[B, block_size, V]`` q buffer iff ``keep_q``
    (rejection-sampling verification with a drafter)."""
    b, s = num_slots, cache_len
    tc = target.init_cache(b, s)
    dk = dv = None
    if drafter is not None:
        dc = drafter.init_cache(b, s)
        dk, dv = dc.k, dc.v
    block_size = drafter.cfg.block_size if drafter is not None else 0
    gp = max(block_size, 1)
    q = jnp.zeros((b, block_size, target.cfg.vocab_size), jnp.float32) if keep_q else None
    return DecodeState(
        tk=tc.k,
        tv=tc.v,
        dk=dk,
        dv=dv,
        anchor=jnp.zeros((b,), jnp.int32),
        pos=jnp.zeros((b,), jnp.int32),
        key=jnp.zeros((b, 2), jnp.uint32),
        temperature=jnp.ones((b,), jnp.float32),
        top_k=jnp.zeros((b,), jnp.int32),
        top_p=jnp.ones((b,), jnp.float32),
        draft=jnp.zeros((b, gp), jnp.int32),
        conf=jnp.zeros((b, gp), jnp.float32),
        bias_ids=jnp.zeros((b, nb), jnp.int32),
        bias_val=jnp.zeros((b, nb), jnp.float32),
        bias_until=jnp.full((b, nb), INT32_MIN, jnp.int32),
        qprob=q,
    )


def state_shardings(kind, mesh, target_cfg, drafter_cfg, keep_q: bool):
    """Shardings of a :class:`DecodeState` or :class:`PrefixArrays` (``kind``) on ``mesh``: KV
    caches over their KV heads (``[L, B, S, kvh, hd]``), everything else replicated (and None
    where the state holds None: no drafter (``drafter_cfg`` None), or no q (``keep_q`` False))."""
    repl = shd.replicated(mesh)

    def cache(cfg):
        return shd.cache_sharding(mesh, cfg.num_kv_heads, (1, 1, 1, cfg.num_kv_heads, cfg.head_dim))

    t = cache(target_cfg)
    d = cache(drafter_cfg) if drafter_cfg is not None else None
    caches = {"tk": t, "tv": t, "dk": d, "dv": d}
    rest: dict[str, Any] = {f: repl for f in kind._fields if f not in CACHE_FIELDS}
    if not keep_q:
        rest["qprob"] = None
    return kind(**caches, **rest)


def serving_mesh(mesh):
    """``None`` / a :class:`jax.sharding.Mesh` / a spec string -> ``None`` or a mesh whose
    non-``model`` axes have size 1.

    A spec ``model:N`` runs on the first ``N`` devices of ``jax.devices()`` (the rest stay idle;
    ``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS`` pick which); ``model:-1`` (or no ``model``)
    takes every device. To choose other devices pass a mesh built over them
    (``shd.make_mesh("model:4", devices)``).

    Raises:
      DSparkInputError: bad spec, ``N`` above the device count, or ``data``/``fsdp`` larger than 1.
    """
    if mesh is None or (isinstance(mesh, str) and not mesh.strip()):
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        try:
            spec = shd.parse_mesh(mesh)
            if "model" not in spec and -1 not in spec.values():
                spec["model"] = -1
            devices = jax.devices()
            n = spec.get("model", 1) * spec.get("data", 1) * spec.get("fsdp", 1)
            if -1 not in spec.values() and n > len(devices):
                raise ValueError(f"mesh {mesh} needs {n} devices, but {len(devices)} are available")
            mesh = shd.make_mesh(spec, devices if -1 in spec.values() else devices[:n])
        except ValueError as e:
            raise DSparkInputError(str(e)) from None
    extra = {a: n for a, n in dict(mesh.shape).items() if a != "model" and n > 1}
    if extra:
        raise DSparkInputError(
            f"the engine shards over 'model' only (tensor parallel); mesh "
            f"{shd.describe(mesh)} also splits {', '.join(extra)}: use mesh=model:N"
        )
    return mesh
