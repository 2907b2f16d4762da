"""DeepSeek's Gemma 4 drafters (DeepSpec's ``Gemma4DSparkModel``) as new drafters of a Gemma 4 target:
the :class:`~dspark_jax.config.DrafterConfig` fields of ``DrafterConfig.for_target(arch="gemma4")``."""

from __future__ import annotations

from typing import Any

from dspark_jax.errors import DSparkInputError

# Gemma 4 draft layers and a frozen copy of the target's embedding (scaled) and LM head (soft-capped),
# beside the formats' q/k-norm, mask row and Markov / confidence heads (INTEROP_ARCH).
GEMMA4_LAYERS: dict[str, Any] = {"own_embeddings": True, "mlp_activation": "gelu_tanh", "sandwich_norms": True,
                                 "layer_scalar": True, "v_norm": True, "query_scale": 1.0}  # fmt: skip


def gemma4_fields(target: Any, variant: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The :class:`DrafterConfig` fields of DeepSeek's Gemma 4 drafter for ``target`` (a
    :class:`~dspark_jax.config.TargetConfig`, untyped here: that module imports this one): DeepSpec's
    ``build_draft_config`` keeps the target's text config, so every draft layer is the target's
    full-attention layer (``global_head_dim``; ``num_global_key_value_heads`` with keys as values,
    else ``num_key_value_heads``; the full layers' RoPE), with the target's final soft-cap and an
    embedding scaled by sqrt(H). Errors: :meth:`~dspark_jax.config.DrafterConfig.for_target`."""
    if not target.is_gemma4:
        raise DSparkInputError(f"drafter_arch=gemma4 needs a Gemma 4 target; {target.name!r} is not one")
    if target.layer_types and "full_attention" not in target.layer_types:
        raise DSparkInputError("drafter_arch=gemma4: the target has no full-attention layer for the draft layers")
    unsupported = {"variant": variant != "dspark", "width": overrides.get("width", 0),
                   "draft_vocab_size": overrides.get("draft_vocab_size", 0)}  # fmt: skip
    if bad := [k for k, v in unsupported.items() if v]:
        raise DSparkInputError(
            f"drafter_arch=gemma4 (a Gemma 4 target's default; DeepSeek's Gemma4DSparkModel: a full-vocabulary "
            f"DSpark drafter as wide as its target) does not take {', '.join(bad)}; use drafter_arch=interop for these"
        )
    kv = (target.global_num_kv_heads or target.num_kv_heads) if target.k_eq_v else target.num_kv_heads
    return dict(
        GEMMA4_LAYERS,
        mask_token_id=target.default_mask_token_id(),
        head_dim=target.global_head_dim or target.head_dim,
        num_kv_heads=kv,
        k_eq_v=target.k_eq_v,
        embed_scale=float(target.hidden_size) ** 0.5,
        final_logit_softcap=target.final_logit_softcap,
    )
