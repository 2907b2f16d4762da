"""Gemma 2 and Gemma 3 text targets: the one decoder, configured by TargetConfig data.

Tiny random models written by transformers itself (4 layers, hidden 64, vocab 256, fp32, eager
attention, perturbed ``1 + w`` norms, alternating sliding / full layers with an 8-token window)
are loaded through the Hugging Face loader and compared with transformers' logits (max |diff| <=
1e-4) over 40 positions, past the window: Gemma 2 with attention and final soft-caps and a query
scale other than ``head_dim ** -0.5``; Gemma 3 with q/k norms, a local RoPE base on sliding layers
and linear RoPE scaling on full ones. Each Gemma field is shown to matter (turning it off moves
the logits). Greedy speculative decoding and the serving engine equal plain decoding; training
runs on a Gemma target; warm starts from Gemma layers are refused by name (Gemma 4: test_gemma4.py). Gemma 2
and Gemma 3 GGUFs written as llama.cpp's converter writes them give transformers' logits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.hf_io import load_hf_dir
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint
from dspark_jax.serving.engine import Request, SamplingParams
from tests.helpers.drafters import assert_same_outputs, bigram_drafter, random_drafter
from tests.helpers.engine_drive import chunked_engine, drive

pytestmark = pytest.mark.exactness

TOL = 1e-4
VOCAB, WINDOW, SEQ = 256, 8, 40
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}


def _gemma_config(kind: str, **extra):
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
                  initializer_range=0.1, attn_implementation="eager")  # fmt: skip
    if kind == "gemma2":
        kw = dict(query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
        return tr.Gemma2Config(**{**common, **kw, **extra})
    kw = dict(query_pre_attn_scalar=16, final_logit_softcapping=3.0, sliding_window_pattern=2)
    kw["rope_parameters"] = GEMMA3_ROPE
    return tr.Gemma3TextConfig(**{**common, **kw, **extra})


def _write(kind: str, path, **extra):
    """A tiny random Gemma 2 / Gemma 3 text model saved to ``path``; returns the fp32 torch model."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    model_cls = tr.Gemma2ForCausalLM if kind == "gemma2" else tr.Gemma3ForCausalLM
    model = model_cls(_gemma_config(kind, **extra)).eval()
    with torch.no_grad():  # Gemma norms are 1 + w: random w, so that a mis-mapped norm shows up
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.copy_(0.3 * torch.randn_like(prm))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``kind -> (kind, torch model, TargetConfig, params)``, each family written and loaded once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            model = _write(kind, path)
            cache[kind] = (kind, model, *load_hf_dir(path))
        return cache[kind]

    return get


@pytest.fixture(params=["gemma2", "gemma3"])
def family(request, written):
    return written(request.param)


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()


def _ids(n=SEQ, seed=3):
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def test_loader_reads_the_gemma_fields(family):
    kind, _, cfg, params = family
    assert cfg.norm_offset == 1.0 and cfg.embed_scale == np.float32(8.0) and cfg.mlp_activation == "gelu_tanh"
    assert cfg.sandwich_norms and cfg.tie_embeddings and cfg.final_logit_softcap == 3.0
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == WINDOW
    assert set(params["layers"]) >= {"post_attn_norm", "post_mlp_norm"}
    if kind == "gemma2":
        assert cfg.attn_logit_softcap == 4.0 and cfg.query_scale == pytest.approx(24**-0.5) and not cfg.qk_norm
    else:  # Gemma 3: q/k norms; query_pre_attn_scalar == head_dim is the default scale
        assert cfg.qk_norm and cfg.attn_logit_softcap is None and cfg.query_scale is None
        assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling.rope_type) == (50000.0, 1000.0, "linear")


def test_logits_match_transformers_past_the_window(family):
    """Cache-less, and through the KV cache (prefill 20, a 3-token block, then one token at a time)."""
    _, model, cfg, params = family
    ids = _ids()
    want = _hf_logits(model, ids)
    assert np.abs(want).max() > 1.0  # the final soft-cap (3.0) binds
    target = Target(cfg, params)
    pos = np.arange(SEQ, dtype=np.int32)[None]
    full = np.asarray(target(ids[None], pos).logits[0])
    np.testing.assert_allclose(full, want, atol=TOL, rtol=0)
    cache, parts, start = target.init_cache(1, SEQ), [], 0
    for n in (20, 3, 1, 1, SEQ - 25):
        out = target(ids[None, start : start + n], pos[:, start : start + n], cache)
        cache, start = out.cache, start + n
        parts.append(np.asarray(out.logits[0]))
    np.testing.assert_allclose(np.concatenate(parts), want, atol=TOL, rtol=0)


GEMMA2_OFF = {"norm_offset": 0.0, "embed_scale": 1.0, "mlp_activation": "silu", "sandwich_norms": None,
              "attn_logit_softcap": None, "final_logit_softcap": None, "query_scale": None}  # fmt: skip
GEMMA3_OFF = {"sliding_rope_theta": None, "rope_scaling": None, "qk_norm": False}


def test_every_gemma_field_matters(family):
    """Turning any one Gemma field off moves the logits by far more than the tolerance, so the parity
    test above checks each of them."""
    kind, _, cfg, params = family
    ids = _ids(24)
    pos = np.arange(24, dtype=np.int32)[None]
    base = np.asarray(Target(cfg, params)(ids[None], pos).logits[0])
    for field, off in {**GEMMA2_OFF, **(GEMMA3_OFF if kind == "gemma3" else {})}.items():
        if field == "sandwich_norms":  # the post-norms' weights w = 0 (a unit 1 + w norm) stand for "off"
            p = {**params, "layers": {**params["layers"], "post_attn_norm": 0 * params["layers"]["post_attn_norm"]}}
            moved = np.asarray(Target(cfg, p)(ids[None], pos).logits[0])
        elif getattr(cfg, field) == off:
            continue
        else:
            moved = np.asarray(Target(dataclasses.replace(cfg, **{field: off}), params)(ids[None], pos).logits[0])
        assert np.abs(moved - base).max() > 100 * TOL, field


@pytest.mark.parametrize(
    "kind,extra,match",
    [
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("gemma3", {"rope_parameters": {**GEMMA3_ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 1000.0}}},
         "RoPE scaling 'linear' on sliding layers"),
        ("gemma3", {"rope_parameters": {**GEMMA3_ROPE, "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                                          "rope_theta": 1e4}}},
         "RoPE scaling 'dynamic'"),
        ("gemma2", {"hidden_activation": "gelu"}, "activation 'gelu'"),
    ],
)  # fmt: skip
def test_refuses_what_it_does_not_implement(tmp_path, kind, extra, match):
    _write(kind, tmp_path, **extra)
    with pytest.raises(DSparkInputError, match=match) as e:
        load_hf_dir(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- decoding


def _target(written, kind):
    _, _, cfg, params = written(kind)
    return Target(cfg, params, fingerprint=params_fingerprint(params))


def _prompts(lengths):
    rng = np.random.default_rng(5)
    return [[1] + rng.integers(3, VOCAB, k - 1).tolist() for k in lengths]


def test_greedy_speculative_equals_plain(written):
    """Gemma 3 (per-layer RoPE, q/k norms, windows): verification blocks and rollbacks are exact."""
    target = _target(written, "gemma3")
    prompts = _prompts((SEQ, 13))
    ar = generate_autoregressive(target, prompts, max_new_tokens=20, cache_len=80)
    sp = generate_speculative(
        target, random_drafter(target, block_size=4), prompts, max_new_tokens=20, cache_len=80, num_speculative_tokens=4
    )
    assert_same_outputs(ar, sp)


def test_engine_equals_plain_decoding(written):
    """Packed decode steps and verification, one-shot and chunked prefill (12-token chunks), give
    plain decoding's tokens on the Gemma 2 target (soft-capped, scaled attention; windows)."""
    target = _target(written, "gemma2")
    drafter = bigram_drafter(target, block_size=3)
    eng = chunked_engine(target, drafter)
    prompts = _prompts((30, 21, 5))
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=12), f"g{i}") for i, p in enumerate(prompts)]
    ar = generate_autoregressive(target, prompts, max_new_tokens=12, cache_len=64)
    want = {r.request_id: (g.token_ids, g.finish_reason) for r, g in zip(reqs, ar.generations, strict=True)}
    for chunked in (False, True):
        assert drive(eng, reqs, chunked=chunked, slots=3) == want


def test_warm_start_from_gemma_layers_is_refused(written):
    from dspark_jax.training.warm_start import check_init_from_target_layers

    target = _target(written, "gemma3")
    drafter = random_drafter(target, block_size=4)
    with pytest.raises(DSparkInputError, match="Gemma"):
        check_init_from_target_layers(drafter, target, list(range(drafter.cfg.num_layers)))


def test_training_on_a_gemma_target_reduces_the_loss(written):
    """The trainer's path (tapped features, the soft-capped target distribution, the drafter's
    logits through the target head) runs on a Gemma target and learns."""
    from flax import nnx

    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.training.data import batches
    from dspark_jax.training.train_config import TrainConfig, drafter_config
    from dspark_jax.training.trainer import Trainer

    target = _target(written, "gemma3")
    cfg = TrainConfig.from_keys(steps=20, batch_size=4, anchors_per_seq=4, block_size=4, num_layers=1, markov_rank=8,
                      learning_rate=1e-2)  # fmt: skip
    tr = Trainer(cfg, target, DSparkDrafter(drafter_config(cfg, target), nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(3, VOCAB, (8, 32)).astype(np.int32), "lengths": np.full(8, 32, np.int32),
            "prompt_lengths": np.full(8, 4, np.int32)}  # fmt: skip
    it = batches(data, cfg.batch_size, seed=0)
    losses = [float(tr.step(next(it), s)[0].loss) for s in range(20)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_multimodal_gemma3_checkpoint_loads_its_text_model(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: the text model (``language_model.*``)
    loads and its text-only logits match transformers'; the vision tower is never read."""
    import torch
    import transformers as tr

    torch.manual_seed(1)
    text = _gemma_config("gemma3").to_dict()
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    c = tr.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
                        boi_token_index=253, eoi_token_index=254, attn_implementation="eager")  # fmt: skip
    model = tr.Gemma3ForConditionalGeneration(c).eval()
    with torch.no_grad():
        for n, prm in model.named_parameters():
            if "norm" in n and "vision" not in n:
                prm.copy_(0.3 * torch.randn_like(prm))
    model.save_pretrained(tmp_path)
    cfg, params = load_hf_dir(tmp_path)
    assert cfg.sandwich_norms and cfg.qk_norm and cfg.sliding_rope_theta == 1000.0
    assert cfg.final_logit_softcap is None  # Gemma3ForConditionalGeneration does not soft-cap its logits
    ids = _ids(24)
    ids = np.where(ids >= 253, ids - 100, ids)  # no image / begin- / end-of-image token: a text-only prompt
    got = np.asarray(Target(cfg, params)(ids[None], np.arange(24, dtype=np.int32)[None]).logits[0])
    np.testing.assert_allclose(got, _hf_logits(model, ids), atol=TOL, rtol=0)


def _write_gemma_tensors(w, model, arch):
    """``model``'s tensors into GGUF writer ``w`` as the converter writes them: names from gguf's own
    map, every ``*norm.weight`` stored with 1 added, no ``lm_head`` (tied); then the file is written."""
    import gguf

    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = t.float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(data, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_gemma3_gguf(model, path):
    """``model`` as an F32 ``gemma3`` GGUF the way convert_hf_to_gguf.py's Gemma3Model writes it: its
    metadata (no query scale, local RoPE base or layer pattern: llama.cpp fixes those)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])
    _write_gemma_tensors(w, model, gguf.MODEL_ARCH.GEMMA3)
    return path


def _write_gemma2_gguf(model, path, extra=lambda w: None):
    """``model`` as an F32 ``gemma2`` GGUF the way convert_hf_to_gguf.py's Gemma2Model writes it: no
    RoPE base (llama.cpp's default 1e4), query scale or layer pattern; both soft-caps and the window.
    ``extra(w)`` adds metadata or tensors before the file is written."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    extra(w)
    _write_gemma_tensors(w, model, gguf.MODEL_ARCH.GEMMA2)
    return path


def test_gemma3_gguf_matches_transformers(tmp_path):
    """A Gemma 3 text model through GGUF as llama.cpp's converter writes it (norms stored as 1 + w;
    llama.cpp's fixed rules: every 6th layer full, local RoPE base 1e4, query scale head_dim ** -0.5)
    gives transformers' logits past the window, cache-less and through the KV cache, and the same
    TargetConfig as the Hugging Face directory. A pattern key is refused (llama.cpp ignores it)."""
    import dataclasses as dc

    import gguf

    from dspark_jax.models.gguf_io import gguf_config, load_gguf

    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    model = _write("gemma3", tmp_path / "hf", num_hidden_layers=7, final_logit_softcapping=None,
                   sliding_window_pattern=6, rope_parameters=rope, layer_types=None)  # fmt: skip
    hf_cfg, _ = load_hf_dir(tmp_path / "hf")
    assert hf_cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    cfg, params = load_gguf(_write_gemma3_gguf(model, tmp_path / "g.gguf"))
    assert dc.replace(cfg, name=hf_cfg.name, max_position=hf_cfg.max_position, eos_ids=hf_cfg.eos_ids,
                      bos_id=hf_cfg.bos_id) == hf_cfg  # fmt: skip
    _assert_gguf_logits(cfg, params, model)
    w = gguf.GGUFWriter(str(tmp_path / "p.gguf"), "gemma3")
    w.add_block_count(7)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_feed_forward_length(96)
    w.add_sliding_window(8)
    w.add_sliding_window_pattern([True] * 7)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DSparkInputError, match="sliding_window_pattern is not supported"):
        gguf_config(tmp_path / "p.gguf")


def _assert_gguf_logits(cfg, params, model):
    """Cache-less, and through the KV cache (prefill 20, a 3-token block, then single tokens)."""
    ids = _ids()
    want = _hf_logits(model, ids)
    target = Target(cfg, params)
    pos = np.arange(SEQ, dtype=np.int32)[None]
    np.testing.assert_allclose(np.asarray(target(ids[None], pos).logits[0]), want, atol=TOL, rtol=0)
    cache, parts, start = target.init_cache(1, SEQ), [], 0
    for n in (20, 3, 1, SEQ - 24):
        out = target(ids[None, start : start + n], pos[:, start : start + n], cache)
        cache, start = out.cache, start + n
        parts.append(np.asarray(out.logits[0]))
    np.testing.assert_allclose(np.concatenate(parts), want, atol=TOL, rtol=0)


def test_gemma2_gguf_matches_transformers(tmp_path):
    """A Gemma 2 model through GGUF as llama.cpp's converter writes it (norms stored as 1 + w, both
    soft-caps binding; llama.cpp's fixed rules: even layers slide, query scale head_dim ** -0.5, RoPE
    base 1e4) gives transformers' logits past the window, and the Hugging Face directory's
    TargetConfig. What llama.cpp reads otherwise than transformers is refused by name."""
    import dataclasses as dc

    import gguf

    from dspark_jax.models.gguf_io import gguf_config, load_gguf

    model = _write("gemma2", tmp_path / "hf", query_pre_attn_scalar=16)
    hf_cfg, _ = load_hf_dir(tmp_path / "hf")
    cfg, params = load_gguf(_write_gemma2_gguf(model, tmp_path / "g.gguf"))
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.query_scale) == (4.0, 3.0, None)
    assert dc.replace(cfg, name=hf_cfg.name, max_position=hf_cfg.max_position, eos_ids=hf_cfg.eos_ids,
                      bos_id=hf_cfg.bos_id) == hf_cfg  # fmt: skip
    _assert_gguf_logits(cfg, params, model)
    refusals = [
        (lambda w: w.add_sliding_window_pattern([True, False] * 2), "sliding_window_pattern is not supported"),
        (
            lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(2.0)),
            "RoPE scaling is not supported for gemma2",
        ),
        (lambda w: w.add_tensor("output.weight", np.zeros((VOCAB, 64), np.float32)), "output.weight"),
    ]
    for i, (extra, match) in enumerate(refusals):
        with pytest.raises(DSparkInputError, match=match):
            gguf_config(_write_gemma2_gguf(model, tmp_path / f"r{i}.gguf", extra))
    # llama.cpp's rules for what a file leaves out, and the 46-layer (27B) query scale (H / heads) ** -0.5
    w = gguf.GGUFWriter(str(tmp_path / "27b.gguf"), "gemma2")
    for add, value in ((w.add_block_count, 46), (w.add_embedding_length, 64), (w.add_head_count, 2),
                       (w.add_key_length, 16), (w.add_value_length, 16), (w.add_feed_forward_length, 96)):  # fmt: skip
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    big = gguf_config(tmp_path / "27b.gguf")
    assert (big.attn_logit_softcap, big.final_logit_softcap, big.sliding_window) == (50.0, 30.0, 4096)
    assert big.query_scale == pytest.approx(32**-0.5) and big.layer_types[:2] == ("sliding_attention", "full_attention")
