"""``python -m dspark_jax.train``: train, checkpoint, export and evaluate a drafter.

Usage::

    python -m dspark_jax.train --preset stories260k [key=value ...]
    python -m dspark_jax.train --config dspark_jax/recipes/smollm2-135m-instruct.yaml steps=200
    python -m dspark_jax.train --preset stories260k --dry-run
    python -m dspark_jax.train --config dspark_jax/recipes/qwen3-8b.yaml --dry-run --devices 4   # no weights needed
    python -m dspark_jax.train --config dspark_jax/recipes/qwen3-8b.yaml --dry-run --devices 8 --mesh data:2,model:4 \
        --device-memory-gib 16                        # -> per-device total: X GiB (fits 16 GiB)
    python -m dspark_jax.train --config dspark_jax/recipes/qwen3-8b.yaml --dry-run --serve --devices 8 --mesh model:8 \
        --num-slots 64 --cache-len 4096 --device-memory-gib 16    # serving: weights + KV caches

Stages (each resumable; rerunning the same command continues where it stopped):
1. self-distillation data: the target generates continuations of training
   prompts with its own jitted batched decoding -> ``<workdir>/data/shard_*.npz``;
2. training with Orbax checkpoints in ``<workdir>/checkpoints`` (resumes from the
   newest one; the data order depends only on (seed, step)); with ``feature_cache=DIR``
   the frozen target's tapped features are first computed once per training sequence
   into ``DIR`` (:mod:`dspark_jax.training.feature_cache`) and every step reads them from there;
3. export to ``<export_dir>`` (drafter params + config + target identity);
4. evaluation on held-out prompts: tau, acceptance, per-position acceptance ->
   ``<workdir>/eval.json``.

Every field of :class:`~dspark_jax.training.trainer.TrainConfig` is a ``key=value`` override.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

from dspark_jax.config import apply_overrides
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.trainer import TRAIN_PRESETS, TrainConfig

# One-line notes shown after a key's default in --help (full docs: TrainConfig's docstring).
_FIELD_NOTES = {
    "feature_cache": "folder of the target-feature cache: target forward once per sequence, not per step (empty = off)",
    "feature_cache_dtype": "float32 (same numbers as uncached) or bfloat16 (half the disk)",
    "mesh": "device mesh over data/fsdp/model, e.g. data:2,model:4 (empty = every device on data)",
}


def _field_help() -> str:
    lines = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default
        note = f"  # {_FIELD_NOTES[f.name]}" if f.name in _FIELD_NOTES else ""
        lines.append(f"  {f.name}={default!r}{note}")
    return "\n".join(lines)


def tensorboard_writer(logdir: Path):
    """A TensorBoard ``SummaryWriter`` on ``logdir`` when TensorBoard is installed, else None.

    Uses ``tensorboardX`` or ``torch.utils.tensorboard`` (both need the ``tensorboard``
    package); training logs JSONL regardless.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            return importlib.import_module(mod).SummaryWriter(str(logdir))
        except Exception:
            continue
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.train",
        description="Train a DSpark (or DFlash) drafter for a target model by self-distillation, "
        "save Orbax checkpoints, export it, and report tau on held-out prompts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override with key=value; defaults shown for the stories260k preset):\n" + _field_help(),
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(TRAIN_PRESETS),
        help="built-in recipe to start from (default: stories260k)",
    )
    p.add_argument("--config", default=None, help="YAML or JSON file of config keys, applied after --preset")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="read only the target's config (no weights), build the drafter abstractly, print "
        "parameter counts and a per-device memory estimate as JSON, then exit",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: number of devices to plan the per-device batch and memory for "
        "(default: the visible devices)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="AXIS:N,...",
        help="device mesh over data/fsdp/model, e.g. data:2,model:4 (same as mesh=...; default: "
        "every device on data, parameters replicated)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        metavar="G",
        help="with --dry-run: per-device memory; prints 'per-device total: X GiB (fits|does not fit G GiB)'",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="with --dry-run: plan serving (engine weights + KV caches of --num-slots x --cache-len, "
        "tensor parallel; default mesh model:N) instead of training",
    )
    p.add_argument("--num-slots", type=int, default=64, help="with --dry-run --serve: decode slots (default 64)")
    p.add_argument(
        "--cache-len", type=int, default=4096, help="with --dry-run --serve: KV-cache positions per slot (default 4096)"
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE.jsonl",
        help="extra training prompts (JSONL with prompt/text/question/turns); same as prompts_file=FILE",
    )
    p.add_argument("--skip-eval", action="store_true", help="do not evaluate tau after training")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=500 gamma=8")
    return p


def load_config(args: argparse.Namespace) -> TrainConfig:
    """Preset, then config file, then ``key=value`` overrides.

    Raises:
      DSparkInputError: unreadable config file or unknown/bad keys.
    """
    cfg = TRAIN_PRESETS[args.preset or "stories260k"]
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise DSparkInputError(f"config file not found: {path}")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text) or {}
            else:
                data = json.loads(text)
        except Exception as e:  # yaml and json raise different types
            raise DSparkInputError(f"cannot parse {path}: {str(e).splitlines()[0]}") from None
        if "preset" in data and not args.preset:
            preset = str(data.pop("preset"))
            if preset not in TRAIN_PRESETS:
                raise DSparkInputError(f"{path}: unknown preset {preset!r}")
            cfg = TRAIN_PRESETS[preset]
        data.pop("preset", None)
        cfg = _apply(cfg, {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in data.items()})
    cfg = _apply(cfg, args.overrides)
    if args.prompts:
        cfg = _apply(cfg, {"prompts_file": args.prompts})
    return cfg


def _apply(cfg, overrides):
    try:
        return apply_overrides(cfg, overrides)
    except ValueError as e:
        raise DSparkInputError(str(e)) from None


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


def estimate_memory(
    cfg: TrainConfig, tcfg, dcfg, target_params: int, drafter_params: int, devices: int, mesh=None
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
    and vocabulary terms are divided by ``model`` where it divides them, the hidden-size
    terms are replicated. Total = weights and optimizer state + the larger of the two
    activation peaks (target forward; drafter forward/backward). XLA's actual peak differs
    (fusion, buffer reuse); ``tests/test_mesh.py`` checks it against the compiled sharded
    step's memory analysis on forced CPU devices.

    Args:
      devices: device count; mesh: spec or sizes (default: every device on ``data``).
    Returns:
      GiB per component, ``total`` [GiB] and ``total_bytes``.
    """
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.model_io import target_param_shapes
    from dspark_jax.models.sharding import tree_bytes_per_device

    sizes = _mesh_sizes(mesh, devices)
    m = sizes["model"]
    cb = jnp.dtype(cfg.dtype).itemsize
    t, d = tcfg, dcfg
    micro = max(1, cfg.batch_size // (sizes["data"] * sizes["fsdp"] * cfg.grad_accum_steps))
    L, V, A, S, g, N = cfg.seq_len, t.vocab_size, cfg.anchors_per_seq, d.num_slots, d.gamma, d.num_layers
    gib = lambda x: round(x / 2**30, 3)
    t_bytes = tree_bytes_per_device(_shape_tree(target_param_shapes(t)), sizes, t, itemsize=cb)
    d_abstract = nnx.state(nnx.eval_shape(lambda: build_drafter(d, nnx.Rngs(0))), nnx.Param)
    d_elems = tree_bytes_per_device(d_abstract, sizes, d, itemsize=1)
    drafter_bytes = d_elems * (4 * 4 + (cb if cb < 4 else 0) + (4 if cfg.grad_accum_steps > 1 else 0))
    vt, ht, it = _div(V, m), _div(t.num_heads, m), _div(t.intermediate_size, m)
    hd_, kd_, id_ = _div(d.num_heads, m), _div(d.num_kv_heads, m), _div(d.intermediate_size, m)
    target_fwd = micro * (
        t.num_layers * L * t.hidden_size * cb
        + 2 * t.num_heads * L * L * 4 / ht
        + 3 * L * t.intermediate_size * cb / it
        + L * V * 4 / vt
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
    head = micro * A * g * V * 4 * (3 if cfg.remat else 6) / vt
    # Two activation peaks: inside the target forward, and in the drafter's backward pass (the
    # target's float32 logits stay alive for p_target through both).
    train_peak = micro * L * V * 4 / vt + context + backbone + head
    parts = {
        "target_weights": t_bytes,
        "drafter_weights": d_elems * (4 + (cb if cb < 4 else 0)),  # float32 master (+ compute copy)
        "drafter_grads": d_elems * (4 + (4 if cfg.grad_accum_steps > 1 else 0)),  # (+ accumulator)
        "optimizer_state": d_elems * 8,  # AdamW moments, sharded like params
        "drafter_weights_grads_adam": drafter_bytes,
        "activations": max(target_fwd, train_peak),
        "target_forward_peak": target_fwd,
        "drafter_context": context,
        "drafter_backbone": backbone,
        "loss_head": head,
        "drafter_step_peak": train_peak,
    }
    out = {k: gib(v) for k, v in parts.items()}
    total = t_bytes + drafter_bytes + max(target_fwd, train_peak)
    out["total"] = gib(total)
    out["total_bytes"] = int(total)
    return out


def estimate_serving_memory(
    tcfg, dcfg, *, num_slots: int, max_len: int, dtype: str, devices: int, mesh=None, max_tokens: int = 128
) -> dict[str, float]:
    """Per-device serving memory [GiB] of :class:`~dspark_jax.serving.engine.Engine` on a ``model`` mesh.

    Target and drafter weights in ``dtype`` sharded by :mod:`dspark_jax.models.sharding`'s rules; the
    target's KV cache ``[L, slots, max_len, kvh, hd]`` and the drafter's context cache
    ``[N, slots, max_len, kvh_d, hd_d]`` (keys and values) over KV heads where ``model``
    divides them; and the activations of the largest step: ``max_tokens`` packed tokens'
    float32 logits and one layer's attention scores of ``slots x (gamma + 1)`` queries over
    ``max_len`` positions (heads split over ``model``), plus the drafter's block logits.

    Args:
      dcfg: drafter config or None (plain serving).
      max_tokens: the largest packed-token bucket (the engine's default ladder ends at 128).
    """
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.model_io import target_param_shapes
    from dspark_jax.models.sharding import tree_bytes_per_device

    sizes = _mesh_sizes(mesh, devices)
    m = sizes["model"]
    cb = jnp.dtype(dtype).itemsize
    t = tcfg
    gib = lambda x: round(x / 2**30, 3)
    t_bytes = tree_bytes_per_device(_shape_tree(target_param_shapes(t)), sizes, t, itemsize=cb)
    kv = 2 * t.num_layers * num_slots * max_len * t.num_kv_heads * t.head_dim * cb / _div(t.num_kv_heads, m)
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
            / _div(dcfg.num_kv_heads, m)
        )
        width = dcfg.gamma + 1
    k_tok = min(max_tokens, num_slots * width)
    vd = _div(t.vocab_size, m)
    act = (
        k_tok * t.vocab_size * 4 * 2 / vd
        + num_slots * width * max_len * t.num_heads * 4 * 2 / _div(t.num_heads, m)
        + k_tok * (t.hidden_size * 4 + 3 * t.intermediate_size / _div(t.intermediate_size, m)) * cb
    )
    if dcfg is not None:
        act += num_slots * dcfg.gamma * t.vocab_size * 4 * 2 / vd
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


def _recipe_configs(cfg: TrainConfig):
    """``(TargetConfig, DrafterConfig)`` of a recipe from the target's config alone (no weights).

    Raises:
      DSparkInputError: the drafter config does not fit the target.
    """
    from dspark_jax.models.presets import target_config
    from dspark_jax.training.trainer import drafter_config

    tcfg = target_config(cfg.target)

    class _T:  # only .cfg and .fingerprint are read by drafter_config
        def __init__(self, c):
            self.cfg, self.fingerprint = c, ""

    try:
        return tcfg, drafter_config(cfg, _T(tcfg))
    except ValueError as e:
        raise DSparkInputError(f"drafter config does not fit target {tcfg.name}: {e}") from None


def dry_run(
    cfg: TrainConfig, devices: int | None = None, mesh: str | None = None, device_memory_gib: float | None = None
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
    Raises:
      DSparkInputError: unknown target, missing files, a bad mesh, or a drafter config that
        does not fit the target (e.g. taps beyond its depth).
    """
    t0 = time.perf_counter()
    import jax
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.model_io import count_target_params
    from dspark_jax.training.trainer import count_params

    tcfg, dcfg = _recipe_configs(cfg)
    abstract = nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(0)))  # float32 master weights, abstract
    n_d = count_params(nnx.state(abstract, nnx.Param))
    n_t = count_target_params(tcfg)
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
        "drafter_params": n_d,
        "drafter_config": dcfg.to_dict(),
        "dtype": cfg.dtype,
        "devices": n_dev,
        "mesh": ",".join(f"{a}:{n}" for a, n in sizes.items()),
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
      DSparkInputError: bad sizes or mesh, or a drafter config that does not fit the target.
    """
    import jax

    if num_slots < 1 or cache_len < 2:
        raise DSparkInputError(f"--num-slots must be >= 1 and --cache-len >= 2, got {num_slots} and {cache_len}")
    tcfg, dcfg = _recipe_configs(cfg)
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
        "dtype": cfg.dtype,
        "devices": n_dev,
        "mesh": ",".join(f"{a}:{n}" for a, n in sizes.items()),
        "num_slots": num_slots,
        "cache_len": cache_len,
        "drafter": f"{dcfg.variant}-g{dcfg.gamma}-n{dcfg.num_layers}",
        "per_device_memory_estimate_gib": mem["total"],
        "memory_breakdown_gib": mem,
    }
    if device_memory_gib:
        report["device_memory_gib"] = device_memory_gib
        report["fits"] = mem["total"] <= device_memory_gib
    report["summary"] = fits_line(mem["total"], device_memory_gib)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args)
        if args.mesh is not None:
            cfg = _apply(cfg, {"mesh": args.mesh})
        if args.serve and not args.dry_run:
            raise DSparkInputError(
                "--serve plans serving memory and needs --dry-run (serve with python -m dspark_jax.serve)"
            )
        if args.dry_run and args.serve:
            report = serve_dry_run(
                cfg,
                num_slots=args.num_slots,
                cache_len=args.cache_len,
                devices=args.devices,
                device_memory_gib=args.device_memory_gib,
            )
            print(json.dumps(report, indent=2))
            print(report["summary"], file=sys.stderr)
            return 0
        if args.dry_run:
            report = dry_run(cfg, devices=args.devices, device_memory_gib=args.device_memory_gib)
            print(json.dumps(report, indent=2))
            print(report["summary"], file=sys.stderr)
            return 0
        run(cfg, evaluate=not args.skip_eval)
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def prepare_data(cfg: TrainConfig, target, tok) -> tuple[list[Path], list[str]]:
    """Stage 1: the self-distillation shards and the held-out evaluation prompts of ``cfg``.

    Splits the prompt source into training and held-out prompts (written to
    ``<workdir>/eval_prompts.json``), then generates the target's continuations of the
    training prompts into ``<workdir>/data`` (resumable), or, with ``cfg.data_dir``,
    only lists the shards already there (that folder is never written).

    Returns:
      ``(shard paths, held-out prompt texts)``.
    Raises:
      DSparkInputError: unknown prompt source, or an empty ``data_dir``.
    """
    from tqdm.auto import tqdm

    from dspark_jax.decoding.speculative import generate_autoregressive
    from dspark_jax.training import data as data_mod

    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    chat = cfg.prompts == "chat"
    if cfg.prompts == "tinystories":
        texts = data_mod.tinystories_openings()
    elif cfg.prompts == "chat":
        texts = data_mod.chat_training_prompts()
    else:
        raise DSparkInputError(f"prompts must be 'tinystories' or 'chat', got {cfg.prompts!r}")
    n_builtin = len(texts)
    if cfg.prompts_file:
        texts += data_mod.read_prompt_file(cfg.prompts_file)
    train_texts, eval_texts = data_mod.split_prompts(texts, min(cfg.num_eval_prompts, len(texts) // 5), cfg.seed)
    (workdir / "eval_prompts.json").write_text(json.dumps(eval_texts, indent=1))
    guard = data_mod.evaluation_texts(eval_texts)
    if cfg.prompts_file and len(texts) > n_builtin:  # user prompts: keep evaluation prompts out
        drop = data_mod.drop_contaminated(train_texts, guard)
        if any(drop):
            print(
                f"contamination guard: dropped {sum(drop)} training prompts that contain an evaluation prompt",
                file=sys.stderr,
            )
        train_texts = [t for t, d in zip(train_texts, drop) if not d]
    corpus_shards = _corpus_shards(cfg, tok, chat, guard, workdir)
    if cfg.data_dir:
        # Shared data (read only): e.g. every drafter of a comparison trains on the same shards.
        shards = sorted(Path(cfg.data_dir).glob("shard_[0-9]*[0-9].npz"))
        if not shards:
            raise DSparkInputError(f"data_dir {cfg.data_dir} holds no shard_*.npz files")
        return shards + corpus_shards, eval_texts
    if chat and len(train_texts) < cfg.num_prompts:
        # Few distinct chat prompts: repeat them, the sampled continuations differ.
        train_texts = (train_texts * (cfg.num_prompts // max(1, len(train_texts)) + 1))[: cfg.num_prompts]
    train_ids = data_mod.encode_prompts(tok, train_texts, chat)
    # A prompt taking more than half the stored length leaves too few target tokens to learn from.
    train_ids = [ids for ids in train_ids if len(ids) <= cfg.seq_len // 2] or train_ids
    train_ids = train_ids[: cfg.num_prompts]
    bar = tqdm(total=len(train_ids), desc="generate data", unit="seq", dynamic_ncols=True)

    def gen(batch, bi):
        sampled = data_mod.sampled_rows([bi * cfg.gen_batch_size + i for i in range(len(batch))], cfg.gen_sampled_frac)
        res = generate_autoregressive(
            target,
            batch,
            max_new_tokens=cfg.gen_max_new_tokens,
            temperature=[cfg.gen_sample_temperature if s else cfg.gen_temperature for s in sampled],
            top_p=[cfg.gen_sample_top_p if s else cfg.gen_top_p for s in sampled],
            seed=[cfg.seed * 1_000_003 + bi * 4096 + i for i in range(len(batch))],
        )
        return [g.token_ids for g in res.generations]

    def progress(done, total):
        bar.n = done
        bar.refresh()

    shards = data_mod.generate_shards(
        workdir / "data",
        train_ids,
        gen,
        seq_len=cfg.seq_len,
        shard_size=cfg.gen_shard_size,
        batch_size=cfg.gen_batch_size,
        progress=progress,
    )
    bar.close()
    return shards + corpus_shards, eval_texts


def _corpus_shards(cfg: TrainConfig, tok, chat: bool, guard: list[str], workdir: Path) -> list[Path]:
    """Shards of ``cfg.corpus`` (no generation), contaminated rows dropped; [] without a corpus."""
    from dspark_jax.training import data as data_mod

    if not cfg.corpus:
        return []
    rows = data_mod.read_corpus(cfg.corpus)
    drop = data_mod.drop_contaminated([data_mod.corpus_row_text(r) for r in rows], guard)
    rows = [r for r, d in zip(rows, drop) if not d]
    if cfg.corpus_max_sequences:
        rows = rows[: cfg.corpus_max_sequences]
    print(f"corpus {cfg.corpus}: {len(rows)} rows ({sum(drop)} dropped by the contamination guard)", file=sys.stderr)
    seqs = [data_mod.encode_corpus_row(tok, r, chat) for r in rows]
    for old in (workdir / "data_corpus").glob("corpus_*.npz"):
        old.unlink()
    return data_mod.write_sequence_shards(
        workdir / "data_corpus", seqs, seq_len=cfg.seq_len, shard_size=cfg.gen_shard_size
    )


def run(cfg: TrainConfig, evaluate: bool = True, *, calibrate: bool = True, target_and_tokenizer=None) -> dict:
    """Runs all stages for ``cfg``; returns the summary written to ``<workdir>/summary.json``.

    Args:
      evaluate: run stage 4 (held-out tau).
      calibrate: fit the confidence temperatures (stage 3b; drafters with a confidence head).
      target_and_tokenizer: an already loaded ``(target, tokenizer)`` for ``cfg.target``
        (e.g. several runs in one process); default: loaded from ``cfg.target``.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    from dspark_jax.api import load_target
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import export_drafter
    from dspark_jax.training import data as data_mod
    from dspark_jax.training.trainer import (
        Trainer,
        append_jsonl,
        count_params,
        drafter_config,
        maybe_initialize_distributed,
        truncate_jsonl,
    )

    maybe_initialize_distributed()
    t_start = time.perf_counter()
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    dtype = jnp.dtype(cfg.dtype)
    mesh = None
    if cfg.mesh:  # the target's weights go straight from the host to their shards
        from dspark_jax.models.sharding import make_mesh

        try:
            mesh = make_mesh(cfg.mesh)
        except ValueError as e:
            raise DSparkInputError(str(e)) from None
    target, tok = target_and_tokenizer or load_target(cfg.target, dtype=dtype, mesh=mesh)
    chat = cfg.prompts == "chat"

    # -- stage 1: self-distillation data -----------------------------------------------
    t0 = time.perf_counter()
    shards, eval_texts = prepare_data(cfg, target, tok)
    data = data_mod.load_shards(shards)
    gen_seconds = time.perf_counter() - t0
    n_tokens = int((data["lengths"] - data["prompt_lengths"]).sum())

    # -- stage 2: training ----------------------------------------------------------------
    dcfg = drafter_config(cfg, target)
    cache_seconds = 0.0
    fc_dir = cfg.feature_cache
    if fc_dir == "auto":  # <workdir>/feature_cache where it can be used (one process), else off
        fc_dir = str(workdir / "feature_cache") if jax.process_count() == 1 else ""
    if fc_dir:
        # The frozen target once per sequence (dspark_jax.training.feature_cache) instead of once per step.
        from dspark_jax.training.feature_cache import ensure_feature_cache

        if jax.process_count() > 1:
            # A mesh inside one process (any data/fsdp/model split of its devices) works: the cached rows are
            # sharded over the batch axes like the tokens. Several processes would each need the whole cache on
            # a local or shared disk, and its build (the target over every sequence) is not split among them.
            raise DSparkInputError(
                f"feature_cache needs a single process (this run has {jax.process_count()}): the cache is built by "
                "one process running the target over every training sequence into one folder, which the other "
                "hosts cannot see; leave feature_cache empty on multi-host runs (the target then runs in the "
                "step, sharded over the mesh)"
            )
        t0 = time.perf_counter()
        fcache = ensure_feature_cache(
            fc_dir,
            target,
            data,
            dcfg.taps,
            store_dtype=cfg.feature_cache_dtype,
            batch_size=max(1, min(cfg.gen_batch_size, 64)),
        )
        data = {**data, **fcache.batch_arrays(dcfg.taps)}
        cache_seconds = time.perf_counter() - t0
    # float32 master weights whatever cfg.dtype: the Trainer computes in cfg.dtype.
    drafter = build_drafter(dcfg, nnx.Rngs(cfg.seed))
    if dcfg.draft_vocab_size:  # from the data, so a resumed run rebuilds the same vocabulary
        drafter.set_draft_vocab(data_mod.draft_vocabulary(data, dcfg.draft_vocab_size, target.cfg.vocab_size))
    trainer = Trainer(cfg, target, drafter, mesh=mesh)
    mgr = trainer.checkpoint_manager(workdir / "checkpoints")
    start = trainer.restore_latest(mgr)
    if start:
        print(f"resuming from checkpoint step {start}", file=sys.stderr)
    lead = jax.process_index() == 0  # one process writes logs (Orbax coordinates the checkpoints)
    metrics_path = workdir / "metrics.jsonl"
    if lead:  # rows logged after the checkpoint we resume from are about to be redone
        truncate_jsonl(metrics_path, start)
    tb = tensorboard_writer(workdir / "tensorboard") if lead else None
    it = data_mod.batches(data, cfg.batch_size, cfg.seed, start_step=start)
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=not lead)
    t_train = time.perf_counter()
    tok_per_step = cfg.batch_size * cfg.seq_len
    step = start
    last_log, last_log_step = time.perf_counter(), start
    terms = None
    # Preemption notice (TPU VMs, Kubernetes, Slurm send SIGTERM first): finish the step in
    # flight, checkpoint it and exit, so the restart loses nothing. A second signal kills.
    preempted = []
    handler = lambda signum, frame: (preempted.append(signum), signal.signal(signum, signal.SIG_DFL))
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    while step < cfg.steps and not preempted:
        batch = next(it)
        terms, gnorm = trainer.step(batch, step)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.perf_counter()
            row = {
                "step": step,
                **{k: float(v) for k, v in terms._asdict().items() if k != "acc_by_pos"},
                "grad_norm": float(gnorm),
                "tokens_per_s": tok_per_step * (step - last_log_step) / max(now - last_log, 1e-9),
                "elapsed_s": now - t_train,
            }
            last_log, last_log_step = now, step
            if lead:
                append_jsonl(metrics_path, row)
            if tb is not None:
                for k, v in row.items():
                    if k != "step":
                        tb.add_scalar(f"train/{k}", v, step)
                tb.flush()
            bar.set_postfix(
                loss=f"{row['loss']:.3f}",
                tv=f"{row['tv']:.3f}",
                tau_est=f"{row['tau_est']:.2f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
            )
        if step % cfg.ckpt_every == 0:
            trainer.save(mgr, step)
        if cfg.time_budget_s and time.perf_counter() - t_train > cfg.time_budget_s:
            print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}", file=sys.stderr)
            break
    bar.close()
    for sig, prev in previous.items():
        signal.signal(sig, prev)
    if tb is not None:
        tb.close()
    if mgr.latest_step() != step:
        trainer.save(mgr, step)
    if preempted:
        print(
            f"stopped by signal {preempted[0]} at step {step}; checkpoint saved, rerun the same command to resume",
            file=sys.stderr,
        )
        raise SystemExit(128 + preempted[0])
    train_seconds = time.perf_counter() - t_train
    drafter = trainer.drafter()

    summary = {
        "target": target.cfg.name,
        "target_fingerprint": target.fingerprint,
        "steps": step,
        "train_sequences": int(data["tokens"].shape[0]),
        "train_generated_tokens": n_tokens,
        "data_seconds": round(gen_seconds, 1),
        "feature_cache_seconds": round(cache_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "devices": jax.device_count(),
        "drafter_params": count_params(nnx.state(drafter, nnx.Param)),
        "final_train_metrics": {k: float(v) for k, v in terms._asdict().items() if k != "acc_by_pos"} if terms else {},
    }
    # -- stage 3: export -------------------------------------------------------------------
    export = export_drafter(drafter, cfg.export_path(), extra={"train": summary, "config": dataclasses.asdict(cfg)})
    summary["export_dir"] = str(export)
    # -- stage 3b: confidence calibration (dspark_jax.training.calibration) --------------------------------
    # Sequential temperature scaling on target continuations of the held-out eval prompts (never
    # in the training data): temperatures go into the export, the report into calibration.json.
    if calibrate and drafter.cfg.has_confidence and eval_texts:
        from dspark_jax.training.calibration import calibrate_training_run

        summary["calibration"] = calibrate_training_run(
            cfg, target, drafter, data_mod.encode_prompts(tok, eval_texts, chat), export, workdir
        )
    # -- stage 4: held-out evaluation ----------------------------------------------------------
    if evaluate and eval_texts:
        from dspark_jax.evaluation.acceptance import evaluate_tau

        eval_ids = data_mod.encode_prompts(tok, eval_texts, chat)
        summary["eval"] = evaluate_tau(
            target,
            drafter,
            eval_ids,
            max_new_tokens=cfg.eval_max_new_tokens,
            temperature=cfg.eval_temperature,
            gamma=dcfg.gamma,
        )
        (workdir / "eval.json").write_text(json.dumps(summary["eval"], indent=2))
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    ev = summary.get("eval", {})
    print(
        json.dumps(
            {
                "export_dir": summary["export_dir"],
                "steps": step,
                "train_seconds": summary["train_seconds"],
                "data_seconds": summary["data_seconds"],
                "tau": ev.get("tau"),
                "acceptance_rate": ev.get("acceptance_rate"),
            }
        )
    )
    return summary


if __name__ == "__main__":
    sys.exit(main())
