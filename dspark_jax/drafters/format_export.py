"""Writing a drafter in the field's checkpoint formats (DeepSpec's ``Qwen3DSparkModel`` and
``Gemma4DSparkModel``, speculators' ``dspark`` / ``dflash``), the inverse of :mod:`dspark_jax.drafters.formats`.

:func:`export_blockers` lists what a drafter holds that a format cannot (the first architecture's
learned mask vector, no q/k-norm, a width other than the target's, ...): such a drafter is refused,
never approximated. :func:`export_to_format` writes ``config.json`` + ``model.safetensors`` as
those loaders expect them (``sample_from_anchor`` and ``draft_vocab_size`` always written: a
speculators config without ``sample_from_anchor`` is served in the wrong layout by older vLLM),
taking the embedding / LM-head copies and the restricted ``lm_head`` from the target, plus
``dspark_jax.json`` beside them: the calibration temperatures and biases (engines ignore the file; vLLM
calibrates online) and the drafter's own config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax.drafters.gemma4_format as gemma4_format
from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.base import check_compatible
from dspark_jax.drafters.formats import HEAD_TENSORS, LAYER_TENSORS, NORM_TENSORS
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.rope import hf_rope_dict
from dspark_jax.models.target import Target

EXPORT_FORMATS = ("deepspec", "speculators")
SIDECAR = "dspark_jax.json"
SPECULATORS_VERSION = "0.9.0"


def export_blockers(cfg: DrafterConfig, fmt: str, target_layers: int) -> list[str]:
    """Why a drafter cannot be written in format ``fmt`` (empty: it can, exactly).

    Args:
      cfg: the drafter's config.
      fmt: one of :data:`EXPORT_FORMATS`.
      target_layers: the target's depth L. Tap L - 1 (the last layer's output before the final
        norm) is DeepSpec's ``target_layer_ids`` L - 1 as its target cache stores it and
        speculators' ``aux_hidden_state_layer_ids`` L as its vLLM extraction stores it.
    """
    if cfg.variant == "eagle3":
        return ["an eagle3 drafter has no DSpark/DFlash checkpoint format"]
    out = []
    gemma = {k: getattr(cfg, k) for k in ("sandwich_norms", "layer_scalar", "v_norm", "k_eq_v", "query_scale")}
    if cfg.own_embeddings:  # DeepSpec's Gemma4DSparkModel
        out += gemma4_format.blockers(cfg) + ([] if fmt == "deepspec" else [f"{fmt}'s format has no own embedding"])
    elif any(gemma.values()) or cfg.mlp_activation != "silu" or cfg.final_logit_softcap is not None:
        out.append("its layers are Gemma layers without their own embedding (no format holds them)")
    if not cfg.qk_norm:
        out.append("its layers have no q/k-norm (the first architecture: retrain with drafter_arch=interop)")
    if cfg.mask_token_id < 0:
        out.append("its mask slots read a learned vector, not a token's embedding row (mask_token_id)")
    if cfg.model_width != cfg.hidden_size:
        out.append(
            f"its width {cfg.model_width} differs from the target's hidden size {cfg.hidden_size} "
            "(train with drafter_width=0, the target's width, for a drafter the formats hold)"
        )
    if cfg.markov and cfg.confidence_input == "head" and cfg.markov_head != "vanilla":
        out.append(f"its confidence head reads the {cfg.markov_head} head's output, the formats' read W1[x]")
    if cfg.markov and cfg.markov_w1_size != cfg.vocab_size:
        out.append("its Markov W1 has rows for the draft vocabulary only, the formats' have one per target token")
    if cfg.markov and cfg.markov_head not in HEAD_TENSORS:
        out.append(f"the {cfg.markov_head} Markov head has no counterpart in the formats")
    if max(cfg.taps) >= target_layers:
        out.append(f"it taps layer {max(cfg.taps)} of a {target_layers}-layer target")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "freq_factors":
        out.append("its RoPE frequency factors (a GGUF target's rope_freqs.weight) have no Hugging Face rope type")
    if fmt == "deepspec" and cfg.draft_vocab_size:
        out.append("DeepSpec's format has no draft vocabulary (use --format speculators)")
    if fmt == "deepspec" and cfg.variant == "dflash":
        out.append(
            "DeepSpec's DFlash is anchor-first; this dflash drafter has the 1 + N layout (use --format speculators)"
        )
    return out


def _np(x: Any, dtype: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(jnp.asarray(x, dtype)))


def _confidence_head(drafter: Any) -> tuple[bool, bool]:
    """``(enable_confidence_head, confidence_head_with_markov)`` of a dspark drafter: the head
    of an imported DFlash (``w = 0``, ``b = +inf``) is no head. Beside a vanilla Markov head the
    head is always written with its Markov half, zeros included (the same confidences in every
    reader): llama.cpp loads a confidence head only in that shape (``[d + r, 1]``) and refuses
    the file otherwise. Beside a gated or rnn head (which llama.cpp does not serve) a zero Markov
    half is left out, as DeepSpec writes it."""
    cfg = drafter.cfg
    if not cfg.has_confidence:
        return False, False
    w, b = np.asarray(drafter.conf_w[...]), float(np.asarray(drafter.conf_b[...]))
    if np.isinf(b) and not np.any(w):
        return False, False
    return True, bool(cfg.markov and (cfg.markov_head == "vanilla" or np.any(w[cfg.model_width :])))


def format_tensors(drafter: Any, target: Target | None, fmt: str, dtype: Any) -> dict[str, np.ndarray]:
    """The safetensors of ``drafter`` in format ``fmt`` (names as :mod:`~dspark_jax.drafters.formats` reads them)."""
    cfg = drafter.cfg
    layers = {k: v[...] for k, v in drafter.layers.items()}
    t: dict[str, np.ndarray] = {}
    if cfg.own_embeddings:
        t.update(gemma4_format.tensors(drafter, lambda a: _np(a, dtype)))
    for ours, theirs in () if cfg.own_embeddings else LAYER_TENSORS.items():
        for i in range(cfg.num_layers):
            w = layers[ours][i]
            t[f"layers.{i}.{theirs}.weight"] = _np(w if ours in NORM_TENSORS else w.T, dtype)
    t["fc.weight"] = _np(drafter.fc[...].T, dtype)
    t["hidden_norm.weight"] = _np(drafter.ctx_norm[...], dtype)
    t["norm.weight"] = _np(drafter.final_norm[...], dtype)
    if cfg.markov:
        head = drafter.markov_head
        t["markov_head.markov_w1.weight"] = _np(head.w1[...], dtype)
        t["markov_head.markov_w2.weight"] = _np(head.w2[...].T, dtype)
        for ours, theirs in HEAD_TENSORS[cfg.markov_head].items():
            a = getattr(head, ours)[...]
            t[f"markov_head.{theirs}"] = _np(a.T if a.ndim == 2 else a, dtype)
    enabled, with_markov = _confidence_head(drafter)
    if enabled:
        w = drafter.conf_w[...]
        t["confidence_head.proj.weight"] = _np(w if with_markov else w[: cfg.model_width], dtype)[None, :]
        t["confidence_head.proj.bias"] = _np(drafter.conf_b[...], dtype).reshape(1)
    if fmt == "deepspec" and not cfg.own_embeddings:
        assert target is not None  # export_to_format: only a drafter with its own embedding goes without
        t["embed_tokens.weight"] = _np(target.embed[...], dtype)
        t["lm_head.weight"] = _np(target.lm_head_weight().T, dtype)
    elif cfg.draft_vocab_size and target is not None:
        ids = np.asarray(drafter.draft_vocab, np.int64)
        t["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
        t2d = np.zeros((cfg.vocab_size,), bool)
        t2d[ids] = True
        t["t2d"] = t2d
        t["lm_head.weight"] = _np(target.lm_head_rows(jnp.asarray(ids, jnp.int32)), dtype)
    return t


def _layer_config(cfg: DrafterConfig, target: Target, dtype: Any) -> dict[str, Any]:
    """The draft layers' Qwen3 config (DeepSpec's top level, speculators' ``transformer_layer_config``)."""
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": target.cfg.max_position,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": hf_rope_dict(cfg.rope_scaling, where="drafter export"),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "tie_word_embeddings": False,
        "bos_token_id": target.cfg.bos_id,
        "eos_token_id": list(target.cfg.eos_ids),
        "torch_dtype": jnp.dtype(dtype).name,
    }


def format_config(
    drafter: Any, target: Target | None, fmt: str, dtype: Any, verifier: str, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``config.json`` of ``drafter`` in format ``fmt`` (``verifier``: speculators' verifier name;
    ``base``: a Gemma 4 drafter's source config, whose keys the drafter does not read are kept)."""
    cfg = drafter.cfg
    enabled, with_markov = _confidence_head(drafter)
    markov = {"markov_rank": cfg.markov_rank} if cfg.variant == "dspark" else {}
    if cfg.markov:
        markov["markov_head_type"] = cfg.markov_head
    anchor_first = cfg.variant == "dspark"
    block = cfg.block_size if anchor_first else cfg.block_size + 1
    if fmt == "deepspec":
        keys = dict(
            num_target_layers=cfg.target_num_layers if target is None else target.cfg.num_layers,
            block_size=block,
            target_layer_ids=list(cfg.taps),
            mask_token_id=cfg.mask_token_id,
            enable_confidence_head=enabled,
            **markov,
        )
        if enabled:
            keys["confidence_head_with_markov"] = with_markov
        if cfg.own_embeddings:
            if target is not None:
                keys.update(max_position_embeddings=target.cfg.max_position, bos_token_id=target.cfg.bos_id)
            return gemma4_format.config(cfg, base, keys, jnp.dtype(dtype).name)
        assert target is not None  # export_to_format
        return {**_layer_config(cfg, target, dtype), "architectures": ["Qwen3DSparkModel"], **keys}
    assert target is not None  # export_to_format
    kind = "dspark" if anchor_first and (cfg.markov or enabled) else "dflash"
    out = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": _layer_config(cfg, target, dtype),
        "draft_vocab_size": cfg.draft_size,
        "block_size": block,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": [t + 1 for t in cfg.taps],
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": anchor_first,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": _verifier_architectures(target)},
        },
        "speculators_version": SPECULATORS_VERSION,
    }
    if kind == "dspark":
        out.update(enable_confidence_head=enabled, confidence_head_with_markov=with_markov, **markov)
    else:  # all layers full attention: causal only where vLLM's dflash reading says so (docs/interop.md#format-details)
        out["sliding_window_non_causal"] = True
    return out


def _verifier_architectures(target: Target) -> list[str]:
    """The target's transformers architecture, as speculators' ``verifier`` section names it.

    Raises:
      DSparkInputError: a mixture-of-experts target with q/k/v biases (no such family is loaded).
    """
    c = target.cfg
    if c.num_experts:  # Qwen3-MoE has q/k-norm; Mixtral (GGUF ``llama`` with experts) has neither it nor biases
        if c.qkv_bias or c.o_bias:
            raise DSparkInputError("a mixture-of-experts target with q/k/v biases has no verifier architecture here")
        return ["Qwen3MoeForCausalLM"] if c.qk_norm else ["MixtralForCausalLM"]
    if c.grouped_attention:
        return ["Gemma4ForCausalLM"]
    if c.norm_offset:  # Gemma's 1 + w norms: Gemma 3 has q/k norms, Gemma 2 soft-caps instead
        return ["Gemma3ForCausalLM"] if c.qk_norm else ["Gemma2ForCausalLM"]
    if c.qk_norm:
        return ["Qwen3ForCausalLM"]
    if c.qkv_bias and not c.o_bias:  # Qwen2's o_proj has no bias; a Llama with attention_bias has one
        return ["Qwen2ForCausalLM"]
    if c.has_sliding_layers:  # Ministral: Mistral with some full-attention layers
        return ["MistralForCausalLM"] if None not in c.layer_windows() else ["MinistralForCausalLM"]
    return ["LlamaForCausalLM"]


def export_to_format(
    drafter: Any,
    target: Target | None,
    fmt: str,
    out: str | Path,
    *,
    dtype: Any = None,
    verifier: str | None = None,
    base_config: dict[str, Any] | None = None,
) -> tuple[Path, list[str]]:
    """Writes ``drafter`` in format ``fmt`` to the directory ``out`` (created; files overwritten).

    Args:
      drafter: a dspark/dflash drafter (:func:`~dspark_jax.drafters.checkpoint.load_drafter`).
      target: the target it was trained for (checked with
        :func:`~dspark_jax.drafters.base.check_compatible`): supplies the embedding / LM-head
        copies (DeepSpec) and the restricted ``lm_head`` of a draft vocabulary (speculators).
        None only for a drafter with its own embedding and head (DeepSeek's Gemma 4 drafters).
      fmt: ``"deepspec"`` or ``"speculators"``.
      out: the directory to write.
      dtype: tensor dtype (default: the drafter's), e.g. ``jnp.bfloat16``.
      verifier: speculators' ``verifier.name_or_path`` (default: the target's name).
      base_config: a Gemma 4 drafter's source ``config.json``: the keys its layers do not read
        (token ids, context length, the target's sliding-layer settings) are written back as they were.
    Returns:
      ``(out, notes)``: notes for the user (e.g. a head vLLM does not serve).
    Raises:
      DSparkInputError: an unknown format, a drafter for another target, or one the format
        cannot express (:func:`export_blockers`, all reasons in one line).
    """
    if fmt not in EXPORT_FORMATS:
        raise DSparkInputError(f"unknown format {fmt!r}: use one of {', '.join(EXPORT_FORMATS)}")
    if target is None and not drafter.cfg.own_embeddings:
        raise DSparkInputError("exporting this drafter needs its target (for the embedding and LM head)")
    if target is not None:
        check_compatible(target, drafter)
    depth = drafter.cfg.target_num_layers if target is None else target.cfg.num_layers
    blockers = export_blockers(drafter.cfg, fmt, depth or max(drafter.cfg.taps) + 1)
    if blockers:
        raise DSparkInputError(f"this drafter cannot be written in the {fmt} format: {'; '.join(blockers)}")
    from safetensors.numpy import save_file

    dtype = jnp.dtype(dtype or drafter.dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.cfg
    conf = format_config(drafter, target, fmt, dtype, verifier or (target.cfg.name if target else ""), base_config)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(format_tensors(drafter, target, fmt, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    side = {
        "format": f"{fmt} export of a dspark_jax drafter",
        "calibration": list(drafter.calibration) if drafter.calibration else None,
        "calibration_greedy": list(drafter.calibration_greedy) if drafter.calibration_greedy else None,
        "calibration_bias": list(drafter.calibration_bias) if drafter.calibration_bias else None,
        "calibration_greedy_bias": list(drafter.calibration_greedy_bias) if drafter.calibration_greedy_bias else None,
        "config": cfg.to_dict(),
        "params": int(sum(np.size(x) for x in _leaves(drafter))),
    }
    (out / SIDECAR).write_text(json.dumps(side, indent=2))
    notes = []
    if fmt == "deepspec" and target is not None and not target.cfg.tie_embeddings:
        notes.append(
            "llama.cpp drafts with the wrong head from this DeepSpec export of an untied target (its converter drops "
            "the full-vocabulary lm_head, its loader then uses embed_tokens): for llama.cpp use --format speculators"
        )
    if cfg.markov and cfg.markov_head != "vanilla":
        notes.append(
            f"the {cfg.markov_head} Markov head loads in speculators and DeepSpec; vLLM serves vanilla heads only"
        )
    return out, notes


def _leaves(drafter: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(nnx.state(drafter, nnx.Param))
