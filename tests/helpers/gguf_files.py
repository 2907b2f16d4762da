"""A writer of tiny GGUF files from canonical params, for the loader and parity tests."""

from __future__ import annotations

import gguf
import numpy as np

from dspark_jax.config import TargetConfig


def write_gguf(path, arch, cfg: TargetConfig, p: dict, permute: bool, tokenizer_kv):
    """Writes canonical params (``random_params`` / a loader's layout) as an F32 GGUF at ``path``
    with architecture ``arch`` (``permute``: llama's q/k rows back to adjacent pairs);
    ``tokenizer_kv(writer)`` adds the tokenizer's (and any other) metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    tokenizer_kv(w)

    def to_adjacent(m, n):  # inverse of adjacent_to_half on [out, in]
        out, d = m.shape
        return m.reshape(n, 2, out // n // 2, d).transpose(0, 2, 1, 3).reshape(out, d)

    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # fmt: skip
    w.add_tensor("token_embd.weight", p["embed"])
    for i in range(cfg.num_layers):
        for k, a in p["layers"].items():
            m = a[i] if a.ndim == 2 else np.ascontiguousarray(a[i].T)
            if permute and k in ("wq", "wk"):
                m = to_adjacent(m, cfg.num_heads if k == "wq" else cfg.num_kv_heads)
            w.add_tensor(f"blk.{i}.{names[k]}.weight", np.ascontiguousarray(m))
    w.add_tensor("output_norm.weight", p["final_norm"])
    if "lm_head" in p:
        w.add_tensor("output.weight", np.ascontiguousarray(p["lm_head"].T))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
