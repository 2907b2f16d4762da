"""The SmolLM2 Hugging Face folder llama.cpp's converter reads beside a drafter (benchmarks.smollm2_hf)."""

from __future__ import annotations

from benchmarks.smollm2_hf import smollm2_hf_dir

from .test_tokenizer import CHATML, ROUND_TRIP, SMOL_SYSTEM


def test_smollm2_hf_dir_matches_the_gguf(smollm2_reader, smollm2_tokenizer, tmp_path):
    """Config of the GGUF's hyperparameters; tokenizer encoding as ours and llama.cpp's ``smollm`` pre-type
    (digits split first: ``"\\n    288"`` is ``"\\n    "`` and three digits, not ``"\\n   "``, ``" "``, digits)."""
    from transformers import AutoConfig, AutoTokenizer

    from dspark_jax.models.gguf_io import gguf_config

    out = smollm2_hf_dir(tmp_path / "hf", smollm2_reader)
    hf_cfg, cfg = AutoConfig.from_pretrained(str(out)), gguf_config(smollm2_reader)
    assert hf_cfg.architectures == ["LlamaForCausalLM"] and hf_cfg.tie_word_embeddings == cfg.tie_embeddings
    assert (hf_cfg.vocab_size, hf_cfg.hidden_size, hf_cfg.num_hidden_layers) == (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_layers,
    )
    assert (hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads) == (cfg.num_heads, cfg.num_kv_heads)
    assert hf_cfg.rope_parameters["rope_theta"] == cfg.rope_theta
    hf = AutoTokenizer.from_pretrained(str(out))
    for text in [*ROUND_TRIP, SMOL_SYSTEM + CHATML, "def f(x):\n    return x\n>>> f(4)\n    288\n"]:
        assert hf.encode(text) == list(smollm2_tokenizer.encode(text)), text
    assert hf.encode("(4)\n    288") == [24, 36, 25, 2367, 34, 40, 40]
