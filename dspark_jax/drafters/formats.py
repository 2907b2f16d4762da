"""DSpark / DFlash drafters in the field's checkpoint formats, read into this project's drafter.

Three layouts (facts: ``docs/interop.md#format-details``; each a ``config.json`` + ``*.safetensors`` directory
of Qwen3 decoder layers with q/k-norm, ``fc``, ``hidden_norm``, ``norm``):

* ``deepspec``: DeepSeek's ``Qwen3DSparkModel`` (``dspark_qwen3_*_block7``): a flat copy of the
  target's Qwen3 config plus ``block_size``, ``target_layer_ids`` (decoder-layer outputs, -1 = the
  embedding output), ``mask_token_id``, ``markov_rank``, ``markov_head_type``, the confidence-head
  flags; frozen copies of ``embed_tokens`` / ``lm_head``; Markov ``W1 [V, r]``, ``W2 [V, r]``;
  anchor-first (block = anchor + block_size-1 masks, slot k predicts position p + k + 1). DeepSpec's
  DFlash is the same class with ``markov_rank=0`` and no confidence head. A tap of the target's last
  layer (L - 1) is its output before the final norm, as DeepSpec's target cache records it (and as
  speculators' ``aux_hidden_state_layer_ids`` L holds it), this project's tap L - 1. Older configs
  (``DSparkDraftModel``, ``model_type: qwen3``) keep ``target_layer_ids`` / ``mask_token_id`` under
  ``dflash_config`` and are normalised. DeepSeek's ``Gemma4DSparkModel`` (Gemma 4 draft layers with
  their own scaled embedding and soft-capped LM head) is read by :mod:`~dspark_jax.drafters.gemma4_format`.
* ``speculators``: vllm-project/speculators' ``dspark`` / ``dflash``: the draft layers' config under
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (Hugging Face ``hidden_states``
  indices, decoder layer + 1), ``sample_from_anchor``, ``draft_vocab_size`` with ``d2t`` offsets,
  ``t2d`` and a restricted ``lm_head [N, d]``; Markov ``W2 [N, r]``; no embedding copy.
* ``zlab-dflash``: z-lab's ``DFlashDraftModel``: ``dflash_config.{target_layer_ids, mask_token_id}``,
  the 1 + N layout (slot 0 the anchor, slots 1..B-1 predict p+1..p+B-1).

:func:`read_external` converts one exactly (transposes and stacking only, float32 or the dtype
asked for, no approximation) into a :class:`~dspark_jax.config.DrafterConfig` of the formats'
architecture (``qk_norm``, ``mask_token_id``, ``confidence_input="raw"``, ``markov_w1_rows="target"``)
and this project's parameter tree; anything the drafter cannot represent is refused with one line
naming it. Mapping of DeepSpec's DFlash (no confidence head): a ``dspark`` drafter with
``markov_rank=0`` whose confidence head is ``w = 0``, ``b = +inf`` (confidence 1, the value this
project's ``dflash`` drafters report), which exports back as ``enable_confidence_head: false``.
:func:`resolve_drafter_source` resolves a Hugging Face Hub id through ``huggingface_hub``'s cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

import dspark_jax.drafters.gemma4_format as gemma4_format
from dspark_jax.config import DrafterConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.rope import hf_rope_scaling
from dspark_jax.models.weights import HF_LAYER_TENSORS

FORMATS = ("deepspec", "speculators", "zlab-dflash")
# Per-layer tensors: this project's stacked name -> the formats' name under ``layers.{i}.``.
LAYER_TENSORS = HF_LAYER_TENSORS
# Layer tensors that are vectors (norm weights, copied as they are); the rest are [out, in] matrices.
NORM_TENSORS = ("attn_norm", "q_norm", "k_norm", "mlp_norm")
# Markov-head tensors per head type: ours -> the formats' (under ``markov_head.``), matrices transposed.
HEAD_TENSORS = {
    "vanilla": {},
    "gated": {"gate_w": "gate_proj.weight", "gate_b": "gate_proj.bias"},
    "rnn": {"rnn_wx": "joint_proj.weight", "rnn_b": "joint_proj.bias"},
}
# Tensors checked against the target where it is known (the frozen copies): a few rows suffice.
_REFERENCE_ROWS = 8


@dataclasses.dataclass
class ExternalDrafter:
    """A drafter read from one of :data:`FORMATS`.

    Attributes:
      format: one of :data:`FORMATS`.
      cfg: the equivalent :class:`~dspark_jax.config.DrafterConfig` (``target_num_layers`` 0 when the
        checkpoint does not record the target's depth: speculators' and z-lab's).
      params: this project's parameter tree (pure dict of numpy arrays, float32 or the stored dtype).
      draft_vocab: the draft vocabulary's ascending target ids, or None.
      reference_rows: ``{"embed" | "lm_head": (ids [k] int, rows [k, H])}`` rows of the target's
        embedding / LM head that the checkpoint stores (DeepSpec's copies, speculators' restricted
        head), compared with the target's by :func:`check_reference_rows`.
      notes: what the conversion assumed (e.g. a layout flag the config lacks).
      verifier: the target the checkpoint names (speculators' ``verifier.name_or_path``), or None.
    """

    format: str
    cfg: DrafterConfig
    params: dict[str, Any]
    draft_vocab: tuple[int, ...] | None
    reference_rows: dict[str, tuple[np.ndarray, np.ndarray]]
    notes: list[str]
    verifier: str | None = None


def resolve_drafter_source(spec: str | Path) -> Path:
    """The local directory of a drafter: ``spec`` itself when it exists, else a Hugging Face Hub id
    (``owner/name``) resolved through ``huggingface_hub``'s cache (downloaded when online; with
    ``HF_HUB_OFFLINE=1`` or no network, the cached snapshot).

    Raises:
      DSparkInputError: neither an existing path nor a resolvable Hub id.
    """
    p = Path(spec).expanduser()
    if p.exists():
        return p
    text = str(spec)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise DSparkInputError(
            f"{text} is not a drafter export: no such directory (nor a Hugging Face Hub id owner/name)"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a core dependency
        raise DSparkInputError("resolving a Hub id needs huggingface_hub (pip install huggingface-hub)") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    errors = []
    for local_only in (True,) if offline else (False, True):
        try:
            return Path(snapshot_download(text, local_files_only=local_only))
        except Exception as e:  # network, missing cache entry, bad id: say why once
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    raise DSparkInputError(f"drafter {text!r}: not a directory, and the Hub id could not be resolved: {errors[-1]}")


def detect_format(path: Path) -> str | None:
    """The format of a drafter directory (:data:`FORMATS`), or None when ``config.json`` names none.

    Raises:
      DSparkInputError: an unreadable ``config.json``.
    """
    c = _read_config(path)
    if c is None:
        return None
    if "speculators_model_type" in c:
        return "speculators"
    arch = list(c.get("architectures") or [])
    if "Qwen3DSparkModel" in arch or "Gemma4DSparkModel" in arch:
        return "deepspec"
    if "DSparkDraftModel" in arch and c.get("model_type") == "qwen3":
        return "deepspec"  # an older DeepSpec name (its keys under dflash_config: _legacy_deepspec)
    if "DFlashDraftModel" in arch:
        return "zlab-dflash"
    return None


def read_json_object(f: Path) -> dict[str, Any]:
    """A JSON file holding one object (a drafter's ``config.json`` or ``drafter.json``).

    Raises:
      DSparkInputError: not valid JSON, or not an object.
    """
    try:
        c = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DSparkInputError(f"{f} is corrupt: {e}") from None
    if not isinstance(c, dict):
        raise DSparkInputError(f"{f} is corrupt: not a JSON object")
    return c


def _read_config(path: Path) -> dict[str, Any] | None:
    f = path / "config.json"
    return read_json_object(f) if f.is_file() else None


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files (a leading ``model.`` is dropped)."""
    from safetensors.numpy import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DSparkInputError(f"{path}: no *.safetensors weight files")
    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            loaded = load_file(str(f))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise DSparkInputError(f"{f} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
        out.update({k.removeprefix("model."): v for k, v in loaded.items()})
    return out


def _layer_shape(c: dict[str, Any], where: str) -> dict[str, Any]:
    """The draft layers' shape from a Qwen3-style config dict, refusing what the drafter lacks."""
    mt = c.get("model_type")
    if mt is not None and "gemma" in str(mt):
        raise DSparkInputError(
            f"{where}: Gemma draft layers (model_type {mt!r}) are supported in DeepSpec's Gemma4DSparkModel "
            "checkpoints only"
        )
    if mt not in (None, "qwen3", "qwen2", "llama"):
        raise DSparkInputError(f"{where}: draft layers of model_type {mt!r} are not supported (Qwen3 layers only)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise DSparkInputError(f"{where}: attention or MLP biases are not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise DSparkInputError(f"{where}: hidden_act {c.get('hidden_act')!r} is not supported (SiLU only)")
    types = c.get("layer_types") or []
    if c.get("use_sliding_window") or any(t != "full_attention" for t in types):
        raise DSparkInputError(f"{where}: sliding-window attention layers are not supported (full attention only)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope = dict(rope) if isinstance(rope, dict) else {}
    if "original_max_position_embeddings" in c:  # a top-level value wins, as in transformers
        rope["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    max_pos = int(c.get("max_position_embeddings") or 0)
    theta, scaling = hf_rope_scaling(rope, max_position=max_pos, where=where)
    theta = theta if theta is not None else c.get("rope_theta", 10000.0)
    nh = int(c["num_attention_heads"])
    return dict(
        hidden_size=int(c["hidden_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=nh,
        num_kv_heads=int(c.get("num_key_value_heads") or nh),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // nh),
        intermediate_size=int(c["intermediate_size"]),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        vocab_size=int(c["vocab_size"]),
    )


def _taps(ids: list[int], *, hf_indices: bool, where: str) -> tuple[int, ...]:
    """This project's taps (decoder-layer outputs) from DeepSpec / z-lab layer ids (``hf_indices``
    False: -1 = embedding output) or speculators' ``hidden_states`` indices (True: 0 = embedding)."""
    taps = tuple(int(i) - 1 if hf_indices else int(i) for i in ids)
    if not taps:
        raise DSparkInputError(f"{where}: the config lists no tapped target layers")
    if any(t < 0 for t in taps):
        name = "aux_hidden_state_layer_ids 0" if hf_indices else "target_layer_ids -1"
        raise DSparkInputError(
            f"{where}: a tap of the target's embedding output ({name}) is not supported: taps are decoder-layer outputs"
        )
    if list(taps) != sorted(set(taps)):
        raise DSparkInputError(f"{where}: tapped layers {list(ids)} are not strictly increasing")
    return taps


@dataclasses.dataclass
class _Fields:
    """What one format's config says beyond the layer shape (:func:`_format_fields`)."""

    layer: dict[str, Any]
    taps: tuple[int, ...]
    anchor_first: bool
    markov_rank: int
    head: str
    conf: bool
    conf_markov: bool
    target_layers: int
    block_size: int
    mask_token_id: Any
    verifier: str | None = None
    arch: dict[str, Any] = dataclasses.field(default_factory=dict)


def _format_fields(fmt: str, c: dict[str, Any], where: str, notes: list[str]) -> _Fields:
    """The drafter-level fields of ``config.json`` in format ``fmt`` (module doc)."""
    if fmt == "speculators":
        kind = c.get("speculators_model_type")
        if kind not in ("dspark", "dflash"):
            raise DSparkInputError(f"{where}: speculators model type {kind!r} is not a DSpark/DFlash drafter")
        layer = _layer_shape(dict(c.get("transformer_layer_config") or {}), where)
        if "sample_from_anchor" in c:
            anchor_first = bool(c["sample_from_anchor"])
        else:
            anchor_first = kind == "dspark"
            notes.append(
                f"config has no sample_from_anchor: assumed {anchor_first} (the speculators default for {kind})"
            )
        th = c.get("target_hidden_size")
        if th is not None and int(th) != layer["hidden_size"]:
            raise DSparkInputError(
                f"{where}: target_hidden_size {th} differs from the draft width {layer['hidden_size']} "
                "(this drafter's width is the target's)"
            )
        rank = int(c.get("markov_rank", 256)) if kind == "dspark" else 0
        conf = bool(c.get("enable_confidence_head", True)) if kind == "dspark" else False
        return _Fields(
            layer=layer,
            taps=_taps(list(c.get("aux_hidden_state_layer_ids") or []), hf_indices=True, where=where),
            anchor_first=anchor_first,
            markov_rank=rank,
            head=str(c.get("markov_head_type", "vanilla")),
            conf=conf,
            conf_markov=bool(c.get("confidence_head_with_markov", True)) and conf and rank > 0,
            target_layers=0,
            block_size=int(c.get("block_size") or 0),
            mask_token_id=c.get("mask_token_id"),
            verifier=((c.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"),
        )
    if fmt == "deepspec":
        c = _legacy_deepspec(c, notes)
        rank = int(c.get("markov_rank", 0))
        conf = bool(c.get("enable_confidence_head", False))
        layer = gemma4_format.layer_shape(c, where) if gemma4_format.is_gemma4(c) else _layer_shape(c, where)
        return _Fields(
            layer=layer,
            arch=layer.pop("arch", {}),
            taps=_taps(list(c.get("target_layer_ids") or []), hf_indices=False, where=where),
            anchor_first=True,
            markov_rank=rank,
            head=str(c.get("markov_head_type", "vanilla")),
            conf=conf,
            conf_markov=bool(c.get("confidence_head_with_markov", False)) and conf and rank > 0,
            target_layers=int(c.get("num_target_layers", 0)),
            block_size=int(c.get("block_size") or 0),
            mask_token_id=c.get("mask_token_id"),
        )
    dc = dict(c.get("dflash_config") or {})  # zlab-dflash
    return _Fields(
        layer=_layer_shape(c, where),
        taps=_taps(list(dc.get("target_layer_ids") or c.get("target_layer_ids") or []), hf_indices=False, where=where),
        anchor_first=False,
        markov_rank=0,
        head="vanilla",
        conf=False,
        conf_markov=False,
        target_layers=int(c.get("num_target_layers", 0)),
        block_size=int(c.get("block_size") or dc.get("block_size") or 0),
        mask_token_id=dc.get("mask_token_id", c.get("mask_token_id")),
    )


def _legacy_deepspec(c: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """An older DeepSpec config (``architectures: ["DSparkDraftModel"]``, ``model_type: "qwen3"``)
    keeps ``target_layer_ids`` and ``mask_token_id`` under ``dflash_config``: their values are
    moved to the top level, as vLLM's and vllm-ascend's normalisation to ``Qwen3DSparkModel`` does
    (the nested values win). Other configs are returned unchanged."""
    dc = c.get("dflash_config")
    if "DSparkDraftModel" not in list(c.get("architectures") or []) or not isinstance(dc, dict):
        return c
    moved = {k: dc[k] for k in ("target_layer_ids", "mask_token_id") if k in dc}
    if moved:
        notes.append(f"older DSparkDraftModel config: {', '.join(moved)} read from dflash_config")
    return {**c, **moved}


def read_external(path: str | Path) -> ExternalDrafter:
    """Reads a drafter directory of one of :data:`FORMATS` (module doc).

    Returns:
      :class:`ExternalDrafter` (float32 weights where the files are float32, else their dtype).
    Raises:
      DSparkInputError: not a known format, a configuration or tensor the drafter cannot
        represent (named), missing or misshapen tensors.
    """
    path = Path(path)
    fmt = detect_format(path)
    if fmt is None:
        raise DSparkInputError(
            f"{path} is not a drafter export: no drafter.json (dspark_jax), and config.json names no "
            "DSpark/DFlash format (DeepSpec Qwen3DSparkModel, speculators dspark/dflash, z-lab DFlashDraftModel)"
        )
    c = _read_config(path) or {}
    where, notes = f"{path} ({fmt})", []
    f = _format_fields(fmt, c, where, notes)
    if f.head not in HEAD_TENSORS:
        raise DSparkInputError(f"{where}: Markov head type {f.head!r} is not supported (vanilla, gated, rnn)")
    if f.mask_token_id is None:
        raise DSparkInputError(f"{where}: the config has no mask_token_id")
    if f.block_size < (1 if f.anchor_first else 2):
        raise DSparkInputError(f"{where}: block_size {c.get('block_size')!r} is missing or too small")
    if not f.anchor_first and f.markov_rank:
        raise DSparkInputError(
            f"{where}: a Markov head with sample_from_anchor=false (the 1 + N layout) is not supported"
        )
    v, h = f.layer["vocab_size"], f.layer["hidden_size"]
    t = _tensors(path)
    reference: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    draft_vocab, n = None, v
    if fmt == "speculators" and int(c.get("draft_vocab_size") or v) != v:
        n = int(c["draft_vocab_size"])
        draft_vocab = _draft_vocab(t, n, v, where)
        reference["lm_head"] = _sample_rows(_take(t, "lm_head.weight", (n, h), where), np.asarray(draft_vocab))
    if fmt == "deepspec":  # copies of the target's (a Gemma 4 drafter's own: the same raw rows, unscaled)
        for ours, name in (("embed", "embed_tokens.weight"), ("lm_head", "lm_head.weight")):
            if name in t:
                reference[ours] = _sample_rows(_take(t, name, (v, h), where), np.arange(v))
    shape = {k: f.layer[k] for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")}
    cfg = DrafterConfig(
        vocab_size=v,
        hidden_size=h,
        target_num_layers=f.target_layers,
        taps=f.taps,
        variant="dspark" if f.anchor_first else "dflash",
        block_size=f.block_size if f.anchor_first else f.block_size - 1,
        markov_rank=f.markov_rank,
        rope_theta=f.layer["rope_theta"],
        rope_scaling=f.layer["rope_scaling"],
        rms_eps=f.layer["rms_eps"],
        target_name=str(f.verifier or c.get("_name_or_path") or path.name),
        markov_head=f.head,
        draft_vocab_size=0 if draft_vocab is None else n,
        qk_norm=True,
        mask_token_id=int(f.mask_token_id),
        confidence_input="raw",
        markov_w1_rows="target",
        **shape,
        **f.arch,
    )
    params = _params(cfg, t, conf=f.conf, conf_markov=f.conf_markov, where=where)
    return ExternalDrafter(fmt, cfg, params, draft_vocab, reference, notes, f.verifier)


def _take(t: dict[str, np.ndarray], name: str, shape: tuple[int, ...] | None, where: str) -> np.ndarray:
    if name not in t:
        raise DSparkInputError(f"{where}: tensor {name!r} is missing")
    a = t[name]
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise DSparkInputError(f"{where}: tensor {name!r} has shape {list(a.shape)}, expected {list(shape)}")
    return a


def _sample_rows(table: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A few rows (evenly spread, the last included) of ``table`` with the target ids they belong to."""
    pick = np.unique(np.linspace(0, len(ids) - 1, min(_REFERENCE_ROWS, len(ids))).round().astype(int))
    return ids[pick].astype(np.int64), np.asarray(table[pick], np.float32)


def _draft_vocab(t: dict[str, np.ndarray], n: int, v: int, where: str) -> tuple[int, ...]:
    """Target ids of speculators' draft vocabulary from ``d2t`` offsets (``id = i + d2t[i]``),
    checked against ``t2d`` when present."""
    d2t = _take(t, "d2t", (n,), where).astype(np.int64)
    ids = np.arange(n, dtype=np.int64) + d2t
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= v:
        raise DSparkInputError(f"{where}: d2t does not map to {n} ascending target ids in [0, {v})")
    if "t2d" in t:
        t2d = _take(t, "t2d", (v,), where).astype(bool)
        if int(t2d.sum()) != n or not np.all(t2d[ids]):
            raise DSparkInputError(f"{where}: t2d and d2t describe different draft vocabularies")
    return tuple(int(i) for i in ids)


def _params(cfg: DrafterConfig, t: dict[str, np.ndarray], *, conf: bool, conf_markov: bool, where: str) -> dict:
    """This project's parameter tree (pure dict) from the formats' tensors (module doc)."""
    d, n, r = cfg.hidden_size, cfg.num_layers, cfg.markov_rank
    qd, kd, hd, i_ = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "attn_norm": (d,),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "mlp_norm": (d,),
        "wq": (qd, d),
        "wk": (kd, d),
        "wv": (kd, d),
        "wo": (d, qd),
        "w_gate": (i_, d),
        "w_up": (i_, d),
        "w_down": (d, i_),
    }
    read: set[str] = set()  # what a Gemma 4 drafter's tensors are checked against: every one is read

    def take(name: str, shape: tuple[int, ...] | None) -> np.ndarray:
        read.add(name)
        return _take(t, name, shape, where)

    layers = {}
    for ours, theirs in () if cfg.own_embeddings else LAYER_TENSORS.items():
        per = [take(f"layers.{k}.{theirs}.weight", shapes[ours]) for k in range(n)]
        layers[ours] = np.stack(per if ours in NORM_TENSORS else [w.T for w in per])
    if cfg.own_embeddings:
        layers = gemma4_format.layer_params(cfg, take)
    if f"layers.{n}.input_layernorm.weight" in t:
        raise DSparkInputError(f"{where}: the checkpoint has more than num_hidden_layers={n} layers")
    f_in = len(cfg.taps) * cfg.hidden_size
    out: dict[str, Any] = {
        "fc": take("fc.weight", (d, f_in)).T,
        "ctx_norm": take("hidden_norm.weight", (d,)),
        "final_norm": take("norm.weight", (d,)),
        "layers": layers,
    }
    if cfg.own_embeddings:
        out.update(gemma4_format.own_params(cfg, take))
    if cfg.markov:
        head = {
            "w1": take("markov_head.markov_w1.weight", (cfg.vocab_size, r)),
            "w2": take("markov_head.markov_w2.weight", (cfg.draft_size, r)).T,
        }
        in_dim = {"gated": d + r, "rnn": 2 * r + d}.get(cfg.markov_head, 0)
        out_dim = {"gated": r, "rnn": 3 * r}.get(cfg.markov_head, 0)
        for ours, theirs in HEAD_TENSORS[cfg.markov_head].items():
            shape = (out_dim, in_dim) if theirs.endswith("weight") else (out_dim,)
            a = take(f"markov_head.{theirs}", shape)
            head[ours] = a.T if a.ndim == 2 else a
        out["markov_head"] = head
    if cfg.has_confidence:
        c_in = d + (r if cfg.markov else 0)
        if conf:
            w_in = d + (r if conf_markov else 0)
            w = take("confidence_head.proj.weight", (1, w_in))[0]
            b = take("confidence_head.proj.bias", (1,))[0]
            out["conf_w"] = np.concatenate([w, np.zeros((c_in - w_in,), w.dtype)])
            out["conf_b"] = np.asarray(b)
        else:  # no confidence head: confidence 1 (module doc)
            dt = out["fc"].dtype
            out["conf_w"], out["conf_b"] = np.zeros((c_in,), dt), np.asarray(np.inf, dt)
    if cfg.own_embeddings and (unread := sorted(set(t) - read)):
        raise DSparkInputError(f"{where}: tensors this drafter does not read: {', '.join(unread[:4])}")
    return out


def check_reference_rows(ext_rows: dict[str, tuple[np.ndarray, np.ndarray]], embed: Any, lm_head_rows: Any) -> None:
    """Refuses a target whose embedding / LM-head rows differ from the copies an imported
    checkpoint stores (:attr:`ExternalDrafter.reference_rows`).

    Args:
      ext_rows: the stored rows.
      embed: ``ids -> [k, H]`` the target's embedding rows.
      lm_head_rows: ``ids -> [k, H]`` the target's LM-head rows.
    Raises:
      DSparkInputError: names the tensor that differs (beyond bfloat16 rounding).
    """
    for name, (ids, rows) in ext_rows.items():
        theirs = np.asarray(embed(ids) if name == "embed" else lm_head_rows(ids), np.float32)
        scale = float(np.max(np.abs(theirs))) or 1.0
        if theirs.shape != rows.shape or float(np.max(np.abs(theirs - rows))) > 1e-2 * scale:
            label = "embed_tokens" if name == "embed" else "lm_head"
            raise DSparkInputError(
                f"the drafter's stored {label} copy differs from this target's: it was made for another target"
            )


# Texts for the first-position check: plain English any chat or story tokenizer encodes.
CHECK_TEXTS = (
    "Once upon a time, there was a little girl who lived in a village near the forest. She liked to play outside.",
    "The capital of France is Paris. It is known for the Eiffel Tower, its museums and its food.",
    "To sort a list in Python, call the sorted function: it returns a new list and leaves the old one unchanged.",
)
# Below this first-position greedy agreement a drafter is almost surely misaligned (the field's
# layout mismatches give about 1%); a drafter merely trained for little reaches far more.
MIN_FIRST_POSITION_AGREEMENT = 0.05


def first_position_agreement(target: Any, drafter: Any, rows: list[list[int]]) -> float:
    """Fraction of positions where the drafter's first draft token (greedy, Markov bias included)
    equals the target's greedy next token, teacher-forced over ``rows`` (token ids; every position
    but the last is an anchor). A layout mismatch (anchor-first read as 1 + N, taps shifted by one)
    drops it to about 1% without any error.
    """
    import jax.numpy as jnp

    hits = total = 0
    for row in rows:
        if len(row) < 2:
            continue
        tokens = jnp.asarray(row, jnp.int32)[None]
        out = target(tokens, jnp.arange(len(row), dtype=jnp.int32)[None], taps=drafter.cfg.taps)
        anchors = jnp.arange(len(row) - 1, dtype=jnp.int32)[None]
        block = drafter.train_blocks(target, out.features, tokens, anchors)
        bias, _ = drafter.teacher_forced_heads(block.hidden[:, :, :1], tokens[:, :-1, None])
        first = drafter.to_target_ids(jnp.argmax(block.logits[:, :, 0] + jnp.asarray(bias)[:, :, 0], axis=-1))
        hits += int(jnp.sum(first[0] == jnp.argmax(out.logits[0, :-1], axis=-1)))
        total += len(row) - 1
    return hits / max(total, 1)


def warn_if_misaligned(target: Any, tokenizer: Any, drafter: Any, where: str) -> float | None:
    """Runs :func:`first_position_agreement` on :data:`CHECK_TEXTS` and warns (``UserWarning``)
    below :data:`MIN_FIRST_POSITION_AGREEMENT`; returns the agreement (None for a drafter without
    blocks, e.g. eagle3)."""
    import warnings

    if not hasattr(drafter, "train_blocks"):
        return None
    rows = [list(tokenizer.encode(t))[:48] for t in CHECK_TEXTS]
    agree = first_position_agreement(target, drafter, rows)
    if agree < MIN_FIRST_POSITION_AGREEMENT:
        warnings.warn(
            f"{where}: the drafter's first draft token agrees with the target on only {agree:.1%} of "
            "positions of plain text: it was probably made for another target or read in the wrong layout",
            stacklevel=2,
        )
    return agree
