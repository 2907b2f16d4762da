"""Target families beyond plain-RoPE Llama / Qwen3: RoPE scaling and Qwen2 biases, exact or refused.

Tiny random models written by transformers itself (2 layers, hidden 64, vocab 256, fp32, perturbed
norms and biases) are loaded through the Hugging Face loader and through GGUF files written with
the ``gguf`` package the way llama.cpp's ``convert_hf_to_gguf.py`` writes them, and compared with
transformers' logits (max |diff| <= 1e-4) over 64 positions, past ``original_max_position_embeddings``
(32): llama3-, linear- and yarn-scaled Llama, Qwen2.5 (q/k/v biases) with yarn. Greedy speculative
decoding equals plain decoding on the Qwen2 target. What is not implemented exactly is refused by
name (sliding windows, soft-caps, unknown GGUF metadata, unread tensors).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.models.gguf_io import load_gguf
from dspark_jax.models.hf_io import load_hf_dir
from tests.helpers.tiny import cached_logits, hf_logits

pytestmark = pytest.mark.exactness

TOL = 1e-4
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ORIG, SEQ = 256, 64, 4, 2, 16, 32, 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIG, "rope_theta": 10000.0}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "rope_theta": 10000.0}
CASES = {"llama-llama3": ("llama", LLAMA3), "llama-linear": ("llama", LINEAR), "llama-yarn": ("llama", YARN),
         "qwen2-yarn": ("qwen2", YARN)}  # fmt: skip


def make_hf(kind: str, rope: dict | None, path, seed: int = 0, **extra):
    """A tiny random transformers model of ``kind`` (llama / qwen2 / qwen3) saved to ``path``."""
    import torch
    import transformers as tr

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=4 * ORIG, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, initializer_range=0.15, **extra)  # fmt: skip
    if rope is not None:
        common["rope_parameters"] = dict(rope)
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    model = getattr(tr, f"{family}ForCausalLM")(getattr(tr, f"{family}Config")(**common))
    with torch.no_grad():  # non-trivial norms and biases, so that a mis-mapped one shows up
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.copy_(1.0 + 0.3 * torch.randn_like(prm))
            elif n.endswith(".bias"):
                prm.copy_(0.3 * torch.randn_like(prm))
    model.save_pretrained(path, safe_serialization=True)
    return model.float().eval()


def jax_logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    """Full causal forward ``[T, V]``; checks that the KV-cache path (prefill 40, then 3, 1 and the
    rest) and the serving engine's packed pass (8 tokens after the prefill) give the same logits."""
    from dspark_jax.models.target import Target

    target = Target(cfg, params)
    # prefill, a verification-sized block, one token, the rest
    full, prefilled = cached_logits(target, ids, (40, 3, 1, len(ids) - 44), TOL)
    k = np.arange(8, dtype=np.int32)
    packed = target.forward_packed(ids[40:48], 0 * k, k, 40 + k, prefilled, num_rows=1, width=8)
    np.testing.assert_allclose(np.asarray(packed.logits), full[40:48], atol=TOL, rtol=0)
    return full


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, SEQ).astype(np.int32)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``get(name)`` -> ``(transformers model, its directory)`` of :data:`CASES`, each written once."""
    made = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            made[name] = (make_hf(*CASES[name], path), path)
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_matches_transformers_past_original_context(hf_models, name):
    model, path = hf_models(name)
    cfg, params = load_hf_dir(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == CASES[name][1]["rope_type"]
    assert cfg.qkv_bias == name.startswith("qwen2")
    ids = tokens()
    want, got = hf_logits(model, ids), jax_logits(cfg, params, ids)
    assert np.abs(want).max() > 0.5, "logits too flat for the comparison to mean anything"
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


# ----------------------------------------------------------------------------- GGUF, as llama.cpp writes it


def llama3_rope_factors(rope: dict) -> np.ndarray:
    """``rope_freqs.weight`` as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors computes it
    (its ``old_context_len`` is the model's original context, 8192 for every Llama 3.x)."""
    base, dim = rope["rope_theta"], HEAD_DIM
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], ORIG
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(model, rope: dict, arch: str, path, extra_kv=None, extra_tensors=()):
    """The HF ``model`` as an F32 GGUF: metadata, tensor names and the llama q/k row permutation of
    convert_hf_to_gguf.py (TextModel.set_gguf_parameters, LlamaModel.permute, Qwen2Model)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(HEAD_DIM)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, value in (extra_kv or {}).items():
        w.add_uint32(key, value)
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope))
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}

    def permute(m, n):  # LlamaModel.permute: half-rotation rows -> adjacent pairs
        return m.reshape(n, 2, m.shape[0] // n // 2, *m.shape[1:]).swapaxes(1, 2).reshape(m.shape)

    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            for suffix in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{hf}.{suffix}")
                if t is None:
                    continue
                if arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                    t = permute(t, c.num_attention_heads if hf == "self_attn.q_proj" else c.num_key_value_heads)
                w.add_tensor(f"blk.{i}.{gg}.{suffix}", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for name, t in extra_tensors:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", ["llama-llama3", "qwen2-yarn", "llama-linear"])
def test_gguf_matches_transformers_past_original_context(name, tmp_path):
    """A Llama 3.1-style GGUF (rope_freqs.weight) and a Qwen2.5 one (biases, yarn metadata) decode
    like transformers; before RoPE scaling was read from GGUF, the llama3 file loaded with plain
    frequencies (max |diff| 5.3 here, 4.6 within the first 32 positions)."""
    kind, rope = CASES[name]
    model = make_hf(kind, rope, tmp_path / "hf", seed=3)
    arch = "llama" if kind == "llama" else kind
    cfg, params = load_gguf(write_gguf(model, rope, arch, tmp_path / "m.gguf"))
    assert cfg.rope_scaling is not None and cfg.qkv_bias == (kind == "qwen2")
    assert cfg.rope_scaling.rope_type == ("freq_factors" if rope["rope_type"] == "llama3" else rope["rope_type"])
    ids = tokens(1)
    want, got = hf_logits(model, ids), jax_logits(cfg, params, ids)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_attention_bias_matches_transformers(kind, tmp_path):
    """``attention_bias: true`` in a Llama / Qwen3 config (biases on q/k/v and o_proj) gives transformers'
    logits from the Hugging Face directory and, for Llama, from a GGUF written as llama.cpp's converter
    writes it (q/k biases permuted like their rows, ``attn_output.bias``). It used to be refused."""
    import dataclasses

    model = make_hf(kind, None, tmp_path / "hf", seed=5, attention_bias=True)
    cfg, params = load_hf_dir(tmp_path / "hf")
    assert cfg.qkv_bias and cfg.o_bias and params["layers"]["bo"].shape == (2, HIDDEN)
    ids = tokens(2)
    want = hf_logits(model, ids)
    assert np.abs(jax_logits(cfg, params, ids) - want).max() <= TOL
    if kind == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        gcfg, gparams = load_gguf(write_gguf(model, rope, "llama", tmp_path / "m.gguf"))
        same = dict(name=cfg.name, max_position=cfg.max_position, bos_id=cfg.bos_id, eos_ids=cfg.eos_ids)
        assert dataclasses.replace(gcfg, **same) == cfg
        assert np.abs(jax_logits(gcfg, gparams, ids) - want).max() <= TOL


# ----------------------------------------------------------------------------- refusals


def _edit_config(path, **changes):
    c = json.loads((path / "config.json").read_text())
    c.update(changes)
    (path / "config.json").write_text(json.dumps(c))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_hf("qwen3", None, path)
    return path


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"layer_types": ["full_attention", "chunked_attention"], "sliding_window": 8}, "chunked_attention"),
        ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
        ({"final_logit_softcapping": 30.0}, "final logit soft-capping"),
        ({"mlp_bias": True}, "MLP biases"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": ORIG}},
         "RoPE scaling 'longrope'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial rotary"),
    ],
)  # fmt: skip
def test_hf_refuses_what_it_does_not_implement(qwen3_dir, tmp_path, changes, match):
    """Math the loader does not implement is refused by name (sliding layers are implemented:
    tests/unit/models/test_sliding_window.py)."""
    import shutil

    path = tmp_path / "m"
    shutil.copytree(qwen3_dir, path)
    _edit_config(path, **changes)
    with pytest.raises(DSparkInputError, match=match) as e:
        load_hf_dir(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_hf_refuses_unread_tensor(qwen3_dir, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(qwen3_dir, path)
    (f,) = path.glob("*.safetensors")
    t = load_file(f)
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(HIDDEN, np.float32)
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(DSparkInputError, match="o_proj.bias' is not read"):
        load_hf_dir(path)


def test_gguf_refuses_unknown_metadata_and_tensors(tmp_path):
    model = make_hf("llama", LINEAR, tmp_path / "hf", seed=4)
    p = write_gguf(model, LINEAR, "llama", tmp_path / "a.gguf", extra_kv={"llama.expert_shared_count": 1})
    with pytest.raises(DSparkInputError, match="llama.expert_shared_count is not supported"):
        load_gguf(p)
    extra = [("blk.0.ffn_up.bias", np.zeros(96, np.float32))]
    p = write_gguf(model, LINEAR, "llama", tmp_path / "b.gguf", extra_tensors=extra)
    with pytest.raises(DSparkInputError, match="ffn_up.bias' is not read"):
        load_gguf(p)
    extra = [("blk.0.attn_output.bias", np.zeros(HIDDEN, np.float32))]  # read when every layer has one
    p = write_gguf(model, LINEAR, "llama", tmp_path / "c.gguf", extra_tensors=extra)
    with pytest.raises(DSparkInputError, match="lacks tensor 'blk.1.attn_output.bias'"):
        load_gguf(p)


def test_rope_scaling_round_trips_through_config_dict():
    from dspark_jax.config import DrafterConfig, RopeScaling, TargetConfig

    cfg = TargetConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=4, max_position=16,
                       rope_scaling=RopeScaling("freq_factors", freq_factors=(1.0, 8.0)))  # fmt: skip
    back = TargetConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and hash(back) == hash(cfg)
    dcfg = DrafterConfig.for_target(cfg, taps=(0,))
    assert dcfg.rope_scaling == cfg.rope_scaling
    assert DrafterConfig.from_dict(json.loads(json.dumps(dcfg.to_dict()))) == dcfg


# ----------------------------------------------------------------------------- speculative == plain


def test_qwen2_yarn_greedy_speculative_equals_autoregressive(hf_models):
    """Greedy speculative decoding with a small random drafter equals plain decoding on the Qwen2.5
    target (biases, yarn), past the original context."""
    from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
    from dspark_jax.models.target import Target
    from tests.helpers.tiny import tiny_drafter

    cfg, params = load_hf_dir(hf_models("qwen2-yarn")[1])
    target = Target(cfg, params)
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, VOCAB, n)] for n in (30, 12, 5)]
    kw = dict(max_new_tokens=[24, 30, 9], temperature=0, stop_ids=())
    ar = generate_autoregressive(target, prompts, **kw)
    d = tiny_drafter(target)
    sp = generate_speculative(target, d, prompts, num_speculative_tokens=d.cfg.block_size, **kw)
    for a, s in zip(ar.generations, sp.generations, strict=True):
        assert s.token_ids == a.token_ids and len(a.token_ids) > 1


def test_drafter_of_a_scaled_target_keeps_its_rope_through_export(hf_models, tmp_path):
    """A new drafter copies its target's RoPE scaling (as DeepSpec's drafters do); DeepSpec's
    format writes it as ``rope_scaling`` and reads it back unchanged."""
    from flax import nnx

    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.drafters.format_export import export_to_format
    from dspark_jax.models.target import Target

    cfg, params = load_hf_dir(hf_models("qwen2-yarn")[1])
    target = Target(cfg, params)
    dcfg = DrafterConfig.for_target(cfg, taps=(0,), num_layers=1, block_size=4, markov_rank=8)
    assert dcfg.rope_scaling == cfg.rope_scaling and cfg.rope_scaling.rope_type == "yarn"
    out, _ = export_to_format(build_drafter(dcfg, nnx.Rngs(0)), target, "deepspec", tmp_path / "ds")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"]["rope_type"] == "yarn"
    assert written["rope_scaling"]["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
    loaded, _ = load_drafter(out, target=target)
    assert loaded.cfg.rope_scaling == cfg.rope_scaling


@pytest.mark.parametrize(
    "rope",
    [
        LLAMA3,
        dict(LLAMA3, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0, rope_theta=500000.0),
        LINEAR,
        YARN,
        dict(YARN, beta_fast=16.0, beta_slow=2.0, truncate=False, rope_theta=1e6),
        dict(YARN, mscale=1.0, mscale_all_dim=0.5),
        dict(YARN, attention_factor=0.8),
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG},  # legacy rope_scaling key
    ],
)
def test_rope_table_equals_transformers(rope):
    """The frequency table and cos/sin factor equal transformers' ROPE_INIT_FUNCTIONS for each setting."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dspark_jax.models.rope import hf_rope_scaling, rope_table

    hc = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                     max_position_embeddings=4 * ORIG, rope_scaling=dict(rope))  # fmt: skip
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[hc.rope_parameters["rope_type"]](hc, "cpu")
    theta, scaling = hf_rope_scaling(dict(rope), max_position=4 * ORIG, where="test")
    inv, scale = rope_table(theta if theta is not None else 10000.0, HEAD_DIM, scaling)
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=2e-6)
    assert scale == pytest.approx(want_scale, rel=1e-6)


def test_speculators_verifier_section_names_each_familys_architecture():
    """An export's ``verifier.architectures`` is the target's own transformers class, for every family
    the loaders read (it said ``Qwen3ForCausalLM`` for any target with q/k norms, Gemma 3 included)."""
    import dataclasses
    from types import SimpleNamespace

    from dspark_jax.drafters.format_export import _verifier_architectures
    from dspark_jax.models.presets import builtin_target_config

    def arch(name, **fields):
        cfg = dataclasses.replace(builtin_target_config(name), **fields)
        return _verifier_architectures(SimpleNamespace(cfg=cfg))  # pyright: ignore[reportArgumentType]

    assert arch("qwen3-8b") == ["Qwen3ForCausalLM"]
    assert arch("qwen3-8b", qk_norm=False, qkv_bias=True) == ["Qwen2ForCausalLM"]
    assert arch("llama-3.1-8b-instruct") == ["LlamaForCausalLM"]
    assert arch("llama-3.1-8b-instruct", qkv_bias=True, o_bias=True) == ["LlamaForCausalLM"]
    windows = dict(layer_types=("sliding_attention",) * 32, sliding_window=4096)
    assert arch("llama-3.1-8b-instruct", **windows) == ["MistralForCausalLM"]
    mixed = dict(layer_types=("sliding_attention", "full_attention") * 16, sliding_window=4096)
    assert arch("llama-3.1-8b-instruct", **mixed) == ["MinistralForCausalLM"]
    assert arch("gemma-3-12b") == ["Gemma3ForCausalLM"]
    assert arch("gemma-3-12b", qk_norm=False, attn_logit_softcap=50.0) == ["Gemma2ForCausalLM"]
    assert arch("gemma-4-12b") == ["Gemma4ForCausalLM"]
    assert arch("qwen3-30b-a3b") == ["Qwen3MoeForCausalLM"]
