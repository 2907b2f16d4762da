"""One attention entry point over a static KV cache, with implementations chosen by platform.

Implements docs/design.md#attention-backends. :func:`attend` has the contract of
:func:`~dspark_jax.models.layers.cached_attention` (query ``(b, t)`` sees the cache slots
``<= q_pos[b, t]`` of row ``b``; ``q_pos < 0`` sees nothing and gives 0) and runs it with one of:

* ``xla``: :func:`~dspark_jax.models.layers.cached_attention` (the reference; a ``lax.fori_loop``
  over the live 256-key blocks with an online float32 softmax);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` with per-row key/value
  lengths and a per-query mask (fp16/bf16 only: a float32 target keeps the ``xla`` path);
* ``pallas_tpu``: JAX's Pallas ragged paged attention kernel, the contiguous cache rows viewed as
  pages, one kernel "sequence" per query (with the kernel's static ``sliding_window`` when every
  layer slides by the same window; a per-layer traced window is refused by name, and ``auto``
  takes ``xla`` for it);
* ``auto``: ``cudnn`` on a CUDA GPU for fp16/bf16, ``pallas_tpu`` on a TPU, else ``xla``.

The backend is a static setting (:attr:`~dspark_jax.config.TargetConfig.attention_backend`),
resolved while tracing; a backend whose constraints the shapes or dtypes miss falls back to
``xla`` and logs the reason once. On CPU ``auto`` is ``xla``, so the traced program is exactly
the one :func:`~dspark_jax.models.layers.cached_attention` gives.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import ATTENTION_BACKENDS
from dspark_jax.models.layers import cached_attention

_log = logging.getLogger(__name__)
_noted: set[tuple[str, str]] = set()

PAGE_SIZES = (128, 64, 32, 16, 8)
"""Page sizes tried, largest first, for the paged view of a cache row (the first that divides ``S``)."""


def current_platform() -> str:
    """The default JAX backend's platform: ``cpu``, ``gpu`` (CUDA), ``rocm``, ``tpu``, ..."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "gpu"
    return platform


def select_backend(
    backend: str, q: Any, k_cache: Any, platform: str | None = None, *, traced_window: bool = False
) -> tuple[str, str | None]:
    """The implementation that runs, and why a requested one does not.

    Args:
      backend: one of :data:`~dspark_jax.config.ATTENTION_BACKENDS`.
      q: the queries ``[B, T, n_heads, hd]`` (anything with ``shape`` and ``dtype``).
      k_cache: the key cache ``[L, B', S, n_kv_heads, hd]`` (likewise).
      platform: as :func:`current_platform` (default: the current one).
      traced_window: the layer's sliding window is a traced value (a model mixing sliding and
        full layers): the Pallas kernel takes a static window only.
    Returns:
      ``(name, reason)``: ``name`` in ``xla``/``cudnn``/``pallas_tpu``; ``reason`` is None unless a
      requested (or, for ``auto``, the platform's) backend fell back to ``xla``.
    Raises:
      ValueError: an unknown backend name, or ``pallas_tpu`` asked for by name with ``traced_window``.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {ATTENTION_BACKENDS}")
    if traced_window and backend == "pallas_tpu":
        raise ValueError("attention backend 'pallas_tpu' does not implement a per-layer (traced) sliding window")
    if backend == "xla":
        return "xla", None
    platform = platform or current_platform()
    want = backend if backend != "auto" else {"gpu": "cudnn", "tpu": "pallas_tpu"}.get(platform)
    if want is None:
        return "xla", None
    if traced_window and want == "pallas_tpu":
        return "xla", "a per-layer (traced) sliding window is not implemented by the Pallas kernel path"
    reason = (cudnn_unfit if want == "cudnn" else pallas_tpu_unfit)(q, k_cache, platform)
    return (want, None) if reason is None else ("xla", reason)


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
      backend: static, one of :data:`~dspark_jax.config.ATTENTION_BACKENDS`; a backend that does
        not fit falls back to ``xla`` (:func:`select_backend`), logged once per reason.
      scale / softcap: static score scale (None: ``hd ** -0.5``) and soft-cap (None: none), as
        :func:`~dspark_jax.models.layers.score_scale` and :func:`~dspark_jax.models.layers.soft_cap`;
        either one runs the ``xla`` path.
      window: None (full attention) or the layer's sliding window W (a static int, or an int32
        scalar, traced): a query then sees only the slots ``q_pos - W < s <= q_pos``.
    Returns:
      ``[B, T, n_heads * hd]`` in the dtype of ``q``.
    Raises:
      ValueError: an unknown backend name; ``pallas_tpu`` by name with a traced window.
    """
    traced = window is not None and not isinstance(window, int)
    name, reason = select_backend(backend, q, k_cache, traced_window=traced)
    if name != "xla" and (scale is not None or softcap is not None):
        name, reason = "xla", "a query scale or attention soft-cap (Gemma) runs on the xla path"
    if reason is not None:
        _note_fallback(backend, reason)
    if name == "cudnn":
        return cudnn_attention(q, k_cache, v_cache, layer, q_pos, window=window)
    if name == "pallas_tpu":
        if window is None:
            return pallas_tpu_attention(q, k_cache, v_cache, layer, q_pos)
        return pallas_tpu_attention(q, k_cache, v_cache, layer, q_pos, window=int(window))
    return cached_attention(q, k_cache, v_cache, layer, q_pos, window=window, scale=scale, softcap=softcap)


def _note_fallback(backend: str, reason: str) -> None:
    """Logs a fallback to xla once per (backend, reason): a warning when it was asked for by name."""
    if (backend, reason) in _noted:
        return
    _noted.add((backend, reason))
    level = logging.INFO if backend == "auto" else logging.WARNING
    _log.log(level, "attention backend %r runs as xla: %s", backend, reason)


def _layer_rows(cache: jax.Array, layer, rows: int, dtype) -> jax.Array:
    """``cache[layer, :rows]`` as ``dtype``: ``[rows, S, n_kv_heads, hd]``."""
    return jax.lax.dynamic_index_in_dim(cache, jnp.asarray(layer, jnp.int32), 0, keepdims=False)[:rows].astype(dtype)


# ---------------------------------------------------------------------------------------------- cuDNN


def cudnn_unfit(q: Any, k_cache: Any, platform: str) -> str | None:
    """Why the cuDNN path cannot run these shapes (None: it can); arguments as :func:`select_backend`.

    cuDNN's fused attention takes fp16/bf16 (fp8) only, so float32 queries (a float32 target: the
    reference numerics, CPU tests) stay on ``xla``; the head dimension must be a multiple of 8 and
    at most 256 on Hopper or later (128 before).
    """
    if platform != "gpu":
        return f"cuDNN needs a CUDA GPU (platform {platform})"
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
    k = _layer_rows(k_cache, layer, b, q.dtype)
    v = _layer_rows(v_cache, layer, b, q.dtype)
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
) -> jax.Array:
    """:func:`attend` by ``jax.nn.dot_product_attention`` (arguments and result as :func:`attend`).

    ``implementation`` is passed through: ``"cudnn"`` on a GPU; ``"xla"`` or None run the very same
    arguments through jax's XLA implementation (how the CPU tests check this path). A query with
    ``q_pos < 0`` (which ``dot_product_attention`` would average over masked keys) gives exactly 0.
    """
    b, t, nh, hd = q.shape
    a = cudnn_arguments(q, k_cache, v_cache, layer, q_pos, window)
    out = jax.nn.dot_product_attention(
        q, a.k, a.v, mask=a.mask, key_value_seq_lengths=a.kv_lens, implementation=implementation
    )
    out = jnp.where((q_pos >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(b, t, nh * hd).astype(q.dtype)


# ------------------------------------------------------------------------------------------ Pallas TPU


def page_size_for(cache_len: int) -> int | None:
    """The largest of :data:`PAGE_SIZES` dividing ``cache_len`` (None: none does)."""
    return next((p for p in PAGE_SIZES if cache_len % p == 0), None)


def pallas_tpu_unfit(q: Any, k_cache: Any, platform: str) -> str | None:
    """Why the Pallas ragged paged attention path cannot run these shapes (None: it can);
    arguments as :func:`select_backend`.

    Constraints: a TPU; float32 or bfloat16; a head dimension that is a multiple of 128 (the TPU
    lane width; the kernel does not pad heads); a cache length a page size divides; and the
    kernel's own head tiling rule (``2 * n_kv_heads`` combined K/V heads fully tiled).
    """
    if platform != "tpu":
        return f"the Pallas ragged paged attention kernel needs a TPU (platform {platform})"
    dtype = jnp.dtype(q.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"{dtype.name} queries: the kernel path takes float32/bfloat16"
    hd, nh, nkv, s_len = q.shape[-1], q.shape[2], k_cache.shape[3], k_cache.shape[2]
    if hd % 128:
        return f"head_dim {hd} is not a multiple of 128"
    if page_size_for(s_len) is None:
        return f"cache length {s_len} is not a multiple of {PAGE_SIZES[-1]}"
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

        get_min_heads_per_blk(nh, 2 * nkv, dtype, dtype)
    except (ImportError, ValueError) as e:
        return f"the kernel does not take these heads ({e})"
    return None


class RaggedPagedArguments(NamedTuple):
    """The arguments of JAX's ``ragged_paged_attention`` (and its ``ref_ragged_paged_attention``)
    for the ``N = B * T`` queries of :func:`attend`, one kernel sequence per query.

    Attributes:
      q: ``[N, n_heads, hd]`` the queries, row-major over ``(b, t)``.
      kv_pages: ``[B * S / P, P, 2 * n_kv_heads, hd]`` the layer's first ``B`` rows cut into pages
        of ``P`` slots, keys and values interleaved on the head axis (``0::2`` keys, ``1::2``
        values, the kernel's layout); page ``b * S / P + j`` holds slots ``[j P, (j + 1) P)`` of row ``b``.
      kv_lens: ``[N]`` int32 ``q_pos + 1`` clipped into ``[1, S]``: a one-query sequence of length
        ``n`` sees its first ``n`` keys, i.e. the slots ``<= q_pos``.
      page_indices: ``[N, S / P]`` int32 the pages of each query's row, in order.
      cu_q_lens: ``[N + 1]`` int32 ``0, 1, ..., N`` (one query per sequence).
      num_seqs: ``[1]`` int32 ``N``.
    """

    q: jax.Array
    kv_pages: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def ragged_paged_arguments(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, q_pos: jax.Array, page_size: int
) -> RaggedPagedArguments:
    """The paged view of a cache layer and the per-query metadata (arguments as :func:`attend`;
    ``page_size`` must divide ``S``).

    One sequence per query makes the kernel's causal rule (the last ``q_len`` keys of a sequence
    are its queries') exact for any ``q_pos``, not only consecutive positions; a row's pages are
    then read once per query, the same as per row at decode (``T = 1``).

    Raises:
      ValueError: ``page_size`` does not divide the cache length.
    """
    b, t, nh, hd = q.shape
    s_len, nkv = k_cache.shape[2], k_cache.shape[3]
    if s_len % page_size:
        raise ValueError(f"page size {page_size} does not divide the cache length {s_len}")
    k = _layer_rows(k_cache, layer, b, q.dtype)
    v = _layer_rows(v_cache, layer, b, q.dtype)
    per_row = s_len // page_size
    kv_pages = jnp.stack([k, v], axis=3).reshape(b * per_row, page_size, 2 * nkv, hd)
    row_pages = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
    n = b * t
    return RaggedPagedArguments(
        q=q.reshape(n, nh, hd),
        kv_pages=kv_pages,
        kv_lens=jnp.clip(q_pos + 1, 1, s_len).reshape(n).astype(jnp.int32),
        page_indices=jnp.repeat(row_pages, t, axis=0),
        cu_q_lens=jnp.arange(n + 1, dtype=jnp.int32),
        num_seqs=jnp.array([n], jnp.int32),
    )


def pallas_tpu_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    q_pos: jax.Array,
    *,
    page_size: int | None = None,
    kernel=None,
    window: int | None = None,
) -> jax.Array:
    """:func:`attend` by JAX's Pallas ragged paged attention (arguments and result as :func:`attend`).

    Args:
      page_size: slots per page (default :func:`page_size_for` the cache length).
      window: static sliding window W (the kernel's ``sliding_window``: a query sees the keys
        ``q_pos - W < s <= q_pos``), or None.
      kernel: the function called with :class:`RaggedPagedArguments` and ``sm_scale`` (and
        ``sliding_window`` with a window); default
        ``jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention`` (TPU
        only). The CPU tests pass JAX's ``ref_ragged_paged_attention`` (eager: it loops in Python).
    Raises:
      ValueError: no page size divides the cache length.
    """
    b, t, nh, hd = q.shape
    page_size = page_size or page_size_for(k_cache.shape[2])
    if page_size is None:
        raise ValueError(f"no page size in {PAGE_SIZES} divides the cache length {k_cache.shape[2]}")
    if kernel is None:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
    a = ragged_paged_arguments(q, k_cache, v_cache, layer, q_pos, page_size)
    extra = {} if window is None else {"sliding_window": int(window)}
    out = kernel(*a, sm_scale=float(hd) ** -0.5, **extra).reshape(b, t, nh, hd)
    out = jnp.where((q_pos >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(b, t, nh * hd).astype(q.dtype)
