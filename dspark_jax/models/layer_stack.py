"""How a decoder keeps its per-layer weights and runs its layer loop: one stacked ``[L, ...]``
array per weight under a ``lax.scan``, or separate buffers per layer under an unrolled loop.

XLA's CPU backend does not read a slice of a stack in place: each scan step copies its layer's
weights into a fresh buffer before the matrix products read them (a ``dynamic-slice`` fusion, and
a static slice is a copy too). A batch-1 decode step is a stream of matrix-vector products, so
that copy costs more than the products themselves (SmolLM2-135M: 22 against 18 ms a token,
docs/results.md). On the CPU the target therefore keeps each layer's weights in buffers of their
own and unrolls the layer loop (one layer body per layer: compiles take longer, about 3x for a
30-layer model), while accelerators, whose compilers fuse the slice into the product, keep the
stack and one compiled layer body (:data:`LAYOUTS`; docs/design.md#target-model).

XLA's CPU matrix-vector product (one row: a batch-1 decode step) reads a kernel fastest transposed,
``[out, in]``, and fused where kernels read the same input (SmolLM2-135M's layer products: 34 GB/s as
``[in, out]``, 46 as fused ``[out, in]``), while a product of a few rows (a verification pass) is
1.5-1.7x slower on the transposed kernel than on ``[in, out]``. So per-layer buffers of a target up to
:data:`ONE_ROW_COPIES_MAX_BYTES` also hold one-row copies (:data:`FUSED`: q/k/v in one matrix, gate/up
in another, 4 products a layer instead of 7), which one-row passes read and the others do not. The
layouts compute the same functions: a pass of several rows gives the stacked layout's float32 logits bit
for bit, a one-row pass agrees to rounding (the fused products sum in another order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.layers import gate, gated_mlp

LAYOUTS = ("auto", "stacked", "per_layer")
"""``layer_layout`` values of :class:`~dspark_jax.models.target.Target`: ``auto`` is ``per_layer``
for a float32 target on a CPU without a mesh, else ``stacked``."""


def per_layer_layout(layout: str, cfg: Any, mesh: Any, dtype: Any) -> bool:
    """Whether a target of ``cfg`` built with ``layer_layout=layout`` keeps per-layer buffers.

    ``auto`` picks per-layer buffers for float32 weights on the CPU backend when the target is not
    sharded (``mesh`` None) and its layers scan uniformly (not Gemma 4's two layer shapes, not dense
    and sparse MLP layers mixed, whose weights are stacked per group). A bfloat16 target keeps the
    stack: unrolled, XLA keeps more of a bfloat16 program in float32 across layers (it allows excess
    precision), so that its cached and cache-less passes would round further apart.

    Raises:
      ValueError: an unknown layout, or ``per_layer`` asked for a target it does not serve.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layer_layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    unsupported = [
        name
        for name, on in (
            ("a device mesh", mesh is not None),
            ("grouped attention (Gemma 4)", cfg.grouped_attention),
            ("mixed dense and sparse MLP layers", cfg.mixed_mlp),
        )
        if on
    ]
    if layout == "per_layer" and unsupported:
        raise ValueError(f"layer_layout='per_layer' is not implemented with {unsupported[0]}")
    if layout == "auto":
        return not unsupported and jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32
    return layout == "per_layer"


FUSED = (
    ("wqkv_t", ("wq", "wk", "wv")),
    ("wo_t", ("wo",)),
    ("w_gate_up_t", ("w_gate", "w_up")),
    ("w_down_t", ("w_down",)),
)
"""The one-row copies of a per-layer buffer: ``name -> the [in, out] kernels`` it holds as
``concatenate(kernels, axis=1).T``, ``[sum of outs, in]`` (when the layer has all of them, 2-D)."""

ONE_ROW_COPIES_MAX_BYTES = 4 << 30
"""Per-layer weights up to this size [bytes] get :data:`FUSED` one-row copies (they double the
projections' memory); a larger target keeps its ``[in, out]`` kernels only."""


def one_row_copies(layer: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The :data:`FUSED` copies of one layer's kernels ``{key: [in, out]}`` (groups it lacks are skipped)."""
    out = {}
    for name, parts in FUSED:
        if all(k in layer and layer[k].ndim == 2 for k in parts):
            out[name] = jnp.concatenate([jnp.asarray(layer[k]) for k in parts], axis=1).T
    return out


def store_layers(stacked: Mapping[str, Any], per_layer: bool, cast: Callable[..., nnx.Param], shardings=None):
    """The module storage of ``stacked`` (``{key: [L, ...]}``, host or device arrays).

    Returns:
      ``nnx.Dict`` of ``nnx.Param`` ``[L, ...]`` (stacked), or ``nnx.List`` of ``L`` ``nnx.Dict``
      of ``nnx.Param`` (per layer; up to :data:`ONE_ROW_COPIES_MAX_BYTES` of weights also each
      layer's :func:`one_row_copies`). ``cast(array, sharding)`` makes each parameter.
    """
    sh = shardings or {}
    if not per_layer:
        return nnx.Dict({k: cast(v, sh.get(k)) for k, v in stacked.items()})
    n = len(next(iter(stacked.values())))
    layers = [{k: v[i] for k, v in stacked.items()} for i in range(n)]
    if sum(v.size * 4 for v in stacked.values()) <= ONE_ROW_COPIES_MAX_BYTES:  # float32: per_layer_layout
        layers = [d | one_row_copies(d) for d in layers]
    return nnx.List([nnx.Dict({k: cast(v) for k, v in d.items()}) for d in layers])


def stacked_weights(layers) -> dict[str, jax.Array]:
    """``{key: [L, ...]}`` of :func:`store_layers`' storage, without the one-row copies (stacked on
    the fly for per-layer buffers: a copy, for code outside the decode loop)."""
    if isinstance(layers, nnx.List):
        keys = [k for k in layers[0] if k not in dict(FUSED)]
        return {k: jnp.stack([d[k][...] for d in layers]) for k in keys}
    return {k: v[...] for k, v in layers.items()}


def _one_row(x: jax.Array, p: Mapping[str, Any], name: str) -> bool:
    """Whether ``x [..., in]`` is one row and ``p`` has the one-row copy ``name`` (static)."""
    return name in p and math.prod(x.shape[:-1]) == 1


def _rows_dot(x: jax.Array, w_t: jax.Array) -> jax.Array:
    """``x [..., in]`` times the transposed kernel ``w_t [out, in]``: ``[..., out]``."""
    return jax.lax.dot_general(x, w_t, (((x.ndim - 1,), (1,)), ((), ())))


def qkv_projections(p: Mapping[str, jax.Array], a: jax.Array, q_width: int) -> tuple[jax.Array, ...]:
    """A layer's ``(a W_q, a W_k, a W_v)`` of ``a [..., H]`` from its weights ``p`` (one row: the
    fused copy, ``q_width`` being ``W_q``'s output width and k and v the remaining equal halves)."""
    if not _one_row(a, p, "wqkv_t"):
        return a @ p["wq"], a @ p["wk"], a @ p["wv"]
    y = _rows_dot(a, p["wqkv_t"])
    kv = (y.shape[-1] - q_width) // 2
    return y[..., :q_width], y[..., q_width : q_width + kv], y[..., q_width + kv :]


def out_projection(p: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """A layer's attention output ``x [..., nh*hd]`` times ``W_o`` (one row: the transposed copy)."""
    return _rows_dot(x, p["wo_t"]) if _one_row(x, p, "wo_t") else x @ p["wo"]


def dense_mlp(p: Mapping[str, jax.Array], x: jax.Array, activation: str) -> jax.Array:
    """A layer's gated MLP of ``x [..., H]`` (:func:`~dspark_jax.models.layers.gated_mlp`; one row:
    the fused, transposed copies)."""
    if not _one_row(x, p, "w_gate_up_t"):
        return gated_mlp(x, p["w_gate"], p["w_up"], p["w_down"], activation)
    gu = _rows_dot(x, p["w_gate_up_t"])
    f = gu.shape[-1] // 2
    return _rows_dot(gate(gu[..., :f], gu[..., f:], activation), p["w_down_t"])


def layer_inputs(layers) -> dict[str, jax.Array] | list[dict[str, jax.Array]]:
    """What :func:`run_layers` takes: the stacked dict, or a list of per-layer dicts."""
    if isinstance(layers, nnx.List):
        return [{k: v[...] for k, v in d.items()} for d in layers]
    return {k: v[...] for k, v in layers.items()}


def run_layers(body: Callable, carry: Any, params, extra: Any = None) -> tuple[Any, Any]:
    """``lax.scan(body, carry, xs)`` over the layers: ``xs`` is ``params`` (or ``(params, extra)``).

    Args:
      body: ``(carry, xs) -> (carry, y)``, one layer.
      params: :func:`layer_inputs`: a stacked dict (scanned) or a list of per-layer dicts (the loop
        is unrolled, layer ``i`` getting ``params[i]`` and ``extra``'s row ``i``).
      extra: optional per-layer inputs ``[L, ...]`` (a pytree), scanned beside the weights.
    Returns:
      ``(carry, ys)`` as ``lax.scan``'s: ``ys`` stacked over layers (None when ``body`` gives None).
    """
    if not isinstance(params, list):
        return jax.lax.scan(body, carry, params if extra is None else (params, extra))
    ys = []
    for i, p in enumerate(params):
        carry, y = body(carry, p if extra is None else (p, jax.tree.map(lambda a, i=i: a[i], extra)))
        ys.append(y)
    if ys[0] is None:
        return carry, None
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
