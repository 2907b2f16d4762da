"""Device mesh and logical-axis sharding rules (docs/design.md#device-mesh).

MaxText style: every parameter, cache and batch dimension has a *logical* name
(``vocab``, ``heads``, ``kv_heads``, ``mlp``, ``embed``, ``batch`` ...), and a table of
rules maps logical names to *mesh* axes. The mesh has three named axes:

* ``data``  -- the batch is split over it (data parallel);
* ``fsdp``  -- the batch is split over it too, and parameters' ``embed`` dimension
  with their optimizer state (fully sharded data parallel; size 1 unless asked for);
* ``model`` -- attention heads, KV heads, MLP hidden units, the vocabulary and the
  drafter's feature projection are split over it (tensor parallel); so are a mixture-of-experts
  target's experts' hidden units (every chip holds a slice of every expert, so a batch-1 step reads
  the routed experts' slices on all chips at once, as vLLM's default does), or, when the axis does
  not divide the experts' hidden width, the experts themselves (expert parallel).

A dimension is only sharded when the mesh axis divides it -- in *units*: a fused
``[H, heads * head_dim]`` projection is sharded over ``model`` only when the number of
heads is divisible, so every device holds whole heads -- otherwise it is replicated
(the replication fallback: stories260K has 4 KV heads, SmolLM2-135M 9 heads and 3 KV
heads). So any model runs on any mesh; only the memory saving differs.
One exception: a KV cache with fewer KV heads than ``model`` devices, a divisor of them, puts
each head on ``model / kv_heads`` devices (:func:`cache_sharding`).

Everything here is a pure function of shapes, names and the mesh: the trainer
(:mod:`dspark_jax.training.trainer`), the engine (:mod:`dspark_jax.serving.engine`) and the dry run
(:mod:`dspark_jax.train`) share it. The default mesh (``mesh=""``) is today's layout:
every device on ``data`` (parameters replicated); on one device nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "model")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("expert_mlp", "model"),
    ("experts", "model"),  # used only when "expert_mlp" could not take the axis
    ("features", "model"),
    ("embed", "fsdp"),
    ("layers", None),
    ("norm", None),
    ("head_dim", None),
    ("rank", None),
    ("cache_batch", None),
    ("cache_seq", None),
)

# Logical names of a parameter's trailing dimensions, by parameter name (target, DSpark/DFlash
# drafter and EAGLE-3 drafter share names). Extra leading dimensions are the stacked ``layers``.
# Parameters not listed (norm scales, biases, the Markov gate/GRU, the confidence head) are
# small and replicated.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "g_wq": ("embed", "heads"),  # Gemma 4's full-attention layers (their few KV heads: replicated)
    "g_wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "moe_gate": ("experts", "embed", "expert_mlp"),
    "moe_up": ("experts", "embed", "expert_mlp"),
    "moe_down": ("experts", "expert_mlp", "embed"),
    "fc": ("features", "embed"),
    "w1": ("vocab", "rank"),  # the DSpark drafter's Markov head, markov_head/w1 (drafters.markov)
    "w2": ("rank", "vocab"),
    # A CPU target's one-row copies ([out, in], models.layer_stack.FUSED), sharded like their kernels
    # when such a target is placed on a mesh afterwards (the trainer's host mesh).
    "wqkv_t": ("features", "embed"),
    "wo_t": ("embed", "heads"),
    "w_gate_up_t": ("mlp", "embed"),
    "w_down_t": ("embed", "mlp"),
}

# A KV cache ``[L, B, S, kv_heads, head_dim]`` (target and drafter context caches).
CACHE_AXES = ("layers", "cache_batch", "cache_seq", "kv_heads", "head_dim")


def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """Parses ``"data:2,model:4"`` into ``{"data": 2, "model": 4}`` (missing axes: 1).

    One size may be ``-1`` (or ``*``): it takes whatever the device count leaves
    (resolved by :func:`make_mesh`). ``None`` or ``""`` gives ``{}`` (the default mesh).

    Raises:
      ValueError: unknown axis name, repeated axis, or a size that is not a positive
        integer (or ``-1``), with the offending text.
    """
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        text = str(spec).strip()
        if not text:
            return {}
        items = []
        for part in text.split(","):
            name, sep, size = part.strip().partition(":")
            if not sep:
                raise ValueError(f"mesh {spec!r}: expected axis:size pairs like data:2,model:4, got {part!r}")
            items.append((name.strip(), size.strip()))
    out: dict[str, int] = {}
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(f"mesh {spec!r}: unknown axis {name!r} (axes: {', '.join(MESH_AXES)})")
        if name in out:
            raise ValueError(f"mesh {spec!r}: axis {name!r} given twice")
        try:
            n = -1 if str(size) == "*" else int(size)
        except ValueError:
            raise ValueError(f"mesh {spec!r}: size of {name!r} must be an integer, got {size!r}") from None
        if n < 1 and n != -1:
            raise ValueError(f"mesh {spec!r}: size of {name!r} must be >= 1 (or -1), got {n}")
        out[name] = n
    if sum(1 for v in out.values() if v == -1) > 1:
        raise ValueError(f"mesh {spec!r}: at most one axis may be -1")
    return out


def mesh_shape(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Sizes of all three axes for ``num_devices`` devices.

    The default (empty spec) puts every device on ``data``; a ``-1`` axis (or, when every
    given size is fixed and ``data`` is not named, ``data``) takes the remaining factor.

    Raises:
      ValueError: the sizes' product is not the device count, e.g.
        ``mesh data:3,model:4 needs 12 devices (3 x 4), but 8 are available``.
    """
    sizes = parse_mesh(spec)
    free = [k for k, v in sizes.items() if v == -1]
    if not free and "data" not in sizes:
        sizes["data"] = -1
        free = ["data"]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if fixed < 1 or num_devices % fixed:
            raise ValueError(
                f"mesh {_fmt(spec)} does not divide {num_devices} devices (the fixed axes need a multiple of {fixed})"
            )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total != num_devices:
        named = " x ".join(str(v) for v in sizes.values() if v != 1) or "1"
        raise ValueError(f"mesh {_fmt(spec)} needs {total} devices ({named}), but {num_devices} are available")
    return {a: int(sizes.get(a, 1)) for a in MESH_AXES}


def _fmt(spec) -> str:
    if isinstance(spec, Mapping):
        return ",".join(f"{k}:{v}" for k, v in spec.items())
    return str(spec or "(default)")


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, fsdp, model)`` mesh over ``devices`` (default: every device of every host).

    Devices are laid out in ``jax.devices()`` order with ``model`` fastest, so a model-parallel
    group is a run of neighbouring devices (same host / same ICI ring).

    Raises:
      ValueError: bad spec or a size product that is not the device count (see :func:`mesh_shape`).
    """
    devs = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(spec, len(devs))
    return Mesh(np.array(devs, dtype=object).reshape([shape[a] for a in MESH_AXES]), MESH_AXES)


def axis_size(mesh: Mesh | AbstractMesh, axis: str | Sequence[str] | None) -> int:
    """Devices along a mesh axis (or the product over a tuple of axes; 1 for None or absent)."""
    if axis is None:
        return 1
    if isinstance(axis, str):
        return int(dict(mesh.shape).get(axis, 1))
    return math.prod(axis_size(mesh, a) for a in axis)


def _present(mesh: Mesh | AbstractMesh, axis):
    """``axis`` restricted to axes the mesh has (tuple rules); None when nothing remains."""
    names = set(mesh.axis_names)
    if axis is None:
        return None
    if isinstance(axis, str):
        return axis if axis in names else None
    kept = tuple(a for a in axis if a in names)
    return kept[0] if len(kept) == 1 else (kept or None)


def logical_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    rules: Iterable[tuple[str, Any]] = DEFAULT_RULES,
    units: Mapping[str, int] | None = None,
) -> P:
    """``PartitionSpec`` of an array whose dimensions have logical names ``axes``.

    Args:
      axes: logical name per dimension (None: replicated), ``len(axes) == len(shape)``.
      shape: the array's shape.
      mesh: the device mesh (or an :class:`AbstractMesh` when planning).
      rules: ``(logical, mesh axis | tuple of mesh axes | None)`` pairs; first match wins, and
        when two dimensions want one mesh axis, the one whose rule comes first takes it.
      units: logical name -> the count that must be divisible (e.g. ``heads`` -> number of
        heads for a fused ``heads * head_dim`` dimension); default: the dimension itself.
    Returns:
      The spec; a dimension is replicated when its rule's mesh axes do not divide it, or
      when those mesh axes are taken by a dimension whose rule comes earlier in ``rules``.
    Raises:
      ValueError: ``axes`` and ``shape`` differ in length.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    table = dict(rules)
    rank = {name: i for i, name in enumerate(table)}  # which dimension picks its mesh axes first
    units = units or {}
    used: set[str] = set()
    out: list[Any] = [None] * len(axes)
    for i in sorted(range(len(axes)), key=lambda i: (rank.get(axes[i] or "", len(rank)), i)):
        name, dim = axes[i], shape[i]
        mesh_axis = _present(mesh, table.get(name)) if name is not None else None
        n = axis_size(mesh, mesh_axis)
        flat = {mesh_axis} if isinstance(mesh_axis, str) else set(mesh_axis or ())
        count = int(units.get(name, dim)) if name is not None else dim
        if not (mesh_axis is None or n == 1 or count % n or dim % n or flat & used):
            out[i] = mesh_axis
            used |= flat
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _units(cfg: Any) -> dict[str, int]:
    """Divisibility units of a target/drafter config: whole heads per device."""
    return {"heads": int(cfg.num_heads), "kv_heads": int(cfg.num_kv_heads)}


def _path_names(path) -> list[str]:
    names = []
    for k in path:
        key = getattr(k, "key", None)
        if isinstance(key, str):
            names.append(key)
        elif isinstance(getattr(k, "name", None), str) and k.name != "value":
            names.append(k.name)
    return names


def param_axes(path, shape: Sequence[int]) -> tuple[str | None, ...]:
    """Logical axes of a parameter (or of its optimizer moments) from its tree path and shape.

    The parameter's name is the last name on the path that :data:`PARAM_AXES` knows (so an
    optax ``mu/layers/wq/value`` path resolves like ``layers/wq/value``); leading dimensions
    beyond the named trailing ones are ``layers``. Unknown names and scalars: replicated.
    """
    names = _path_names(path)
    trailing = next((PARAM_AXES[n] for n in reversed(names) if n in PARAM_AXES), None)
    if trailing is None or len(shape) < len(trailing):
        return (None,) * len(shape)
    return ("layers",) * (len(shape) - len(trailing)) + trailing


def tree_shardings(tree: Any, mesh: Mesh, cfg: Any, rules: Iterable[tuple[str, Any]] = DEFAULT_RULES) -> Any:
    """``NamedSharding`` for every array leaf of a parameter tree (``nnx.State``, pure dict) or of
    an optimizer state over such a tree; the same structure as ``tree``.

    Args:
      tree: arrays or ``jax.ShapeDtypeStruct`` leaves.
      mesh: the device mesh (or an :class:`AbstractMesh` when planning).
      cfg: the model's :class:`~dspark_jax.config.TargetConfig` or
        :class:`~dspark_jax.config.DrafterConfig` (head counts for divisibility).
    """
    rules = tuple(rules)
    units = _units(cfg)

    def one(path, x):
        shape = tuple(np.shape(x))
        return NamedSharding(mesh, logical_spec(param_axes(path, shape), shape, mesh, rules, units))

    return jax.tree_util.tree_map_with_path(one, tree)


def kv_heads_split_model(model: int, num_kv_heads: int) -> bool:
    """Whether a KV cache's head axis goes over a split ``model_kv x model_rep`` of a ``model`` axis
    of ``model`` devices (:func:`cache_sharding`): fewer KV heads than devices, more than one, a divisor."""
    return 1 < num_kv_heads < model and model % num_kv_heads == 0


def cache_sharding(
    mesh: Mesh, num_kv_heads: int, shape: Sequence[int], rules: Iterable[tuple[str, Any]] = DEFAULT_RULES
) -> NamedSharding:
    """Sharding of a KV cache ``[L, B, S, kv_heads, head_dim]``: KV heads over ``model`` when it
    divides them; with fewer KV heads than ``model`` devices (a multiple of them), each KV head on
    ``model / kv_heads`` neighbouring devices, else replicated.

    Why the split: the query heads are over ``model``, so device ``i`` needs only KV head
    ``i // (model / kv_heads)``. A replicated cache made the TPU compiler keep that one head in the
    layer loop anyway and all-gather (and copy) the whole K and V cache after every step. The split
    is a :class:`NamedSharding` on the same devices, in the same order, with ``model`` cut into
    ``model_kv`` (major, over the KV heads) and ``model_rep`` (minor, the copies of a head): each
    device holds one KV head, where the read and the write are local.
    """
    rules = tuple(rules)
    m = axis_size(mesh, "model")
    if (
        isinstance(mesh, Mesh)
        and dict(rules).get("kv_heads") == "model"
        and kv_heads_split_model(m, num_kv_heads)
        and mesh.axis_names[-1] == "model"
    ):
        d = mesh.devices
        split = Mesh(
            d.reshape(d.shape[:-1] + (num_kv_heads, m // num_kv_heads)),
            (*mesh.axis_names[:-1], "model_kv", "model_rep"),
        )
        return NamedSharding(
            split,
            logical_spec(CACHE_AXES, shape, split, (*rules, ("kv_heads", "model_kv")), {"kv_heads": num_kv_heads}),
        )
    return NamedSharding(mesh, logical_spec(CACHE_AXES, shape, mesh, rules, {"kv_heads": num_kv_heads}))


def batch_sharding(mesh: Mesh, ndim: int = 1, rules: Iterable[tuple[str, Any]] = DEFAULT_RULES) -> NamedSharding:
    """Leading (batch) dimension over ``data`` (and ``fsdp``); the rest replicated."""
    axis = _present(mesh, dict(rules).get("batch"))
    return NamedSharding(mesh, P(axis) if axis is not None else P())


def batch_axes(mesh: Mesh, rules: Iterable[tuple[str, Any]] = DEFAULT_RULES):
    """The mesh axis (or axes) the batch is split over (for ``PartitionSpec`` entries)."""
    return _present(mesh, dict(rules).get("batch"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree: Any, shardings: Any) -> Any:
    """Puts every leaf of ``tree`` (identical on all processes) on its sharding.

    One process: ``jax.device_put``. Several: each process fills its own devices from its
    host copy (``jax.make_array_from_callback``), which works for meshes spanning devices
    this process cannot address. ``shardings`` is a tree like ``tree`` or one sharding.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def shard_bytes(shape: Sequence[int], itemsize: int, spec: P, mesh_sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of an array of ``shape`` laid out by ``spec`` (no devices needed)."""
    n = math.prod(int(d) for d in shape) * itemsize
    for entry in spec:
        for a in (entry,) if isinstance(entry, str) else (entry or ()):
            n //= int(mesh_sizes.get(a, 1))
    return int(n)


class AbstractMesh:
    """Axis names and sizes only, to plan shardings for devices that are not here (dry runs).

    Quacks like :class:`jax.sharding.Mesh` for :func:`logical_spec` (``axis_names``, ``shape``).
    """

    def __init__(self, sizes: Mapping[str, int]):
        self.axis_names = MESH_AXES
        self.shape = {a: int(sizes.get(a, 1)) for a in MESH_AXES}


def tree_bytes_per_device(
    tree: Any,
    sizes: Mapping[str, int],
    cfg: Any,
    itemsize: int | None = None,
    rules: Iterable[tuple[str, Any]] = DEFAULT_RULES,
) -> int:
    """Per-device bytes of a parameter tree (shapes only) under the rules on a mesh of ``sizes``.

    Args:
      tree: leaves with ``.shape`` (and ``.dtype`` unless ``itemsize`` is given).
      itemsize: bytes per element to assume (default: each leaf's dtype).
    """
    mesh = AbstractMesh(sizes)
    rules, units = tuple(rules), _units(cfg)
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        shape = tuple(np.shape(x))
        spec = logical_spec(param_axes(path, shape), shape, mesh, rules, units)
        total += shard_bytes(shape, itemsize or np.dtype(x.dtype).itemsize, spec, mesh.shape)
    return total


def describe(mesh: Mesh) -> str:
    """``"data:2,model:4"``: the axes larger than 1 (``"data:1"`` on one device)."""
    parts = [f"{a}:{n}" for a, n in dict(mesh.shape).items() if n > 1]
    return ",".join(parts) or "data:1"
