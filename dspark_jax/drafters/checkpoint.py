"""Drafter export and loading (Orbax), independent of the training code.

An export directory holds:

* ``drafter.json`` -- format version, :class:`~dspark_jax.config.DrafterConfig`
  (which records the target it was trained for: name, vocab, hidden size, depth,
  taps, weights fingerprint), per-position calibration temperatures and logit biases, the draft
  vocabulary's target ids (``draft_vocab``, drafters with ``draft_vocab_size > 0``)
  and the training summary;
* ``params/`` -- the drafter parameters as an Orbax ``StandardCheckpointer`` tree.

``load_drafter(path)`` rebuilds the module from these two alone. It also reads drafters in the
field's checkpoint formats (DeepSpec, speculators, z-lab DFlash; :mod:`dspark_jax.drafters.formats`)
and Hugging Face Hub ids of either.

Formats: ``dspark_jax.drafter/4`` (written now) adds the calibration's logit biases
(``calibration_bias`` / ``calibration_greedy_bias``; an older reader would ignore them and
compute other confidences, hence the new number). Formats 3 and 4 nest a DSpark drafter's
Markov-head weights under ``markov_head`` (``markov_head/w1``, ``markov_head/gate_w``, ...: one module per head
type, :mod:`dspark_jax.drafters.markov`); formats 1 and 2 kept them at the top level
(``markov_w1``, ``markov_gate_w``, ...) and load through a renaming of those paths. Format 1
also named the first head variants ``"gated"`` / ``"rnn"`` (now ``"gated_v0"`` / ``"rnn_v0"``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from dspark_jax.config import LEGACY_MARKOV_HEADS, DrafterConfig
from dspark_jax.drafters.base import Drafter, check_compatible
from dspark_jax.drafters.build import build_drafter
from dspark_jax.drafters.formats import (
    ExternalDrafter,
    check_reference_rows,
    detect_format,
    read_external,
    read_json_object,
    resolve_drafter_source,
)
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target

FORMAT = "dspark_jax.drafter/4"
_FORMAT_1, _FORMAT_2 = "dspark_jax.drafter/1", "dspark_jax.drafter/2"
# Formats 1 and 2 under the names the package layout move briefly wrote them with.
_RENAMED = {"dspark_jax.drafters.dspark/1": _FORMAT_1, "dspark_jax.drafters.dspark/2": _FORMAT_2}
EXPORT_FORMATS = (_FORMAT_1, _FORMAT_2, "dspark_jax.drafter/3", FORMAT)  # the export formats this reads
# Formats 1 and 2 kept the Markov head's weights at the top level: markov_<name> is now markov_head/<name>.
_FLAT_HEAD_PREFIX, _HEAD = "markov_", "markov_head"


def _flat_head_layout(tree: dict[str, Any]) -> dict[str, Any]:
    """A parameter tree (pure dict) with ``markov_head/<name>`` written as format 2's ``markov_<name>``."""
    out = {k: v for k, v in tree.items() if k != _HEAD}
    out.update({_FLAT_HEAD_PREFIX + k: v for k, v in (tree.get(_HEAD) or {}).items()})
    return out


def _nested_head_layout(tree: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`_flat_head_layout`: format 2's ``markov_<name>`` -> ``markov_head/<name>``."""
    out = {k: v for k, v in tree.items() if not k.startswith(_FLAT_HEAD_PREFIX)}
    head = {k[len(_FLAT_HEAD_PREFIX) :]: v for k, v in tree.items() if k.startswith(_FLAT_HEAD_PREFIX)}
    if head:
        out[_HEAD] = head
    return out


def export_drafter(
    drafter: Drafter, path: str | Path, *, calibration: list[float] | None = None, extra: dict[str, Any] | None = None
) -> Path:
    """Writes ``drafter`` as a self-contained export directory (overwrites ``path``).

    Args:
      drafter: trained drafter.
      path: export directory.
      calibration: optional per-position temperatures T_1..T_gamma for the
        confidence head (sequential temperature scaling); default: the
        drafter's own ``calibration`` (with its ``calibration_bias``; none with temperatures
        given here).
      extra: JSON-serialisable metadata (training summary, metrics).
    Returns:
      The absolute export path.
    """
    path = Path(path).absolute()
    bias = None
    if calibration is None and drafter.calibration is not None:
        calibration, bias = list(drafter.calibration), drafter.calibration_bias
    lead = jax.process_index() == 0
    # Several processes (a multi-host run): every one saves its shards through Orbax into the same
    # folder, process 0 alone clears it first and writes the metadata.
    if lead and path.exists():
        shutil.rmtree(path)
    if lead:
        path.mkdir(parents=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"export {path}")
    params = nnx.state(drafter, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:  # closing it stops its background save thread
        ckptr.save(path / "params", nnx.to_pure_dict(params))
        ckptr.wait_until_finished()
    if not lead:
        return path
    meta = {
        "format": FORMAT,
        "config": drafter.cfg.to_dict(),
        "dtype": jnp.dtype(drafter.dtype).name,
        "calibration": calibration,
        "calibration_bias": list(bias) if bias else None,
        "calibration_greedy": list(drafter.calibration_greedy or []) or None,
        "calibration_greedy_bias": list(drafter.calibration_greedy_bias or []) or None,
        "draft_vocab": list(drafter.draft_vocab or []) or None,
        "extra": extra or {},
    }
    (path / "drafter.json").write_text(json.dumps(meta, indent=2))
    return path


def read_export_meta(path: str | Path) -> dict[str, Any]:
    """Reads and validates ``drafter.json`` of an export, or the config of a drafter in one of the
    field's formats (:mod:`dspark_jax.drafters.formats`; then ``format`` is ``"external/<name>"``,
    ``config`` the converted :class:`DrafterConfig`'s dict and ``extra`` says where it came from).
    ``path`` may be a Hugging Face Hub id (:func:`~dspark_jax.drafters.formats.resolve_drafter_source`).

    Raises:
      DSparkInputError: not an export directory, or a corrupt/unknown metadata file.
    """
    path = resolve_drafter_source(path)
    meta_path = path / "drafter.json"
    if not meta_path.is_file() and detect_format(path) is not None:
        ext = read_external(path)
        return _external_meta(path, ext)
    if not meta_path.is_file():
        raise DSparkInputError(
            f"{path} is not a drafter export (no drafter.json): pass the export directory "
            "written by `python -m dspark_jax.train`"
        )
    meta = read_json_object(meta_path)
    if meta.get("format") in _RENAMED:
        meta["format"] = _RENAMED[meta["format"]]
    if meta.get("format") not in EXPORT_FORMATS:
        raise DSparkInputError(
            f"{meta_path}: unsupported export format {meta.get('format')!r} "
            f"(expected one of {', '.join(EXPORT_FORMATS)})"
        )
    return meta


def export_config(meta: dict[str, Any], path: str | Path) -> DrafterConfig:
    """The :class:`DrafterConfig` recorded in the metadata ``meta`` (:func:`read_export_meta`) of
    the export at ``path``, older exports' names converted.

    Raises:
      DSparkInputError: a config that is missing or invalid.
    """
    try:
        conf = dict(meta["config"])
        if meta.get("format") == _FORMAT_1 and conf.get("markov_head") in LEGACY_MARKOV_HEADS:
            conf["markov_head"] = LEGACY_MARKOV_HEADS[conf["markov_head"]]
        return DrafterConfig.from_dict(conf)
    except (KeyError, TypeError, ValueError) as e:
        raise DSparkInputError(f"{path}/drafter.json has an invalid config: {e}") from None


def _external_meta(path: Path, ext: ExternalDrafter) -> dict[str, Any]:
    """The metadata of a drafter read from another format (:func:`read_export_meta`)."""
    return {
        "format": f"external/{ext.format}",
        "config": ext.cfg.to_dict(),
        "dtype": str(ext.params["fc"].dtype),
        "calibration": None,
        "calibration_greedy": None,
        "draft_vocab": list(ext.draft_vocab) if ext.draft_vocab else None,
        "extra": {"source": str(path), "source_format": ext.format, "notes": ext.notes, "verifier": ext.verifier},
    }


def load_drafter(path: str | Path, dtype: Any = None, target: Target | None = None) -> tuple[Drafter, dict[str, Any]]:
    """Loads an exported drafter, or a drafter in one of the field's checkpoint formats.

    Args:
      path: export directory from :func:`export_drafter`; a DeepSpec, speculators (``dspark`` /
        ``dflash``) or z-lab DFlash directory (:mod:`dspark_jax.drafters.formats`, converted exactly);
        or a Hugging Face Hub id of either (resolved through the local Hub cache).
      dtype: parameter/compute dtype (default: the dtype it was saved in).
      target: the target it will decode with, when known: the drafter is checked against it
        (:func:`~dspark_jax.drafters.base.check_compatible`; for an imported checkpoint also its
        stored embedding / LM-head copies, and the target's depth is recorded where the
        checkpoint lacks it).
    Returns:
      ``(drafter, meta)`` where ``meta`` has ``calibration`` and ``extra``; the
      calibration temperatures are also installed on the drafter
      (``set_calibration``), so decoding uses calibrated confidences. Formats 1 and 2 load
      through the renaming of their Markov-head paths (module doc). An imported checkpoint has no
      calibration; ``meta["extra"]["notes"]`` lists what its conversion assumed (each also
      printed as a warning).
    Raises:
      DSparkInputError: missing/corrupt export, parameters that do not match
        the recorded config, a checkpoint the drafter cannot represent, or a drafter for
        another target.
    """
    src = resolve_drafter_source(path)
    if not (src / "drafter.json").is_file() and detect_format(src) is not None:
        return _load_external(src, dtype, target)
    drafter, meta = _load_export(src.absolute(), dtype)
    if target is not None:
        check_compatible(target, drafter)
    return drafter, meta


def _load_external(path: Path, dtype: Any, target: Target | None) -> tuple[Drafter, dict[str, Any]]:
    """:func:`load_drafter` of a checkpoint in another format."""
    ext = read_external(path)
    cfg = ext.cfg
    if target is not None:
        t = target.cfg

        def embed_rows(ids):
            ids = jnp.asarray(ids, jnp.int32)  # a drafter's own embedding copies the target's table, unscaled
            return jnp.take(target.embed[...], ids, axis=0) if cfg.own_embeddings else target.embed_tokens(ids)

        check_reference_rows(
            ext.reference_rows,
            embed_rows,
            lambda ids: target.lm_head_rows(jnp.asarray(ids, jnp.int32)),
        )
        # The checks passed: record the target as this project's exports do.
        cfg = dataclasses.replace(
            cfg,
            target_num_layers=cfg.target_num_layers or t.num_layers,
            target_name=t.name,
            target_fingerprint=getattr(target, "fingerprint", "") or cfg.target_fingerprint,
        )
    for note in ext.notes:
        warnings.warn(f"{path}: {note}", stacklevel=3)
    dtype = jnp.dtype(dtype or ext.params["fc"].dtype)
    abstract = nnx.eval_shape(lambda: build_drafter(cfg, nnx.Rngs(0), dtype=dtype))
    graphdef, abs_state = nnx.split(abstract)
    want = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    try:
        check_stored_shapes(lambda: ext.params, want)
    except ValueError as e:
        raise DSparkInputError(f"{path}: {e}") from None
    drafter = nnx.merge(graphdef, abs_state)
    state = nnx.state(drafter, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), ext.params))
    nnx.update(drafter, state)
    if ext.draft_vocab is not None:
        drafter.set_draft_vocab(ext.draft_vocab)
    meta = _external_meta(path, ext)
    meta["config"] = cfg.to_dict()
    if target is not None:
        check_compatible(target, drafter)
    return drafter, meta


def _load_export(path: Path, dtype: Any) -> tuple[Drafter, dict[str, Any]]:
    """:func:`load_drafter` of this project's export directory."""
    meta = read_export_meta(path)
    cfg = export_config(meta, path)
    dtype = dtype or jnp.dtype(meta.get("dtype", "float32"))
    abstract = nnx.eval_shape(lambda: build_drafter(cfg, nnx.Rngs(0), dtype=dtype))
    graphdef, abs_state = nnx.split(abstract)
    target_tree = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    )
    flat_head = meta["format"] in (_FORMAT_1, _FORMAT_2)
    if flat_head:
        target_tree = _flat_head_layout(target_tree)
    if not (path / "params").exists():
        raise DSparkInputError(f"{path} has no params/ folder: the export is incomplete")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            check_stored_shapes(lambda: ckptr.metadata(path / "params"), target_tree)
            restored = ckptr.restore(path / "params", target_tree)
    except Exception as e:  # orbax raises many types for corrupt/mismatched trees
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DSparkInputError(f"cannot restore drafter parameters from {path}/params: {msg}") from None
    if flat_head:
        restored = _nested_head_layout(restored)
    drafter = nnx.merge(graphdef, abs_state)
    state = nnx.state(drafter, nnx.Param)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(drafter, state)
    try:
        drafter.set_calibration(meta.get("calibration"), bias=meta.get("calibration_bias"))
        if meta.get("calibration_greedy"):
            drafter.set_calibration(meta["calibration_greedy"], greedy=True, bias=meta.get("calibration_greedy_bias"))
    except (TypeError, ValueError) as e:
        raise DSparkInputError(f"{path}/drafter.json has an invalid calibration: {e}") from None
    if cfg.draft_vocab_size:
        try:
            drafter.set_draft_vocab(meta.get("draft_vocab") or [])
        except (TypeError, ValueError) as e:
            raise DSparkInputError(f"{path}/drafter.json has an invalid draft vocabulary: {e}") from None
    return drafter, meta


def check_stored_shapes(read_metadata: Callable[[], Any], target_tree: Any) -> None:
    """Refuses a checkpoint whose arrays differ in name or shape from ``target_tree``'s, from its
    metadata alone (no array is read).

    Args:
      read_metadata: returns the checkpoint's orbax tree metadata (``ArrayMetadata`` leaves with
        ``.shape``); when it raises or returns None the check is skipped and the restore decides.
      target_tree: the tree to restore into (leaves with ``.shape``).
    Raises:
      ValueError: names the mismatched arrays. Checked before restoring because orbax abandons
        its other pending reads when one fails, and they surface later (at garbage collection or
        interpreter exit) as unraisable-exception tracebacks.
    """
    try:
        stored = read_metadata()
        stored = getattr(stored, "item_metadata", stored)
        have = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    except Exception:  # no readable metadata (or a layout this check does not know): the restore decides
        return
    if not have:
        return
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(target_tree)}
    bad = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if bad:
        k = bad[0]
        raise ValueError(
            f"{len(bad)} array(s) differ from the config, e.g. {k}: stored {have.get(k)}, config {want.get(k)}"
        )
