"""Sliding-window attention (Mistral, Qwen3 with sliding layers) against transformers, on tiny
random fp32 models transformers itself writes (eager attention), at positions well past the window:

* the loaders read the window (Mistral's ``sliding_window``; Qwen3's ``use_sliding_window`` /
  ``max_window_layers`` / ``layer_types``; GGUF ``{arch}.attention.sliding_window[_pattern]``);
  a Qwen3 config with sliding layers used to load as full attention;
* logits within 1e-4 of transformers through the cache-less pass (prefill / training), the cached
  prefill and cached one-token decode steps;
* the cached attention backends (xla blocked loop with a window-skipping start, the cuDNN
  arguments run through XLA, the Pallas paged view through JAX's reference kernel with a static
  window) equal dense windowed attention; ``pallas_tpu`` is refused by name for mixed layers;
* greedy speculative decoding equals plain decoding, and the serving engine (one-shot and chunked
  prefill, packed steps) equals plain decoding, on the windowed Mistral target.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import TargetConfig
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.attention import attend, cudnn_attention, pallas_tpu_attention, select_backend
from dspark_jax.models.gguf_io import gguf_config, load_gguf
from dspark_jax.models.hf_io import load_hf_dir
from dspark_jax.models.layers import attention, cached_attention
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint
from dspark_jax.serving.engine import Request, SamplingParams
from tests.helpers.drafters import assert_same_outputs, bigram_drafter, random_drafter
from tests.helpers.engine_drive import chunked_engine, drive

WINDOW, PROMPT, DECODE = 8, 40, 6


def _write(kind: str, path):
    import torch
    from transformers import (
        MinistralConfig,
        MinistralForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  sliding_window=WINDOW, attn_implementation="eager")  # fmt: skip
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif kind == "ministral":  # Mistral with layer_types: layer 1 full attention
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        model = MinistralForCausalLM(MinistralConfig(layer_types=types, **common))
    else:  # layer 0 full attention, layers 1-2 sliding
        model = Qwen3ForCausalLM(Qwen3Config(use_sliding_window=True, max_window_layers=1, **common))
    with torch.no_grad():  # larger attention logits and perturbed norms, so that a wrong mask shows
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.add_(0.1 * torch.randn_like(prm))
            elif "q_proj" in n or "k_proj" in n:
                prm.mul_(4.0)
    model.save_pretrained(path)
    return model.float().eval()


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _write(request.param, path)
    cfg, params = load_hf_dir(path)
    return request.param, model, cfg, params


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_loader_reads_the_windows(family):
    kind, _, cfg, _ = family
    want = ("sliding_attention",) * 3 if kind == "mistral" else ("full_attention",) + ("sliding_attention",) * 2
    assert cfg.layer_types == want and cfg.sliding_window == WINDOW
    assert cfg.layer_windows() == tuple(WINDOW if t == "sliding_attention" else None for t in want)
    assert TargetConfig.from_dict(cfg.to_dict()) == cfg


def test_logits_match_transformers_past_the_window(family):
    """Cache-less pass, cached prefill and cached decode steps, all within 1e-4 of transformers."""
    _, model, cfg, params = family
    _assert_matches_transformers(model, cfg, params)


def test_ministral_layer_types_match_transformers(tmp_path):
    """Ministral (``model_type: ministral``, Mistral with per-layer ``layer_types``) loads its mixed
    sliding / full layers and matches transformers past the window (it used to be refused)."""
    model = _write("ministral", tmp_path)
    cfg, params = load_hf_dir(tmp_path)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.sliding_window == WINDOW
    _assert_matches_transformers(model, cfg, params)


def _assert_matches_transformers(model, cfg, params):
    target = Target(cfg, params)
    rng = np.random.default_rng(0)
    ids = [1] + rng.integers(3, cfg.vocab_size, PROMPT - 1).tolist()
    # greedy continuation by transformers, then one forward over everything as the reference
    full = list(ids)
    for _ in range(DECODE):
        full.append(int(_hf_logits(model, full)[-1].argmax()))
    want = _hf_logits(model, full)
    pos = jnp.arange(len(full), dtype=jnp.int32)[None]
    got = np.asarray(target(jnp.asarray([full]), pos).logits[0])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    cache = target.init_cache(1, 64)
    out = target(jnp.asarray([ids]), pos[:, :PROMPT], cache=cache)
    np.testing.assert_allclose(np.asarray(out.logits[0]), want[:PROMPT], atol=1e-4, rtol=1e-4)
    cache = out.cache
    for i in range(PROMPT, len(full)):
        out = target(jnp.asarray([[full[i]]]), jnp.asarray([[i]], jnp.int32), cache=cache)
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits[0, 0]), want[i], atol=1e-4, rtol=1e-4)


def test_qwen3_sliding_config_was_not_full_attention(family):
    """The windowed logits differ from full attention's past the window (the mask matters here)."""
    kind, model, cfg, params = family
    full = Target(dataclasses.replace(cfg, layer_types=(), sliding_window=None), params)
    ids = [1] + np.random.default_rng(0).integers(3, cfg.vocab_size, PROMPT - 1).tolist()
    got = np.asarray(full(jnp.asarray([ids]), jnp.arange(PROMPT, dtype=jnp.int32)[None]).logits[0])
    assert np.abs(got[WINDOW:] - _hf_logits(model, ids)[WINDOW:]).max() > 1e-2


def test_gguf_window(family, tmp_path):
    """A GGUF carrying ``{arch}.attention.sliding_window`` (all layers for ``llama`` without a
    pattern, else per the pattern) gives transformers' logits; without the key it loads as full
    attention (llama.cpp's converter writes Mistral so: the window cannot be known)."""
    import gguf

    from tests.helpers.gguf_files import write_gguf

    kind, model, cfg, params = family
    arch, pattern = ("llama", None) if kind == "mistral" else ("qwen3", [False, True, True])

    def window_kv(w):
        w.add_sliding_window(WINDOW)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)

    write_gguf(tmp_path / "w.gguf", arch, cfg, params, arch == "llama", window_kv)
    got_cfg, got_params = load_gguf(tmp_path / "w.gguf")
    assert (got_cfg.layer_types, got_cfg.sliding_window) == (cfg.layer_types, cfg.sliding_window)
    ids = [1] + np.random.default_rng(2).integers(3, cfg.vocab_size, PROMPT - 1).tolist()
    pos = jnp.arange(PROMPT, dtype=jnp.int32)[None]
    got = np.asarray(Target(got_cfg, got_params)(jnp.asarray([ids]), pos).logits[0])
    np.testing.assert_allclose(got, _hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    write_gguf(tmp_path / "full.gguf", arch, cfg, params, arch == "llama", lambda w: None)
    assert not gguf_config(tmp_path / "full.gguf").has_sliding_layers
    if arch == "qwen3":  # which layers slide is not written: refused
        write_gguf(tmp_path / "np.gguf", arch, cfg, params, False, lambda w: w.add_sliding_window(WINDOW))
        with pytest.raises(DSparkInputError, match="sliding_window_pattern"):
            gguf_config(tmp_path / "np.gguf")
    assert gguf.Keys.Attention.SLIDING_WINDOW == "{arch}.attention.sliding_window"


def test_hf_config_errors(tmp_path):
    import json

    _write("qwen3", tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    c["layer_types"] = ["full_attention", "chunked_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(DSparkInputError, match="chunked_attention"):
        load_hf_dir(tmp_path)
    c["layer_types"], c["use_sliding_window"] = ["full_attention"] * 3, True  # as given: no layer slides
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert load_hf_dir(tmp_path)[0].layer_types == ()
    mistral = tmp_path / "mistral"  # a checkpoint of its own: the loader refuses unread tensors (q/k norms)
    _write("mistral", mistral)
    c = json.loads((mistral / "config.json").read_text())
    c["sliding_window"] = None
    (mistral / "config.json").write_text(json.dumps(c))  # Mistral v0.2+: no window
    cfg = load_hf_dir(mistral)[0]
    assert (cfg.layer_types, cfg.sliding_window, cfg.qk_norm) == ((), None, False)


def test_config_rules():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=4, max_position=16)  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window >= 1"):
        TargetConfig(**base, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="not implemented"):
        TargetConfig(**base, layer_types=("local", "full_attention"), sliding_window=4)
    with pytest.raises(ValueError, match="pallas_tpu"):
        TargetConfig(**base, layer_types=("full_attention", "sliding_attention"), sliding_window=4,
                     attention_backend="pallas_tpu")  # fmt: skip
    every = TargetConfig(
        **base, layer_types=("sliding_attention",) * 2, sliding_window=4, attention_backend="pallas_tpu"
    )
    assert every.uniform_window == 4
    assert "layer_types" not in TargetConfig(**base).to_dict()  # full attention: the dict of before


@pytest.mark.parametrize("s_len,block", [(40, 256), (96, 16)])
def test_cached_attention_window_equals_dense(s_len, block):
    """The blocked loop (starting at the first block a window reaches) and the cuDNN arguments
    equal dense attention under the windowed mask, queries far from and near the start, and
    a padding query (q_pos < 0) gives 0."""
    rng = np.random.default_rng(1)
    b, t, nh, nkv, hd, w = 2, 3, 4, 2, 8, 7
    q = jnp.asarray(rng.standard_normal((b, t, nh, hd)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((2, b, s_len, nkv, hd)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((2, b, s_len, nkv, hd)), jnp.float32)
    q_pos = jnp.asarray([[s_len - 3, s_len - 2, s_len - 1], [2, 9, -1]], jnp.int32)
    slots = jnp.arange(s_len)[None, None, :]
    mask = (slots <= q_pos[:, :, None]) & (slots > q_pos[:, :, None] - w)
    mask = mask.at[1, 2, 0].set(True)  # dense attention needs one key; its output is zeroed below
    want = np.array(attention(q, kc[1], vc[1], mask))
    want[1, 2] = 0
    win = jnp.int32(w)
    got = cached_attention(q, kc, vc, 1, q_pos, block=block, window=win)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    got = cudnn_attention(q, kc, vc, 1, q_pos, implementation="xla", window=win)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(attend(q, kc, vc, 1, q_pos, backend="auto", window=win)), want, atol=1e-5)
    with pytest.raises(ValueError, match="sliding window"):
        attend(q, kc, vc, 1, q_pos, backend="pallas_tpu", window=win)
    assert select_backend("auto", q, kc, "tpu", traced_window=True)[0] == "xla"
    if s_len % 8 == 0:  # the paged view (pages of 8 slots) with the kernel's static window, by its reference
        got = pallas_tpu_attention(q, kc, vc, 1, q_pos, page_size=8, kernel=_reference_kernel, window=w)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def _reference_kernel(q, kv_pages, *metadata, **kw):
    """JAX's ``ref_ragged_paged_attention`` with the metadata concrete (it slices by them)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    meta = [np.asarray(m) for m in metadata]
    return jax.jit(lambda qq, pages: ref_ragged_paged_attention(qq, pages, *meta, **kw))(q, kv_pages)


def test_windowed_loop_skips_the_blocks_before_the_window():
    """The xla loop never reads the blocks before the earliest window (NaN there would show), so
    a windowed layer's cost follows the window, not the context."""
    rng = np.random.default_rng(2)
    s_len, block, w = 128, 16, 7
    q = jnp.asarray(rng.standard_normal((1, 2, 4, 8)), jnp.float32)
    kc = rng.standard_normal((1, 1, s_len, 2, 8)).astype(np.float32)
    vc = rng.standard_normal((1, 1, s_len, 2, 8)).astype(np.float32)
    want = np.asarray(cached_attention(q, jnp.asarray(kc), jnp.asarray(vc), 0, jnp.asarray([[60, 70]]), window=w))
    kc[:, :, :48], vc[:, :, :48] = np.nan, np.nan  # blocks 0-2: before slot 54, the first one seen
    got = cached_attention(q, jnp.asarray(kc), jnp.asarray(vc), 0, jnp.asarray([[60, 70]]), block=block, window=w)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def _target(kind, tmp_path_factory) -> Target:
    path = tmp_path_factory.mktemp(f"{kind}-decode")
    _write(kind, path)
    cfg, params = load_hf_dir(path)
    return Target(cfg, params, fingerprint=params_fingerprint(params))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Every layer slides by one window: a static window in every path."""
    return _target("mistral", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_sliding(tmp_path_factory):
    """A full layer then sliding layers: the per-layer window is traced in the layer scan."""
    return _target("qwen3", tmp_path_factory)


def _prompts(n, lengths):
    rng = np.random.default_rng(5)
    return [[1] + rng.integers(3, n, k - 1).tolist() for k in lengths]


def test_greedy_speculative_equals_plain(mistral):
    prompts = _prompts(mistral.cfg.vocab_size, (PROMPT, 13))
    ar = generate_autoregressive(mistral, prompts, max_new_tokens=20, cache_len=80)
    sp = generate_speculative(
        mistral,
        random_drafter(mistral, block_size=4),
        prompts,
        max_new_tokens=20,
        cache_len=80,
        num_speculative_tokens=4,
    )
    assert_same_outputs(ar, sp)


@pytest.mark.parametrize("kind", ["mistral", "qwen3_sliding"])
def test_engine_equals_plain_decoding(kind, request):
    """Packed decode steps and verification with one-shot and chunked prefill (12-token chunks, so
    a prompt spans passes) give plain decoding's tokens on the windowed targets."""
    target = request.getfixturevalue(kind)
    drafter = bigram_drafter(target, block_size=3)
    eng = chunked_engine(target, drafter)
    prompts = _prompts(target.cfg.vocab_size, (30, 21, 5, 26))
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=14), f"w{i}") for i, p in enumerate(prompts)]
    ar = generate_autoregressive(target, prompts, max_new_tokens=14, cache_len=64)
    want = {r.request_id: (g.token_ids, g.finish_reason) for r, g in zip(reqs, ar.generations)}
    for chunked in (False, True):
        assert drive(eng, reqs, chunked=chunked, slots=3) == want
