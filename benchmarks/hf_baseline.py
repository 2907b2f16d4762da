"""The outside baseline of the speed benchmarks: ``transformers`` (PyTorch, fp32) on the same weights
as the JAX target (:func:`hf_llama_from_params` converts the project's canonical parameters,
whatever file they came from: llama2.c, GGUF or safetensors), its logits against the target's
(:func:`hf_parity`) and its batch-1 ``generate`` timed (:func:`hf_generate`). Torch and
transformers are imported when called."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def hf_llama_config(cfg):
    """The ``transformers`` ``LlamaConfig`` of a target config (Llama family without q/k-norm).

    Raises:
      ValueError: a Qwen3-style (q/k-norm) or Qwen2-style (q/k/v bias) target, or one with RoPE scaling.
    """
    from transformers import LlamaConfig

    if cfg.qk_norm or cfg.qkv_bias or cfg.rope_scaling is not None:
        raise ValueError("only plain-RoPE Llama targets are converted here (no q/k-norm, q/k/v biases, RoPE scaling)")
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_theta,  # pyright: ignore[reportCallIssue]  (a **kwargs field of LlamaConfig)
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_id,
        eos_token_id=list(cfg.eos_ids) or None,
        pad_token_id=(list(cfg.eos_ids) or [0])[0],
    )


def hf_llama_from_params(cfg, params):
    """A ``transformers`` ``LlamaForCausalLM`` (fp32, eval mode) holding the same weights.

    Args:
      cfg: :class:`~dspark_jax.config.TargetConfig` (Llama family without q/k-norm).
      params: canonical parameters (kernels ``[in, out]`` stacked per layer, RoPE in the
        Hugging Face ``rotate_half`` layout, as every loader of :mod:`dspark_jax.models.model_io`
        produces).
    Raises:
      ValueError: as :func:`hf_llama_config`.
    """
    import torch
    from transformers import LlamaForCausalLM

    hc = hf_llama_config(cfg)
    model = LlamaForCausalLM(hc).float().eval()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32)))
    lay = params["layers"]
    sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"])}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t(np.asarray(params["lm_head"]).T)
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(lay["attn_norm"][i])
        sd[p + "post_attention_layernorm.weight"] = t(lay["mlp_norm"][i])
        for k, n in names.items():
            sd[p + n + ".weight"] = t(np.asarray(lay[k][i]).T)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight") and "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


def hf_parity(model, target, ids: Sequence[int]) -> float:
    """Max |logit difference| between transformers and the JAX target on one prompt."""
    import torch

    with torch.no_grad():
        want = model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    got = np.asarray(target(jnp.asarray([list(ids)], jnp.int32), pos).logits[0])
    return float(np.max(np.abs(got - want)))


def hf_generate(
    model, prompt: Sequence[int], max_new_tokens: int, temperature: float, seed: int, eos_ids: Sequence[int]
) -> tuple[list[int], float]:
    """``model.generate`` at batch 1; returns (generated ids, seconds)."""
    import torch

    torch.manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    kw = (
        dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids) or None,
            pad_token_id=(list(eos_ids) or [0])[0],
            **kw,
        )
    secs = time.perf_counter() - t0
    return out[0, ids.shape[1] :].tolist(), secs
