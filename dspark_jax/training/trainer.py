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
equivalent of ``pmap``. With ``mesh=data:D,model:M`` (:mod:`dspark_jax.models.sharding`,
DESIGN.md "Scale: a device mesh") the frozen target and the drafter are also sharded
over ``model`` (heads, MLP, vocabulary; replicated where ``M`` does not divide them),
the optimizer state like its parameters, and ``fsdp`` shards parameters' ``embed``
dimension; the jitted step has explicit in/out shardings, XLA inserts the collectives.
The loss is one weighted mean over the *global* batch
(sums over every device's rows divided by the global weight; XLA inserts the
all-reduces), so an N-device step equals a one-device step on the same global
batch. Multi-host: :func:`maybe_initialize_distributed`; each process feeds only
the rows of the global batch that live on its own devices
(``jax.make_array_from_process_local_data``).

Gradient accumulation (``grad_accum_steps``): the global batch is split into
micro-batches processed by ``lax.scan`` inside the same jitted step. Anchors are
drawn once for the whole global batch and every micro-batch contributes weighted
*sums* (numerators) divided by the global weight (denominator), so the result is
the big-batch step, not a mean of per-micro-batch means.

Feature cache (``feature_cache``, :mod:`dspark_jax.training.feature_cache`): when the batch
carries the target's tapped features and last hidden state, computed once per
sequence before training, step 1 skips the target forward and computes
``p_target`` only at the gathered positions from the cached last hidden state
(same numbers as the uncached step for a float32 cache).

Precision: parameters and optimizer state are float32 master copies; with
``dtype=bfloat16`` the forward pass runs on a bfloat16 cast of them (the frozen
target lives in bfloat16), the loss and its reductions stay float32.
``remat=True`` rematerialises each drafter layer and the vocabulary-sized loss
head in the backward pass (``jax.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.dspark import Drafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.models.target import Target


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; every field is a ``key=value`` override.

    Attributes (units in brackets):
      target: preset name or path of the target model.
      workdir: run folder (data shards, Orbax checkpoints, metrics.jsonl).
      export_dir: export folder (default ``<workdir>/export``).
      variant: ``dspark``, ``dflash`` or ``eagle3`` (the autoregressive baseline of
        :mod:`dspark_jax.drafters.eagle`: always one layer, ``num_layers`` is not used; default
        taps low/mid/high, :func:`~dspark_jax.drafters.eagle.eagle_taps`).
      gamma: block size [tokens]; num_layers: drafter backbone layers;
      markov_rank: Markov head rank r; markov_head: ``vanilla`` / ``gated`` / ``rnn``
        (:class:`~dspark_jax.config.DrafterConfig`); taps: tapped target layers (empty = default);
      drafter_intermediate_size: FFN width (0 = the target's, scaled by drafter_width / H).
      draft_vocab_size: N > 0 drafts over the N most frequent target-generated tokens of
        the training data (:func:`dspark_jax.training.data.draft_vocabulary`; stored in the export);
        0 = the full vocabulary.
      drafter_width: the drafter's residual width d (0 = the target's hidden size H; a
        tiny target trains a better drafter wider than itself). Heads keep the target's
        count with ``head_dim = d / num_heads``; dspark/dflash only.
      prompts: ``tinystories`` or ``chat``; prompts_file: extra JSONL prompts;
      num_prompts: training prompts used; num_eval_prompts: held-out prompts;
      gen_max_new_tokens [tokens], gen_temperature, gen_top_p, gen_batch_size:
        self-distillation generation settings; seq_len: stored length [tokens].
      steps, batch_size [sequences, global], anchors_per_seq: optimisation size.
      learning_rate, warmup_frac, weight_decay, grad_clip: AdamW schedule.
      ce_weight, l1_weight, conf_weight, pos_decay: loss (DESIGN.md "Training").
      time_budget_s [s]: stop training early after this much wall time (0 = off;
        counted per invocation: rerunning the command continues towards ``steps``).
      grad_accum_steps: micro-batches per optimisation step (the global batch
        is split; same result as one big batch, less activation memory).
      seed; dtype (``float32``/``bfloat16`` compute; master weights and
        optimizer state are always float32); remat: rematerialise drafter
        layers and the loss head in the backward pass (less memory, ~1/3 more
        compute); log_every, ckpt_every, keep_checkpoints [steps / count];
      gen_shard_size [sequences]: self-distillation data per resumable shard;
      gen_sampled_frac: fraction of the generated continuations sampled at a serving
        temperature (``gen_sample_temperature``, ``gen_sample_top_p``; DeepSpec uses 0.7 / 0.8)
        instead of ``gen_temperature``, spread evenly over the prompts (teaches the drafter and
        its confidence head the sampled regime);
      corpus: a text or JSONL file (:func:`dspark_jax.training.data.read_corpus`: plain text,
        prompt/response or chat ``messages``) distilled on directly: no generation, one target
        forward per sequence in the train step; only response tokens are targets of chat rows.
        Mixed with the generated data (``corpus_max_sequences`` caps it, 0 = all). Rows that
        contain an evaluation prompt are dropped (:func:`dspark_jax.training.data.drop_contaminated`),
        and so are such prompts of ``prompts_file``;
      eval_max_new_tokens [tokens], eval_temperature: held-out evaluation.
      data_dir: read the self-distillation shards (``shard_*.npz``) from this folder
        instead of generating them into ``<workdir>/data``; the folder is only read
        (e.g. several drafters trained on the identical data of one run).
      feature_cache: folder of a target-feature cache (:mod:`dspark_jax.training.feature_cache`;
        empty = off): the frozen target runs once per training sequence before training
        and every step reads its tapped features from disk instead of recomputing them
        (saves the target forward of every step: 1.45x per DSpark step for the stories260k
        preset on 2 CPU cores, more where the target dominates the step). Built when missing, extended when
        it lacks this drafter's taps, refused when it belongs to another target or data.
        ``auto``: ``<workdir>/feature_cache`` on a single-process run, off on several.
      feature_cache_dtype: ``float32`` (cached training equals uncached) or ``bfloat16``
        (half the disk and memory).
      mesh: device mesh ``axis:size,...`` over ``data``, ``fsdp`` and ``model``
        (:func:`dspark_jax.models.sharding.make_mesh`), e.g. ``data:2,model:4`` on 8 devices; one
        size may be -1 (the rest). Empty: every device on ``data`` (pure data parallel,
        parameters replicated: the layout before meshes existed).
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
    drafter_width: int = 0
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
    grad_accum_steps: int = 1
    seed: int = 0
    dtype: str = "float32"
    remat: bool = False
    log_every: int = 25
    ckpt_every: int = 250
    keep_checkpoints: int = 3
    gen_shard_size: int = 256
    gen_sampled_frac: float = 0.0
    gen_sample_temperature: float = 0.7
    gen_sample_top_p: float = 0.8
    corpus: str = ""
    corpus_max_sequences: int = 0
    eval_max_new_tokens: int = 128
    eval_temperature: float = 0.0
    markov_head: str = "vanilla"
    draft_vocab_size: int = 0
    data_dir: str = ""
    feature_cache: str = ""
    feature_cache_dtype: str = "float32"
    mesh: str = ""

    def export_path(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.workdir) / "export"


TRAIN_PRESETS: dict[str, TrainConfig] = {
    # A drafter twice the target's width (1.78x its parameters) trained from a feature cache:
    # held-out tau 4.05 after 1100 steps (docs/results.md, session 5).
    "stories260k": TrainConfig(drafter_width=128, steps=1100, feature_cache="auto"),
    "smollm2-135m-instruct": TrainConfig(
        target="smollm2-135m-instruct",
        workdir="runs/smollm2-135m-instruct",
        prompts="chat",
        gamma=8,
        num_layers=2,
        markov_rank=128,
        num_prompts=512,
        num_eval_prompts=16,
        gen_max_new_tokens=160,
        gen_batch_size=16,
        seq_len=256,
        steps=600,
        batch_size=8,
        anchors_per_seq=16,
        learning_rate=1e-3,
        eval_max_new_tokens=96,
    ),
    # Qwen3 recipes for a TPU VM (see dspark_jax/recipes/qwen3-*.yaml): the paper's drafter shape (5 layers,
    # taps 1/9/17/25/33, gamma 7, Markov rank 256), bf16 compute, float32 master weights.
    "qwen3-4b": TrainConfig(
        target="qwen3-4b",
        workdir="runs/qwen3-4b",
        prompts="chat",
        variant="dspark",
        gamma=7,
        num_layers=5,
        markov_rank=256,
        taps=(1, 9, 17, 25, 33),
        num_prompts=100_000,
        num_eval_prompts=32,
        gen_max_new_tokens=1536,
        gen_temperature=0.7,
        gen_top_p=0.8,
        gen_batch_size=256,
        gen_shard_size=4096,
        seq_len=2048,
        steps=10_000,
        batch_size=64,
        grad_accum_steps=4,
        anchors_per_seq=64,
        learning_rate=6e-4,
        warmup_frac=0.04,
        ce_weight=0.1,
        l1_weight=0.9,
        conf_weight=1.0,
        dtype="bfloat16",
        remat=True,
        log_every=50,
        ckpt_every=500,
        keep_checkpoints=3,
        eval_max_new_tokens=512,
    ),
}
TRAIN_PRESETS["qwen3-8b"] = dataclasses.replace(
    TRAIN_PRESETS["qwen3-4b"], target="qwen3-8b", workdir="runs/qwen3-8b", grad_accum_steps=8
)


def drafter_config(cfg: TrainConfig, target: Target) -> DrafterConfig:
    """The :class:`DrafterConfig` a run builds for ``target``."""
    t = target.cfg
    eagle = cfg.variant == "eagle3"
    over: dict[str, Any] = dict(
        variant=cfg.variant,
        gamma=cfg.gamma,
        num_layers=1 if eagle else cfg.num_layers,
        markov_rank=cfg.markov_rank if cfg.variant == "dspark" else 0,
        markov_head=cfg.markov_head,
        target_fingerprint=target.fingerprint,
        draft_vocab_size=cfg.draft_vocab_size,
    )
    if cfg.taps:
        over["taps"] = tuple(cfg.taps)
    elif eagle:
        from dspark_jax.drafters.eagle import eagle_taps

        over["taps"] = eagle_taps(t)
    if cfg.drafter_width and cfg.drafter_width != t.hidden_size and not eagle:
        if cfg.drafter_width % t.num_heads:
            raise DSparkInputError(
                f"drafter_width={cfg.drafter_width} is not a multiple of the target's {t.num_heads} heads"
            )
        over.update(
            width=cfg.drafter_width,
            head_dim=cfg.drafter_width // t.num_heads,
            intermediate_size=int(round(t.intermediate_size * cfg.drafter_width / t.hidden_size)),
        )
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
    acc_by_pos: jax.Array  # [gamma] mean 1 - TV per position


def sample_anchors(key: jax.Array, lengths: jax.Array, prompt_lengths: jax.Array, num: int) -> jax.Array:
    """``[B, num]`` int32 anchors uniform in ``[prompt_len - 1, length - 2]`` (>= 0).

    Anchors start at the last prompt token so every predicted token is target-generated.
    """
    lo = jnp.maximum(prompt_lengths - 1, 0)
    hi = jnp.maximum(lengths - 2, lo)
    u = jax.random.uniform(key, (lengths.shape[0], num))
    return (lo[:, None] + jnp.floor(u * (hi - lo + 1)[:, None])).astype(jnp.int32)


def position_weights(anchors: jax.Array, lengths: jax.Array, gamma: int, pos_decay: float) -> jax.Array:
    """``[B, A, gamma]`` float32 loss weights ``exp(-(k-1)/pos_decay)``, 0 past a sequence's end."""
    k = jnp.arange(gamma, dtype=jnp.int32)
    valid = (anchors[..., None] + k + 1) < lengths[:, None, None]
    return jnp.exp(-k.astype(jnp.float32) / pos_decay) * valid


def loss_sums(
    drafter: Drafter,
    target: Target,
    tokens: jax.Array,
    lengths: jax.Array,
    anchors: jax.Array,
    cfg: TrainConfig,
    remat: bool = False,
    cached: tuple[jax.Array, jax.Array] | None = None,
) -> dict[str, jax.Array]:
    """Additive loss statistics of a (micro-)batch: weighted sums, never means.

    Summing these over micro-batches or devices and then :func:`finalize_loss`
    gives exactly the statistics of the whole batch (the denominator ``w`` is
    summed too). ``objective`` is ``sum_k w_k (ce_weight CE + l1_weight TV +
    conf_weight BCE)``; the loss is ``objective / w``.

    Args:
      tokens: ``[B, L]`` int32; lengths: ``[B]`` int32; anchors: ``[B, A]`` int32.
      remat: recompute the drafter's layers (``train_blocks(remat=True)``) and the
        vocabulary-sized loss head in the backward pass.
      cached: optional ``(tap_features [B, L, n_taps * H], last_hidden [B, L, H])`` of the
        target from a feature cache (:mod:`dspark_jax.training.feature_cache`; any float dtype, cast
        to the target's): the target forward is skipped and ``p_target`` is computed only at
        the ``B * A * gamma`` gathered positions (``target.unembed`` of the last hidden state).
    Returns:
      dict of float32 scalars (``acc_num``/``acc_den``: ``[gamma]``).
    Raises:
      ValueError: ``cached`` features do not have the drafter's ``len(taps) * H`` columns.
    """
    dc = drafter.cfg
    g = dc.gamma
    if cached is None:
        out = target(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), taps=dc.taps)
        feats = jax.lax.stop_gradient(out.features)
        t_logits = jax.lax.stop_gradient(out.logits)
    else:
        c_feats, c_hidden = cached
        want = len(dc.taps) * target.cfg.hidden_size
        if c_feats.shape[:2] != tokens.shape or c_feats.shape[-1] != want:
            raise ValueError(
                f"cached features {c_feats.shape} do not fit tokens {tokens.shape} and "
                f"{len(dc.taps)} taps x {target.cfg.hidden_size}"
            )
        feats = jax.lax.stop_gradient(c_feats.astype(target.dtype))
        t_logits = None
    block = drafter.train_blocks(target, feats, tokens, anchors, remat=remat)
    k = jnp.arange(g, dtype=jnp.int32)
    src = anchors[..., None] + k  # position whose next token is predicted
    valid = (src + 1) < lengths[:, None, None]  # [B, A, g]
    src_c = jnp.minimum(src, tokens.shape[1] - 1)
    tgt_c = jnp.minimum(src + 1, tokens.shape[1] - 1)
    bidx = jnp.arange(tokens.shape[0])[:, None, None]
    prev = tokens[bidx, src_c]  # teacher forcing: x_{k-1} is the true token
    labels = tokens[bidx, tgt_c]
    w = position_weights(anchors, lengths, g, cfg.pos_decay)
    if t_logits is None:  # only the gathered positions: [B, A, g, V] instead of [B, L, V]
        t_sel = jax.lax.stop_gradient(target.unembed(c_hidden.astype(target.dtype)[bidx, src_c]))
    else:
        t_sel = t_logits[bidx, src_c]

    def head(hidden, base_logits, t_sel):
        if remat:  # recompute the [.., V] base logits from the hidden states instead of storing them
            base_logits = drafter.base_logits(target, hidden)
        p_t = jax.nn.softmax(t_sel, axis=-1)
        # Only a drafter with a Markov head / draft vocabulary has them (not dflash, not eagle3).
        bias, e = drafter.teacher_forced_heads(hidden, prev) if dc.markov else (0.0, None)
        logq = jax.nn.log_softmax(base_logits + bias, axis=-1)  # [..., N] draft space
        ids = drafter.draft_vocab_ids() if dc.draft_vocab_size else None
        if ids is None:
            ce = -jnp.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]
            tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(logq) - p_t), axis=-1)
        else:
            # q is zero off the draft vocabulary, so the target's mass there counts in full
            # towards TV; a label off the vocabulary cannot be predicted and has no CE term.
            li = drafter.draft_index(labels)
            inside = li < dc.draft_vocab_size
            ce = jnp.where(
                inside,
                -jnp.take_along_axis(logq, jnp.minimum(li, dc.draft_vocab_size - 1)[..., None], axis=-1)[..., 0],
                0.0,
            )
            p_in = jnp.take(p_t, ids, axis=-1)
            tv = 0.5 * (jnp.sum(jnp.abs(jnp.exp(logq) - p_in), axis=-1) + jnp.maximum(1.0 - jnp.sum(p_in, -1), 0.0))
        if dc.has_confidence:
            z = drafter.confidence_logit(hidden, e)
            soft = jax.lax.stop_gradient(1.0 - tv)
            bce = optax.sigmoid_binary_cross_entropy(z, soft) - optax.sigmoid_binary_cross_entropy(
                jnp.log(soft + 1e-6) - jnp.log1p(-soft + 1e-6), soft
            )  # minus the label entropy: 0 at optimum
            conf_err = jnp.abs(jax.nn.sigmoid(z) - soft)
        else:
            bce = jnp.zeros_like(tv)
            conf_err = jnp.zeros_like(tv)
        return ce, tv, bce, conf_err

    if remat:
        ce, tv, bce, conf_err = jax.checkpoint(head, prevent_cse=False)(block.hidden, None, t_sel)
    else:
        ce, tv, bce, conf_err = head(block.hidden, block.logits, t_sel)
    ws = lambda x: jnp.sum(w * x)
    vf = valid.astype(jnp.float32)
    full = jnp.all(valid, axis=-1, keepdims=True)  # analytic tau on complete blocks only
    surv = jnp.cumprod(1.0 - tv, axis=-1)
    return {
        "objective": cfg.ce_weight * ws(ce) + cfg.l1_weight * ws(tv) + cfg.conf_weight * ws(bce),
        "w": jnp.sum(w),
        "ce": ws(ce),
        "tv": ws(tv),
        "bce": ws(bce),
        "conf_err": ws(conf_err),
        "acc_num": jnp.sum((1.0 - tv) * vf, axis=(0, 1)),
        "acc_den": jnp.sum(vf, axis=(0, 1)),
        "tau_num": jnp.sum(jnp.sum(surv, -1, keepdims=True) * full),
        "tau_den": jnp.sum(full).astype(jnp.float32),
    }


def finalize_loss(s: dict[str, jax.Array]) -> LossTerms:
    """Means of the summed statistics of :func:`loss_sums` (the weighted means over the batch)."""
    denom = jnp.maximum(s["w"], 1e-6)
    return LossTerms(
        s["objective"] / denom,
        s["ce"] / denom,
        s["tv"] / denom,
        s["bce"] / denom,
        s["conf_err"] / denom,
        1.0 + s["tau_num"] / jnp.maximum(s["tau_den"], 1.0),
        s["acc_num"] / jnp.maximum(s["acc_den"], 1.0),
    )


def drafter_loss(
    drafter: Drafter,
    target: Target,
    tokens: jax.Array,
    lengths: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    cfg: TrainConfig,
) -> LossTerms:
    """DSpark training loss on a batch (DESIGN.md "Training"; paper Appendix A4).

    Args:
      tokens: ``[B, L]`` int32 target-generated sequences (0-padded).
      lengths / prompt_lengths: ``[B]`` int32 valid and prompt lengths [tokens].
      key: PRNG key for the anchor positions.
    Returns:
      :class:`LossTerms` (scalars float32, ``acc_by_pos [gamma]``).
    """
    anchors = sample_anchors(key, lengths, prompt_lengths, cfg.anchors_per_seq)
    return finalize_loss(loss_sums(drafter, target, tokens, lengths, anchors, cfg))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay and global-norm clipping."""
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warm, max(cfg.steps, warm + 1), end_value=cfg.learning_rate * 0.05
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    )


def data_mesh() -> Mesh:
    """1-D mesh ``("data",)`` over every device of every host."""
    return Mesh(np.array(jax.devices()), ("data",))


def maybe_initialize_distributed() -> None:
    """Calls ``jax.distributed.initialize()`` when launched as one of several processes.

    Triggered by the standard coordinator variables (``JAX_COORDINATOR_ADDRESS``,
    or TPU VM pod metadata via ``DSPARK_DISTRIBUTED=1``). Idempotent.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("DSPARK_DISTRIBUTED") == "1":
        try:
            jax.distributed.initialize()
        except RuntimeError as e:  # already initialised (e.g. run() called twice in one process)
            if "already" not in str(e).lower():
                raise


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


_BATCH_KEYS = ("tokens", "lengths", "prompt_lengths")
# Optional per-sequence arrays of a feature cache (dspark_jax.training.feature_cache.FEATURES_KEY / LAST_HIDDEN_KEY).
_CACHED_KEYS = ("tap_features", "last_hidden")


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

    def __init__(self, cfg: TrainConfig, target: Target, drafter: Drafter, mesh: Mesh | None = None):
        if cfg.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {cfg.grad_accum_steps}")
        self.cfg = cfg
        if mesh is None:
            mesh = shd.make_mesh(cfg.mesh) if cfg.mesh else data_mesh()
        self.mesh = mesh
        self.tx = make_optimizer(cfg)
        graph, params = nnx.split(drafter, nnx.Param)
        compute = jnp.dtype(cfg.dtype)

        def graph_with(**attrs):
            """The drafter's graph definition with some static attributes replaced (no array copies)."""
            m = nnx.merge(graph, params)
            for k, v in attrs.items():
                setattr(m, k, v)
            return nnx.split(m, nnx.Param)[0]

        # Master copy: float32 parameters (and optimizer state); the graph that runs the
        # forward pass may compute in bfloat16 (remat is an argument of loss_sums).
        self.d_graph = graph if jnp.dtype(drafter.dtype) == jnp.float32 else graph_with(dtype=jnp.float32)
        c_graph = self.d_graph if compute == jnp.float32 else graph_with(dtype=compute)
        self.params = jax.tree.map(lambda x: x.astype(jnp.float32) if _is_float(x) else x, params)
        self.t_graph, self.t_state = nnx.split(target)
        repl = NamedSharding(self.mesh, P())
        self.batch_sharding = shd.batch_sharding(self.mesh)
        self.param_shardings = shd.tree_shardings(self.params, self.mesh, drafter.cfg)
        self.target_shardings = shd.tree_shardings(self.t_state, self.mesh, target.cfg)
        self.opt_shardings = shd.tree_shardings(jax.eval_shape(self.tx.init, self.params), self.mesh, drafter.cfg)
        self.params = shd.place(self.params, self.param_shardings)
        self.t_state = shd.place(self.t_state, self.target_shardings)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        t_graph, tx, mesh = self.t_graph, self.tx, self.mesh
        batch_axis = shd.batch_axes(mesh)
        n_micro, gamma = cfg.grad_accum_steps, drafter.cfg.gamma

        def to_compute(p):
            if compute == jnp.float32:
                return p
            return jax.tree.map(lambda x: x.astype(compute) if _is_float(x) else x, p)

        def step(params, opt_state, t_state, tokens, lengths, plens, step_idx, cached=None):
            target = nnx.merge(t_graph, t_state)
            key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step_idx)  # depends only on (seed, step)
            # Anchors for the whole global batch, drawn once: identical whatever the number of
            # devices or micro-batches.
            anchors = sample_anchors(key, lengths, plens, cfg.anchors_per_seq)
            # Global normaliser: the position weight of every valid target in the global batch.
            denom = jnp.maximum(jnp.sum(position_weights(anchors, lengths, gamma, cfg.pos_decay)), 1e-6)

            def micro_loss(p, toks, lens, anc, cache=None):
                d = nnx.merge(c_graph, to_compute(p))
                sums = loss_sums(d, target, toks, lens, anc, cfg, remat=cfg.remat, cached=cache)
                return sums["objective"] / denom, sums

            grad_fn = jax.grad(micro_loss, has_aux=True)
            if n_micro == 1:
                grads, sums = grad_fn(params, tokens, lengths, anchors, cached)
            else:

                def split(x):
                    # Row j * n_micro + i goes to micro-batch i: each device keeps its own rows
                    # (no cross-device shuffle) and every micro-batch spans all devices.
                    y = x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)
                    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, batch_axis)))

                xs = (split(tokens), split(lengths), split(anchors), jax.tree.map(split, cached))
                first = jax.tree.map(lambda x: x[0], xs)
                zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, *first))

                def body(acc, x):
                    g, s = grad_fn(params, *x)
                    return jax.tree.map(jnp.add, acc, (g, s)), None

                (grads, sums), _ = jax.lax.scan(body, zeros, xs)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, finalize_loss(sums), optax.global_norm(grads)

        self._step = jax.jit(
            step, donate_argnums=(0, 1), out_shardings=(self.param_shardings, self.opt_shardings, repl, repl)
        )

    def drafter(self) -> Drafter:
        """The trained drafter (float32 master weights)."""
        return nnx.merge(self.d_graph, self.params)

    def shard_batch(self, batch: dict[str, np.ndarray]) -> tuple[jax.Array, ...]:
        """``(tokens, lengths, prompt_lengths)`` as global arrays sharded over the ``data`` axis.

        When ``batch`` carries a feature cache's rows (``tap_features``, ``last_hidden``;
        :meth:`FeatureCache.batch_arrays <dspark_jax.training.feature_cache.FeatureCache.batch_arrays>`)
        they follow, sharded the same way: ``(tokens, lengths, prompt_lengths, tap_features,
        last_hidden)``.

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
        keys = _BATCH_KEYS + (_CACHED_KEYS if all(k in batch for k in _CACHED_KEYS) else ())
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
        idx = self.batch_sharding.addressable_devices_indices_map((global_batch,)).values()
        starts = [i[0].start or 0 for i in idx]
        stops = [global_batch if i[0].stop is None else i[0].stop for i in idx]
        lo, hi = min(starts), max(stops)
        if sum(b - a for a, b in set(zip(starts, stops))) != hi - lo:
            raise ValueError("this process's devices do not hold a contiguous block of the batch")
        return slice(lo, hi)

    def step(self, batch: dict[str, np.ndarray], step_idx: int) -> tuple[LossTerms, jax.Array]:
        """One optimisation step on a global batch; the anchor key depends only on (seed, step)."""
        tokens, lengths, plens, *cached = self.shard_batch(batch)
        self.params, self.opt_state, terms, gnorm = self._step(
            self.params,
            self.opt_state,
            self.t_state,
            tokens,
            lengths,
            plens,
            np.int32(step_idx),
            tuple(cached) if cached else None,
        )
        return terms, gnorm

    # -- checkpoints -----------------------------------------------------------------

    def checkpoint_manager(self, directory: Path) -> ocp.CheckpointManager:
        """Orbax manager keeping ``keep_checkpoints`` steps.

        Saves are atomic (written to a temporary directory, renamed when complete);
        temporary directories left by a run killed mid-save are removed on start.
        """
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=self.cfg.keep_checkpoints, create=True, cleanup_tmp_directories=True
        )
        return ocp.CheckpointManager(directory.absolute(), options=opts)

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


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drops rows with ``step > max_step`` (logged by a killed run after its last checkpoint).

    Rewritten atomically; a torn last line (killed mid-write) is dropped too.
    """
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(row.get("step", 0)) <= max_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)
