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

Both layouts run the same operations on the same values: in float32 a pass gives the same logits
either way, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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


def store_layers(stacked: Mapping[str, Any], per_layer: bool, cast: Callable[..., nnx.Param], shardings=None):
    """The module storage of ``stacked`` (``{key: [L, ...]}``, host or device arrays).

    Returns:
      ``nnx.Dict`` of ``nnx.Param`` ``[L, ...]`` (stacked), or ``nnx.List`` of ``L`` ``nnx.Dict``
      of ``nnx.Param`` (per layer). ``cast(array, sharding)`` makes each parameter.
    """
    sh = shardings or {}
    if not per_layer:
        return nnx.Dict({k: cast(v, sh.get(k)) for k, v in stacked.items()})
    n = len(next(iter(stacked.values())))
    return nnx.List([nnx.Dict({k: cast(v[i]) for k, v in stacked.items()}) for i in range(n)])


def stacked_weights(layers) -> dict[str, jax.Array]:
    """``{key: [L, ...]}`` of :func:`store_layers`' storage (stacked on the fly for per-layer
    buffers: a copy, for code outside the decode loop)."""
    if isinstance(layers, nnx.List):
        return {k: jnp.stack([d[k][...] for d in layers]) for k in layers[0]}
    return {k: v[...] for k, v in layers.items()}


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
