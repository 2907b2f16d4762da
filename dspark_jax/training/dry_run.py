"""``python -m dspark_jax.train --dry-run``: plan a run's memory from the target's config alone.

Reads only the target's *config* (llama2.c header, GGUF metadata, Hugging Face ``config.json``,
or a built-in config such as ``qwen3-8b``) and builds the drafter abstractly (``nnx.eval_shape``):
no weights are read or allocated. :func:`dry_run` plans training (:func:`estimate_memory`),
:func:`serve_dry_run` serving (:func:`estimate_serving_memory`), each per device of a
``(data, fsdp, model)`` mesh (docs/design.md#device-mesh).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.distributed import process_layout
from dspark_jax.training.train_config import TrainConfig


def _mesh_sizes(mesh, devices: int) -> dict[str, int]:
    """``mesh`` spec (or sizes) -> sizes of data/fsdp/model for ``devices`` devices.

    Raises:
      DSparkInputError: bad spec, or sizes whose product is not ``devices``.
    """
    from dspark_jax.models.sharding import mesh_shape

    try:
        return mesh_shape(mesh or "", devices)
    except ValueError as e:
        raise DSparkInputError(str(e)) from None


def _shape_tree(shapes):
    import jax

    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(tuple(s), np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def _div(n: int, m: int) -> int:
    """The model-axis split of a dimension of ``n`` units: ``m`` when it divides, else 1 (replicated)."""
    return m if m > 1 and n % m == 0 else 1


def _kv_div(n: int, m: int) -> int:
    """The split of a serving KV cache's ``n`` KV heads over ``model:m``
    (:func:`dspark_jax.models.sharding.cache_sharding`): ``m`` when it divides them, ``n`` when they
    divide ``m`` (each head on ``m / n`` devices), else 1 (replicated)."""
    return n if 1 < n < m and m % n == 0 else _div(n, m)


def _train_activations(
    cfg: TrainConfig, t: TargetConfig, d: DrafterConfig, micro: int, m: int, cb: int
) -> dict[str, float]:
    """Activation bytes per device of one training micro-batch of ``micro`` sequences
    (:func:`estimate_memory`): ``target_forward_peak``, ``drafter_context``, ``drafter_backbone``,
    ``loss_head`` and ``drafter_step_peak``; ``m`` is the model-axis size, ``cb`` the compute
    dtype's bytes."""
    L, V, A, S, N = cfg.seq_len, t.vocab_size, cfg.anchors_per_seq, d.num_block_positions, d.num_layers
    vt, ht, it = _div(V, m), _div(t.num_heads, m), _div(t.intermediate_size, m)
    hd_, kd_, id_ = _div(d.num_heads, m), _div(d.num_kv_heads, m), _div(d.intermediate_size, m)
    # The target forward (no gradient): every layer's output stacked by the layer scan, which XLA
    # keeps split over ``model`` along the hidden axis; one layer's float32 attention scores and MLP;
    # and two float32 logits buffers (the logits and their softmax for p_target).
    target_fwd = micro * (
        t.num_layers * L * t.hidden_size * cb / _div(t.hidden_size, m)
        + t.num_heads * L * L * 4 / ht
        + 3 * L * t.intermediate_size * cb / it
        + 2 * L * V * 4 / vt
    )
    context = (
        micro
        * L
        * ((len(d.taps) * t.hidden_size + d.hidden_size) * cb + 2 * N * d.num_kv_heads * d.head_dim * cb / kd_)
    )
    blocks = micro * A * S
    per_layer = blocks * (d.num_heads * L * 4 / hd_ + 8 * d.hidden_size * cb + 3 * d.intermediate_size * cb / id_)
    # Stored for the backward pass (each layer's input with remat, else every layer's activations),
    # plus one layer's worth held during its backward step (recomputed activations and cotangents).
    backbone = (blocks * d.hidden_size * cb * N + 2 * per_layer) if cfg.remat else per_layer * (N + 1)
    head = micro * A * d.block_size * V * 4 * (3 if cfg.remat else 6) / vt
    # Two activation peaks: inside the target forward, and in the drafter's backward pass (the
    # target's float32 logits stay alive for p_target through both).
    train_peak = micro * L * V * 4 / vt + context + backbone + head
    return {
        "target_forward_peak": target_fwd,
        "drafter_context": context,
        "drafter_backbone": backbone,
        "loss_head": head,
        "drafter_step_peak": train_peak,
    }


def estimate_memory(
    cfg: TrainConfig,
    tcfg: TargetConfig,
    dcfg: DrafterConfig,
    target_params: int,
    drafter_params: int,
    devices: int,
    mesh=None,
) -> dict[str, float]:
    """Rough per-device training memory [GiB] of the step on a ``(data, fsdp, model)`` mesh, by component.

    Weights: the frozen target in ``cfg.dtype``; the drafter's float32 master weights,
    gradients and AdamW moments (+ a ``cfg.dtype`` compute copy, + an accumulation buffer
    when ``grad_accum_steps > 1``), each sharded by :mod:`dspark_jax.models.sharding`'s rules
    (exact per-device bytes, replication fallback included). Activations of one micro-batch
    of ``batch_size / (data * fsdp * grad_accum_steps)`` sequences: the target forward
    (tapped layer outputs, one layer's attention scores and MLP, float32 logits), the
    drafter's context keys/values, the backbone activations kept for the backward pass (one
    layer's when ``remat``), and the float32 vocabulary-sized loss head; heads, MLP, KV heads
    and vocabulary terms (and the target's stacked layer outputs) are divided by ``model`` where it
    divides them, the drafter's hidden-size terms are replicated. Total = weights and optimizer
    state + the larger of the two activation peaks (target forward; drafter forward/backward
    with the micro-batch's gradients). XLA's actual peak differs (fusion, buffer reuse);
    ``tests/integration/test_mesh.py`` checks it against the compiled sharded step's memory
    analysis on forced CPU devices, and ``python -m benchmarks.plan_check`` against the TPU
    compiler's device memory for a TPU topology.

    Args:
      devices: device count; mesh: spec or sizes (default: every device on ``data``).
    Returns:
      GiB per component, ``total`` [GiB] and ``total_bytes``.
    """
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.sharding import tree_bytes_per_device
    from dspark_jax.models.weights import target_param_shapes
    from dspark_jax.training.trainer import FROZEN_PARAMS

    sizes = _mesh_sizes(mesh, devices)
    cb = jnp.dtype(cfg.dtype).itemsize
    t, d = tcfg, dcfg
    micro = max(1, cfg.batch_size // (sizes["data"] * sizes["fsdp"] * cfg.grad_accum_steps))
    gib = lambda x: round(x / 2**30, 3)
    t_bytes = tree_bytes_per_device(_shape_tree(target_param_shapes(t)), sizes, t, itemsize=cb)
    d_abstract = nnx.state(nnx.eval_shape(lambda: build_drafter(d, nnx.Rngs(0))), nnx.Param)
    d_elems = tree_bytes_per_device(d_abstract, sizes, d, itemsize=1)
    # a drafter's own frozen embedding / LM head (drafter_arch=gemma4) get no gradients, no AdamW moments
    frozen = {k: d_abstract[k] for k in FROZEN_PARAMS if d.own_embeddings and k in d_abstract}
    adam_elems = d_elems - (tree_bytes_per_device(nnx.State(frozen), sizes, d, itemsize=1) if frozen else 0)
    grad_bytes = adam_elems * (4 + (4 if cfg.grad_accum_steps > 1 else 0))  # (+ accumulator); none for frozen
    drafter_bytes = d_elems * (4 + (cb if cb < 4 else 0)) + grad_bytes + adam_elems * 8
    act = _train_activations(cfg, t, d, micro, sizes["model"], cb)
    target_fwd, train_peak = act["target_forward_peak"], act["drafter_step_peak"]
    parts = {
        "target_weights": t_bytes,
        "drafter_weights": d_elems * (4 + (cb if cb < 4 else 0)),  # float32 master (+ compute copy)
        "drafter_grads": grad_bytes,
        "optimizer_state": adam_elems * 8,  # AdamW moments, sharded like params
        "drafter_weights_grads_adam": drafter_bytes,
        "activations": max(target_fwd, train_peak),
        **act,
    }
    out = {k: gib(v) for k, v in parts.items()}
    # A micro-batch's float32 gradients exist only from the drafter's backward pass on: the target
    # forward runs before them (the accumulator, the master weights and AdamW state are live throughout).
    grads = adam_elems * 4
    total = t_bytes + drafter_bytes - grads + max(target_fwd, train_peak + grads)
    out["total"] = gib(total)
    out["total_bytes"] = int(total)
    return out


def estimate_serving_memory(
    tcfg: TargetConfig,
    dcfg: DrafterConfig | None,
    *,
    num_slots: int,
    max_len: int,
    dtype: str,
    devices: int,
    mesh=None,
    max_tokens: int = 128,
) -> dict[str, float]:
    """Per-device serving memory [GiB] of :class:`~dspark_jax.serving.engine.Engine` on a ``model`` mesh.

    Target and drafter weights in ``dtype`` sharded by :mod:`dspark_jax.models.sharding`'s rules; the
    target's KV cache ``[L, slots, max_len, kvh, hd]`` and the drafter's context cache
    ``[N, slots, max_len, kvh_d, hd_d]`` (keys and values) over KV heads where ``model``
    divides them; and the activations of the largest step: ``max_tokens`` packed tokens'
    float32 logits and one layer's attention scores of ``slots x (block_size + 1)`` queries over
    ``max_len`` positions (heads split over ``model``), plus the drafter's block logits.

    Args:
      dcfg: drafter config or None (plain serving).
      max_tokens: the largest packed-token bucket (the engine's default ladder ends at 128).
    """
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.layers import ATTN_BLOCK
    from dspark_jax.models.sharding import tree_bytes_per_device
    from dspark_jax.models.weights import target_param_shapes

    sizes = _mesh_sizes(mesh, devices)
    m = sizes["model"]
    cb = jnp.dtype(dtype).itemsize
    t = tcfg
    gib = lambda x: round(x / 2**30, 3)
    t_bytes = tree_bytes_per_device(_shape_tree(target_param_shapes(t)), sizes, t, itemsize=cb)
    kv = 2 * t.num_layers * num_slots * max_len * t.num_kv_heads * t.head_dim * cb / _kv_div(t.num_kv_heads, m)
    parts = {"target_weights": t_bytes, "target_kv_cache": kv}
    width = 1
    if dcfg is not None:
        d_abstract = nnx.state(nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(0))), nnx.Param)
        parts["drafter_weights"] = tree_bytes_per_device(d_abstract, sizes, dcfg, itemsize=cb)
        parts["drafter_kv_cache"] = (
            2
            * dcfg.num_layers
            * num_slots
            * max_len
            * dcfg.num_kv_heads
            * dcfg.head_dim
            * cb
            / _kv_div(dcfg.num_kv_heads, m)
        )
        width = dcfg.block_size + 1
    k_tok = min(max_tokens, num_slots * width)
    vd = _div(t.vocab_size, m)
    # Vocabulary-sized buffers of the packed tokens, live together while they are sampled and
    # verified: float32 logits and probabilities, the sampler's uint32 random bits and int32
    # candidate ids (top-k / top-p), and a boolean mask (17 bytes a token and id). Attention
    # scores stay within one ATTN_BLOCK of keys at a time (blocked attention), not the whole cache.
    act = (
        k_tok * t.vocab_size * (4 * 4 + 1) / vd
        + num_slots * width * min(max_len, ATTN_BLOCK) * t.num_heads * 4 * 2 / _div(t.num_heads, m)
        + k_tok * (t.hidden_size * 4 + 3 * t.intermediate_size / _div(t.intermediate_size, m)) * cb
    )
    if dcfg is not None:  # the drafter's float32 block logits, sampled where they are
        act += num_slots * dcfg.block_size * t.vocab_size * 4 / vd
    parts["step_activations"] = act
    out = {k: gib(v) for k, v in parts.items()}
    total = sum(parts.values())
    out["total"] = gib(total)
    out["total_bytes"] = int(total)
    return out


def fits_line(total_gib: float, device_memory_gib: float | None) -> str:
    """``per-device total: X GiB (fits|does not fit G GiB)`` (no verdict without a budget)."""
    if not device_memory_gib:
        return f"per-device total: {total_gib:.2f} GiB"
    verdict = "fits" if total_gib <= device_memory_gib else "does not fit"
    return f"per-device total: {total_gib:.2f} GiB ({verdict} {device_memory_gib:g} GiB)"


@dataclasses.dataclass(frozen=True)
class _ConfigOnlyTarget:
    """A target known by its config alone (no weights): what :func:`drafter_config` reads."""

    cfg: TargetConfig
    fingerprint: str = ""


def recipe_configs(cfg: TrainConfig):
    """``(TargetConfig, DrafterConfig)`` of a recipe from the target's config alone (no weights).

    Raises:
      DSparkInputError: the drafter config does not fit the target.
    """
    from dspark_jax.models.presets import target_config
    from dspark_jax.training.train_config import drafter_config

    tcfg = target_config(cfg.target)
    try:
        return tcfg, drafter_config(cfg, _ConfigOnlyTarget(tcfg))
    except ValueError as e:
        raise DSparkInputError(f"drafter config does not fit target {tcfg.name}: {e}") from None


def dry_run(
    cfg: TrainConfig,
    devices: int | None = None,
    mesh: str | None = None,
    device_memory_gib: float | None = None,
    num_processes: int = 1,
) -> dict:
    """Parameter counts and a per-device memory estimate, without any weights.

    Reads only the target's *config* (llama2.c header, GGUF metadata, Hugging
    Face ``config.json``, or a built-in config such as ``qwen3-8b``) and builds
    the drafter abstractly (``nnx.eval_shape``): nothing is loaded or allocated.

    Args:
      devices: device count to plan for (default: the visible devices).
      mesh: mesh spec to plan for (default: ``cfg.mesh``; empty = every device on ``data``).
      device_memory_gib: per-device memory; the report's ``fits`` and ``summary`` say
        whether the estimate fits it.
      num_processes: processes the ``devices`` are spread over (TPU pod hosts, GPU nodes; needs
        ``devices``): ``process_layout`` is :func:`~dspark_jax.training.distributed.process_layout`.
    Raises:
      DSparkInputError: unknown target, missing files, a bad mesh, a drafter config that
        does not fit the target (e.g. taps beyond its depth), or devices that do not split
        over the processes.
    """
    t0 = time.perf_counter()
    import jax
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.weights import count_target_params
    from dspark_jax.training.trainer import count_params

    tcfg, dcfg = recipe_configs(cfg)
    abstract = nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(0)))  # float32 master weights, abstract
    n_d = count_params(nnx.state(abstract, nnx.Param))
    n_t = count_target_params(tcfg)
    if num_processes > 1 and not devices:
        raise DSparkInputError(f"planning {num_processes} processes needs --devices (the global device count)")
    n_dev = int(devices or jax.device_count())
    if n_dev < 1:
        raise DSparkInputError(f"--devices must be >= 1, got {n_dev}")
    mesh = cfg.mesh if mesh is None else mesh
    sizes = _mesh_sizes(mesh, n_dev)
    n_batch = sizes["data"] * sizes["fsdp"]
    warnings = []
    if cfg.batch_size % (n_batch * cfg.grad_accum_steps):
        warnings.append(
            f"batch_size {cfg.batch_size} is not divisible by {n_batch} data-parallel devices x "
            f"{cfg.grad_accum_steps} micro-batches: training would refuse it"
        )
    if cfg.seq_len > tcfg.max_position:
        warnings.append(f"seq_len {cfg.seq_len} exceeds the target's context {tcfg.max_position}")
    mem = estimate_memory(cfg, tcfg, dcfg, n_t, n_d, n_dev, mesh=sizes)
    report = {
        "target": tcfg.name,
        "target_config": tcfg.to_dict(),
        "target_params": n_t,
        "target_active_params": count_target_params(tcfg, active=True),
        "drafter_params": n_d,
        "drafter_config": dcfg.to_dict(),
        "dtype": cfg.dtype,
        "devices": n_dev,
        "mesh": ",".join(f"{a}:{n}" for a, n in sizes.items()),
        "process_layout": process_layout(n_dev, num_processes, sizes, cfg.batch_size),
        "global_batch": cfg.batch_size,
        "grad_accum_steps": cfg.grad_accum_steps,
        "per_device_micro_batch": max(1, cfg.batch_size // (n_batch * cfg.grad_accum_steps)),
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "remat": cfg.remat,
        "per_device_memory_estimate_gib": mem["total"],
        "memory_breakdown_gib": mem,
        "warnings": warnings,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if device_memory_gib:
        report["device_memory_gib"] = device_memory_gib
        report["fits"] = mem["total"] <= device_memory_gib
    report["summary"] = fits_line(mem["total"], device_memory_gib)
    return report


def serve_dry_run(
    cfg: TrainConfig,
    *,
    num_slots: int,
    cache_len: int,
    devices: int | None = None,
    mesh: str | None = None,
    device_memory_gib: float | None = None,
) -> dict:
    """Per-device serving memory of the recipe's target and drafter (:func:`estimate_serving_memory`):
    ``num_slots`` decode slots x ``cache_len`` positions in ``cfg.dtype`` on a ``model`` mesh
    (default ``model:<devices>``), without any weights.

    Raises:
      DSparkInputError: bad sizes or mesh, a drafter config that does not fit the target, or a
        target the engine does not serve (Gemma 4).
    """
    import jax

    from dspark_jax.models.gemma4 import refuse
    from dspark_jax.models.weights import count_target_params

    if num_slots < 1 or cache_len < 2:
        raise DSparkInputError(f"--num-slots must be >= 1 and --cache-len >= 2, got {num_slots} and {cache_len}")
    tcfg, dcfg = recipe_configs(cfg)
    refuse(tcfg, "the serving engine")
    n_dev = int(devices or jax.device_count())
    mesh = mesh if mesh else (cfg.mesh or f"model:{n_dev}")
    sizes = _mesh_sizes(mesh, n_dev)
    if sizes["data"] * sizes["fsdp"] > 1:
        raise DSparkInputError(f"serving shards over 'model' only; got mesh {mesh}: use --mesh model:{n_dev}")
    mem = estimate_serving_memory(
        tcfg, dcfg, num_slots=num_slots, max_len=cache_len, dtype=cfg.dtype, devices=n_dev, mesh=sizes
    )
    report = {
        "mode": "serve",
        "target": tcfg.name,
        "target_params": count_target_params(tcfg),
        "target_active_params": count_target_params(tcfg, active=True),
        "dtype": cfg.dtype,
        "devices": n_dev,
        "mesh": ",".join(f"{a}:{n}" for a, n in sizes.items()),
        "num_slots": num_slots,
        "cache_len": cache_len,
        "drafter": f"{dcfg.variant}-g{dcfg.block_size}-n{dcfg.num_layers}",
        "per_device_memory_estimate_gib": mem["total"],
        "memory_breakdown_gib": mem,
    }
    if device_memory_gib:
        report["device_memory_gib"] = device_memory_gib
        report["fits"] = mem["total"] <= device_memory_gib
    report["summary"] = fits_line(mem["total"], device_memory_gib)
    return report
