"""Gemma 4 text targets (``gemma4_text``): the one decoder with Gemma 4's layers as TargetConfig data.

Tiny random models written by transformers itself (``Gemma4TextConfig`` / ``Gemma4ForCausalLM``,
4 layers, hidden 64, vocab 256, fp32, eager attention, random ``x * w`` norm weights and layer
scalars, an 8-token window) are loaded through the Hugging Face loader and compared with
transformers' logits over 40 positions, past the window, cache-less and through the KV cache:

* ``k_eq_v``: sliding / full layers alternating (pattern period 2), full layers with head width 32
  and 1 KV head against the sliding layers' 16 and 2, keys as values, proportional RoPE with a
  partial factor 0.5 and factor 2, final soft-cap;
* ``v_proj``: three sliding layers then a full one (one period of 4 layers), a value projection on
  the full layer, default RoPE everywhere, no soft-cap;
* ``unified``: ``k_eq_v``'s layers written by ``Gemma4UnifiedForCausalLM`` (``gemma4_unified_text``,
  the text decoder of google/gemma-4-12B-it).

Greedy speculative decoding equals plain decoding; the taps are transformers' hidden states; the
trainer learns on a Gemma 4 target; a multimodal ``gemma4`` checkpoint loads as its text model; what
is not implemented (per-layer input embeddings, KV-shared layers, the MoE block, other RoPE types,
the serving engine) is refused in one line. On device meshes: tests/integration/test_gemma4_mesh.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.hf_io import hf_target_config, load_hf_dir
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint
from tests.helpers.drafters import assert_same_outputs, random_drafter
from tests.helpers.tiny import cached_logits, hf_logits

pytestmark = pytest.mark.exactness

TOL = 1e-4
VOCAB, WINDOW, SEQ = 256, 8, 40
VARIANTS = {
    "k_eq_v": dict(
        layer_types=["sliding_attention", "full_attention"] * 2,
        attention_k_eq_v=True,
        final_logit_softcapping=3.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.5, rope_theta=5e4, factor=2.0),
        },
    ),
    "v_proj": dict(
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        attention_k_eq_v=False,
        final_logit_softcapping=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 5e4},
        },
    ),
}
VARIANTS["unified"] = VARIANTS["k_eq_v"]


def _config(unified=False, **extra):
    import transformers as tr

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              sliding_window=WINDOW, hidden_size_per_layer_input=0, max_position_embeddings=128,
              rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              attn_implementation="eager")  # fmt: skip
    if unified:
        del kw["hidden_size_per_layer_input"]
        return tr.Gemma4UnifiedTextConfig(**{**kw, **extra})
    return tr.Gemma4TextConfig(**{**kw, **extra})


def _write(path, unified=False, **extra):
    """A tiny random Gemma 4 text model saved to ``path``; returns the fp32 torch model."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    cls = tr.Gemma4UnifiedForCausalLM if unified else tr.Gemma4ForCausalLM
    model = cls(_config(unified, **extra)).eval()
    with torch.no_grad():  # x * w norms and layer scalars near 1 but not 1: a mis-mapped one shows up
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.copy_(1 + 0.3 * torch.randn_like(prm))
        for n, buf in model.named_buffers():
            if n.endswith("layer_scalar"):
                buf.copy_(0.5 + torch.rand_like(buf))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``variant -> (torch model, TargetConfig, params)``, each written and loaded once."""
    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (_write(path, name == "unified", **VARIANTS[name]), *load_hf_dir(path))
        return cache[name]

    return get


def _ids(n=SEQ, seed=3):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def test_loader_reads_the_gemma4_fields(written):
    _, cfg, params = written("k_eq_v")
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.global_head_dim, cfg.global_num_kv_heads) == (16, 2, 32, 1)
    assert cfg.k_eq_v and cfg.v_norm and cfg.layer_scalar and cfg.norm_offset == 0.0 and cfg.query_scale == 1.0
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling.partial_rotary_factor) == (5e4, 1000.0, 0.5)
    assert cfg.rope_scaling.rope_type == "proportional" and cfg.rope_scaling.factor == 2.0
    layers = params["layers"]
    assert layers["wq"].shape == (2, 64, 64) and layers["g_wq"].shape == (2, 64, 128) and "g_wv" not in layers
    assert layers["g_wk"].shape == (2, 64, 32) and layers["layer_scalar"].shape == (4,)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_past_the_window(written, name):
    """Cache-less, and through the KV cache (prefill 17, one token, then a block of 22): both within
    1e-4 of transformers, 32 positions past the 8-token window; each cache has its layers' shape."""
    model, cfg, params = written(name)
    ids = _ids()
    want = hf_logits(model, ids)
    full, cache = cached_logits(Target(cfg, params), ids, (17, 1, SEQ - 18), TOL)
    np.testing.assert_allclose(full, want, atol=TOL, rtol=0)
    (ks, kf), _ = cache
    assert ks.shape == (cfg.layer_types.count("sliding_attention"), 1, SEQ, 2, 16)
    assert kf.shape == (cfg.layer_types.count("full_attention"), 1, SEQ, cfg.global_num_kv_heads, 32)


def test_taps_are_the_hidden_states_of_transformers(written):
    """Tap ``i < L - 1`` is transformers' ``hidden_states[i + 1]`` (after the layer scalar)."""
    import torch

    model, cfg, params = written("k_eq_v")
    ids = _ids(12)
    with torch.no_grad():
        hs = model(torch.tensor(ids[None]), output_hidden_states=True).hidden_states
    out = Target(cfg, params)(ids[None], np.arange(12, dtype=np.int32)[None], taps=(0, 1, 2))
    want = np.concatenate([hs[i + 1][0].numpy() for i in (0, 1, 2)], axis=-1)
    np.testing.assert_allclose(np.asarray(out.features[0]), want, atol=TOL, rtol=0)


def test_greedy_speculative_equals_plain(written):
    """Verification blocks and rollbacks over both caches are exact (prompts past the window)."""
    _, cfg, params = written("k_eq_v")
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, VOCAB, k - 1).tolist() for k in (SEQ, 13)]
    ar = generate_autoregressive(target, prompts, max_new_tokens=20, cache_len=80)
    sp = generate_speculative(
        target, random_drafter(target, block_size=4), prompts, max_new_tokens=20, cache_len=80, num_speculative_tokens=4
    )
    assert_same_outputs(ar, sp)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"hidden_size_per_layer_input": 16}, "per-layer input embeddings"),
        ({"num_kv_shared_layers": 2}, "KV-shared layers"),
        ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 1, "moe_intermediate_size": 8},
         "mixture-of-experts block"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e3},
                              "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "RoPE type 'linear' on sliding_attention layers"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
                              "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                                 "original_max_position_embeddings": 64}}},
         "RoPE type 'yarn' on full_attention layers"),
        ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ],
)  # fmt: skip
def test_refuses_what_it_does_not_implement(extra, match):
    with pytest.raises(DSparkInputError, match=match) as e:
        hf_target_config(_config(**{**VARIANTS["v_proj"], **extra}), where="gemma4/config.json", name="g4")
    assert "gemma4/config.json" in str(e.value) and "\n" not in str(e.value)


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A ``gemma4`` (Gemma4ForConditionalGeneration) checkpoint: its text model (``model.language_model.*``),
    the final soft-cap applied as transformers' class applies it; logits within 1e-4."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    text = _config(**VARIANTS["k_eq_v"])
    model = tr.Gemma4ForConditionalGeneration(tr.Gemma4Config(text_config=text.to_dict(), vision_config=None,
                                                                 audio_config=None)).eval()  # fmt: skip
    model.save_pretrained(tmp_path)
    cfg, params = load_hf_dir(tmp_path)
    assert cfg == hf_target_config(text, where="x", name=tmp_path.name) and cfg.final_logit_softcap == 3.0
    ids = _ids(16)
    got = Target(cfg, params)(ids[None], np.arange(16, dtype=np.int32)[None]).logits[0]
    np.testing.assert_allclose(np.asarray(got), hf_logits(model, ids), atol=TOL, rtol=0)


def test_engine_refuses_a_gemma4_target(written):
    """The serving engine's packed passes are not implemented for Gemma 4: a one-line refusal."""
    from dspark_jax.serving.engine import Engine, EngineConfig

    _, cfg, params = written("v_proj")
    target = Target(cfg, params)
    with pytest.raises(DSparkInputError, match="serving engine does not support Gemma 4") as e:
        Engine(target, None, EngineConfig(num_slots=2, cache_len=32, policy="plain", prefill_chunk_tokens=0))
    assert "\n" not in str(e.value)
    with pytest.raises(DSparkInputError, match="packed pass does not support Gemma 4"):
        target.forward_packed(*(np.zeros(2, np.int32),) * 4, target.init_cache(2, 8), num_rows=2, width=1)


def test_training_on_a_gemma4_target_reduces_the_loss(written):
    """The trainer's path (tapped features of both layer kinds, the soft-capped target distribution,
    the drafter's logits through the tied head) runs on a Gemma 4 target and learns."""
    from flax import nnx

    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.training.data import batches
    from dspark_jax.training.train_config import TrainConfig, drafter_config
    from dspark_jax.training.trainer import Trainer

    _, cfg, params = written("k_eq_v")
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    tc = TrainConfig.from_keys(steps=12, batch_size=4, anchors_per_seq=4, block_size=4, num_layers=1, markov_rank=8,
                     learning_rate=1e-2, taps=(0, 1, 3), drafter_arch="interop")  # fmt: skip
    tr = Trainer(tc, target, DSparkDrafter(drafter_config(tc, target), nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(3, VOCAB, (8, 24)).astype(np.int32), "lengths": np.full(8, 24, np.int32),
            "prompt_lengths": np.full(8, 4, np.int32)}  # fmt: skip
    it = batches(data, tc.batch_size, seed=0)
    losses = [float(tr.step(next(it), s)[0].loss) for s in range(12)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_gguf_refuses_gemma4_by_architecture(tmp_path):
    import gguf

    from dspark_jax.models.gguf_io import load_gguf

    w = gguf.GGUFWriter(str(tmp_path / "g4.gguf"), "gemma4")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DSparkInputError, match="GGUF architecture 'gemma4' is not supported"):
        load_gguf(tmp_path / "g4.gguf")


def test_trains_and_exports_deepseeks_gemma4_drafter(written, tmp_path):
    """``drafter_arch`` defaults to DeepSeek's Gemma 4 layout for a Gemma 4 target: draft layers of the
    target's full-attention shape, its own copies of the target's embedding and soft-capped head, which
    training leaves bit-identical (no update, no weight decay); ``--format deepspec`` writes a
    ``Gemma4DSparkModel`` that loads back to the same parameters, and greedy speculative == plain."""
    import json

    import jax
    from flax import nnx

    from dspark_jax.commands.export import main as export_main
    from dspark_jax.drafters.checkpoint import export_drafter, load_drafter
    from dspark_jax.training.data import batches
    from dspark_jax.training.pipeline import _build_trainer
    from dspark_jax.training.train_config import TrainConfig, drafter_config

    _, cfg, params = written("k_eq_v")
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    tc = TrainConfig.from_keys(steps=3, batch_size=4, anchors_per_seq=4, block_size=4, num_layers=1, markov_rank=8,
                     learning_rate=1e-2, weight_decay=0.5, taps=(0, 3), grad_accum_steps=2)  # fmt: skip
    dcfg = drafter_config(tc, target)
    shape = (dcfg.head_dim, dcfg.num_kv_heads, dcfg.k_eq_v, dcfg.final_logit_softcap, dcfg.embed_scale)
    assert dcfg.own_embeddings and dcfg.rope_scaling == cfg.rope_scaling and shape == (32, 1, True, 3.0, 8.0)
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(3, VOCAB, (8, 24)).astype(np.int32), "lengths": np.full(8, 24, np.int32),
            "prompt_lengths": np.full(8, 4, np.int32)}  # fmt: skip
    tr = _build_trainer(tc, target, dcfg, data, None)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
    it = batches(data, tc.batch_size, seed=0)
    assert all(np.isfinite(float(tr.step(next(it), s)[0].loss)) for s in range(tc.steps))
    drafter = tr.drafter()
    np.testing.assert_array_equal(np.asarray(drafter.embed[...]), np.asarray(target.embed[...]))
    np.testing.assert_array_equal(np.asarray(drafter.lm_head[...]), np.asarray(target.lm_head_weight()))
    assert not np.array_equal(np.asarray(drafter.fc[...]), before["fc"])  # the rest trains
    export_drafter(drafter, tmp_path / "run")  # the run's export, then python -m dspark_jax.export
    out = tmp_path / "ds"
    assert export_main([str(tmp_path / "run"), "--format", "deepspec", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma4DSparkModel"]
    loaded, _ = load_drafter(out, target=target)
    mine, theirs = nnx.to_pure_dict(nnx.state(drafter, nnx.Param)), nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompts = [[1] + rng.integers(3, VOCAB, k - 1).tolist() for k in (SEQ, 13)]
    ar = generate_autoregressive(target, prompts, max_new_tokens=16, cache_len=80)
    n_spec = loaded.cfg.block_size
    assert_same_outputs(
        ar,
        generate_speculative(target, loaded, prompts, max_new_tokens=16, cache_len=80, num_speculative_tokens=n_spec),
    )


def test_gemma4_drafter_arch_refusals(written):
    """``drafter_arch=gemma4`` needs a Gemma 4 target and the format's shape (full vocabulary, the
    target's width, DSpark); ``auto`` picks it for Gemma 4 DSpark drafters only."""
    from dspark_jax.config import DrafterConfig, TargetConfig

    _, cfg, _ = written("k_eq_v")
    assert DrafterConfig.for_target(cfg, arch="auto").own_embeddings
    assert not DrafterConfig.for_target(cfg, arch="auto", variant="dflash").own_embeddings
    llama = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position=64)  # fmt: skip
    assert not DrafterConfig.for_target(llama, arch="auto").own_embeddings
    with pytest.raises(DSparkInputError, match="needs a Gemma 4 target"):
        DrafterConfig.for_target(llama, arch="gemma4")
    with pytest.raises(DSparkInputError, match="does not take draft_vocab_size; use drafter_arch=interop") as e:
        DrafterConfig.for_target(cfg, arch="auto", draft_vocab_size=32)
    assert "\n" not in str(e.value)
