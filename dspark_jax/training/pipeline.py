"""The stages of ``python -m dspark_jax.train`` (each resumable; rerunning continues where it stopped).

1. self-distillation data (:func:`prepare_data`): the target generates continuations of training
   prompts with its own jitted batched decoding -> ``<workdir>/data/shard_*.npz``;
2. training (:func:`dspark_jax.training.loop.train_loop`) with Orbax checkpoints in
   ``<workdir>/checkpoints``; with ``feature_cache=DIR`` the frozen target's tapped features are
   first computed once per training sequence into ``DIR``
   (:mod:`dspark_jax.training.feature_cache`) and every step reads them from there;
3. export to ``<export_dir>`` (drafter params + config + target identity), then (3b) confidence
   calibration on held-out prompts (:mod:`dspark_jax.training.calibration`);
4. evaluation on held-out prompts: tau, acceptance, per-position acceptance ->
   ``<workdir>/eval.json``.

:func:`run` runs them all and writes ``<workdir>/summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from dspark_jax.data import prompts as prompts_mod
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.train_config import TrainConfig


def _is_lead() -> bool:
    """True on process 0, which writes the run's JSON files (:mod:`dspark_jax.training.distributed`)."""
    import jax

    return jax.process_index() == 0


def _prompt_split(cfg: TrainConfig, workdir: Path) -> tuple[list[str], list[str], list[str]]:
    """``(training prompts, held-out prompts, contamination guard texts)`` of ``cfg``'s prompt source.

    The held-out prompts are written to ``<workdir>/eval_prompts.json``; user prompts
    (``prompts_file``) that contain an evaluation prompt are dropped from training.

    Raises:
      DSparkInputError: unknown prompt source.
    """

    if cfg.prompts == "tinystories":
        texts = prompts_mod.tinystories_openings()
    elif cfg.prompts == "chat":
        texts = prompts_mod.chat_training_prompts()
    else:
        raise DSparkInputError(f"prompts must be 'tinystories' or 'chat', got {cfg.prompts!r}")
    n_builtin = len(texts)
    if cfg.prompts_file:
        texts += prompts_mod.read_prompt_file(cfg.prompts_file)
    train_texts, eval_texts = prompts_mod.split_prompts(texts, min(cfg.num_eval_prompts, len(texts) // 5), cfg.seed)
    if _is_lead():
        (workdir / "eval_prompts.json").write_text(json.dumps(eval_texts, indent=1))
    guard = prompts_mod.evaluation_texts(eval_texts)
    if cfg.prompts_file and len(texts) > n_builtin:  # user prompts: keep evaluation prompts out
        drop = prompts_mod.drop_contaminated(train_texts, guard)
        if any(drop):
            print(
                f"contamination guard: dropped {sum(drop)} training prompts that contain an evaluation prompt",
                file=sys.stderr,
            )
        train_texts = [t for t, d in zip(train_texts, drop) if not d]
    return train_texts, eval_texts, guard


def _generate_data(cfg: TrainConfig, target, tok, train_texts: list[str], workdir: Path) -> list[Path]:
    """The target's continuations of ``train_texts`` as shards in ``<workdir>/data`` (resumable)."""
    from tqdm.auto import tqdm

    from dspark_jax.decoding.speculative import generate_autoregressive
    from dspark_jax.training import data as data_mod

    chat = cfg.prompts == "chat"
    if chat and len(train_texts) < cfg.num_prompts:
        # Few distinct chat prompts: repeat them, the sampled continuations differ.
        train_texts = (train_texts * (cfg.num_prompts // max(1, len(train_texts)) + 1))[: cfg.num_prompts]
    train_ids = prompts_mod.encode_prompts(tok, train_texts, chat)
    # A prompt taking more than half the stored length leaves too few target tokens to learn from.
    train_ids = [ids for ids in train_ids if len(ids) <= cfg.seq_len // 2] or train_ids
    train_ids = train_ids[: cfg.num_prompts]
    bar = tqdm(total=len(train_ids), desc="generate data", unit="seq", dynamic_ncols=True)

    def gen(batch, bi):
        sampled = data_mod.sampled_rows([bi * cfg.gen_batch_size + i for i in range(len(batch))], cfg.gen_sampled_frac)
        # One temperature / top-p per row (generate_autoregressive takes a float or one per prompt).
        temperature: Any = [cfg.gen_sample_temperature if s else cfg.gen_temperature for s in sampled]
        top_p: Any = [cfg.gen_sample_top_p if s else cfg.gen_top_p for s in sampled]
        res = generate_autoregressive(
            target,
            batch,
            max_new_tokens=cfg.gen_max_new_tokens,
            temperature=temperature,
            top_p=top_p,
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
    return shards


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
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    train_texts, eval_texts, guard = _prompt_split(cfg, workdir)
    if cfg.magpie_prompts and not cfg.data_dir:
        train_texts = _with_magpie(cfg, target, tok, train_texts, guard, workdir)
    corpus_shards = _corpus_shards(cfg, tok, cfg.prompts == "chat", guard, workdir)
    if cfg.data_dir:
        # Shared data (read only): e.g. every drafter of a comparison trains on the same shards.
        shards = sorted(Path(cfg.data_dir).glob("shard_[0-9]*[0-9].npz"))
        if not shards:
            raise DSparkInputError(f"data_dir {cfg.data_dir} holds no shard_*.npz files")
        return shards + corpus_shards, eval_texts
    return _generate_data(cfg, target, tok, train_texts, workdir) + corpus_shards, eval_texts


def _with_magpie(cfg: TrainConfig, target, tok, train_texts: list[str], guard: list[str], workdir: Path) -> list[str]:
    """``train_texts`` with ``cfg.magpie_prompts`` requests written by the target mixed evenly into the
    first ``num_prompts`` (:mod:`dspark_jax.training.magpie`; generated once into
    ``<workdir>/magpie_prompts.jsonl``, reused by a resumed run).

    Raises:
      DSparkInputError: ``prompts`` is not ``chat``, or the target has no chat template.
    """
    from dspark_jax.training import magpie

    if cfg.prompts != "chat":
        raise DSparkInputError(f"magpie_prompts needs prompts=chat (a chat target), got prompts={cfg.prompts!r}")
    extra = magpie.read_or_generate(workdir / "magpie_prompts.jsonl", target, tok, cfg.magpie_prompts, cfg.seed, guard)
    print(f"magpie: {len(extra)} target-written prompts mixed into the first {cfg.num_prompts}", file=sys.stderr)
    return magpie.mix_prompts(train_texts, extra, cfg.num_prompts)


def _corpus_shards(cfg: TrainConfig, tok, chat: bool, guard: list[str], workdir: Path) -> list[Path]:
    """Shards of ``cfg.corpus`` (no generation), contaminated rows dropped; [] without a corpus."""
    from dspark_jax.training import data as data_mod

    if not cfg.corpus:
        return []
    rows = data_mod.read_corpus(cfg.corpus)
    drop = prompts_mod.drop_contaminated([data_mod.corpus_row_text(r) for r in rows], guard)
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


def _run_mesh(cfg: TrainConfig):
    """The device mesh of ``cfg.mesh``, or None (the trainer's default layout).

    Raises:
      DSparkInputError: a bad mesh spec.
    """
    if not cfg.mesh:
        return None
    from dspark_jax.models.sharding import make_mesh

    try:
        return make_mesh(cfg.mesh)
    except ValueError as e:
        raise DSparkInputError(str(e)) from None


def _with_feature_cache(cfg: TrainConfig, workdir: Path, target, data: dict, taps) -> tuple[dict[str, Any], float]:
    """``data`` with the feature cache's per-sequence views added (built when missing), and the
    seconds it took; ``data`` unchanged when ``cfg.feature_cache`` is off.

    Raises:
      DSparkInputError: a feature cache on a multi-process run, or a cache of another run.
    """
    import jax

    fc_dir = cfg.feature_cache
    if fc_dir == "auto":  # <workdir>/feature_cache where it can be used (one process), else off
        fc_dir = str(workdir / "feature_cache") if jax.process_count() == 1 else ""
    if not fc_dir:
        return data, 0.0
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
        taps,
        store_dtype=cfg.feature_cache_dtype,
        batch_size=max(1, min(cfg.gen_batch_size, 64)),
    )
    return {**data, **fcache.batch_arrays(taps)}, time.perf_counter() - t0


def _build_trainer(cfg: TrainConfig, target, dcfg, data: dict[str, Any], mesh):
    """A :class:`~dspark_jax.training.trainer.Trainer` for a freshly initialised drafter of ``dcfg``."""
    from flax import nnx

    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.training import data as data_mod
    from dspark_jax.training.trainer import Trainer

    # float32 master weights whatever cfg.dtype: the Trainer computes in cfg.dtype.
    drafter = build_drafter(dcfg, nnx.Rngs(cfg.seed))
    if cfg.init_from_target_layers:  # a resumed run's checkpoint then overwrites it
        from dspark_jax.training.warm_start import init_from_target_layers

        init_from_target_layers(drafter, target, cfg.init_from_target_layers)
    if dcfg.own_embeddings:  # drafter_arch=gemma4: frozen copies of the target's tables
        from dspark_jax.drafters.gemma4_format import copy_target_tables

        copy_target_tables(drafter, target)
    if dcfg.draft_vocab_size:  # dspark / dflash only (DrafterConfig refuses one for eagle3)
        # From the data, so a resumed run rebuilds the same vocabulary.
        drafter.set_draft_vocab(data_mod.draft_vocabulary(data, dcfg.draft_vocab_size, target.cfg.vocab_size))
    return Trainer(cfg, target, drafter, mesh=mesh)


def _calibration_texts(cfg: TrainConfig, workdir: Path, eval_texts: list[str]) -> tuple[list[str], str]:
    """``(prompts, description)`` whose continuations calibrate the confidence head: up to
    ``num_calib_prompts`` of the training split past the first ``num_prompts`` (in no training
    shard and no evaluation), else the evaluation prompts (then the fit half of calibration
    overlaps ``python -m dspark_jax.eval`` on the same prompts)."""
    train_texts, _, _ = _prompt_split(cfg, workdir)
    if cfg.data_dir:  # shared shards: which prompts they hold is not known here
        spare = []
    else:
        spare = train_texts[cfg.num_prompts : cfg.num_prompts + max(0, cfg.num_calib_prompts)]
    if spare:
        return spare, f"target continuations of {len(spare)} training-split prompts past num_prompts (unseen)"
    return eval_texts, "target continuations of the held-out eval prompts"


def _calibrate_and_evaluate(
    cfg: TrainConfig, target, tok, drafter, eval_texts: list[str], export: Path, evaluate: bool, calibrate: bool
) -> dict[str, Any]:
    """Stages 3b and 4 on the held-out prompts: ``{"calibration": ..., "eval": ...}`` (those that ran).

    3b: sequential temperature scaling of the confidence head on target continuations of the
    held-out prompts (never in the training data): temperatures go into the export, the report
    into ``calibration.json``. 4: held-out tau -> ``<workdir>/eval.json``.
    """

    out: dict[str, Any] = {}
    calibrate = calibrate and drafter.cfg.has_confidence
    if not eval_texts or not (calibrate or evaluate):
        return out
    workdir = Path(cfg.workdir)
    eval_ids = prompts_mod.encode_prompts(tok, eval_texts, cfg.prompts == "chat")
    if calibrate:
        from dspark_jax.training.calibration import calibrate_training_run

        calib_texts, source = _calibration_texts(cfg, workdir, eval_texts)
        calib_ids = prompts_mod.encode_prompts(tok, calib_texts, cfg.prompts == "chat")
        out["calibration"] = calibrate_training_run(cfg, target, drafter, calib_ids, export, workdir, source=source)
    if evaluate:
        from dspark_jax.evaluation.acceptance import evaluate_tau

        out["eval"] = evaluate_tau(
            target,
            drafter,
            eval_ids,
            max_new_tokens=cfg.eval_max_new_tokens,
            temperature=cfg.eval_temperature,
            num_speculative_tokens=drafter.cfg.block_size,
        )
        (workdir / "eval.json").write_text(json.dumps(out["eval"], indent=2))
    return out


def _print_result(summary: dict[str, Any]) -> None:
    """One JSON line on stdout: where the export is, and the headline numbers."""
    ev = summary.get("eval", {})
    print(
        json.dumps(
            {
                "export_dir": summary["export_dir"],
                "steps": summary["steps"],
                "train_seconds": summary["train_seconds"],
                "data_seconds": summary["data_seconds"],
                "tau": ev.get("tau"),
                "acceptance_rate": ev.get("acceptance_rate"),
            }
        )
    )


def _check_multi_process(cfg: TrainConfig) -> bool:
    """True on the process that writes the run's files (process 0; the only one of a single-process run).

    Several processes train only: stage 1 must have run before (``data_dir`` or ``corpus``), and
    calibration and evaluation are left to a single-host ``python -m dspark_jax.eval`` on the export
    (the decoding loops read tokens back to one host).

    Raises:
      DSparkInputError: a multi-process run that would have to generate its data.
    """
    import jax

    if jax.process_count() == 1:
        return True
    if not (cfg.data_dir or cfg.corpus):
        raise DSparkInputError(
            f"a run of {jax.process_count()} processes trains on prepared shards: generate them first on one host "
            "(same recipe with steps=0 --skip-eval writes <workdir>/data) and pass data_dir=<that folder>, "
            "on a filesystem every host sees"
        )
    if jax.process_index() == 0:
        print(
            f"{jax.process_count()} processes, {jax.device_count()} devices: calibration and evaluation skipped "
            "(run python -m dspark_jax.eval on the export from one host)",
            file=sys.stderr,
        )
    return jax.process_index() == 0


def run(cfg: TrainConfig, evaluate: bool = True, *, calibrate: bool = True, target_and_tokenizer=None) -> dict:
    """Runs all stages for ``cfg``; returns the summary written to ``<workdir>/summary.json``.

    Args:
      evaluate: run stage 4 (held-out tau).
      calibrate: fit the confidence temperatures (stage 3b; drafters with a confidence head).
      target_and_tokenizer: an already loaded ``(target, tokenizer)`` for ``cfg.target``
        (e.g. several runs in one process); default: loaded from ``cfg.target``.
    Raises:
      DSparkInputError: bad config, data, mesh or checkpoints (one-line message).
      SystemExit: ``128 + signal`` after a preemption signal (checkpoint saved; rerun to resume).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.decoding.loading import load_target
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import export_drafter
    from dspark_jax.training import data as data_mod
    from dspark_jax.training.distributed import maybe_initialize_distributed
    from dspark_jax.training.loop import scalar_terms, train_loop
    from dspark_jax.training.train_config import drafter_config
    from dspark_jax.training.trainer import count_params
    from dspark_jax.training.warm_start import check_init_from_target_layers

    maybe_initialize_distributed()  # no-op when the CLI has already joined the run
    lead = _check_multi_process(cfg)
    evaluate, calibrate = (evaluate, calibrate) if jax.process_count() == 1 else (False, False)
    t_start = time.perf_counter()
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if lead:
        (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    mesh = _run_mesh(cfg)  # the target's weights go straight from the host to their shards
    target, tok = target_and_tokenizer or load_target(cfg.target, dtype=jnp.dtype(cfg.dtype), mesh=mesh)
    dcfg = drafter_config(cfg, target)
    if cfg.init_from_target_layers:  # a warm start that cannot be done is refused before any data
        check_init_from_target_layers(
            nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(0))), target, cfg.init_from_target_layers
        )
    # -- stage 1: self-distillation data -----------------------------------------------
    t0 = time.perf_counter()
    shards, eval_texts = prepare_data(cfg, target, tok)
    data = data_mod.load_shards(shards)
    gen_seconds = time.perf_counter() - t0
    # -- stage 2: training ----------------------------------------------------------------
    train_data, cache_seconds = _with_feature_cache(cfg, workdir, target, dict(data), dcfg.taps)
    trainer = _build_trainer(cfg, target, dcfg, train_data, mesh)
    step, terms, train_seconds = train_loop(cfg, trainer, train_data, workdir)
    drafter: Any = trainer.drafter()  # DSparkDrafter or EagleDrafter (export_drafter's annotation names only the first)
    summary: dict[str, Any] = {
        "target": target.cfg.name,
        "target_fingerprint": target.fingerprint,
        "steps": step,
        "train_sequences": int(data["tokens"].shape[0]),
        "train_generated_tokens": int((data["lengths"] - data["prompt_lengths"]).sum()),
        "data_seconds": round(gen_seconds, 1),
        "feature_cache_seconds": round(cache_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "devices": jax.device_count(),
        "drafter_params": count_params(nnx.state(drafter, nnx.Param)),
        "final_train_metrics": scalar_terms(terms) if terms else {},
    }
    # -- stage 3: export; 3b calibration and 4 held-out evaluation ------------------------
    export = export_drafter(drafter, cfg.export_path(), extra={"train": summary, "config": dataclasses.asdict(cfg)})
    summary["export_dir"] = str(export)
    summary.update(_calibrate_and_evaluate(cfg, target, tok, drafter, eval_texts, export, evaluate, calibrate))
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    if lead:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_result(summary)
    return summary
