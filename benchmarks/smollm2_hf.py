"""SmolLM2-135M-Instruct as the Hugging Face folder llama.cpp's converter needs beside a drafter.

``convert_hf_to_gguf.py DRAFTER --target-model-dir DIR`` reads two things from ``DIR`` for a
DSpark / DFlash drafter (``conversion/qwen.py``, ``DFlashModel``): ``config.json`` (the target's
architecture, whose tokenizer handler it then runs, and its RoPE for the M-RoPE check) and the
tokenizer (``tokenizer.json`` through ``AutoTokenizer``; its pre-tokenizer is identified by
hashing the tokens of a test text, here as ``smollm``). It reads no target weights unless the
drafter ships a ``mask_embedding.pt`` (ours do not: the drafter's GGUF borrows the target's
embedding and head at run time). The target itself runs from a GGUF (the bundled Q4_1 file, or an
F32 GGUF of its dequantized weights), so the folder holds only the config and the tokenizer.

The tokenizer is the one dspark_jax reads from the GGUF
(:func:`dspark_jax.models.tokenizer.gguf_tokenizer`: digits split one by one before the GPT-2
regex, as SmolLM2's own ``tokenizer.json`` and llama.cpp's ``smollm`` pre-type do). transformers
5's ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` drops that digit split (``"\\n    288"``
becomes ``"\\n   "``, ``" "``, digits instead of ``"\\n    "``, digits), and reads the whole file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def smollm2_hf_dir(out: Path, gguf: Any = None) -> Path:
    """``out`` with ``config.json`` (transformers' ``LlamaConfig`` of the GGUF's hyperparameters)
    and the GGUF's tokenizer as transformers saves it (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``); no weights. Written once (a folder with both files is reused).

    ``gguf``: SmolLM2's GGUF, a path or an open ``gguf.GGUFReader`` (default: the bundled Q4_1
    file, :func:`~dspark_jax.models.presets.smollm2_gguf_path`).

    Raises:
      DSparkInputError: the bundled GGUF is not installed (``gguf`` not given), or the file's
        tokenizer is not byte-level BPE.
    """
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.gguf_io import open_gguf
    from dspark_jax.models.presets import smollm2_gguf_path
    from dspark_jax.models.tokenizer import BPETokenizer, gguf_tokenizer

    out = Path(out)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    reader = gguf if hasattr(gguf, "fields") else open_gguf(smollm2_gguf_path() if gguf is None else gguf)
    kv = lambda k: reader.fields[k].contents()
    tok = gguf_tokenizer(reader)
    if not isinstance(tok, BPETokenizer):
        raise DSparkInputError("smollm2_hf_dir: the GGUF's tokenizer is not byte-level BPE (tokenizer.ggml.model gpt2)")
    ids = {k: int(kv(f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos", "unknown", "padding")}
    pieces = {k: tok.id_to_piece(i) for k, i in ids.items()}
    cfg = LlamaConfig(
        vocab_size=int(kv("llama.vocab_size")),
        hidden_size=int(kv("llama.embedding_length")),
        intermediate_size=int(kv("llama.feed_forward_length")),
        num_hidden_layers=int(kv("llama.block_count")),
        num_attention_heads=int(kv("llama.attention.head_count")),
        num_key_value_heads=int(kv("llama.attention.head_count_kv")),
        max_position_embeddings=int(kv("llama.context_length")),
        rms_norm_eps=float(kv("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(kv("llama.rope.freq_base")),  # pyright: ignore[reportCallIssue]  (a **kwargs field)
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
    )
    cfg.architectures = ["LlamaForCausalLM"]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok.tok,
        bos_token=pieces["bos"],
        eos_token=pieces["eos"],
        unk_token=pieces["unknown"],
        pad_token=pieces["padding"],
        chat_template=tok.chat_template,
    )
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    cfg.save_pretrained(str(out))
    return out
