"""Drafter training: self-distilled data, frozen target in the step, data parallel.

DESIGN.md "Training". One step:

1. frozen target forward over ``[B, L]`` sequences -> tapped features and
   ``p_target`` at every position;
2. ``A`` random anchor blocks per sequence, all in one drafter pass
   (block-sparse mask, :meth:`Drafter.train_blocks`);
3. teacher-forced Markov correction (``x_{k-1}`` = the true previous token);
4. loss = ``w_k * (ce_weight * CE + l1_weight * TV + conf_weight * BCE(c_k, sg(1 - TV_k)))``
   with position weights ``w_k = exp(-(k-1)/pos_decay)``, normalised by the
   weight of valid positions; ``TV = 0.5 ||p_draft - p_target||_1`` is exactly
   one minus the acceptance probability;
5. AdamW (warmup + cosine, global-norm clipping) update.

Data parallel: the step is ``jax.jit`` over a 1-D device mesh ``("data",)`` with
the batch sharded along it and parameters replicated -- the ``shard_map``/``jit``
equivalent of ``pmap`` (gradients are averaged across devices by XLA's
all-reduce). Multi-host: :func:`maybe_initialize_distributed`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import DrafterConfig
from .drafter import Drafter
from .target import Target


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; every field is a ``key=value`` override.

    Attributes (units in brackets):
      target: preset name or path of the target model.
      workdir: run folder (data shards, Orbax checkpoints, metrics.jsonl).
      export_dir: export folder (default ``<workdir>/export``).
      variant: ``dspark`` or ``dflash``.
      gamma: block size [tokens]; num_layers: drafter backbone layers;
      markov_rank: Markov head rank r; taps: tapped target layers (empty = default);
      drafter_intermediate_size: FFN width (0 = the target's).
      prompts: ``tinystories`` or ``chat``; prompts_file: extra JSONL prompts;
      num_prompts: training prompts used; num_eval_prompts: held-out prompts;
      gen_max_new_tokens [tokens], gen_temperature, gen_top_p, gen_batch_size:
        self-distillation generation settings; seq_len: stored length [tokens].
      steps, batch_size [sequences, global], anchors_per_seq: optimisation size.
      learning_rate, warmup_frac, weight_decay, grad_clip: AdamW schedule.
      ce_weight, l1_weight, conf_weight, pos_decay: loss (DESIGN.md "Training").
      time_budget_s [s]: stop training early after this much wall time (0 = off).
      seed; dtype (``float32``/``bfloat16`` compute); log_every, ckpt_every,
      keep_checkpoints [steps / count];
      eval_max_new_tokens [tokens], eval_temperature: held-out evaluation.
    """

    target: str = "stories260k"
    workdir: str = "runs/stories260k"
    export_dir: str = ""
    variant: str = "dspark"
    gamma: int = 8
    num_layers: int = 2
    markov_rank: int = 64
    taps: tuple[int, ...] = ()
    drafter_intermediate_size: int = 0
    prompts: str = "tinystories"
    prompts_file: str = ""
    num_prompts: int = 2048
    num_eval_prompts: int = 50
    gen_max_new_tokens: int = 150
    gen_temperature: float = 0.0
    gen_top_p: float = 1.0
    gen_batch_size: int = 128
    seq_len: int = 160
    steps: int = 800
    batch_size: int = 32
    anchors_per_seq: int = 16
    learning_rate: float = 3e-3
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    pos_decay: float = 4.0
    time_budget_s: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    log_every: int = 25
    ckpt_every: int = 250
    keep_checkpoints: int = 3
    eval_max_new_tokens: int = 128
    eval_temperature: float = 0.0

    def export_path(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.workdir) / "export"


TRAIN_PRESETS: dict[str, TrainConfig] = {
    "stories260k": TrainConfig(),
    "smollm2-135m-instruct": TrainConfig(
        target="smollm2-135m-instruct", workdir="runs/smollm2-135m-instruct", prompts="chat",
        gamma=8, num_layers=2, markov_rank=128, num_prompts=512, num_eval_prompts=16,
        gen_max_new_tokens=160, gen_batch_size=16, seq_len=256, steps=600, batch_size=8,
        anchors_per_seq=16, learning_rate=1e-3, eval_max_new_tokens=96),
}


def drafter_config(cfg: TrainConfig, target: Target) -> DrafterConfig:
    """The :class:`DrafterConfig` a run builds for ``target``."""
    t = target.cfg
    over: dict[str, Any] = dict(variant=cfg.variant, gamma=cfg.gamma, num_layers=cfg.num_layers,
                                markov_rank=cfg.markov_rank if cfg.variant == "dspark" else 0,
                                target_fingerprint=target.fingerprint)
    if cfg.taps:
        over["taps"] = tuple(cfg.taps)
    if cfg.drafter_intermediate_size:
        over["intermediate_size"] = cfg.drafter_intermediate_size
    return DrafterConfig.for_target(t, **over)


class LossTerms(NamedTuple):
    loss: jax.Array
    ce: jax.Array
    tv: jax.Array
    bce: jax.Array
    conf_err: jax.Array
    tau_est: jax.Array
    acc_by_pos: jax.Array   # [gamma] mean 1 - TV per position


def sample_anchors(key: jax.Array, lengths: jax.Array, prompt_lengths: jax.Array, num: int) -> jax.Array:
    """``[B, num]`` int32 anchors uniform in ``[prompt_len - 1, length - 2]`` (>= 0).

    Anchors start at the last prompt token so every predicted token is target-generated.
    """
    lo = jnp.maximum(prompt_lengths - 1, 0)
    hi = jnp.maximum(lengths - 2, lo)
    u = jax.random.uniform(key, (lengths.shape[0], num))
    return (lo[:, None] + jnp.floor(u * (hi - lo + 1)[:, None])).astype(jnp.int32)


def drafter_loss(drafter: Drafter, target: Target, tokens: jax.Array, lengths: jax.Array,
                 prompt_lengths: jax.Array, key: jax.Array, cfg: TrainConfig) -> LossTerms:
    """DSpark training loss on a batch (DESIGN.md "Training"; paper Appendix A4).

    Args:
      tokens: ``[B, L]`` int32 target-generated sequences (0-padded).
      lengths / prompt_lengths: ``[B]`` int32 valid and prompt lengths [tokens].
      key: PRNG key for the anchor positions.
    Returns:
      :class:`LossTerms` (scalars float32, ``acc_by_pos [gamma]``).
    """
    dc = drafter.cfg
    g = dc.gamma
    out = target(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), taps=dc.taps)
    feats = jax.lax.stop_gradient(out.features)
    t_logits = jax.lax.stop_gradient(out.logits)
    anchors = sample_anchors(key, lengths, prompt_lengths, cfg.anchors_per_seq)
    block = drafter.train_blocks(target, feats, tokens, anchors)
    k = jnp.arange(g, dtype=jnp.int32)
    src = anchors[..., None] + k                        # position whose next token is predicted
    valid = (src + 1) < lengths[:, None, None]          # [B, A, g]
    src_c = jnp.minimum(src, tokens.shape[1] - 1)
    tgt_c = jnp.minimum(src + 1, tokens.shape[1] - 1)
    bidx = jnp.arange(tokens.shape[0])[:, None, None]
    prev = tokens[bidx, src_c]                          # teacher forcing: x_{k-1} is the true token
    labels = tokens[bidx, tgt_c]
    p_t = jax.nn.softmax(t_logits[bidx, src_c], axis=-1)
    e = drafter.markov_embedding(prev)
    logits = block.logits + drafter.markov_bias(e)
    logq = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]
    tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(logq) - p_t), axis=-1)
    z = drafter.confidence_logit(block.hidden, e)
    soft = jax.lax.stop_gradient(1.0 - tv)
    if dc.has_confidence:
        bce = optax.sigmoid_binary_cross_entropy(z, soft) - optax.sigmoid_binary_cross_entropy(
            jnp.log(soft + 1e-6) - jnp.log1p(-soft + 1e-6), soft)  # minus the label entropy: 0 at optimum
        conf_err = jnp.abs(jax.nn.sigmoid(z) - soft)
    else:
        bce = jnp.zeros_like(tv)
        conf_err = jnp.zeros_like(tv)
    w = jnp.exp(-k.astype(jnp.float32) / cfg.pos_decay) * valid
    denom = jnp.maximum(jnp.sum(w), 1e-6)
    mean = lambda x: jnp.sum(w * x) / denom
    loss = cfg.ce_weight * mean(ce) + cfg.l1_weight * mean(tv) + cfg.conf_weight * mean(bce)
    vf = valid.astype(jnp.float32)
    acc = jnp.sum((1.0 - tv) * vf, axis=(0, 1)) / jnp.maximum(jnp.sum(vf, axis=(0, 1)), 1.0)
    full = jnp.all(valid, axis=-1, keepdims=True)       # analytic tau on complete blocks only
    surv = jnp.cumprod(1.0 - tv, axis=-1)
    tau_est = 1.0 + jnp.sum(jnp.sum(surv, -1, keepdims=True) * full) / jnp.maximum(jnp.sum(full), 1.0)
    return LossTerms(loss, mean(ce), mean(tv), mean(bce), mean(conf_err), tau_est, acc)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay and global-norm clipping."""
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, warm, max(cfg.steps, warm + 1),
                                               end_value=cfg.learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def data_mesh() -> Mesh:
    """1-D mesh ``("data",)`` over every device of every host."""
    return Mesh(np.array(jax.devices()), ("data",))


def maybe_initialize_distributed() -> None:
    """Calls ``jax.distributed.initialize()`` when launched as one of several processes.

    Triggered by the standard coordinator variables (``JAX_COORDINATOR_ADDRESS``,
    or TPU VM pod metadata via ``DSPARK_DISTRIBUTED=1``).
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("DSPARK_DISTRIBUTED") == "1":
        jax.distributed.initialize()


class Trainer:
    """Holds the jitted step, optimizer and sharding for one drafter/target pair.

    Args:
      cfg: run config.
      target: frozen target.
      drafter: drafter to train (its params are replaced by the trained ones).
      mesh: device mesh (default: all devices on the ``data`` axis).
    """

    def __init__(self, cfg: TrainConfig, target: Target, drafter: Drafter, mesh: Mesh | None = None):
        self.cfg = cfg
        self.mesh = mesh or data_mesh()
        self.tx = make_optimizer(cfg)
        self.d_graph, self.params = nnx.split(drafter, nnx.Param)
        self.t_graph, self.t_state = nnx.split(target)
        repl = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.params = jax.device_put(self.params, repl)
        self.t_state = jax.device_put(self.t_state, repl)
        self.opt_state = jax.device_put(self.tx.init(self.params), repl)
        d_graph, t_graph, tx = self.d_graph, self.t_graph, self.tx

        def step(params, opt_state, t_state, tokens, lengths, plens, key):
            target = nnx.merge(t_graph, t_state)

            def loss_fn(p):
                terms = drafter_loss(nnx.merge(d_graph, p), target, tokens, lengths, plens, key, cfg)
                return terms.loss, terms

            (_, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, terms, optax.global_norm(grads)

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def drafter(self) -> Drafter:
        return nnx.merge(self.d_graph, self.params)

    def step(self, batch: dict[str, np.ndarray], step_idx: int) -> tuple[LossTerms, jax.Array]:
        """One optimisation step on a global batch; the anchor key depends only on (seed, step)."""
        if batch["tokens"].shape[0] % self.mesh.size:
            raise ValueError(f"global batch {batch['tokens'].shape[0]} is not divisible by {self.mesh.size} devices")
        put = lambda x: jax.device_put(jnp.asarray(x), self.batch_sharding)
        key = jax.random.fold_in(jax.random.PRNGKey(self.cfg.seed), step_idx)
        self.params, self.opt_state, terms, gnorm = self._step(
            self.params, self.opt_state, self.t_state, put(batch["tokens"]), put(batch["lengths"]),
            put(batch["prompt_lengths"]), key)
        return terms, gnorm

    # -- checkpoints -----------------------------------------------------------------

    def checkpoint_manager(self, directory: Path) -> ocp.CheckpointManager:
        opts = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.keep_checkpoints, create=True)
        return ocp.CheckpointManager(directory.absolute(), options=opts)

    def save(self, mgr: ocp.CheckpointManager, step: int) -> None:
        state = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state}
        mgr.save(step, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()

    def restore_latest(self, mgr: ocp.CheckpointManager) -> int:
        """Restores the newest checkpoint; returns the step to resume from (0 if none)."""
        latest = mgr.latest_step()
        if latest is None:
            return 0
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state})
        state = mgr.restore(latest, args=ocp.args.StandardRestore(abstract))
        nnx.replace_by_pure_dict(self.params, state["params"])
        repl = NamedSharding(self.mesh, P())
        self.params = jax.device_put(self.params, repl)
        self.opt_state = jax.device_put(state["opt_state"], repl)
        return int(latest)


def count_params(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
