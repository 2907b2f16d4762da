"""Tokenizers: llama2.c (run.c algorithm), GGUF byte-level BPE (SmolLM2, also as an HF folder), Hugging Face."""

from __future__ import annotations

import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.models.tokenizer import Llama2cTokenizer

ROUND_TRIP = [
    "Once upon a time",
    "Hello, world! It's 2024-01-15 and π≈3.14159.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n  indented",
    "unicode: héllo wörld, 日本語, Ελληνικά, emoji 🙂🚀",
    "digits 0123456789 and 1,000,000",
]
CHATML = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


# ----------------------------------------------------------------------------- llama2.c


@pytest.fixture(scope="module")
def tok512(stories260k_dir):
    return Llama2cTokenizer.from_file(stories260k_dir / "tok512.bin")


def runc_encode_reference(tok: Llama2cTokenizer, text: str) -> list[int]:
    """Literal transcription of run.c's encode(): O(n^2) rescans, no heap."""
    lookup = {p: i for i, p in reversed(list(enumerate(tok.pieces)))}
    ids = [lookup[b" "]] if text else []
    for ch in text:
        b = ch.encode()
        ids += [lookup[b]] if b in lookup else [x + 3 for x in b]
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            j = lookup.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if j is not None and tok.scores[j] > best:
                best, best_i, best_id = tok.scores[j], i, j
        if best_i < 0:
            return [1] + ids
        ids[best_i : best_i + 2] = [best_id]


def test_llama2c_golden(tok512):
    assert tok512.vocab_size == 512
    assert tok512.bos_id == 1 and tok512.eos_ids == (2,)
    assert tok512.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok512.encode("Once upon a time", add_bos=False) == [403, 407, 261, 378]
    assert tok512.encode("") == [1]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_llama2c_round_trip(tok512, text):
    assert tok512.decode(tok512.encode(text)) == text


def test_llama2c_decode_rules(tok512):
    # BOS/EOS decode to nothing; the space after BOS is stripped only right after BOS.
    assert tok512.decode([1, 403, 2]) == "Once"
    assert tok512.decode([403]) == " Once"
    # Byte fallback: a character absent from the vocabulary -> its UTF-8 bytes + 3.
    ids = tok512.encode("🙂", add_bos=False)
    assert ids[1:] == [b + 3 for b in "🙂".encode()]
    assert tok512.decode(ids) == " 🙂"
    assert tok512.id_to_piece(403) == " Once"


def test_llama2c_heap_merge_matches_runc(tok512, stories260k_dir):
    text_file = stories260k_dir.parents[1] / "text" / "tinystories_val_head.txt"
    texts = ROUND_TRIP + ([text_file.read_text()[:1500]] if text_file.exists() else [])
    for t in texts:
        assert tok512.encode(t) == runc_encode_reference(tok512, t), t[:40]


def test_llama2c_no_chat_template(tok512):
    assert not tok512.has_chat_template
    with pytest.raises(DSparkInputError):
        tok512.apply_chat_template([{"role": "user", "content": "hi"}])


def test_llama2c_bad_file(tmp_path):
    bad = tmp_path / "tok.bin"
    bad.write_bytes(b"\x07\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\xff\x00\x00\x00ab")
    with pytest.raises(DSparkInputError, match="not a valid llama2.c tokenizer"):
        Llama2cTokenizer.from_file(bad)


# ----------------------------------------------------------------------------- SmolLM2 GGUF BPE


def test_smollm2_golden(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.eos_ids == (2,)
    assert tok.encode("Once upon a time") == [6403, 1980, 253, 655]
    assert tok.encode("Once upon a time", add_bos=True) == [1, 6403, 1980, 253, 655]


def test_smollm2_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(CHATML)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == CHATML
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is the capital of France?\nassistant\n"
    assert tok.id_to_piece(1) == "<|im_start|>" and tok.id_to_piece(2) == "<|im_end|>"


def test_smollm2_digits_split(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("2024")
    assert len(ids) == 4 and [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_gguf_target_hf_dir_matches_the_gguf(smollm2_reader, smollm2_tokenizer, tmp_path):
    """Config of the GGUF's hyperparameters; tokenizer encoding as ours and llama.cpp's ``smollm`` pre-type
    (digits split first: ``"\\n    288"`` is ``"\\n    "`` and three digits, not ``"\\n   "``, ``" "``, digits)."""
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.llama_cpp_files import gguf_target_hf_dir
    from dspark_jax.models.gguf_io import gguf_config

    out = gguf_target_hf_dir("smollm2-135m-instruct", tmp_path / "hf")
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


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm2_round_trip(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_smollm2_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.has_chat_template
    # The GGUF's template inserts SmolLM's default system prompt when none is given.
    assert tok.apply_chat_template(msgs) == SMOL_SYSTEM + CHATML
    with_system = [{"role": "system", "content": "Be brief."}] + msgs
    assert tok.apply_chat_template(with_system) == "<|im_start|>system\nBe brief.<|im_end|>\n" + CHATML
    assert (
        tok.apply_chat_template(msgs, add_generation_prompt=False)
        == SMOL_SYSTEM + CHATML.rsplit("<|im_start|>assistant\n", 1)[0]
    )


# ----------------------------------------------------------------------------- Hugging Face


def test_hf_tokenizer(tmp_path, write_tiny_hf_tokenizer):
    from dspark_jax.models.tokenizer import HFTokenizer

    write_tiny_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.vocab_size == 8 and tok.bos_id == 1 and tok.eos_ids == (2,)
    assert tok.encode("hello world") == [3, 4]
    assert tok.encode("hello world", add_bos=True) == [1, 3, 4]
    assert tok.decode([3, 4]) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_hf_tokenizer_missing(tmp_path):
    from dspark_jax.models.tokenizer import HFTokenizer

    with pytest.raises(DSparkInputError):
        HFTokenizer(tmp_path)


# ----------------------------------------------------------------------------- incremental detokenization

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# The SmolLM2 example: "café", the Japanese word for cat and a smiley emoji.
MULTIBYTE = "Write the word 'café' and the Japanese word for cat: 猫 (ねこ), then a smiley emoji 😊. Ω≈ç√ 🚀"
TEXTS = st.text(alphabet=st.sampled_from(list("ab c.\né猫ねこ😊🚀Ωç√ü") + ["\u0301"]), max_size=40)


def check_every_cut(tok, ids):
    """At every cut the streamed text is decode_complete's, holds no U+FFFD from a split
    character and is a prefix of the full text; the whole stream equals decode()."""
    from dspark_jax.models.tokenizer import decode_complete

    full = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in full
    d, acc = tok.detokenizer(), ""
    for k, i in enumerate(ids, 1):
        acc += d.step(i)
        assert "\ufffd" not in acc and full.startswith(acc), (k, acc)
        assert acc == decode_complete(tok, ids[:k])
    assert acc == full


def test_llama2c_detokenizer_every_cut(tok512):
    ids = tok512.encode(MULTIBYTE, add_bos=False)
    assert len(ids) > len(MULTIBYTE.encode()) // 4  # byte fallback: characters split over tokens
    check_every_cut(tok512, ids)
    check_every_cut(tok512, [1] + tok512.encode(MULTIBYTE, add_bos=False))  # the space after BOS is dropped


def test_smollm2_detokenizer_every_cut(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(MULTIBYTE)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some tokens hold only part of a character
    check_every_cut(tok, ids)
    check_every_cut(tok, tok.encode(CHATML) + ids)  # special tokens are skipped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_property_llama2c_detokenizer(tok512, text):
    check_every_cut(tok512, tok512.encode(text, add_bos=False))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(text=TEXTS)
def test_property_smollm2_detokenizer(smollm2_tokenizer, text):
    check_every_cut(smollm2_tokenizer, smollm2_tokenizer.encode(text))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 511), max_size=30))
def test_property_llama2c_stream_equals_decode_on_any_ids(tok512, ids):
    """Arbitrary ids (invalid UTF-8 included): the stream plus a final flush is decode()."""
    d = tok512.detokenizer()
    assert d.extend(ids) + d.utf8.decode(b"", final=True) == tok512.decode(ids, skip_special_tokens=True)


def test_hf_detokenizer(tmp_path, write_tiny_hf_tokenizer):
    from dspark_jax.models.tokenizer import HFTokenizer, _WindowDetokenizer

    write_tiny_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    ids = [3, 4, 5, 6, 7]
    d = tok.detokenizer()
    assert "".join(d.step(i) for i in ids) == tok.decode(ids, skip_special_tokens=True)
    w = _WindowDetokenizer(tok, True)
    assert w.extend(ids) == tok.decode(ids, skip_special_tokens=True)


def test_window_detokenizer_holds_split_characters(tok512):
    from dspark_jax.models.tokenizer import _WindowDetokenizer

    ids = tok512.encode(MULTIBYTE * 3, add_bos=False)
    sizes = []

    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            sizes.append(len(ids))
            return tok512.decode(ids, skip_special_tokens)

    w, acc = _WindowDetokenizer(Counting(), True), ""
    for i in ids:
        acc += w.step(i)
        assert "\ufffd" not in acc and (MULTIBYTE * 3).startswith(acc.lstrip(" "))
    assert acc == tok512.decode(ids)
    assert max(sizes) <= 8 < len(ids)  # a short window per step, never the whole output
