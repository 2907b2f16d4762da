"""Target-feature cache: the frozen target's tapped hidden states, computed once, memory-mapped.

docs/design.md#training runs the frozen target inside every train step for the
drafter's context features (step 1 of the drafter, paper Section 3 / DFlash's
tapped layers) and for ``p_target``. The target is frozen and the
self-distillation shards are fixed, so over several epochs that forward pass
recomputes the same numbers every time it meets a sequence. This module runs it
ONCE per sequence and stores, per tapped layer ``t``, the layer's output
``[N, L, H]`` as ``layer_XXX.npy`` under a cache directory, read back with
``np.load(mmap_mode="r")`` (only the rows of a batch are paged in).

What is stored: the union of the tap layers of every drafter that will train on
the cache plus the target's last layer (``num_layers - 1``). The last layer's
output is the final hidden state before the final norm, so ``target.unembed``
of it gives exactly the target's logits; the trainer computes ``p_target`` only
at the ``B * A * block_size`` gathered positions from it instead of storing
``[N, L, V]`` logits. Beside it, ``lse.npy`` holds per position the float32
logsumexp of those logits over the full vocabulary (``[N, L]``, computed in
chunks of positions while the cache is built, from the stored last hidden state
as the trainer reads it back): with it the loss of a drafter with a draft
vocabulary needs the logits of the draft vocabulary's ids only (exact target
probabilities there, exact mass outside; :mod:`dspark_jax.training.losses`).

Storage dtype (``store_dtype``): ``float32`` (default; a float32 target's cached
training is then numerically the uncached one) or ``bfloat16`` (half the disk
and page-cache, stored as the ``uint16`` bit pattern, exact for a bfloat16
target). A ``manifest.json`` records the target (fingerprint, name, compute
dtype), the layers, the storage dtype, the data shape and a sha256 of the
tokens; :func:`ensure_feature_cache` refuses a cache of another target, data or
dtype and rebuilds one whose layers do not cover the request; one of format 1 (no
logsumexp) of the same target, data and dtype gets its logsumexp added in place. A cache is built
in a temporary sibling directory and renamed into place, so a killed build
leaves no partial cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target

# 2: + lse.npy (the target's full-vocabulary logsumexp per position).
FORMAT_VERSION = 2
STORE_DTYPES = ("float32", "bfloat16")
MANIFEST = "manifest.json"
LSE_FILE = "lse.npy"
# Batch keys the trainer recognises (see ``dspark_jax.training.losses.loss_sums``).
FEATURES_KEY = "tap_features"
LAST_HIDDEN_KEY = "last_hidden"
LSE_KEY = "target_lse"
# Largest float32 logits block [positions, V] the build materialises at once [bytes].
_LSE_CHUNK_BYTES = 64 << 20


def _layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.npy"


def target_identity(target: Target) -> str:
    """The weights' fingerprint (``target.fingerprint``, else computed from the weights)."""
    if target.fingerprint:
        return target.fingerprint
    from dspark_jax.models.weights import params_fingerprint

    return params_fingerprint(nnx.to_pure_dict(nnx.state(target, nnx.Param)))


def tokens_digest(tokens: np.ndarray) -> str:
    """sha256 (hex) of ``tokens [N, L]`` as little-endian int32, shape included."""
    a = np.ascontiguousarray(np.asarray(tokens), dtype="<i4")
    h = hashlib.sha256(f"{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


class TapFeatures:
    """Lazy ``[N, L, n_taps * H]`` view over per-layer memory-mapped files.

    Indexing with row indices (``view[idx]``) reads only those rows and
    concatenates the layers in tap order, like ``Target(..., taps=taps).features``.
    ``bfloat16`` caches come back as ``ml_dtypes.bfloat16`` arrays.
    """

    def __init__(self, layers: Sequence[np.ndarray], store_dtype: str):
        self._layers = list(layers)
        self._bf16 = store_dtype == "bfloat16"
        n, length, h = self._layers[0].shape
        self.shape = (n, length, h * len(self._layers))
        self.dtype = np.dtype(ml_dtypes.bfloat16) if self._bf16 else np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        parts = [np.asarray(m[idx]) for m in self._layers]
        out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
        return out.view(ml_dtypes.bfloat16) if self._bf16 else out

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


@dataclass(frozen=True)
class FeatureCache:
    """An opened cache directory.

    Attributes:
      directory: the cache folder.
      manifest: the parsed ``manifest.json``.
      layers: ``{layer index: [N, L, H] memmap}`` (``float32``, or ``uint16`` bits of bfloat16).
      lse: ``[N, L]`` float32 memmap, the target's logsumexp over all V ids per position.
    """

    directory: Path
    manifest: dict[str, Any]
    layers: Mapping[int, np.ndarray]
    lse: np.ndarray

    @property
    def store_dtype(self) -> str:
        return self.manifest["store_dtype"]

    @property
    def last_layer(self) -> int:
        return int(self.manifest["num_layers"]) - 1

    def batch_arrays(self, taps: Sequence[int]) -> dict[str, TapFeatures | np.ndarray]:
        """Per-sequence arrays to merge into the training data dict (same row order as ``tokens``).

        Returns:
          ``{"tap_features": [N, L, len(taps) * H], "last_hidden": [N, L, H], "target_lse": [N, L]}``
          lazy views; ``data.batches`` indexes them with the same sequence indices as the tokens.
        Raises:
          DSparkInputError: a tap layer is not in the cache.
        """
        missing = sorted(set(int(t) for t in taps) - set(self.layers))
        if missing:
            raise DSparkInputError(
                f"feature cache {self.directory} has layers {sorted(self.layers)}, "
                f"not the requested tap layers {missing}"
            )
        sd = self.store_dtype
        return {
            FEATURES_KEY: TapFeatures([self.layers[int(t)] for t in taps], sd),
            LAST_HIDDEN_KEY: TapFeatures([self.layers[self.last_layer]], sd),
            LSE_KEY: self.lse,
        }


def expected_manifest(target: Target, tokens: np.ndarray, layers: Sequence[int], store_dtype: str) -> dict[str, Any]:
    """The manifest a cache of ``target`` over ``tokens`` with ``layers`` has (``layers`` sorted, last included)."""
    c = target.cfg
    return {
        "format": FORMAT_VERSION,
        "target_name": c.name,
        "target_fingerprint": target_identity(target),
        "target_dtype": jnp.dtype(target.dtype).name,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "layers": sorted({int(t) for t in layers} | {c.num_layers - 1}),
        "store_dtype": store_dtype,
        "num_sequences": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "tokens_sha256": tokens_digest(tokens),
    }


def _mismatch(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    keys = (
        "format",
        "target_fingerprint",
        "target_name",
        "target_dtype",
        "num_layers",
        "hidden_size",
        "store_dtype",
        "num_sequences",
        "seq_len",
        "tokens_sha256",
    )
    return [f"{k}: cache has {have.get(k)!r}, run needs {want[k]!r}" for k in keys if have.get(k) != want[k]]


def open_feature_cache(
    directory: str | Path,
    target: Target,
    data: Mapping[str, np.ndarray],
    taps: Sequence[int],
    store_dtype: str = "float32",
) -> FeatureCache:
    """Opens an existing cache and checks it against the run.

    Args:
      directory: cache folder (written by :func:`build_feature_cache`).
      target: the frozen target the run trains against.
      data: the training data dict (``tokens [N, L] int32``, ...), in training row order.
      taps: tap layers the run needs.
      store_dtype: ``float32`` or ``bfloat16``.
    Returns:
      :class:`FeatureCache` with read-only memory maps.
    Raises:
      DSparkInputError: no cache there, or one of another target / data / dtype, or without some of ``taps``.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise DSparkInputError(f"no feature cache at {directory} (missing {MANIFEST})")
    try:
        have = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DSparkInputError(f"unreadable feature cache manifest {path}: {e.msg}") from None
    want = expected_manifest(target, data["tokens"], taps, store_dtype)
    problems = _mismatch(have, want)
    missing = sorted(set(want["layers"]) - set(have.get("layers", [])))
    if missing:
        problems.append(f"layers {missing} are not cached (cache has {have.get('layers')})")
    if problems:
        raise DSparkInputError(f"feature cache {directory} does not match this run: " + "; ".join(problems))
    n, length, h = want["num_sequences"], want["seq_len"], want["hidden_size"]
    layers = {int(t): _open_array(directory, _layer_file(t), (n, length, h)) for t in have["layers"]}
    return FeatureCache(directory, have, layers, _open_array(directory, LSE_FILE, (n, length)))


def _open_array(directory: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Read-only memory map of the cache file ``name``, checked to have ``shape``.

    Raises:
      DSparkInputError: the file is missing, unreadable or of another shape.
    """
    try:
        m = np.load(directory / name, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DSparkInputError(
            f"feature cache {directory}: cannot read {name} ({e}); delete the folder to rebuild it"
        ) from None
    if m.shape != shape:
        raise DSparkInputError(
            f"feature cache {directory}: {name} has shape {m.shape}, expected {shape}; delete the folder to rebuild it"
        )
    return m


def _check_build_args(target: Target, layers: Sequence[int], store_dtype: str, batch_size: int) -> None:
    """Raises DSparkInputError for a bad ``store_dtype``, ``batch_size`` or layer index."""
    if store_dtype not in STORE_DTYPES:
        raise DSparkInputError(f"feature cache dtype must be one of {STORE_DTYPES}, got {store_dtype!r}")
    if batch_size < 1:
        raise DSparkInputError(f"feature cache batch_size must be >= 1, got {batch_size}")
    c = target.cfg
    bad = [t for t in layers if not 0 <= int(t) < c.num_layers]
    if bad:
        raise DSparkInputError(f"tap layers {bad} out of range for the {c.num_layers}-layer target {c.name}")


def full_vocab_lse(target: Target, hidden: jax.Array) -> jax.Array:
    """``[..., H]`` last hidden states (before the final norm) -> ``[...]`` float32 logsumexp of
    ``target.unembed`` over all V ids, in chunks of positions (``lax.map``) so that at most
    ``_LSE_CHUNK_BYTES`` of logits exist at once whatever the number of positions."""
    h, v = target.cfg.hidden_size, target.cfg.vocab_size
    flat = hidden.reshape(-1, h)
    m = flat.shape[0]
    c = max(1, min(m, _LSE_CHUNK_BYTES // (4 * v)))
    flat = jnp.pad(flat, ((0, -m % c), (0, 0)))
    lse = jax.lax.map(lambda x: jax.nn.logsumexp(target.unembed(x), axis=-1), flat.reshape(-1, c, h))
    return lse.reshape(-1)[:m].reshape(hidden.shape[:-1])


def _features_program(target: Target, stored: tuple[int, ...], batch_size: int, length: int, store_dtype: str):
    """Jitted ``(state, tokens [batch_size, L] int32) -> ([len(stored), batch_size, L, H], [batch_size, L])``:
    the outputs of the ``stored`` layers in the storage dtype and the float32 full-vocabulary
    logsumexp from the last one as stored (what the trainer reads back), and the target's state to
    call it with."""
    graph, state = nnx.split(target)
    h = target.cfg.hidden_size
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))
    jdt = jnp.bfloat16 if store_dtype == "bfloat16" else jnp.float32

    @jax.jit
    def forward(state, toks):
        model = nnx.merge(graph, state)
        out = model(toks, positions, taps=stored)
        assert out.features is not None  # stored always holds the last layer
        f = out.features.reshape(toks.shape[0], length, len(stored), h).astype(jdt)
        # stored is sorted and ends with the last layer; the logits out.logits are never built.
        return jnp.moveaxis(f, 2, 0), full_vocab_lse(model, f[:, :, -1].astype(model.dtype))

    return forward, state


def _write_layers(
    tmp: Path,
    target: Target,
    tokens: np.ndarray,
    stored: tuple[int, ...],
    store_dtype: str,
    batch_size: int,
    progress: bool,
) -> None:
    """Runs the target over ``tokens [N, L]`` in batches and writes each stored layer's ``[N, L, H]``
    output into ``tmp/layer_XXX.npy`` (``uint16`` bits for bfloat16) and the logsumexp ``[N, L]`` into
    ``tmp/lse.npy``. The last batch is padded with zero rows that are not stored."""
    n, length = tokens.shape
    np_store = np.uint16 if store_dtype == "bfloat16" else np.float32
    outs = {
        t: np.lib.format.open_memmap(
            tmp / _layer_file(t), mode="w+", dtype=np_store, shape=(n, length, target.cfg.hidden_size)
        )
        for t in stored
    }
    lse_out = np.lib.format.open_memmap(tmp / LSE_FILE, mode="w+", dtype=np.float32, shape=(n, length))
    forward, state = _features_program(target, stored, batch_size, length, store_dtype)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc="feature cache", unit="seq", dynamic_ncols=True)
    for start in range(0, n, batch_size):
        rows = tokens[start : start + batch_size]
        k = rows.shape[0]
        if k < batch_size:
            rows = np.concatenate([rows, np.zeros((batch_size - k, length), np.int32)])
        feats, lse = forward(state, rows)
        feats = np.asarray(feats)[:, :k]
        lse_out[start : start + k] = np.asarray(lse)[:k]
        for i, t in enumerate(stored):
            outs[t][start : start + k] = feats[i].view(np.uint16) if store_dtype == "bfloat16" else feats[i]
        if bar is not None:
            bar.update(k)
    if bar is not None:
        bar.close()
    for m in (*outs.values(), lse_out):
        m.flush()


def build_feature_cache(
    directory: str | Path,
    target: Target,
    data: Mapping[str, np.ndarray],
    layers: Sequence[int],
    *,
    store_dtype: str = "float32",
    batch_size: int = 16,
    progress: bool = True,
) -> FeatureCache:
    """Runs the target once over every sequence and writes the cache (atomically).

    One jitted forward (static ``[batch_size, L]`` shape; the last batch is padded
    with zero rows that are not stored) returns the outputs of ``layers`` plus the
    last layer; each batch is written into per-layer ``.npy`` memory maps in a
    temporary sibling folder, which replaces ``directory`` once complete.

    Args:
      directory: cache folder (replaced if present).
      target: frozen target (its compute dtype is recorded).
      data: ``tokens [N, L] int32`` (other keys ignored).
      layers: tap layers to store (the last layer is always added).
      store_dtype: ``float32`` or ``bfloat16``.
      batch_size: sequences per target forward [sequences].
      progress: show a tqdm bar.
    Returns:
      the opened :class:`FeatureCache`.
    Raises:
      DSparkInputError: bad ``store_dtype``, ``batch_size`` or layer index.
    """
    _check_build_args(target, layers, store_dtype, batch_size)
    directory = Path(directory)
    tokens = np.asarray(data["tokens"], np.int32)
    manifest = expected_manifest(target, tokens, layers, store_dtype)
    stored = tuple(manifest["layers"])
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    for stale in directory.parent.glob(f".{directory.name}.tmp-*"):  # left by a killed build
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    _write_layers(tmp, target, tokens, stored, store_dtype, batch_size, progress)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        os.replace(directory, old)  # a directory cannot be replaced in one rename
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return open_feature_cache(directory, target, data, stored, store_dtype)


def _add_lse(directory: Path, target: Target, manifest: dict[str, Any], batch_size: int, progress: bool) -> None:
    """Upgrades a format-1 cache in place to format 2: ``lse.npy`` from its stored last layer (read back
    as the trainer reads it, :func:`full_vocab_lse`), written under a temporary name and renamed, then
    the manifest (a run killed in between redoes it)."""
    last = np.load(directory / _layer_file(int(manifest["num_layers"]) - 1), mmap_mode="r")
    n, length, h = last.shape
    bf16 = manifest["store_dtype"] == "bfloat16"
    graph, state = nnx.split(target)
    program = jax.jit(lambda st, x: full_vocab_lse(nnx.merge(graph, st), x.astype(target.dtype)))
    tmp = directory / f".{LSE_FILE}.tmp-{os.getpid()}"
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, length))
    for start in range(0, n, batch_size):
        rows = np.asarray(last[start : start + batch_size])
        k = rows.shape[0]
        rows = np.concatenate([rows, np.zeros((batch_size - k, length, h), rows.dtype)]) if k < batch_size else rows
        out[start : start + k] = np.asarray(program(state, rows.view(ml_dtypes.bfloat16) if bf16 else rows))[:k]
    out.flush()
    del out
    os.replace(tmp, directory / LSE_FILE)
    tmp_manifest = directory / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp_manifest.write_text(json.dumps({**manifest, "format": FORMAT_VERSION}, indent=1))
    os.replace(tmp_manifest, directory / MANIFEST)


def ensure_feature_cache(
    directory: str | Path,
    target: Target,
    data: Mapping[str, np.ndarray],
    taps: Sequence[int],
    *,
    store_dtype: str = "float32",
    batch_size: int = 16,
    progress: bool = True,
) -> FeatureCache:
    """Opens the cache at ``directory``, building it when missing or when it lacks some of ``taps``.

    A cache whose layers do not cover ``taps`` (e.g. another drafter joins a comparison)
    is rebuilt with the union of its layers and ``taps``. One of format 1 (no logsumexp) that covers
    them gets its ``lse.npy`` from its stored last layer, in place (no target forward); an older one
    is rebuilt (a note on stderr either way). A cache of another target, other tokens, another
    storage dtype or a newer format is never silently replaced.

    Raises:
      DSparkInputError: ``directory`` holds a cache of another target / data / dtype,
        or something that is not a cache.
    """
    directory = Path(directory)
    taps = sorted({int(t) for t in taps})
    if not (directory / MANIFEST).is_file():
        if directory.exists() and any(directory.iterdir()):
            raise DSparkInputError(
                f"{directory} exists and is not a feature cache (no {MANIFEST}); choose an empty or new folder"
            )
        return build_feature_cache(
            directory, target, data, taps, store_dtype=store_dtype, batch_size=batch_size, progress=progress
        )
    try:
        return open_feature_cache(directory, target, data, taps, store_dtype)
    except DSparkInputError:
        have = json.loads((directory / MANIFEST).read_text())
        want = expected_manifest(target, data["tokens"], taps, store_dtype)
        old = isinstance(have.get("format"), int) and have["format"] < FORMAT_VERSION
        problems = [p for p in _mismatch(have, want) if not (old and p.startswith("format:"))]
        if problems:
            raise DSparkInputError(
                f"feature cache {directory} was built for another run ("
                + "; ".join(problems)
                + "); delete it or set another feature_cache folder"
            ) from None
        union = sorted(set(have.get("layers", [])) | set(taps))
        if old and union == sorted(have.get("layers", [])) and have["format"] == 1:
            # Format 1 lacks only lse.npy, which the stored last layer gives without the target forward.
            print(f"feature cache {directory}: format 1, adding the target's logsumexp (format 2)", file=sys.stderr)
            _add_lse(directory, target, have, batch_size, progress)
            return open_feature_cache(directory, target, data, taps, store_dtype)
        if old:  # derived data of this very target and data: safe to recompute
            print(f"feature cache {directory}: format {have['format']}, rebuilding it as format 2", file=sys.stderr)
        return build_feature_cache(
            directory, target, data, union, store_dtype=store_dtype, batch_size=batch_size, progress=progress
        )
