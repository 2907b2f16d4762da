"""One attention entry point over a static KV cache, with implementations chosen by platform.

Implements docs/design.md#attention-backends. :func:`attend` has the contract of
:func:`~dspark_jax.models.layers.cached_attention` (query ``(b, t)`` sees the cache slots
``<= q_pos[b, t]`` of row ``b``; ``q_pos < 0`` sees nothing and gives 0) and runs it with one of:

* ``xla``: :func:`~dspark_jax.models.layers.cached_attention` (the reference; a ``lax.fori_loop``
  over the live 256-key blocks with an online float32 softmax);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` with per-row key/value
  lengths and a per-query mask (fp16/bf16 only; no soft-cap);
* ``pallas_tpu``: JAX's Pallas ragged paged attention kernel, the contiguous cache rows viewed as
  pages, one kernel "sequence" per query, with the query scale, soft-cap and a static sliding
  window passed to the kernel; on a mesh it runs under ``shard_map``, each device on its own KV
  heads (:mod:`dspark_jax.models.pallas_tpu`);
* ``auto``: ``cudnn`` on a CUDA GPU when it can serve the program, else ``xla`` (on a TPU too: the
  TPU compiler costs the kernel path above ``xla``, docs/results.md#compiled-for-tpu-on-this-cpu).

The backend is a static setting (:attr:`~dspark_jax.config.TargetConfig.attention_backend`),
resolved while tracing for the devices the program is compiled for (the mesh of the cache's
sharding, else the default device). A backend asked for by name that cannot serve the program is
refused with one line naming what it lacks (:class:`~dspark_jax.errors.DSparkInputError`), never
replaced; ``auto`` takes ``xla`` where cuDNN cannot serve and logs why once. On CPU ``auto`` is ``xla``, so the traced
program is exactly the one :func:`~dspark_jax.models.layers.cached_attention` gives.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import ATTENTION_BACKENDS
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.layers import cached_attention
from dspark_jax.models.pallas_tpu import (
    PAGE_SIZES,
    RaggedPagedArguments,
    layer_rows,
    page_size_for,
    pallas_tpu_attention,
    pallas_tpu_unfit,
    placement,
    ragged_paged_arguments,
)

__all__ = [
    "PAGE_SIZES",
    "RaggedPagedArguments",
    "attend",
    "cudnn_attention",
    "page_size_for",
    "pallas_tpu_attention",
    "ragged_paged_arguments",
    "select_backend",
]

_log = logging.getLogger(__name__)
_noted: set[tuple[str, str]] = set()


def current_platform() -> str:
    """The default JAX backend's platform: ``cpu``, ``gpu`` (CUDA), ``rocm``, ``tpu``, ..."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "gpu"
    return platform


def target_platform(*xs: Any) -> str:
    """The platform the first of ``xs`` on a mesh (arrays, tracers or ``ShapeDtypeStruct`` s) is
    placed on: its mesh's devices' (a deviceless TPU compile on a CPU host says ``tpu``), else
    :func:`current_platform`."""
    platform = placement(*xs).platform
    if platform is None or (platform in ("gpu", "cuda") and jax.default_backend() == "gpu"):
        return current_platform()
    return "gpu" if platform == "cuda" else platform


def select_backend(
    backend: str,
    q: Any,
    k_cache: Any,
    platform: str | None = None,
    *,
    traced_window: bool = False,
    softcap: float | None = None,
) -> tuple[str, str | None]:
    """The implementation that runs.

    Args:
      backend: one of :data:`~dspark_jax.config.ATTENTION_BACKENDS`.
      q: the queries ``[B, T, n_heads, hd]`` (anything with ``shape`` and ``dtype``).
      k_cache: the key cache ``[L, B', S, n_kv_heads, hd]`` (likewise); its sharding's mesh (under
        ``jit``: the abstract mesh with the device kind) decides the platform and the heads a device holds.
      platform: as :func:`current_platform` (default: :func:`target_platform` of ``k_cache``).
      traced_window: the layer's sliding window is a traced value (a model mixing sliding and
        full layers): the Pallas kernel takes a static window only.
      softcap: the attention soft-cap (Gemma 2), or None; cuDNN has none.
    Returns:
      ``(name, reason)``: ``name`` in ``xla``/``cudnn``/``pallas_tpu``; ``reason`` is None unless
      ``auto`` took ``xla`` where the platform's kernel cannot serve the program.
    Raises:
      ValueError: an unknown backend name.
      DSparkInputError: ``cudnn`` or ``pallas_tpu`` by name where it cannot serve the program
        (another platform, dtype, head size, cache length, soft-cap, traced window ...), naming why.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {ATTENTION_BACKENDS}")
    if backend == "xla":
        return "xla", None
    platform = platform or target_platform(k_cache, q)
    want = backend if backend != "auto" else {"gpu": "cudnn"}.get(platform)
    if want is None:
        return "xla", None
    if want == "cudnn":
        reason = cudnn_unfit(q, k_cache, platform, softcap=softcap)
    else:
        reason = pallas_tpu_unfit(q, k_cache, platform, traced_window=traced_window)
    if reason is None:
        return want, None
    if backend == "auto":
        return "xla", reason
    raise DSparkInputError(f"attention backend {backend!r} cannot run this program: {reason} (use xla or auto)")


def attend(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    q_pos: jax.Array,
    *,
    backend: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
    window: jax.Array | int | None = None,
):
    """Grouped-query attention over one layer of a static KV cache, by the chosen backend
    (docs/design.md#attention-backends).

    Args:
      q: ``[B, T, n_heads, hd]`` queries (RoPE applied).
      k_cache, v_cache: ``[L, B', S, n_kv_heads, hd]`` full caches (``B' >= B``: the first ``B``
        rows are read).
      layer: int32 scalar (traced or static) layer index into the caches' axis 0.
      q_pos: ``[B, T]`` int32 last visible slot of each query; ``< 0``: sees nothing (output 0).
      backend: static, one of :data:`~dspark_jax.config.ATTENTION_BACKENDS` (:func:`select_backend`).
      scale / softcap: static score scale (None: ``hd ** -0.5``) and soft-cap (None: none), as
        :func:`~dspark_jax.models.layers.score_scale` and :func:`~dspark_jax.models.layers.soft_cap`.
      window: None (full attention) or the layer's sliding window W (a static int, or an int32
        scalar, traced): a query then sees only the slots ``q_pos - W < s <= q_pos``.
    Returns:
      ``[B, T, n_heads * hd]`` in the dtype of ``q``.
    Raises:
      ValueError: an unknown backend name.
      DSparkInputError: a backend by name that cannot serve the program (:func:`select_backend`).
    """
    traced = window is not None and not isinstance(window, int)
    name, reason = select_backend(backend, q, k_cache, traced_window=traced, softcap=softcap)
    if reason is not None:
        _note_auto(reason)
    if name == "cudnn":
        return cudnn_attention(q, k_cache, v_cache, layer, q_pos, window=window, scale=scale)
    if name == "pallas_tpu":
        w = None if window is None else int(window)
        return pallas_tpu_attention(q, k_cache, v_cache, layer, q_pos, window=w, scale=scale, softcap=softcap)
    return cached_attention(q, k_cache, v_cache, layer, q_pos, window=window, scale=scale, softcap=softcap)


def _note_auto(reason: str) -> None:
    """Logs once per reason (INFO) that ``auto`` took ``xla`` where the platform's kernel could not serve."""
    if ("auto", reason) in _noted:
        return
    _noted.add(("auto", reason))
    _log.info("attention backend 'auto' runs as xla: %s", reason)


# ---------------------------------------------------------------------------------------------- cuDNN


def cudnn_unfit(q: Any, k_cache: Any, platform: str, softcap: float | None = None) -> str | None:
    """Why the cuDNN path cannot run these shapes (None: it can); arguments as :func:`select_backend`.

    cuDNN's fused attention takes fp16/bf16 (fp8) only, so float32 queries (a float32 target: the
    reference numerics, CPU tests) stay on ``xla``; the head dimension must be a multiple of 8 and
    at most 256 on Hopper or later (128 before); ``dot_product_attention`` has no soft-cap.
    """
    if platform != "gpu":
        return f"cuDNN needs a CUDA GPU (platform {platform})"
    if softcap is not None:
        return "the attention soft-cap (Gemma 2) is not in cuDNN's fused attention"
    dtype = jnp.dtype(q.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{dtype.name} queries: cuDNN fused attention takes float16/bfloat16 only"
    hd, limit = q.shape[-1], _cudnn_head_dim_limit()
    if hd % 8 or hd > limit:
        return f"head_dim {hd}: cuDNN needs a multiple of 8 and at most {limit}"
    return None


def _cudnn_head_dim_limit() -> int:
    """256 on compute capability 9.0 or later (Hopper), else 128 (as jax's cuDNN check)."""
    try:
        major = int(str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0])
    except ValueError:
        major = 0
    return 256 if major >= 9 else 128


class CudnnArguments(NamedTuple):
    """What :func:`cudnn_attention` passes to ``jax.nn.dot_product_attention`` besides the queries.

    Attributes:
      k, v: ``[B, S, n_kv_heads, hd]`` the layer's first ``B`` cache rows, in the queries' dtype
        (GQA: ``dot_product_attention`` groups ``n_heads // n_kv_heads`` query heads per KV head).
      mask: ``[B, 1, T, S]`` bool, True where query ``(b, t)`` sees slot ``s`` (``s <= q_pos[b, t]``,
        and ``s > q_pos[b, t] - W`` with a window W); broadcast over heads (cuDNN turns it into an
        additive bias).
      kv_lens: ``[B]`` int32 key/value length of each row, ``max_t q_pos[b, t] + 1`` clipped into
        ``[1, S]``: cuDNN skips the key blocks past it, so the cost follows the live length.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    kv_lens: jax.Array


def cudnn_arguments(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, q_pos: jax.Array, window=None
) -> CudnnArguments:
    """The keys, values, mask and lengths for ``dot_product_attention`` (arguments as :func:`attend`).

    ``dot_product_attention``'s own ``is_causal`` is aligned top-left (query ``t`` sees key ``t``),
    not to absolute cache positions, so the per-query visibility is an explicit mask; the lengths
    only let the kernel skip the dead tail of each row.
    """
    b, s = q.shape[0], k_cache.shape[2]
    k = layer_rows(k_cache, layer, b, q.dtype)
    v = layer_rows(v_cache, layer, b, q.dtype)
    slots = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    mask = slots <= q_pos[:, :, None]
    if window is not None:
        mask = mask & (slots > q_pos[:, :, None] - window)
    mask = mask[:, None]
    kv_lens = jnp.clip(jnp.max(q_pos, axis=1) + 1, 1, s).astype(jnp.int32)
    return CudnnArguments(k, v, mask, kv_lens)


def cudnn_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    q_pos: jax.Array,
    *,
    implementation: Literal["xla", "cudnn"] | None = "cudnn",
    window: jax.Array | int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """:func:`attend` by ``jax.nn.dot_product_attention`` (arguments and result as :func:`attend`).

    ``implementation`` is passed through: ``"cudnn"`` on a GPU; ``"xla"`` or None run the very same
    arguments through jax's XLA implementation (how the CPU tests check this path); ``scale``: the
    score scale (None: ``hd ** -0.5``). A query with
    ``q_pos < 0`` (which ``dot_product_attention`` would average over masked keys) gives exactly 0.
    """
    b, t, nh, hd = q.shape
    a = cudnn_arguments(q, k_cache, v_cache, layer, q_pos, window)
    out = jax.nn.dot_product_attention(
        q, a.k, a.v, mask=a.mask, key_value_seq_lengths=a.kv_lens, scale=scale, implementation=implementation
    )
    out = jnp.where((q_pos >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(b, t, nh * hd).astype(q.dtype)
