"""The training run's configuration: :class:`TrainConfig` (every ``key=value`` override of
``python -m dspark_jax.train``), the drafter it asks for (:class:`DrafterSettings`, its ``drafter``)
and the :class:`~dspark_jax.config.DrafterConfig` that becomes for a target (:func:`drafter_config`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Protocol

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.overrides import apply_overrides


@dataclasses.dataclass(frozen=True)
class DrafterSettings:
    """The drafter a training run builds, before its target is known (:func:`drafter_config`
    resolves it against the target into a :class:`~dspark_jax.config.DrafterConfig`).

    ``key=value`` overrides address it as ``drafter.<field>``; the flat names of recipes and older
    configs (``variant``, ``block_size``, ``drafter_width``, ...) map onto it
    (:data:`TrainConfig.KEY_ALIASES`).

    Attributes (units in brackets):
      variant: ``dspark``, ``dflash`` or ``eagle3`` (the autoregressive baseline of
        :mod:`dspark_jax.drafters.eagle`: always one layer, ``num_layers`` is not used; default
        taps low/mid/high, :func:`~dspark_jax.drafters.eagle.eagle_taps`).
      block_size: block size [tokens]; num_layers: drafter backbone layers;
      markov_rank: Markov head rank r; markov_head: ``vanilla`` / ``gated`` / ``rnn``
        (:class:`~dspark_jax.config.DrafterConfig`); taps: tapped target layers (empty = default);
      intermediate_size: FFN width (0 = the target's, scaled by width / H).
      width: the drafter's residual width d (0 = the target's hidden size H; a
        tiny target trains a better drafter wider than itself). Heads keep the target's
        count with ``head_dim = d / num_heads``; dspark/dflash only (d != H has no external format).
      arch: ``interop`` (the checkpoint formats' architecture), ``legacy`` (this
        project's first), ``gemma4`` (DeepSeek's Gemma 4 drafter: Gemma 4 layers, its own frozen copies
        of the target's embedding and LM head; exports as DeepSpec's ``Gemma4DSparkModel``) or
        ``auto`` (``gemma4`` for a Gemma 4 target's DSpark drafter, else ``interop``):
        :meth:`~dspark_jax.config.DrafterConfig.for_target`'s ``arch``.
      draft_vocab_size: N > 0 drafts over the N most frequent target-generated tokens of
        the training data (:func:`dspark_jax.training.data.draft_vocabulary`; stored in the export);
        0 = the full vocabulary.
    """

    variant: str = "dspark"
    block_size: int = 8
    num_layers: int = 2
    markov_rank: int = 64
    markov_head: str = "vanilla"
    taps: tuple[int, ...] = ()
    intermediate_size: int = 0
    width: int = 0
    arch: str = "auto"
    draft_vocab_size: int = 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; every field is a ``key=value`` override.

    Attributes (units in brackets):
      target: preset name or path of the target model.
      workdir: run folder (data shards, Orbax checkpoints, metrics.jsonl).
      export_dir: export folder (default ``<workdir>/export``).
      drafter: the drafter to build (:class:`DrafterSettings`; ``drafter.block_size=4`` etc.).
      init_from_target_layers: target layers the drafter's layers start from, one per layer
        (``-2,-1``: the last two; :mod:`dspark_jax.training.warm_start`); empty = random.
      prompts: ``tinystories`` or ``chat``; prompts_file: extra JSONL prompts;
      magpie_prompts: N > 0 mixes N user requests written by the (chat) target itself evenly into
        the training prompts (:mod:`dspark_jax.training.magpie`; ``<workdir>/magpie_prompts.jsonl``);
      num_prompts: training prompts used; num_eval_prompts: held-out prompts;
      num_calib_prompts: prompts whose target continuations calibrate the confidence head,
        taken from the training split past the first ``num_prompts`` (so neither trained on
        nor evaluated on); when that split has none left, the held-out evaluation prompts;
      gen_max_new_tokens [tokens], gen_temperature, gen_top_p, gen_batch_size:
        self-distillation generation settings; seq_len: stored length [tokens].
      steps, batch_size [sequences, global], anchors_per_seq: optimisation size.
      learning_rate, warmup_frac, weight_decay, grad_clip: AdamW schedule.
      lr_schedule: ``cosine`` (warmup + cosine to 5%) or ``wsd`` (warmup, constant, linear decay to 0
        over the last ``decay_frac`` of the steps; :mod:`dspark_jax.training.schedules`);
        warmup_steps [steps]: warmup length (0 = ``warmup_frac * steps``).
      ce_weight, l1_weight, conf_weight, pos_decay: loss (docs/design.md#loss).
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
        (1.45x per DSpark step for the stories260k preset on 2 CPU cores). Built when missing, extended
        when it lacks this drafter's taps, refused when it belongs to another target or data.
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
    drafter: DrafterSettings = dataclasses.field(default_factory=DrafterSettings)
    init_from_target_layers: tuple[int, ...] = ()
    prompts: str = "tinystories"
    prompts_file: str = ""
    magpie_prompts: int = 0
    num_prompts: int = 2048
    num_eval_prompts: int = 50
    num_calib_prompts: int = 128
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
    lr_schedule: str = "cosine"
    decay_frac: float = 0.2
    warmup_steps: int = 0
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
    data_dir: str = ""
    feature_cache: str = ""
    feature_cache_dtype: str = "float32"
    mesh: str = ""

    # The flat keys of recipes, config files and command lines -> their place in the nested config.
    KEY_ALIASES: ClassVar[dict[str, str]] = {
        **{f: f"drafter.{f}" for f in ("variant", "block_size", "num_layers", "markov_rank", "markov_head", "taps")},
        "draft_vocab_size": "drafter.draft_vocab_size",
        "drafter_intermediate_size": "drafter.intermediate_size",
        "drafter_width": "drafter.width",
        "drafter_arch": "drafter.arch",
    }

    @classmethod
    def from_keys(cls, **keys: Any) -> TrainConfig:
        """The default config with ``keys`` set, named as on the command line: flat
        (``block_size=4``, :data:`KEY_ALIASES`), nested (``drafter={"block_size": 4}``) or plain fields.

        Raises:
          ValueError: an unknown key or a bad value.
        """
        return cls().with_keys(**keys)

    def with_keys(self, **keys: Any) -> TrainConfig:
        """A copy with ``keys`` set (named as for :meth:`from_keys`).

        Raises:
          ValueError: an unknown key or a bad value.
        """
        return apply_overrides(self, keys)

    def export_path(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.workdir) / "export"


class TargetIdentity(Protocol):
    """What :func:`drafter_config` reads of a target: its config and its weights' fingerprint
    (a :class:`~dspark_jax.models.target.Target`, or a config alone for a dry run)."""

    @property
    def cfg(self) -> TargetConfig: ...
    @property
    def fingerprint(self) -> str: ...


def drafter_config(cfg: TrainConfig, target: TargetIdentity) -> DrafterConfig:
    """The :class:`DrafterConfig` a run builds for ``target`` (from ``cfg.drafter``).

    Raises:
      DSparkInputError: ``drafter.width`` is not a multiple of the target's heads; an unknown ``drafter.arch``.
      ValueError: the drafter config does not fit the target (e.g. taps beyond its depth).
    """
    t, d = target.cfg, cfg.drafter
    eagle = d.variant == "eagle3"
    over: dict[str, Any] = dict(
        variant=d.variant,
        block_size=d.block_size,
        num_layers=1 if eagle else d.num_layers,
        markov_rank=d.markov_rank if d.variant == "dspark" else 0,
        markov_head=d.markov_head,
        target_fingerprint=target.fingerprint,
        draft_vocab_size=d.draft_vocab_size,
    )
    if d.taps:
        over["taps"] = tuple(d.taps)
    elif eagle:
        from dspark_jax.drafters.eagle import eagle_taps

        over["taps"] = eagle_taps(t)
    if d.width and d.width != t.hidden_size and not eagle:
        if d.width % t.num_heads:
            raise DSparkInputError(f"drafter.width={d.width} is not a multiple of the target's {t.num_heads} heads")
        over.update(
            width=d.width,
            head_dim=d.width // t.num_heads,
            intermediate_size=int(round(t.intermediate_size * d.width / t.hidden_size)),
        )
    if d.intermediate_size:
        over["intermediate_size"] = d.intermediate_size
    return DrafterConfig.for_target(t, arch=d.arch, **over)
