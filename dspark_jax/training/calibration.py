"""Calibration of the confidence head: sequential temperature scaling (paper Appendix A5).

docs/design.md#confidence-head, docs/design.md#calibration and docs/design.md#metrics. The scheduler
multiplies confidences into survival probabilities ``a_k = c_1 ... c_k``, so they must
mean what they say. After training, each block position k gets a temperature ``T_k`` and a
logit bias ``b_k`` (``c_k = sigmoid(z_k / T_k + b_k)``, ``z_k`` the raw confidence logit;
``b_k = 0`` with :attr:`CalibrationSettings.bias` off: the paper's temperature scaling), fit left
to right on held-out data so that the *cumulative* survival ``a_k`` matches the observed
survival, earlier positions held fixed. Scaling never reorders the scores of a
position, so the ranking the head learned survives.

Data (:func:`collect`): the drafter runs teacher-forced on held-out target-generated
sequences exactly as in training (:func:`dspark_jax.training.losses.drafter_loss`): for every
anchor block and position k, the raw logit ``z_k`` (``x_{k-1}`` = the true previous
token) and the exact acceptance probability ``1 - TV_k`` between the drafter's
``p_draft`` and the target's ``p_target`` (temperature 1 by default, as the training
label; ``temperature=0`` gives greedy acceptance ``1[argmax q = argmax p]``).

Observed survival, two versions (both computed, documented in every report):

* ``expected``: ``s_k = prod_{i<=k} (1 - TV_i)``, the exact probability that the
  prefix 1..k is accepted (no sampling noise). **Used for fitting** (Brier score,
  i.e. squared error against this soft label; in expectation the same objective as
  the Brier score against sampled outcomes, minus a constant) **and for the headline
  ECE / Brier**.
* ``sampled``: binary outcomes ``y_k = prod_{i<=k} 1[u_i < 1 - TV_i]`` with
  ``u_i ~ U(0, 1)`` (one draw per block, fixed seed): the accept/reject events a
  verifier would produce. **Used for AUROC** (needs binary labels) and reported as
  ``ece_sampled`` / ``brier_sampled``. ``fit_on="sampled"`` fits on them instead.

The metrics (ECE, AUROC, Brier, reliability tables) and the survival helpers live in
:mod:`dspark_jax.evaluation.reliability`, shared with the decode-time reliability of
``python -m dspark_jax.eval``.

At decode time the temperatures and biases stored in the export's ``calibration`` /
``calibration_bias`` fields are installed on the drafter by
:func:`~dspark_jax.drafters.checkpoint.load_drafter` and applied by
:func:`~dspark_jax.drafters.markov.sample_block` (confidences only; tokens are unchanged).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.drafters.checkpoint import EXPORT_FORMATS, FORMAT, read_export_meta
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.evaluation.reliability import (
    N_BINS,
    expected_survival,
    jsonable,
    metrics,
    predicted_survival,
    reliability,
    sampled_survival,
)
from dspark_jax.models.target import Target
from dspark_jax.training.data import heldout_sequences
from dspark_jax.training.temperature_scaling import (
    B_BOUNDS,
    T_BOUNDS,
    CalibrationData,
    CalibrationSettings,
    decode_weights,
    fit_calibration,
    fit_temperatures,
)

__all__ = [
    "B_BOUNDS",
    "T_BOUNDS",
    "BlockTerms",
    "CalibrationData",
    "CalibrationSettings",
    "block_terms",
    "calibrate_export",
    "calibrate_training_run",
    "collect",
    "decode_weights",
    "fit_and_store_calibration",
    "fit_calibration",
    "fit_temperatures",
    "survival_report",
]


# ======================================================================================
# Teacher-forced calibration data
# ======================================================================================
class BlockTerms(NamedTuple):
    """Per-block, per-position teacher-forced terms (all ``[B, A, block_size]``).

    Attributes:
      z: float32 raw confidence logits ``w . [h_k ; W1[x_{k-1}]] + b``.
      accept: float32 exact acceptance probability ``1 - TV_k``.
      valid: bool, the predicted token exists in the sequence (prefix-closed in k).
    """

    z: jax.Array
    accept: jax.Array
    valid: jax.Array


def _acceptance(draft_logits: jax.Array, target_logits: jax.Array, temperature: float) -> jax.Array:
    """``1 - TV(q, p)`` over the last axis; temperature 1 is exactly ``drafter_loss``'s label."""
    draft_logits = draft_logits.astype(jnp.float32)
    target_logits = target_logits.astype(jnp.float32)
    if temperature <= 0:  # greedy: accepted iff the argmaxes agree (first index on ties)
        return (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    if temperature == 1.0:
        q = jnp.exp(jax.nn.log_softmax(draft_logits, axis=-1))
        p = jax.nn.softmax(target_logits, axis=-1)
    else:
        q = jax.nn.softmax(draft_logits / temperature, axis=-1)
        p = jax.nn.softmax(target_logits / temperature, axis=-1)
    return 1.0 - 0.5 * jnp.sum(jnp.abs(q - p), axis=-1)


def _terms_from_features(
    drafter: DSparkDrafter, target: Target, feats, t_logits, tokens, lengths, anchors, temperature: float
) -> BlockTerms:
    """The block part of :func:`block_terms` given the target pass (features, logits)."""
    block_size = drafter.cfg.block_size
    block = drafter.train_blocks(target, feats, tokens, anchors)
    k = jnp.arange(block_size, dtype=jnp.int32)
    src = anchors[..., None] + k  # position whose next token is predicted
    valid = (src + 1) < lengths[:, None, None]  # [B, A, block_size]
    src_c = jnp.minimum(src, tokens.shape[1] - 1)
    bidx = jnp.arange(tokens.shape[0])[:, None, None]
    prev = tokens[bidx, src_c]  # teacher forcing: x_{k-1} is the true token
    bias, e = drafter.teacher_forced_heads(block.hidden, prev)
    logits = drafter.to_target_logits(block.logits + bias)  # -inf off a draft vocabulary
    acc = _acceptance(logits, t_logits[bidx, src_c], temperature)
    z = drafter.confidence_logit(block.hidden, e)
    return BlockTerms(z, acc, valid)


def block_terms(
    drafter: DSparkDrafter,
    target: Target,
    tokens: jax.Array,
    lengths: jax.Array,
    anchors: jax.Array,
    temperature: float = 1.0,
) -> BlockTerms:
    """Teacher-forced raw confidence logits and exact acceptance, as in training.

    The same computation as :func:`dspark_jax.training.losses.drafter_loss` (target pass,
    many anchor blocks in one drafter pass, Markov correction from the true previous
    token, ``1 - TV`` at temperature 1), exposed per position instead of reduced to a loss.

    Args:
      tokens: ``[B, L]`` int32 sequences; lengths: ``[B]`` valid lengths.
      anchors: ``[B, A]`` int32 anchor positions.
      temperature: sampling temperature of the acceptance probability (1: the
        training label; 0: greedy acceptance).
    Returns:
      :class:`BlockTerms` of shape ``[B, A, block_size]``.
    """
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out = target(tokens, pos, taps=drafter.cfg.taps)
    return _terms_from_features(drafter, target, out.features, out.logits, tokens, lengths, anchors, float(temperature))


@partial(jax.jit, static_argnames=("t_graph", "taps"))
def _target_pass(t_state, tokens, *, t_graph, taps):
    target = nnx.merge(t_graph, t_state)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out = target(tokens, pos, taps=taps)
    return out.features, out.logits


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "temperature"))
def _blocks_pass(t_state, d_state, feats, t_logits, tokens, lengths, anchors, *, t_graph, d_graph, temperature):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state)
    return _terms_from_features(drafter, target, feats, t_logits, tokens, lengths, anchors, temperature)


def collect(
    target: Target,
    drafter: DSparkDrafter,
    data: dict[str, np.ndarray],
    *,
    batch_size: int = 8,
    anchor_stride: int = 1,
    temperature: float = 1.0,
    memory_budget_mb: float = 256.0,
) -> CalibrationData:
    """Runs the drafter teacher-forced over every anchor block of held-out sequences.

    Anchors are all positions ``prompt_len - 1 .. length - 2`` (every ``anchor_stride``-th),
    like training's :func:`~dspark_jax.training.losses.sample_anchors` range, so every predicted
    token is target-generated.

    Args:
      data: ``tokens [N, L]``, ``lengths [N]``, ``prompt_lengths [N]`` (the format of
        :func:`dspark_jax.training.data.load_shards` /
        :func:`~dspark_jax.training.data.heldout_sequences`).
      batch_size: sequences per target pass; anchors are processed in chunks that
        keep the block logits under ``memory_budget_mb``.
      temperature: acceptance temperature (see :func:`block_terms`).
    Raises:
      DSparkInputError: no sequence with a block to predict, or a drafter without a
        confidence head.
    """
    if not drafter.cfg.has_confidence:
        raise DSparkInputError("this drafter has no confidence head (DFlash): nothing to calibrate")
    tokens = np.asarray(data["tokens"], np.int32)
    lengths = np.asarray(data["lengths"], np.int32)
    plens = np.asarray(data["prompt_lengths"], np.int32)
    n, length = tokens.shape
    block_size, v = drafter.cfg.block_size, drafter.cfg.vocab_size
    cand = np.arange(0, max(length - 1, 1), max(1, int(anchor_stride)), dtype=np.int32)
    per_anchor = batch_size * block_size * (4 * v * 4 + drafter.cfg.num_heads * (length + block_size) * 8)
    chunk = int(max(1, min(len(cand), memory_budget_mb * 2**20 // max(per_anchor, 1))))
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    out = {"z": [], "accept": [], "valid": [], "seq": [], "anchor": []}
    for s in range(0, n, batch_size):
        rows = np.arange(s, min(s + batch_size, n))
        pad = batch_size - len(rows)
        tok = np.concatenate([tokens[rows], np.zeros((pad, length), np.int32)])
        lens = np.concatenate([lengths[rows], np.zeros((pad,), np.int32)])
        lo = np.concatenate([np.maximum(plens[rows] - 1, 0), np.full((pad,), length, np.int32)])
        feats, t_logits = _target_pass(t_state, jnp.asarray(tok), t_graph=t_graph, taps=drafter.cfg.taps)
        for c in range(0, len(cand), chunk):
            anc = cand[c : c + chunk]
            anc_ok = np.ones(chunk, bool)
            anc_ok[len(anc) :] = False
            anc = np.pad(anc, (0, chunk - len(anc)))
            anchors = np.broadcast_to(anc, (batch_size, chunk)).astype(np.int32)
            terms = _blocks_pass(
                t_state,
                d_state,
                feats,
                t_logits,
                jnp.asarray(tok),
                jnp.asarray(lens),
                jnp.asarray(anchors),
                t_graph=t_graph,
                d_graph=d_graph,
                temperature=float(temperature),
            )
            z, acc, valid = (np.asarray(x) for x in terms)
            ok = anc_ok[None, :] & (anchors >= lo[:, None]) & (anchors <= lens[:, None] - 2)
            valid = valid & ok[..., None]
            keep = valid[..., 0]
            out["z"].append(z[keep])
            out["accept"].append(np.clip(acc[keep], 0.0, 1.0))
            out["valid"].append(valid[keep])
            out["seq"].append(np.broadcast_to((s + np.arange(batch_size))[:, None], keep.shape)[keep])
            out["anchor"].append(anchors[keep])
    res = CalibrationData(*(np.concatenate(out[k]) for k in CalibrationData._fields))
    if res.z.shape[0] == 0:
        raise DSparkInputError("no held-out block to calibrate on: sequences are too short")
    return res


# ======================================================================================
# Survival and sequential temperature scaling
# ======================================================================================
def survival_report(
    data: CalibrationData,
    temperatures: Sequence[float] | np.ndarray | None,
    biases: Sequence[float] | np.ndarray | None = None,
    *,
    seed: int = 0,
    n_bins: int = N_BINS,
) -> dict[str, Any]:
    """Metrics of the predicted cumulative survival (with ``temperatures`` and ``biases``, or raw
    when None) against the expected survival (ECE/Brier) and sampled outcomes (AUROC, ``*_sampled``)."""
    exp_s = expected_survival(data.accept, data.valid)
    smp_s = sampled_survival(data.accept, data.valid, seed)
    pred = predicted_survival(data.z, temperatures, biases)
    out = metrics(pred, data.valid, exp_s, smp_s, n_bins)
    out["reliability"] = reliability(pred[data.valid], exp_s[data.valid], n_bins)
    return out


# ======================================================================================
# Fit + store (after training)
# ======================================================================================
_METHOD = (
    "sequential temperature scaling (paper A5): c_k = sigmoid(z_k / T_k), T_k fit left to right on "
    "held-out sequences (earlier T fixed) minimising the {loss} of the predicted cumulative survival "
    "prod_{{i<=k}} c_i against the {fit_on} observed survival; log T searched in [{lo}, {hi}] "
    "(grid + golden section)"
)
_METHOD_BIAS = (
    "sequential Platt scaling: c_k = sigmoid(z_k / T_k + b_k), (T_k, b_k) fit left to right on "
    "held-out sequences (earlier positions fixed) minimising the {loss} of the predicted cumulative "
    "survival prod_{{i<=k}} c_i against the {fit_on} observed survival; log T searched in [{lo}, {hi}], "
    "b in [{blo}, {bhi}] for each log T (grid + golden section)"
)
_OBSERVED = (
    "teacher-forced on held-out target-generated sequences; acceptance probability 1 - TV between "
    "p_draft and p_target at temperature {t}; 'expected' survival = prod(1 - TV_i) (ECE, Brier), "
    "'sampled' survival = one Bernoulli draw per position with those probabilities (AUROC, "
    "ece_sampled, brier_sampled)"
)


def _compact(rep: dict[str, Any]) -> dict[str, Any]:
    keys = ("ece", "auroc", "brier", "ece_sampled", "brier_sampled", "mean_predicted", "mean_observed", "n")
    return {k: rep["pooled"].get(k) for k in keys if k in rep["pooled"]}


def fit_and_store_calibration(
    target: Target,
    drafter: DSparkDrafter,
    heldout_data: dict[str, np.ndarray],
    export_dir: str | Path | None,
    settings: CalibrationSettings = CalibrationSettings(),
) -> dict[str, Any]:
    """Fits per-position confidence temperatures (and biases) and stores them in an export.

    The held-out sequences are split by sequence into a fit part (``settings.fit_fraction``)
    and a test part; the calibration is fit on the fit part, before/after metrics are
    reported on the test part (headline) and on the fit part. With fewer than two
    sequences both parts are all of them.

    Args:
      target / drafter: the frozen target and the trained drafter (its
        :attr:`~dspark_jax.drafters.dspark.DSparkDrafter.calibration` and ``calibration_bias``
        are set to the fit; the greedy ones for a fit at temperature 0).
      heldout_data: sequences never seen in training (``tokens``, ``lengths``,
        ``prompt_lengths``; see :func:`~dspark_jax.training.data.heldout_sequences`).
      export_dir: export whose ``drafter.json`` gets ``calibration`` (the temperatures),
        ``calibration_bias`` (the biases) and ``extra.calibration`` (pooled before/after
        metrics); ``None`` writes nothing.
      settings: :class:`CalibrationSettings`.
    Returns:
      report dict: ``temperatures``, ``biases``, ``before`` / ``after`` (test part: pooled and
      per-position ECE, AUROC, Brier + reliability table), ``fit_split`` (pooled
      before/after on the fit part), sizes, method and timing.
    Raises:
      DSparkInputError: drafter without confidence head, no usable held-out data,
        or ``export_dir`` is not an export.
    """
    st = settings
    t0 = time.perf_counter()
    meta = read_export_meta(export_dir) if export_dir is not None else None
    data = collect(
        target,
        drafter,
        heldout_data,
        batch_size=st.batch_size,
        anchor_stride=st.anchor_stride,
        temperature=st.temperature,
    )
    fit, test = _split_by_sequence(data, st.fit_fraction, st.seed)
    obs = (
        expected_survival(fit.accept, fit.valid)
        if st.fit_on == "expected"
        else sampled_survival(fit.accept, fit.valid, st.seed + 1)
    )
    weights = decode_weights(fit) if st.weighting == "decode" else None
    temps, biases = fit_calibration(fit.z, obs, fit.valid, loss=st.loss, weights=weights, bias=st.fits_bias)
    report = _fit_report(fit, test, temps, biases if st.fits_bias else None, st)
    greedy = st.temperature <= 0
    drafter.set_calibration(report["temperatures"], greedy=greedy, bias=report["biases"])
    if meta is not None and export_dir is not None:
        _store_in_export(meta, export_dir, report, greedy=greedy)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def _split_by_sequence(
    data: CalibrationData, fit_fraction: float, seed: int
) -> tuple[CalibrationData, CalibrationData]:
    """``(fit, test)`` blocks, split by source sequence (``fit_fraction`` of the sequences, at least
    one on each side); with fewer than two sequences both parts are all of ``data``."""
    seqs = np.unique(data.seq)
    if len(seqs) < 2:
        return data, data
    perm = np.random.default_rng(seed).permutation(seqs)
    n_fit = int(np.clip(round(fit_fraction * len(seqs)), 1, len(seqs) - 1))
    fit_mask = np.isin(data.seq, perm[:n_fit])
    return data.take(fit_mask), data.take(~fit_mask)


def _fit_report(
    fit: CalibrationData, test: CalibrationData, temps: np.ndarray, biases: np.ndarray | None, st: CalibrationSettings
) -> dict[str, Any]:
    """The report of :func:`fit_and_store_calibration` (without ``seconds``): before/after
    metrics of ``temps`` / ``biases`` ``[block_size]`` (None: zero) on the test part, pooled
    before/after on the fit part."""

    def report(data: CalibrationData, t=None, b=None) -> dict[str, Any]:
        return survival_report(data, t, b, seed=st.seed, n_bins=st.n_bins)

    method = _METHOD_BIAS if biases is not None else _METHOD
    return {
        "temperatures": [float(t) for t in temps],
        "biases": None if biases is None else [float(b) for b in biases],
        "method": method.format(
            loss=st.loss, fit_on=st.fit_on, lo=T_BOUNDS[0], hi=T_BOUNDS[1], blo=B_BOUNDS[0], bhi=B_BOUNDS[1]
        ),
        "observed": _OBSERVED.format(t=st.temperature),
        "acceptance_temperature": st.temperature,
        "fit_on": st.fit_on,
        "loss": st.loss,
        "weighting": st.weighting,
        "n_bins": st.n_bins,
        "num_sequences": {"fit": int(len(np.unique(fit.seq))), "test": int(len(np.unique(test.seq)))},
        "num_blocks": {"fit": int(fit.z.shape[0]), "test": int(test.z.shape[0])},
        "before": report(test),
        "after": report(test, temps, biases),
        "fit_split": {
            "before": _compact(report(fit)),
            "after": _compact(report(fit, temps, biases)),
        },
    }


def _store_in_export(meta: dict[str, Any], export_dir: str | Path, report: dict[str, Any], *, greedy: bool) -> None:
    """Writes the fit into the export's ``drafter.json``: the temperatures as ``calibration``
    and the biases as ``calibration_bias`` (``calibration_greedy`` / ``calibration_greedy_bias``
    for a greedy fit; None: no bias) and pooled before/after metrics under ``extra``. The export
    is marked with the current format (the one that reads the biases; the parameters are alike)."""
    key = "calibration_greedy" if greedy else "calibration"
    meta[key] = report["temperatures"]
    meta[f"{key}_bias"] = report["biases"]
    if meta.get("format") in EXPORT_FORMATS:
        meta["format"] = FORMAT
    meta.setdefault("extra", {})[key] = {
        "method": report["method"],
        "acceptance_temperature": report["acceptance_temperature"],
        "before": _compact(report["before"]),
        "after": _compact(report["after"]),
    }
    (Path(export_dir) / "drafter.json").write_text(json.dumps(jsonable(meta), indent=2))


def calibrate_training_run(
    cfg,
    target: Target,
    drafter: DSparkDrafter,
    heldout_prompt_ids: Sequence[Sequence[int]],
    export_dir: str | Path,
    workdir: str | Path,
    *,
    source: str = "target continuations of the held-out eval prompts",
) -> dict[str, Any]:
    """The calibration stage of ``python -m dspark_jax.train`` (after export):
    :func:`calibrate_export` with the run's generation settings (``cfg``, a
    :class:`~dspark_jax.training.train_config.TrainConfig`: ``gen_max_new_tokens``, ``seq_len``,
    ``seed``, ``gen_batch_size``), the report in ``<workdir>/calibration.json``."""
    return calibrate_export(
        target,
        drafter,
        heldout_prompt_ids,
        export_dir,
        Path(workdir, "calibration.json"),
        max_new_tokens=cfg.gen_max_new_tokens,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        batch_size=cfg.gen_batch_size,
        source=source,
    )


def calibrate_export(
    target: Target,
    drafter: DSparkDrafter,
    prompt_ids: Sequence[Sequence[int]],
    export_dir: str | Path,
    report_path: str | Path,
    *,
    max_new_tokens: int,
    seq_len: int,
    seed: int = 0,
    batch_size: int = 64,
    source: str = "target continuations of held-out prompts",
) -> dict[str, Any]:
    """Fits the confidence temperatures and biases of an export on the target's continuations of
    ``prompt_ids`` and stores them in the export (both regimes).

    The target continues every prompt twice, sampled at T = 1 (the 1 - TV fit used by sampled
    rows) and greedily (the argmax-agreement fit used by rows decoding at T = 0), up to
    ``max_new_tokens`` tokens within ``seq_len``; each fit sees the contexts its decoding regime
    produces. The prompts must be disjoint from the drafter's training prompts and from any
    evaluation that reads the calibrated confidences.

    Args:
      target / drafter: the target and the exported drafter (its confidence head is fitted).
      prompt_ids: token ids of the held-out prompts.
      export_dir: the export (``calibration`` / ``calibration_greedy`` and their ``_bias`` lists
        are rewritten).
      report_path: where the full report (JSON) is written.
      max_new_tokens / seq_len: continuation / stored length [tokens]; seed; batch_size; source:
        a description of the prompts for the report.
    Returns:
      compact summary: temperatures, biases, pooled ECE / AUROC / Brier before and after, sizes, seconds.
    Raises:
      DSparkInputError: no prompt, or the export cannot take a calibration.
    """
    if not prompt_ids:
        raise DSparkInputError("calibration needs at least one held-out prompt")
    t0 = time.perf_counter()

    def continuations(temperature: float) -> dict[str, np.ndarray]:
        return heldout_sequences(
            target,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            seq_len=seq_len,
            temperature=temperature,
            top_p=1.0,
            seed=seed,
            batch_size=batch_size,
        )

    st = CalibrationSettings(seed=seed)
    rep = fit_and_store_calibration(target, drafter, continuations(1.0), export_dir, st)
    greedy_data = continuations(0.0)
    rep_greedy = fit_and_store_calibration(
        target, drafter, greedy_data, export_dir, dataclasses.replace(st, temperature=0.0)
    )
    rep["greedy"] = {
        "temperatures": rep_greedy["temperatures"],
        "biases": rep_greedy["biases"],
        "before": _compact(rep_greedy["before"]),
        "after": _compact(rep_greedy["after"]),
    }
    rep["heldout"] = {
        "source": source,
        "num_prompts": len(greedy_data["lengths"]),
        "max_new_tokens": max_new_tokens,
        "seq_len": seq_len,
        "continuations": "sampled at T=1 for the T=1 fit, greedy for the greedy fit",
    }
    rep["seconds"] = round(time.perf_counter() - t0, 2)
    return _write_report(jsonable(rep), report_path)


def _write_report(rep: dict[str, Any], report_path: str | Path) -> dict[str, Any]:
    """Writes :func:`calibrate_export`'s full report; returns its compact summary."""
    Path(report_path).parent.mkdir(parents=True, exist_ok=True)
    Path(report_path).write_text(json.dumps(rep, indent=2))
    keys = ("temperatures", "biases", "greedy", "num_sequences", "num_blocks", "acceptance_temperature", "seconds")
    return {
        **{k: rep[k] for k in keys},
        "before": _compact(rep["before"]),
        "after": _compact(rep["after"]),
        "report": str(report_path),
    }
