"""Drafter training: self-distilled data, frozen target in the step, data parallel.

docs/design.md#training. One step:

1. frozen target forward over ``[B, L]`` sequences -> tapped features and
   ``p_target`` at every position;
2. ``A`` random anchor blocks per sequence, all in one drafter pass
   (block-sparse mask, :meth:`~dspark_jax.drafters.base.Drafter.train_blocks`);
3. teacher-forced Markov correction (``x_{k-1}`` = the true previous token);
4. loss = ``w_k * (ce_weight * CE + l1_weight * TV + conf_weight * BCE(c_k, sg(1 - TV_k)))``
   (:mod:`dspark_jax.training.losses`) with position weights ``w_k = exp(-(k-1)/pos_decay)``, normalised by the
   weight of valid positions; ``TV = 0.5 ||p_draft - p_target||_1`` is exactly
   one minus the acceptance probability;
5. AdamW (warmup + cosine or warmup-stable-decay, global-norm clipping) update.

Data parallel: the step is ``jax.jit`` over a 1-D device mesh ``("data",)`` with
the batch sharded along it and parameters replicated -- the ``shard_map``/``jit``
equivalent of ``pmap``. With ``mesh=data:D,model:M`` (:mod:`dspark_jax.models.sharding`,
docs/design.md#device-mesh) the frozen target and the drafter are also sharded
over ``model`` (heads, MLP, vocabulary; replicated where ``M`` does not divide them),
the optimizer state like its parameters, and ``fsdp`` shards parameters' ``embed``
dimension; the jitted step has explicit in/out shardings, XLA inserts the collectives.
The loss is one weighted mean over the *global* batch (sums over every device's rows divided
by the global weight), so an N-device step equals a one-device step on the same global batch.
Multi-host: :mod:`dspark_jax.training.distributed`; each process feeds only the rows of the global
batch that live on its own devices (``jax.make_array_from_process_local_data``).

Gradient accumulation (``grad_accum_steps``): the global batch is split into
micro-batches processed by ``lax.scan`` inside the same jitted step. Anchors are
drawn once for the whole global batch and every micro-batch contributes weighted
*sums* (numerators) divided by the global weight (denominator), so the result is
the big-batch step, not a mean of per-micro-batch means.

Feature cache (``feature_cache``, :mod:`dspark_jax.training.feature_cache`): when the batch
carries the target's tapped features and last hidden state, computed once per
sequence before training, step 1 skips the target forward and computes
``p_target`` only at the gathered positions from the cached last hidden state
(same numbers as the uncached step for a float32 cache); with a draft vocabulary, from
the cached full-vocabulary logsumexp, only on its ids (:mod:`dspark_jax.training.losses`).

Precision: parameters and optimizer state are float32 master copies; with
``dtype=bfloat16`` the forward pass runs on a bfloat16 cast of them (the frozen
target lives in bfloat16), the loss and its reductions stay float32.
``remat=True`` rematerialises each drafter layer and the vocabulary-sized loss
head in the backward pass (``jax.checkpoint``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.checkpoint import check_stored_shapes
from dspark_jax.drafters.decode_head import without_decode_state
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.models.target import Target
from dspark_jax.training.losses import (
    LossTerms,
    TrainableDrafter,
    finalize_loss,
    loss_sums,
    position_weights,
    sample_anchors,
)
from dspark_jax.training.schedules import host_lr_factor, learning_rate_schedule
from dspark_jax.training.train_config import TrainConfig

# Parameters a drafter holds but never trains: its own copies of the target's embedding and LM head
# (DrafterConfig.own_embeddings), top-level names of its parameter state.
FROZEN_PARAMS = ("embed", "lm_head")


def frozen_labels(params: Any) -> Any:
    """``params``'s tree with each leaf labelled ``"frozen"`` (under :data:`FROZEN_PARAMS`) or ``"train"``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if _top(path) in FROZEN_PARAMS else "train", params
    )


def _top(path: tuple) -> Any:
    k = path[0]
    return getattr(k, "key", getattr(k, "name", k))


def make_optimizer(cfg: TrainConfig, frozen: bool = False) -> optax.GradientTransformation:
    """AdamW with ``cfg.lr_schedule`` and global-norm clipping.

    ``cosine``: the schedule inside AdamW. ``wsd``: AdamW at the peak rate; :class:`Trainer` scales
    each update by :func:`~dspark_jax.training.schedules.host_lr_factor` (a step input).
    ``frozen``: the parameters under :data:`FROZEN_PARAMS` get no update, no weight decay and no
    optimizer state (``optax.multi_transform``); the others AdamW as above.

    Raises:
      DSparkInputError: unknown ``lr_schedule`` or a bad ``wsd`` setting.
    """
    sched = learning_rate_schedule(cfg)
    lr = cfg.learning_rate if cfg.lr_schedule == "wsd" else sched
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    )
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, frozen_labels) if frozen else tx


def data_mesh() -> Mesh:
    """1-D mesh ``("data",)`` over every device of every host."""
    return Mesh(np.array(jax.devices()), ("data",))


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


_BATCH_KEYS = ("tokens", "lengths", "prompt_lengths")
# Optional per-sequence arrays of a feature cache (dspark_jax.training.feature_cache.FEATURES_KEY /
# LAST_HIDDEN_KEY, then LSE_KEY where the batch has it).
_CACHED_KEYS = ("tap_features", "last_hidden")
_LSE_KEY = "target_lse"


def replicate(tree: Any, sharding: NamedSharding) -> Any:
    """Places every leaf (identical on all processes) fully replicated on ``sharding``'s mesh.

    One process: ``jax.device_put``. Several: each process fills its own devices from
    its host copy (``jax.make_array_from_callback``), which works for meshes spanning
    devices this process cannot address.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def put(x):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def _master_and_compute_graphs(drafter: TrainableDrafter, compute: Any) -> tuple[nnx.GraphDef, nnx.GraphDef, nnx.State]:
    """``(master graph, compute graph, float32 params)`` of ``drafter``.

    The master copy holds float32 parameters (and optimizer state); the graph that runs the
    forward pass may compute in bfloat16 (its static attribute ``dtype`` replaced, no array
    copies). Rematerialisation is an argument of :func:`~dspark_jax.training.losses.loss_sums`.
    """
    graph, params = nnx.split(drafter, nnx.Param)

    def graph_with(**attrs):
        """The drafter's graph definition with some static attributes replaced (no array copies)."""
        m = nnx.merge(graph, params)
        for k, v in attrs.items():
            setattr(m, k, v)
        return nnx.split(m, nnx.Param)[0]

    d_graph = graph if jnp.dtype(drafter.dtype) == jnp.float32 else graph_with(dtype=jnp.float32)
    c_graph = d_graph if compute == jnp.float32 else graph_with(dtype=compute)
    params = jax.tree.map(lambda x: x.astype(jnp.float32) if _is_float(x) else x, params)
    return d_graph, c_graph, params


def _accumulate(grad_fn: Callable, params: Any, xs: tuple, mesh: Mesh, n_micro: int) -> tuple[Any, Any]:
    """Sums ``grad_fn``'s ``(grads, loss sums)`` over ``n_micro`` micro-batches with ``lax.scan``.

    Row ``j * n_micro + i`` of every array of ``xs`` (``[B, ...]``) goes to micro-batch ``i``.
    """
    batch_axis = shd.batch_axes(mesh)

    def split(x):
        # Row j * n_micro + i goes to micro-batch i: each device keeps its own rows
        # (no cross-device shuffle) and every micro-batch spans all devices.
        y = x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, batch_axis)))

    xs = jax.tree.map(split, xs)
    first = jax.tree.map(lambda x: x[0], xs)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, *first))

    def body(acc, x):
        g, s = grad_fn(params, *x)
        return jax.tree.map(jnp.add, acc, (g, s)), None

    (grads, sums), _ = jax.lax.scan(body, zeros, xs)
    return grads, sums


def make_train_step(
    cfg: TrainConfig,
    c_graph: nnx.GraphDef,
    t_graph: nnx.GraphDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    block_size: int,
) -> Callable:
    """The (unjitted) optimisation step ``(params, opt_state, t_state, tokens, lengths, plens, step_idx, *,
    cached, lr_scale) -> (params, opt_state, LossTerms, grad norm)`` (module docstring: steps 1-5;
    ``cached``: a feature cache's rows or None; ``lr_scale``: the ``wsd`` factor of this step, None
    for ``cosine``)."""
    compute = jnp.dtype(cfg.dtype)
    n_micro = cfg.grad_accum_steps

    def to_compute(p):
        if compute == jnp.float32:
            return p
        return jax.tree.map(lambda x: x.astype(compute) if _is_float(x) else x, p)

    def step(params, opt_state, t_state, tokens, lengths, plens, step_idx, *, cached=None, lr_scale=None):
        target = nnx.merge(t_graph, t_state)
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step_idx)  # depends only on (seed, step)
        # Anchors for the whole global batch, drawn once: identical whatever the number of
        # devices or micro-batches.
        anchors = sample_anchors(key, lengths, plens, cfg.anchors_per_seq)
        # Global normaliser: the position weight of every valid target in the global batch.
        denom = jnp.maximum(jnp.sum(position_weights(anchors, lengths, block_size, cfg.pos_decay)), 1e-6)

        # Frozen leaves (FROZEN_PARAMS) are not differentiated: no gradient buffers, no accumulator.
        labels = frozen_labels(params)
        fixed = jax.tree.map(lambda lab, x: x if lab == "frozen" else None, labels, params)
        trained = jax.tree.map(lambda lab, x: None if lab == "frozen" else x, labels, params)

        def micro_loss(tp, toks, lens, anc, cache=None):
            p = jax.tree.map(lambda lab, t, f: f if lab == "frozen" else t, labels, tp, fixed)
            d = nnx.merge(c_graph, to_compute(p))
            sums = loss_sums(d, target, toks, lens, anc, cfg, remat=cfg.remat, cached=cache)
            return sums["objective"] / denom, sums

        grad_fn = jax.grad(micro_loss, has_aux=True)
        if n_micro == 1:
            grads, sums = grad_fn(trained, tokens, lengths, anchors, cached)
        else:
            grads, sums = _accumulate(grad_fn, trained, (tokens, lengths, anchors, cached), mesh, n_micro)
        # zeros for the frozen leaves, which make_optimizer's mask discards (never materialised)
        grads = jax.tree.map(lambda lab, g, x: jnp.zeros_like(x) if lab == "frozen" else g, labels, grads, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        if lr_scale is not None:  # wsd: lr(step) / peak from the host (make_optimizer)
            updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        new = optax.apply_updates(params, updates)
        # frozen leaves stay bit-identical (p + 0 would turn -0.0 into +0.0)
        new = jax.tree.map(lambda lab, p, q: p if lab == "frozen" else q, labels, params, new)
        return new, opt_state, finalize_loss(sums), optax.tree.norm(grads)

    return step


class Trainer:
    """Holds the jitted step, optimizer and sharding for one drafter/target pair.

    Args:
      cfg: run config (``grad_accum_steps``, ``dtype``, ``remat`` shape the step).
      target: frozen target (its weights may be bfloat16).
      drafter: drafter to train; its parameters become float32 master weights
        (the drafter passed in is not modified; :meth:`drafter` returns the trained one).
      mesh: device mesh with a ``data`` axis and optionally ``fsdp`` / ``model`` axes
        (default: ``cfg.mesh`` via :func:`dspark_jax.models.sharding.make_mesh`, or every device of
        every host on ``data`` when that is empty). Parameters of the target and drafter and
        the optimizer state are laid out by :func:`dspark_jax.models.sharding.tree_shardings`.

    Raises:
      ValueError: ``grad_accum_steps < 1`` or a bad ``cfg.mesh``.
    """

    def __init__(self, cfg: TrainConfig, target: Target, drafter: TrainableDrafter, mesh: Mesh | None = None):
        if cfg.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {cfg.grad_accum_steps}")
        self.cfg = cfg
        if mesh is None:
            mesh = shd.make_mesh(cfg.mesh) if cfg.mesh else data_mesh()
        self.mesh = mesh
        self.tx = make_optimizer(cfg, frozen=bool(getattr(drafter.cfg, "own_embeddings", False)))
        # Parameters only: a drafter prepared for decoding carries derived rows (never trained).
        drafter = without_decode_state(drafter)
        self._lr_factor = host_lr_factor(cfg)
        self.d_graph, c_graph, params = _master_and_compute_graphs(drafter, jnp.dtype(cfg.dtype))
        self.t_graph, self.t_state = nnx.split(target)
        self._place_state(params, drafter.cfg, target.cfg)
        repl = NamedSharding(self.mesh, P())
        step = make_train_step(cfg, c_graph, self.t_graph, self.tx, self.mesh, drafter.cfg.block_size)
        self._step = jax.jit(
            step, donate_argnums=(0, 1), out_shardings=(self.param_shardings, self.opt_shardings, repl, repl)
        )

    def _place_state(self, params: nnx.State, dcfg: DrafterConfig, tcfg: TargetConfig) -> None:
        """Lays out the drafter's float32 ``params``, the target's state and a fresh optimizer state
        on the mesh (:func:`dspark_jax.models.sharding.tree_shardings`)."""
        self.batch_sharding = shd.batch_sharding(self.mesh)
        self.param_shardings = shd.tree_shardings(params, self.mesh, dcfg)
        self.target_shardings = shd.tree_shardings(self.t_state, self.mesh, tcfg)
        self.opt_shardings = shd.tree_shardings(jax.eval_shape(self.tx.init, params), self.mesh, dcfg)
        self.params = shd.place(params, self.param_shardings)
        self.t_state = shd.place(self.t_state, self.target_shardings)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)

    def drafter(self) -> TrainableDrafter:
        """The trained drafter (float32 master weights)."""
        return nnx.merge(self.d_graph, self.params)

    def shard_batch(self, batch: dict[str, np.ndarray]) -> tuple[jax.Array, ...]:
        """``(tokens, lengths, prompt_lengths)`` as global arrays sharded over the ``data`` axis.

        When ``batch`` carries a feature cache's rows (``tap_features``, ``last_hidden``, ``target_lse``;
        :meth:`FeatureCache.batch_arrays <dspark_jax.training.feature_cache.FeatureCache.batch_arrays>`)
        they follow, sharded the same way: ``(tokens, lengths, prompt_lengths, tap_features,
        last_hidden, target_lse)`` (``target_lse`` only where the batch has it).

        ``batch`` is the global batch (every process computes the same one from
        (seed, step)). With several processes each one transfers only the rows
        that live on its own devices.

        Raises:
          ValueError: the global batch does not split evenly over devices x micro-batches.
        """
        n = batch["tokens"].shape[0]
        n_data = shd.axis_size(self.mesh, shd.batch_axes(self.mesh))
        per = n_data * self.cfg.grad_accum_steps
        if n % per:
            raise ValueError(
                f"global batch {n} is not divisible by {n_data} devices x {self.cfg.grad_accum_steps} micro-batches"
            )
        keys = _BATCH_KEYS
        if all(k in batch for k in _CACHED_KEYS):
            keys += _CACHED_KEYS + ((_LSE_KEY,) if _LSE_KEY in batch else ())
        if jax.process_count() == 1:
            return tuple(jax.device_put(np.asarray(batch[k]), self.batch_sharding) for k in keys)
        rows = self.local_rows(n)
        return tuple(
            jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k])[rows], np.shape(batch[k]))
            for k in keys
        )

    def local_rows(self, global_batch: int) -> slice:
        """Rows of a global batch held by this process's devices (contiguous when the process's
        devices form a block of the batch axes; devices along ``model`` hold the same rows)."""
        # A device's index into the batch axis (None: it holds the whole array).
        rows = [
            (i or (slice(None),))[0]
            for i in self.batch_sharding.addressable_devices_indices_map((global_batch,)).values()
        ]
        starts = [r.start or 0 for r in rows]
        stops = [global_batch if r.stop is None else r.stop for r in rows]
        lo, hi = min(starts), max(stops)
        if sum(b - a for a, b in set(zip(starts, stops))) != hi - lo:
            raise ValueError("this process's devices do not hold a contiguous block of the batch")
        return slice(lo, hi)

    def _step_args(self, batch: dict[str, np.ndarray], step_idx: int) -> tuple[tuple, dict[str, Any]]:
        """The jitted step's ``(positional, keyword)`` arguments for ``batch`` at ``step_idx``."""
        tokens, lengths, plens, *cached = self.shard_batch(batch)
        lr_scale = None if self._lr_factor is None else self._lr_factor(step_idx)
        state = (self.params, self.opt_state, self.t_state)
        kwargs = {"cached": tuple(cached) if cached else None, "lr_scale": lr_scale}
        return (*state, tokens, lengths, plens, np.int32(step_idx)), kwargs

    def step(self, batch: dict[str, np.ndarray], step_idx: int) -> tuple[LossTerms, jax.Array]:
        """One optimisation step on a global batch; the anchor key depends only on (seed, step)."""
        args, kwargs = self._step_args(batch, step_idx)
        self.params, self.opt_state, terms, gnorm = self._step(*args, **kwargs)
        return terms, gnorm

    def lower_step(self, batch: dict[str, np.ndarray]) -> Any:
        """The jitted step lowered for ``batch`` (a ``jax.stages.Lowered``; ``.compile().cost_analysis()``
        gives its FLOPs); runs nothing."""
        args, kwargs = self._step_args(batch, 0)
        return self._step.lower(*args, **kwargs)

    # -- checkpoints -----------------------------------------------------------------

    def checkpoint_manager(self, directory: Path) -> ocp.CheckpointManager:
        """Orbax manager keeping ``keep_checkpoints`` steps.

        Saves are atomic (written to a temporary directory, renamed when complete);
        temporary directories left by a run killed mid-save are removed on start. The item's
        handler is named so that ``item_metadata`` reads a step's shapes before a restore (without
        it orbax returns None and warns that item "default" could not be restored).
        """
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=self.cfg.keep_checkpoints, create=True, cleanup_tmp_directories=True
        )
        return ocp.CheckpointManager(directory.absolute(), options=opts, item_handlers=ocp.StandardCheckpointHandler())

    def save(self, mgr: ocp.CheckpointManager, step: int) -> None:
        state = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state}
        mgr.save(step, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()

    def restore_latest(self, mgr: ocp.CheckpointManager) -> int:
        """Restores the newest readable checkpoint; returns the step to resume from (0 if none).

        Orbax commits a save atomically (temporary directory, then rename), so a run killed
        mid-save leaves no half-written step. Should the newest step still be unreadable
        (damaged on disk) while an older one restores, the damaged ones are reported and
        deleted (a later save may need their step numbers).

        Raises:
          DSparkInputError: checkpoints exist but none matches this run (e.g. another config).
        """
        abstract = jax.tree.map(
            ocp.utils.to_shape_dtype_struct, {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state}
        )
        failed: list[tuple[int, str]] = []
        for step in sorted(mgr.all_steps(), reverse=True):
            try:
                check_stored_shapes(lambda s=step: mgr.item_metadata(s)["params"], abstract["params"])
                state = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
            except Exception as e:  # orbax raises many types for damaged or mismatched checkpoints
                failed.append((step, (str(e).splitlines() or [type(e).__name__])[0][:300]))
                continue
            for bad, msg in failed:
                print(
                    f"warning: checkpoint step {bad} is unreadable ({msg}); deleted, resuming from step {step}",
                    file=sys.stderr,
                )
                mgr.delete(bad)
            nnx.replace_by_pure_dict(self.params, state["params"])
            # Orbax restores into the abstract tree's shardings (this trainer's mesh, whatever
            # the mesh that saved it); place() is a no-op then, and lays out anything else.
            self.params = shd.place(self.params, self.param_shardings)
            self.opt_state = shd.place(state["opt_state"], self.opt_shardings)
            return int(step)
        if failed:
            raise DSparkInputError(
                f"no checkpoint in {mgr.directory} matches this run (newest, step {failed[0][0]}: "
                f"{failed[0][1]}); use a new workdir or delete the checkpoints"
            )
        return 0


def count_params(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))
