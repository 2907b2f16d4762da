"""The project's hot programs compiled for a TPU topology that is not here, by the TPU compiler.

    JAX_PLATFORMS=cpu python -m benchmarks.tpu_compile --topology v5e:2x4 --json /tmp/tpu.json

With ``libtpu`` installed (the version jax's ``tpu`` extra pins), JAX compiles for a named TPU
topology on this CPU (``jax.experimental.topologies.get_topology_desc``, as MaxText's
``train_compile.py``). For each topology and model shape (``qwen3-8b`` and ``qwen3-4b`` by default,
or a folder with a Hugging Face ``config.json``) the programs below are lowered with the
project's own shardings (:func:`dspark_jax.models.sharding.make_mesh` over the topology's devices,
``model:<chips>`` by default; abstract bfloat16 parameters from ``nnx.eval_shape``,
:func:`~dspark_jax.models.sharding.tree_shardings`, :func:`~dspark_jax.models.sharding.cache_sharding`;
caches donated) and compiled:

* ``decode-1``: the batch-1 target step (one token, KV cache write), at each ``--caches`` length;
* ``verify-8``: the batch-1 verification pass of 8 tokens with three tapped layers;
* ``engine-R``: the serving engine's packed target pass (:meth:`Target.forward_packed`) at R rows;
* ``prefill-chunk``: chunked prefill's target pass (``chunk_forward``) over 4 staging lanes;
* ``drafter-ctx``: the DSpark drafter's context-cache write of 64 packed tokens (``write_context``).

With ``--backends xla,pallas_tpu`` the programs that attend through the target's backend
(decode, verify, engine) are compiled again with the Pallas kernel (under ``shard_map`` on the
mesh); ``pallas_calls`` counts the Mosaic kernel calls in the optimised HLO.

Reported per program: per-device memory from ``memory_analysis()`` (arguments, temporaries,
outputs, aliased), the whole-cache copies in the optimised HLO (copy/transpose instructions with
as many elements as one device's K or V cache, anywhere in the module), the collectives in the
HLO (static count; those in the layer loop run once per layer), and bytes accessed with an
estimated time at the chip's HBM bandwidth against the ideal (per-device weights read once, plus
the live KV).

A mixture-of-experts target (``qwen3-30b-a3b``) is compiled the same way; its ideal counts of
each device's experts only those a pass may route to: ``k`` a token, at most the experts the device
holds (:meth:`Builder.active_weight_bytes`), under the project's rule (each expert's hidden units
over ``model``) or with ``--expert-split experts`` (the experts over ``model``, expert parallel).

Two byte counts are reported against the ideal. ``hbm_vs_ideal`` (the one the goals use) reads the
HBM traffic of the program as compiled, rolled layer loop and all, from its optimised HLO
(:func:`benchmarks.hlo_bytes.hbm_bytes`): operands and results in HBM (memory space 0), each
``while`` body times its trip count. ``bytes_vs_ideal`` is libtpu's ``cost_analysis()`` "bytes
accessed", which counts a ``while`` body once, so it comes from a second compile of the same
program with the layer scan unrolled (``jax.lax.scan(unroll=True)`` while tracing); it also counts
the on-chip VMEM copies the compiler stages weights through (a weight staged by ``copy-start``
counts four times) and the unrolled program is not the one that runs (unrolled, verification
slices the stacked K/V weights into fresh HBM buffers; the rolled loop does not). Both count the
attention's loop over 256-key blocks (a runtime trip count) once: the bytes are those of a live
length of one block (256 positions), which is the live length the ideal uses. For a
mixture-of-experts target the unrolled layers take their weights by an index the
compiler cannot see, as the loop does (static slices let it copy a layer's whole expert stacks).
The estimates are ``bytes / HBM bandwidth`` (libtpu's own ``optimal_seconds`` is not used: it
can be negative). The package is imported from ``sys.path`` as found, so running this file by its
path with ``PYTHONPATH=<other checkout>`` measures that checkout (before/after numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.hlo_bytes import cache_copies, collectives, hbm_bytes
from dspark_jax.models import sharding as shd
from dspark_jax.models.layers import KVCache
from dspark_jax.models.target import Target
from dspark_jax.models.weights import target_param_shapes

# Chips per host of the topologies named here (get_topology_desc needs them), and HBM GB/s per chip.
TOPOLOGY_BOUNDS = {"v5e:2x2": (2, 2, 1), "v5e:2x4": (2, 4, 1), "v6e:2x4": (2, 4, 1), "v5p:2x2x1": (2, 2, 1)}
HBM_GBS = (
    ("h100", 3352.0),
    ("v5 lite", 819.0),
    ("v5e", 819.0),
    ("v6 lite", 1640.0),
    ("v6e", 1640.0),
    ("v5p", 2765.0),
    ("v5", 2765.0),
)
EXPERT_KEYS = ("moe_gate", "moe_up", "moe_down")  # a mixture-of-experts layer's expert stacks
LIVE = 256  # live KV positions the byte counts correspond to (one attention block, see the module doc)


# GPUs compiled for without a GPU (``h100:<n>``): XLA's GpuTargetConfig device facts (H100 SXM 80 GB, public specs).
H100 = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 << 10,
    "shared_memory_per_core": 228 << 10,
    "shared_memory_per_block_optin": 227 << 10,
    "threads_per_core_limit": 2048,
    "core_count": 132,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "memory_bandwidth": 3_352_320_000_000,
    "l2_cache_size": 50 << 20,
    "clock_rate_ghz": 1.98,
    "device_memory_size": 80 * 10**9,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA PJRT plugin is importable (False, not ModuleNotFoundError, without ``jax_plugins``)."""
    import importlib.util

    return importlib.util.find_spec("jax_plugins") is not None and (
        importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    )


def gpu_devices(name: str) -> list[Any]:
    """The devices of ``h100:<n>`` (n GPUs on one host), compiled for without a GPU by the CUDA
    PJRT plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at jax's version; no driver needed).

    Raises:
      ValueError: the plugin is not installed.
    """
    from jax.experimental import topologies

    if not cuda_plugin_installed():
        raise ValueError(f"topology {name!r} needs jax-cuda12-plugin and jax-cuda12-pjrt=={jax.__version__}")
    info = " ".join(f"{k}: {v}" for k, v in H100.items())
    config = (
        f"gpu_device_info {{ {info} cuda_compute_capability {{ major: 9 }} }} platform_name: 'CUDA' "
        "dnn_version_info { major: 9 minor: 7 } runtime_version { major: 12 minor: 8 } "
        "device_description_str: 'NVIDIA H100 80GB HBM3'"
    )
    n = int(name.split(":")[1])
    return list(topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{n}").devices)


def topology_devices(name: str) -> list[Any]:
    """The devices of TPU topology ``name`` (``v5e:2x4``) or of ``h100:<n>`` (:func:`gpu_devices`),
    compiled for without a TPU or GPU.

    Raises:
      ValueError: a topology not in :data:`TOPOLOGY_BOUNDS` nor ``h100:<n>``.
    """
    from jax.experimental import topologies

    if re.fullmatch(r"h100:\d+", name):
        return gpu_devices(name)
    if name not in TOPOLOGY_BOUNDS:
        raise ValueError(f"topology {name!r}: known ones are {', '.join(TOPOLOGY_BOUNDS)}")
    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=name,
        chip_config_name="default",
        chips_per_host_bounds=TOPOLOGY_BOUNDS[name],
        num_slices=1,
    )
    return list(topo.devices)


def hbm_gbs(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((v for k, v in HBM_GBS if k in kind), None)


def model_config(spec: str):
    """A built-in config name (``qwen3-8b``) or a folder holding a Hugging Face ``config.json``."""
    from dspark_jax.models.presets import builtin_target_config

    if Path(spec).is_dir():
        from transformers import AutoConfig

        from dspark_jax.models.hf_io import hf_target_config

        return hf_target_config(AutoConfig.from_pretrained(spec), where=spec, name=Path(spec).name)
    return builtin_target_config(spec)


# -------------------------------------------------------------------------------------- costing


def _opaque_unrolled_scan(f, init, xs=None, length=None, reverse=False, **_):
    """``jax.lax.scan`` as straight-line code whose step ``i`` takes its inputs by a dynamic index
    the compiler cannot see (``optimization_barrier``), as the rolled loop's body does: with static
    slices the TPU compiler materialises a layer's whole expert stacks (into VMEM) before picking
    the routed experts from them, which the rolled loop does not do."""
    leaves = jax.tree.leaves(xs)
    n = length if length is not None else leaves[0].shape[0]
    carry, ys = init, []
    for i in reversed(range(n)) if reverse else range(n):
        at = jax.lax.optimization_barrier(jnp.int32(i))
        x = jax.tree.map(lambda a, at=at: jax.lax.dynamic_index_in_dim(a, at, keepdims=False), xs)
        carry, y = f(carry, x)
        ys.append(y)
    if reverse:
        ys.reverse()
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys else None


@contextlib.contextmanager
def unrolled_scans(opaque_index: bool = False):
    """``jax.lax.scan`` unrolls while tracing (the layer loop becomes straight-line code for
    costing); ``opaque_index``: by :func:`_opaque_unrolled_scan`."""
    original = jax.lax.scan

    def scan(*a, **kw):
        if opaque_index:
            return _opaque_unrolled_scan(*a, **kw)
        kw["unroll"] = True
        return original(*a, **kw)

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original


# ------------------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
    name: str
    fn: Any
    args: tuple
    donate: tuple[int, ...]
    out_shardings: Any
    cache_elements: int  # elements of one device's K (or V) cache
    ideal_bytes: int | None  # per-device weights + live KV read by one call (None: not a decode pass)
    opaque_index: bool = False  # cost with the layers taken by an opaque index (a mixture-of-experts target)


def _pair(x: Any) -> KVCache:
    """A :class:`KVCache` of abstract arrays or shardings (K and V alike)."""
    return KVCache(cast(Any, x), cast(Any, x))


def sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


class Builder:
    """Abstract target (and drafter) on a mesh, and the programs over them."""

    def __init__(self, cfg, mesh, dtype=jnp.bfloat16, rules=shd.DEFAULT_RULES):
        self.cfg, self.mesh, self.dtype = cfg, mesh, dtype
        shapes = target_param_shapes(cfg)

        def build():  # abstract: the zeros are never allocated (Qwen3-30B's would be 61 GB)
            zeros = jax.tree.map(lambda s: jnp.zeros(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple))
            return Target(cfg, zeros, dtype=dtype, layer_layout="stacked")  # an accelerator's layout, on any host

        self.graph, state = nnx.split(nnx.eval_shape(build))
        shard = shd.tree_shardings(state, mesh, cfg, rules)
        self.state = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), state, shard)
        self.rep = NamedSharding(mesh, P())
        sizes = dict(mesh.shape)
        self.weight_bytes = 0  # per device, read by every pass: all but the embedding and the experts
        self.expert_bytes = 0  # per device, every expert it holds (all sparse layers)
        self.local_experts = max(cfg.num_experts, 1)  # experts a device holds per layer
        for path, x in jax.tree_util.tree_leaves_with_path(self.state):
            keys = {getattr(k, "key", None) for k in path}
            if not cfg.tie_embeddings and "embed" in keys:
                continue  # an untied embedding is only gathered (one row a token)
            nbytes = shd.shard_bytes(x.shape, x.dtype.itemsize, x.sharding.spec, sizes)
            if keys & set(EXPERT_KEYS):
                self.expert_bytes += nbytes
                spec = tuple(x.sharding.spec) + (None,) * len(x.shape)
                axis = spec[len(x.shape) - 3]  # the expert dimension of [..., E, H, Im] / [..., E, Im, H]
                self.local_experts = cfg.num_experts // shd.axis_size(mesh, axis) if axis else cfg.num_experts
            else:
                self.weight_bytes += nbytes

    def active_weight_bytes(self, tokens: int) -> int:
        """Per-device weight bytes a pass over ``tokens`` tokens must read: the dense weights, and of
        a mixture-of-experts target's experts only ``k`` a token, capped at the experts a device
        holds (the routing is data: a compiled program must serve every routing, and on a device
        whose experts all ``tokens * k`` pairs chose it reads that many, or all it holds)."""
        if not self.expert_bytes:
            return self.weight_bytes
        used = min(tokens * self.cfg.num_experts_per_tok, self.local_experts)
        return self.weight_bytes + self.expert_bytes * used // self.local_experts

    def cache(self, rows: int, length: int, layers: int | None = None, kv_heads: int | None = None, hd=None):
        c = self.cfg
        shape = (layers or c.num_layers, rows, length, kv_heads or c.num_kv_heads, hd or c.head_dim)
        sh = shd.cache_sharding(self.mesh, shape[3], shape)
        one = sds(shape, self.dtype, sh)
        per_dev = shd.shard_bytes(shape, 1, sh.spec, dict(sh.mesh.shape))  # the cache's mesh may split model
        return _pair(one), sh, per_dev

    def kv_live_bytes(self, per_dev_elements: int, length: int) -> int:
        return 2 * per_dev_elements * jnp.dtype(self.dtype).itemsize * min(LIVE, length) // length

    def step(self, length: int, tokens: int, taps: tuple[int, ...] = ()) -> Program:
        graph = self.graph
        cache, sh, per_dev = self.cache(1, length)

        def fn(state, cache, tok, pos):
            out = nnx.merge(graph, state)(tok, pos, cache=cache, taps=taps)
            nxt = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
            return nxt, out.features, out.cache

        ids = sds((1, tokens), jnp.int32, self.rep)
        name = f"{'decode' if tokens == 1 else 'verify'}-{tokens}"
        ideal = self.active_weight_bytes(tokens) + self.kv_live_bytes(per_dev, length)
        return Program(
            name,
            fn,
            (self.state, cache, ids, ids),
            (1,),
            (self.rep, self.rep, _pair(sh)),
            per_dev,
            ideal,
            bool(self.cfg.num_experts),
        )

    def engine(self, rows: int, length: int) -> Program:
        graph = self.graph
        cache, sh, per_dev = self.cache(rows, length)

        def fn(state, cache, tok, row, col, pos):
            out = nnx.merge(graph, state).forward_packed(tok, row, col, pos, cache, num_rows=rows, width=1)
            return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache

        ids = sds((rows,), jnp.int32, self.rep)
        ideal = self.active_weight_bytes(rows) + self.kv_live_bytes(per_dev, length)
        args = (self.state, cache, ids, ids, ids, ids)
        moe = bool(self.cfg.num_experts)
        return Program(f"engine-{rows}", fn, args, (1,), (self.rep, _pair(sh)), per_dev, ideal, moe)

    def prefill_chunk(self, length: int, tokens: int = 256, lanes: int = 4, block: int = 8) -> Program:
        from dspark_jax.serving.engine.chunk_programs import chunk_forward

        graph = self.graph
        cache, sh, per_dev = self.cache(lanes, length)

        def fn(state, cache, tok, pos, lane):
            hidden, _, new = chunk_forward(nnx.merge(graph, state), tok, pos, lane, cache, span=length, block=block)
            return hidden, new

        ids = sds((tokens,), jnp.int32, self.rep)
        args = (self.state, cache, ids, ids, sds((tokens // block,), jnp.int32, self.rep))
        return Program("prefill-chunk", fn, args, (1,), (self.rep, _pair(sh)), per_dev, None)

    def drafter_context(self, length: int, rows: int = 8, tokens: int = 64) -> Program:
        from dspark_jax.config import DrafterConfig
        from dspark_jax.drafters.build import build_drafter

        dcfg = DrafterConfig.for_target(self.cfg, block_size=8, num_layers=2)
        dgraph, dstate = nnx.split(nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(0), dtype=self.dtype)))
        dshard = shd.tree_shardings(dstate, self.mesh, dcfg)
        dstate = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), dstate, dshard)
        cache, sh, per_dev = self.cache(rows, length, dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim)
        width = len(dcfg.taps) * self.cfg.hidden_size

        def fn(dstate, cache, feats, row, pos):
            return nnx.merge(dgraph, dstate).write_context(cache, feats, row, pos)

        ids = sds((tokens,), jnp.int32, self.rep)
        args = (dstate, cache, sds((tokens, width), self.dtype, self.rep), ids, ids)
        return Program("drafter-ctx", fn, args, (1,), _pair(sh), per_dev, None)


def expert_rules(split: str) -> tuple[tuple[str, Any], ...]:
    """Sharding rules with a mixture-of-experts target's experts' hidden units over ``model``
    (``"hidden"``, the project's rule) or, with the ``expert_mlp`` rule dropped, the experts themselves
    (``"experts"``, expert parallel)."""
    return tuple(r for r in shd.DEFAULT_RULES if split == "hidden" or r[0] != "expert_mlp")


def program_specs(
    num_layers: int, caches: tuple[int, ...], rows: tuple[int, ...], attending_only: bool = False
) -> list[tuple[str, dict]]:
    """``(Builder method, keyword arguments)`` of every program measured (``attending_only``: only
    those whose attention is the target's configured backend; chunked prefill and the drafter
    keep their own XLA attention)."""
    taps = (1, num_layers // 2, num_layers - 2)
    out: list[tuple[str, dict]] = []
    for s in caches:
        out += [("step", {"length": s, "tokens": 1}), ("step", {"length": s, "tokens": 8, "taps": taps})]
    s = max(caches)
    out += [("engine", {"rows": r, "length": s}) for r in rows]
    if not attending_only:
        out += [("prefill_chunk", {"length": s}), ("drafter_context", {"length": s})]
    return out


def compile_program(p: Program, unroll: bool):
    fn = p.fn if not unroll else (lambda *a: p.fn(*a))  # a new function: no trace-cache hit
    jit = jax.jit(fn, donate_argnums=p.donate, out_shardings=p.out_shardings)
    with unrolled_scans(p.opaque_index) if unroll else contextlib.nullcontext():
        return jit.lower(*p.args).compile()


def unrolled_bytes(p: Program) -> float:
    """``bytes accessed`` of ``p`` compiled with its layer scan unrolled."""
    cost = compile_program(p, unroll=True).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("bytes accessed", 0.0)) if cost else 0.0


def measure(p: Program, bandwidth: float | None, costed: bool = True, hlo_to: Path | None = None) -> dict[str, Any]:
    """Memory, copies and collectives of ``p``; for a decode pass (``p.ideal_bytes``) also its HBM
    bytes and the bytes of ``p`` compiled with its layer scan unrolled (the slow part: minutes at
    36 layers); ``hlo_to``: write the optimised HLO there."""
    t0 = time.perf_counter()
    exe = compile_program(p, unroll=False)
    seconds = time.perf_counter() - t0
    m = exe.memory_analysis()
    assert m is not None, "the TPU compiler gave no memory analysis"
    hlo = exe.as_text() or ""
    if hlo_to:  # for python -m benchmarks.hlo_bytes FILE (the bytes by memory space and operand)
        hlo_to.write_text(hlo)
    copies = cache_copies(hlo, p.cache_elements)
    nbytes = unrolled_bytes(p) if costed and p.ideal_bytes else None
    hbm = hbm_bytes(hlo)["hbm"] if p.ideal_bytes else None  # this (rolled) program's HBM bytes, from its HLO
    mib = 2.0**20
    r: dict[str, Any] = {
        "program": p.name,
        "args_mib": m.argument_size_in_bytes / mib,
        "temp_mib": m.temp_size_in_bytes / mib,
        "out_mib": m.output_size_in_bytes / mib,
        "alias_mib": m.alias_size_in_bytes / mib,
        "peak_mib": (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
        / mib,
        "cache_copies": len(copies),
        "pallas_calls": hlo.count('custom_call_target="tpu_custom_call"'),
        "copy_lines": copies[:4],
        "collectives": collectives(hlo),
        "bytes_accessed": nbytes,
        "ideal_bytes": p.ideal_bytes,
        "bytes_vs_ideal": nbytes / p.ideal_bytes if nbytes and p.ideal_bytes else None,
        "est_ms": nbytes / bandwidth / 1e6 if nbytes and bandwidth else None,
        "hbm_bytes": hbm,
        "hbm_vs_ideal": hbm / p.ideal_bytes if hbm and p.ideal_bytes else None,
        "hbm_ms": hbm / bandwidth / 1e6 if hbm and bandwidth else None,
        "ideal_ms": p.ideal_bytes / bandwidth / 1e6 if bandwidth and p.ideal_bytes else None,
        "compile_s": seconds,
    }
    return r


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}"
    if isinstance(x, dict):
        return " ".join(f"{k}:{v}" for k, v in x.items()) or "-"
    return str(x)


def table(rows: list[dict[str, Any]]) -> None:
    cols = ["topology", "model", "backend", "program", "cache", "args_mib", "temp_mib", "out_mib", "peak_mib"]
    cols += ["cache_copies", "pallas_calls", "collectives", "bytes_vs_ideal", "est_ms", "hbm_vs_ideal", "hbm_ms"]
    cols += ["ideal_ms"]
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return a[key] / b[key] if a.get(key) and b.get(key) else None


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """verify-8 / decode-1 and cache max / min (decode-1) estimated time, per topology, model and
    attention backend."""
    out = []
    for key in sorted({(r["topology"], r["model"], r["backend"]) for r in rows}):
        mine = [r for r in rows if (r["topology"], r["model"], r["backend"]) == key]
        dec = {r["cache"]: r for r in mine if r["program"] == "decode-1"}
        ver = {r["cache"]: r for r in mine if r["program"] == "verify-8"}
        lo, hi = min(dec), max(dec)
        out.append(
            {
                "topology": key[0],
                "model": key[1],
                "backend": key[2],
                "verify8_over_decode1": _ratio(ver[hi], dec[hi], "bytes_accessed"),
                "cache_hi_over_lo": _ratio(dec[hi], dec[lo], "bytes_accessed"),
                "hbm_verify8_over_decode1": _ratio(ver[hi], dec[hi], "hbm_bytes"),
                "hbm_cache_hi_over_lo": _ratio(dec[hi], dec[lo], "hbm_bytes"),
                "caches": [lo, hi],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tpu_compile", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--topology", default="v5e:2x4", help=f"comma list of {', '.join(TOPOLOGY_BOUNDS)}, h100:<n>")
    ap.add_argument("--models", default="qwen3-8b,qwen3-4b", help="comma list: built-in config names or HF folders")
    ap.add_argument("--mesh", default="", help="mesh spec (default model:<chips>)")
    ap.add_argument("--caches", default="1024,4096", help="cache lengths of decode-1 / verify-8")
    ap.add_argument("--rows", default="1,8,64", help="engine step row counts (at the largest cache)")
    ap.add_argument(
        "--bytes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bytes accessed of the decode passes (a second, unrolled compile: minutes and ~11 GB at 36 layers)",
    )
    ap.add_argument(
        "--expert-split",
        choices=("experts", "hidden"),
        default="hidden",
        help="a mixture-of-experts target's experts' hidden units over model (the project's rule), or the experts",
    )
    ap.add_argument(
        "--backends",
        default="xla",
        help="comma list of target attention backends (xla, pallas_tpu); after the first only the "
        "programs that attend through it (decode, verify, engine)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--hlo-dir", type=Path, default=None, help="write each program's optimised HLO here")
    a = ap.parse_args(argv)
    caches = tuple(int(x) for x in a.caches.split(","))
    rows_arg = tuple(int(x) for x in a.rows.split(","))
    rows: list[dict[str, Any]] = []
    for topo in a.topology.split(","):
        devices = topology_devices(topo)
        mesh = shd.make_mesh(a.mesh or f"model:{len(devices)}", devices=devices)
        bw = hbm_gbs(devices[0].device_kind)
        for spec, (i, backend) in itertools.product(a.models.split(","), enumerate(a.backends.split(","))):
            cfg = dataclasses.replace(model_config(spec), attention_backend=backend)
            b = Builder(cfg, mesh, rules=expert_rules(a.expert_split))
            for method, kw in program_specs(cfg.num_layers, caches, rows_arg, attending_only=i > 0):
                p = getattr(b, method)(**kw)
                s = kw["length"]
                r = {"topology": topo, "mesh": shd.describe(mesh), "model": spec, "backend": backend, "cache": s}
                if cfg.num_experts:
                    r["expert_split"] = a.expert_split
                hlo_to = None
                if a.hlo_dir:
                    a.hlo_dir.mkdir(parents=True, exist_ok=True)
                    hlo_to = a.hlo_dir / f"{topo}-{Path(spec).name}-{backend}-{p.name}-{s}.hlo".replace(":", "_")
                r.update(measure(p, bw, a.bytes, hlo_to))
                rows.append(r)
                print(
                    f"# {topo} {spec} {backend} {p.name} cache {s}: compiled in {r['compile_s']:.1f}s", file=sys.stderr
                )
    table(rows)
    summary = ratios(rows)
    for x in summary:
        print(
            f"{x['topology']} {x['model']} {x['backend']}: verify-8/decode-1 {_fmt(x['verify8_over_decode1'])} "
            f"(HBM {_fmt(x['hbm_verify8_over_decode1'])}), decode-1 cache {x['caches'][1]}/{x['caches'][0]} "
            f"{_fmt(x['cache_hi_over_lo'])} (HBM {_fmt(x['hbm_cache_hi_over_lo'])}) (bytes, live {LIVE})"
        )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["python -m benchmarks.tpu_compile", *(argv or sys.argv[1:])]),
                    "jax": jax.__version__,
                    "live": LIVE,
                    "rows": rows,
                    "ratios": summary,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
