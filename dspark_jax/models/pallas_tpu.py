"""The ``pallas_tpu`` attention backend: JAX's Pallas ragged paged attention kernel over the
contiguous KV cache, on one TPU chip or under ``shard_map`` on a mesh (docs/design.md#attention-backends).

The kernel is a Mosaic custom call, which the SPMD partitioner cannot split, so on a mesh it runs
under ``shard_map`` over the KV-head axis of the cache as :func:`~dspark_jax.models.sharding.cache_sharding`
lays it out (over ``model``, or over ``model_kv`` of its ``model_kv x model_rep`` split when there
are fewer KV heads than ``model`` devices): each device attends with its own query heads to its
own KV heads. The block sizes and the VMEM limit follow the device kind of the devices the program
is compiled for (the mesh's, which a deviceless compile for a TPU topology also has), not
``jax.devices()[0]``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from dspark_jax.models.sharding import kv_heads_split_model

PAGE_SIZES = (128, 64, 32, 16, 8)
"""Page sizes tried, largest first, for the paged view of a cache row (the first that divides ``S``)."""

VMEM_LIMIT_MIB = {4: 16, 5: 32, 6: 32, 7: 32}
"""The scoped VMEM limit passed to the kernel by TPU generation (MiB); its blocks are cut to fit half of it."""


class Placement(NamedTuple):
    """Where an array is placed: ``platform`` (``tpu``, ``cpu``, ...; None: not known), the devices'
    ``device_kind`` (``TPU v5 lite``; None: not known) and the abstract mesh (None: the default device;
    one of one device too, whose kind Mosaic reads from the mesh the kernel is lowered under)."""

    platform: str | None
    device_kind: str | None
    mesh: AbstractMesh | None


def placement(*xs: Any) -> Placement:
    """The :class:`Placement` of the first of ``xs`` that is on a mesh: an array, a tracer under
    ``jit`` (its abstract mesh carries the device kind; an op mixing two meshes, as a cache on its
    own split mesh written with keys from the weights', leaves none) or a ``ShapeDtypeStruct``.
    None on a mesh: ``Placement(None, None, None)``, the default device."""
    for x in xs:
        if isinstance(x, jax.ShapeDtypeStruct):
            sharding = x.sharding
        else:
            try:
                sharding = jax.typeof(x).sharding
            except (TypeError, AttributeError):
                sharding = None
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not isinstance(mesh, AbstractMesh):
            mesh = mesh.abstract_mesh
        device = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
        if mesh is not None and device is not None:
            return Placement(device.platform, device.device_kind, mesh)
    return Placement(None, None, None)


def tpu_generation(device_kind: str | None) -> int | None:
    """4 for ``TPU v4``, 5 for ``TPU v5 lite`` / ``TPU v5``, 7 for ``TPU7x`` ...; None: not a TPU kind."""
    kind = (device_kind or "").replace(" lite", "").replace("TPU7x", "TPU v7")
    if not kind.startswith("TPU v"):
        return None
    digits = kind[5:].split()[0].rstrip("ep")
    return int(digits) if digits.isdigit() else None


class HeadSplit(NamedTuple):
    """How the kernel's heads are cut over a mesh.

    Attributes:
      mesh: the abstract mesh the kernel is ``shard_map``-ped over (None: called on the default device).
      q_axes / kv_axes: the mesh axes of the query-head and KV-head axes (None: whole on every device).
      heads / kv_heads: query and KV heads a device attends with.
    """

    mesh: AbstractMesh | None
    q_axes: Any
    kv_axes: Any
    heads: int
    kv_heads: int


def head_split(mesh: AbstractMesh | None, num_heads: int, num_kv_heads: int) -> HeadSplit:
    """The KV-head axis over ``model`` when it divides the KV heads, over ``model_kv`` of the cache's
    ``model_kv x model_rep`` split when there are fewer (:func:`~dspark_jax.models.sharding.kv_heads_split_model`),
    else whole on every device; the query heads over the same devices (and ``model_rep`` too when it
    divides them), so a device's query heads are those of its KV heads."""
    whole = HeadSplit(mesh, None, None, num_heads, num_kv_heads)
    if mesh is None:
        return whole
    sizes = dict(mesh.shape)
    if "model_kv" not in sizes:
        m = sizes.get("model", 1)
        if m > 1 and num_kv_heads % m == 0:
            return HeadSplit(mesh, "model", "model", num_heads // m, num_kv_heads // m)
        if not (kv_heads_split_model(m, num_kv_heads) and mesh.axis_names[-1] == "model"):
            return whole
        sizes = {
            **{a: sizes[a] for a in mesh.axis_names[:-1]},
            "model_kv": num_kv_heads,
            "model_rep": m // num_kv_heads,
        }
        mesh = AbstractMesh(
            tuple(sizes.values()),
            tuple(sizes),
            (mesh.axis_types[-1],) * len(sizes),
            abstract_device=mesh.abstract_device,
        )
    kv, rep = sizes["model_kv"], sizes.get("model_rep", 1)
    if num_kv_heads % kv:
        return whole._replace(mesh=mesh)
    if num_heads % (kv * rep) == 0:
        return HeadSplit(mesh, ("model_kv", "model_rep"), "model_kv", num_heads // (kv * rep), num_kv_heads // kv)
    return HeadSplit(mesh, "model_kv", "model_kv", num_heads // kv, num_kv_heads // kv)


def page_size_for(cache_len: int) -> int | None:
    """The largest of :data:`PAGE_SIZES` dividing ``cache_len`` (None: none does)."""
    return next((p for p in PAGE_SIZES if cache_len % p == 0), None)


def pallas_tpu_unfit(q: Any, k_cache: Any, platform: str, *, traced_window: bool = False) -> str | None:
    """Why the Pallas ragged paged attention path cannot run these shapes (None: it can);
    arguments as :func:`~dspark_jax.models.attention.select_backend`.

    Constraints: a TPU v4 or later; float32 or bfloat16; a head dimension that is a multiple of 128
    (the TPU lane width; the kernel does not pad heads); a cache length a page size divides; the
    kernel's head tiling rule on the heads a device holds (``2 * n_kv_heads`` combined K/V heads
    fully tiled); a static sliding window.
    """
    if traced_window:
        return "a per-layer (traced) sliding window (sliding and full layers mixed) is not in the kernel"
    if platform != "tpu":
        return f"the Pallas ragged paged attention kernel needs a TPU (platform {platform})"
    where = placement(k_cache, q)
    kind = where.device_kind
    gen = tpu_generation(kind)
    if kind is not None and gen is not None and gen < 4:
        return f"the kernel needs TPU v4 or later ({kind})"
    dtype = jnp.dtype(q.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"{dtype.name} queries: the kernel path takes float32/bfloat16"
    hd, nh, nkv, s_len = q.shape[-1], q.shape[2], k_cache.shape[3], k_cache.shape[2]
    if hd % 128:
        return f"head_dim {hd} is not a multiple of 128"
    if page_size_for(s_len) is None:
        return f"cache length {s_len} is not a multiple of {PAGE_SIZES[-1]}"
    split = head_split(where.mesh, nh, nkv)
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

        get_min_heads_per_blk(split.heads, 2 * split.kv_heads, dtype, dtype)
    except (ImportError, ValueError) as e:
        return f"the kernel does not take {split.heads} query / {split.kv_heads} KV heads a device ({e})"
    return None


def block_sizes(
    device_kind: str | None,
    dtype: Any,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    tokens: int,
    pages: int,
) -> tuple[int, int, int]:
    """``(KV pages a block, queries a block, VMEM limit bytes)`` of one kernel call on ``device_kind``.

    JAX's tuned table for that device kind (its defaults elsewhere), with the KV block halved
    until the kernel's VMEM buffers (double-buffered KV pages with the head axis padded to the
    TPU tile, the query / output blocks, the float32 accumulators and one float32 score block)
    take at most half of :data:`VMEM_LIMIT_MIB`: the tuned whole-row KV block of a long cache
    overflowed the default scoped VMEM.
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

    q_blk, kv_blk = get_min_heads_per_blk(heads, 2 * kv_heads, dtype, dtype)
    gen = tpu_generation(device_kind) or 5
    bkv, bq = (32, 32) if gen == 4 else (128, 32)
    name = " ".join((device_kind or "").split()[:2])
    key = tuned.simplify_key((dtype, dtype, q_blk, kv_blk // 2, head_dim, page_size, tokens, pages))
    bkv, bq = tuned.TUNED_BLOCK_SIZES.get(name, {}).get(key, (bkv, bq)) if gen > 4 else (bkv, bq)
    bkv, bq = min(pages, bkv), min(tokens, bq)
    limit = VMEM_LIMIT_MIB.get(gen, 16) << 20
    item = jnp.dtype(dtype).itemsize
    tile = 8 * (4 // item)  # second-minor tile of the dtype: the combined head axis pads to it
    ratio = heads // kv_heads

    def vmem(bkv: int) -> int:
        kv = 2 * bkv * page_size * (-(-kv_blk // tile) * tile) * head_dim * item
        qo = 4 * bq * (-(-q_blk // tile) * tile) * head_dim * item
        acc = bq * (-(-q_blk // 8) * 8) * head_dim * 4 + 2 * (kv_blk // 2) * (-(-bq * ratio // 8) * 8) * 128 * 4
        return kv + qo + acc + bq * ratio * bkv * page_size * 4

    while bkv > 1 and vmem(bkv) > limit // 2:
        bkv = max(1, bkv // 2)
    return bkv, bq, limit


class RaggedPagedArguments(NamedTuple):
    """The arguments of JAX's ``ragged_paged_attention`` (and its ``ref_ragged_paged_attention``)
    for the ``N = B * T`` queries of :func:`~dspark_jax.models.attention.attend`, one kernel sequence per query.

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


def layer_rows(cache: jax.Array, layer, rows: int, dtype) -> jax.Array:
    """``cache[layer, :rows]`` as ``dtype``: ``[rows, S, n_kv_heads, hd]``."""
    return jax.lax.dynamic_index_in_dim(cache, jnp.asarray(layer, jnp.int32), 0, keepdims=False)[:rows].astype(dtype)


def ragged_paged_arguments(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, q_pos: jax.Array, page_size: int
) -> RaggedPagedArguments:
    """The paged view of a cache layer and the per-query metadata (arguments as
    :func:`~dspark_jax.models.attention.attend`; ``page_size`` must divide ``S``).

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
    k = layer_rows(k_cache, layer, b, q.dtype)
    v = layer_rows(v_cache, layer, b, q.dtype)
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
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """:func:`~dspark_jax.models.attention.attend` by JAX's Pallas ragged paged attention
    (arguments and result as there), under ``shard_map`` over the KV heads (:func:`head_split`)
    when the cache is on a mesh.

    Args:
      page_size: slots per page (default :func:`page_size_for` the cache length).
      window: static sliding window W (the kernel's ``sliding_window``: a query sees the keys
        ``q_pos - W < s <= q_pos``), or None.
      scale / softcap: the score scale (None: ``hd ** -0.5``; the kernel's ``sm_scale``) and the
        soft-cap (the kernel's ``soft_cap``), applied in float32 in the same order as ``xla``.
      kernel: the function called with :class:`RaggedPagedArguments` and the keywords above; default
        JAX's ``ragged_paged_attention`` with :func:`block_sizes` for the target device kind (TPU
        only). The CPU tests pass a reference.
    Raises:
      ValueError: no page size divides the cache length.
    """
    b, t, nh, hd = q.shape
    page_size = page_size or page_size_for(k_cache.shape[2])
    if page_size is None:
        raise ValueError(f"no page size in {PAGE_SIZES} divides the cache length {k_cache.shape[2]}")
    where = placement(k_cache, q)
    split = head_split(where.mesh, nh, k_cache.shape[3])
    extra: dict[str, Any] = {"sm_scale": float(hd) ** -0.5 if scale is None else float(scale)}
    extra.update({} if window is None else {"sliding_window": int(window)})
    extra.update({} if softcap is None else {"soft_cap": float(softcap)})
    if kernel is None:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

        pages = k_cache.shape[2] // page_size
        kind = where.device_kind or jax.devices()[0].device_kind
        bkv, bq, limit = block_sizes(kind, q.dtype, split.heads, split.kv_heads, hd, page_size, b * t, pages)
        blocks = {"num_kv_pages_per_block": bkv, "num_queries_per_block": bq, "vmem_limit_bytes": limit}
        kernel = lambda *a, **kw: ragged_paged_attention(*a, **kw, **blocks)

    def local(q, k_cache, v_cache, layer, q_pos):
        a = ragged_paged_arguments(q, k_cache, v_cache, layer, q_pos, page_size)
        out = kernel(*a, **extra).reshape(q.shape)
        out = jnp.where((q_pos >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
        return out.reshape(b, t, math.prod(q.shape[2:])).astype(q.dtype)

    if split.mesh is None:
        return local(q, k_cache, v_cache, layer, q_pos)
    qs, cs = P(None, None, split.q_axes, None), P(None, None, None, split.kv_axes, None)
    sharded = jax.shard_map(
        local, mesh=split.mesh, in_specs=(qs, cs, cs, P(), P()), out_specs=P(None, None, split.q_axes), check_vma=False
    )
    return sharded(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), q_pos)
