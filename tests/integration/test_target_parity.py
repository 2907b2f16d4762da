"""Parity of the JAX target with the reference implementation (transformers, PyTorch, fp32).

docs/design.md#target-model: logits must match transformers on the same weights. Tiny random
Llama and Qwen3 checkpoints are written offline with ``save_pretrained`` (safetensors),
loaded through the project loader (:func:`dspark_jax.models.hf_io.load_hf_dir`) and compared
on:

* a full forward of a ``[2, 12]`` batch (max |logit diff| <= 1e-4);
* incremental decoding through the static KV cache (prefill 5, then 1 token at a time,
  then a block of 3), which must equal the full forward; also after a rejected block
  left stale entries in the cache (the speculative loop's rollback-by-overwrite);
* hidden-state taps: tap ``i`` equals ``hidden_states[i + 1]`` for ``i < L - 1`` (the
  last tap is the pre-final-norm residual; its final norm equals ``hidden_states[L]``).

The cases vary tied / untied embeddings, RoPE theta, RMSNorm epsilon and q/k-norm.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.exactness

TOL = 1e-4
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 100, 64, 4, 2, 16

# (kind, layers, tie, rope_theta, rms_eps)
CASES = [
    ("llama", 3, False, 10000.0, 1e-5),
    ("llama", 4, True, 500000.0, 1e-6),
    ("qwen3", 3, True, 1000000.0, 1e-6),
    ("qwen3", 4, False, 5000.0, 3e-5),
]
IDS = [f"{k}-L{n}-{'tied' if t else 'untied'}-theta{int(th)}-eps{e:g}" for k, n, t, th, e in CASES]


def _make_hf(kind, layers, tie, theta, eps, path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(layers * 7 + tie)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
        rms_norm_eps=eps,
        rope_theta=theta,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie,
        initializer_range=0.15,
    )  # large enough that attention is far from uniform
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():  # non-trivial norm weights, so a mis-mapped norm shows up
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.copy_(1.0 + 0.3 * torch.randn_like(prm))
    model.save_pretrained(path, safe_serialization=True)
    return model.float().eval()


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def pair(request, tmp_path_factory):
    """``(hf_model, Target, TargetConfig)`` on identical weights."""
    from dspark_jax.models.hf_io import load_hf_dir
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    kind, layers, tie, theta, eps = request.param
    path = tmp_path_factory.mktemp(f"hf_{kind}_{layers}")
    model = _make_hf(kind, layers, tie, theta, eps, path)
    cfg, params = load_hf_dir(path)
    assert (cfg.num_layers, cfg.tie_embeddings, cfg.qk_norm) == (layers, tie, kind == "qwen3")
    assert cfg.rope_theta == theta and cfg.rms_eps == pytest.approx(eps, rel=1e-9)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    return model, Target(cfg, params, fingerprint=params_fingerprint(params)), cfg


def _tokens(b=2, t=12, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(b, t)).astype(np.int32)


def _hf_forward(model, ids):
    import torch

    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


@functools.partial(jax.jit, static_argnames=("graph", "taps"))
def _jit_forward(state, ids, pos, cache, logit_index, *, graph, taps):
    return nnx.merge(graph, state)(ids, pos, cache, taps=taps, logit_index=logit_index)


def run(target, ids, pos, cache=None, taps=(), logit_index=None):
    """``target(...)`` under jit (as in the decode loops; eager is checked separately)."""
    graph, state = nnx.split(target)
    return _jit_forward(state, ids, pos, cache, logit_index, graph=graph, taps=tuple(taps))


def _pos(b, start, t):
    return np.broadcast_to(np.arange(start, start + t, dtype=np.int32), (b, t)).copy()


def test_full_forward_matches_transformers(pair):
    model, target, _ = pair
    ids = _tokens()
    want, _ = _hf_forward(model, ids)
    got = np.asarray(run(target, ids, _pos(2, 0, 12)).logits)
    assert got.shape == want.shape == (2, 12, VOCAB)
    assert np.abs(want).max() > 0.5, "logits too flat for the comparison to mean anything"
    assert np.abs(got - want).max() <= TOL
    # Same greedy choices everywhere (no tie games: the logits are not flat).
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_logit_index_matches_full_forward(pair):
    """Prefill-style call: only the logits at ``logit_index`` (per row)."""
    _, target, _ = pair
    ids = _tokens(seed=1)
    full = np.asarray(run(target, ids, _pos(2, 0, 12)).logits)
    idx = np.array([4, 11], np.int32)
    cache = target.init_cache(2, 16)
    got = np.asarray(run(target, ids, _pos(2, 0, 12), cache, logit_index=idx).logits)
    assert got.shape == (2, VOCAB)
    np.testing.assert_allclose(got, full[np.arange(2), idx], atol=TOL, rtol=0)


def test_incremental_kv_cache_equals_full_forward(pair):
    model, target, _ = pair
    ids = _tokens(seed=2)
    want, _ = _hf_forward(model, ids)
    cache = target.init_cache(2, 16)
    pieces = []
    out = run(target, ids[:, :5], _pos(2, 0, 5), cache)  # prefill 5
    pieces.append(out.logits)
    cache = out.cache
    for t in range(5, 9):  # 1 token at a time
        out = run(target, ids[:, t : t + 1], _pos(2, t, 1), cache)
        pieces.append(out.logits)
        cache = out.cache
    out = run(target, ids[:, 9:12], _pos(2, 9, 3), cache)  # a block of 3
    pieces.append(out.logits)
    got = np.concatenate([np.asarray(p) for p in pieces], axis=1)
    assert got.shape == (2, 12, VOCAB)
    assert np.abs(got - want).max() <= TOL


def test_stale_cache_entries_are_ignored(pair):
    """A rejected block leaves stale K/V past the accepted length; the next pass must
    overwrite/mask them (rollback by position) and give the full-forward logits."""
    model, target, _ = pair
    ids = _tokens(seed=3)
    want, _ = _hf_forward(model, ids)
    cache = target.init_cache(2, 16)
    cache = run(target, ids[:, :5], _pos(2, 0, 5), cache).cache
    junk = (ids[:, 5:8] + 37) % VOCAB
    cache = run(target, junk, _pos(2, 5, 3), cache).cache  # a "draft block" that is then rejected
    # Only the correction token is confirmed: positions 6, 7 still hold junk.
    out = run(target, ids[:, 5:6], _pos(2, 5, 1), cache)
    np.testing.assert_allclose(np.asarray(out.logits), want[:, 5:6], atol=TOL, rtol=0)
    out = run(target, ids[:, 6:9], _pos(2, 6, 3), out.cache)
    np.testing.assert_allclose(np.asarray(out.logits), want[:, 6:9], atol=TOL, rtol=0)


def test_rows_at_different_positions(pair):
    """Rows of one batch at different positions (the batched decode loop's situation)."""
    model, target, _ = pair
    ids = _tokens(seed=4)
    want, _ = _hf_forward(model, ids)
    cache = target.init_cache(2, 16)
    # Row 0 prefilled 5 tokens, row 1 only 3 (then 2 pad tokens, masked by position).
    pref = ids[:, :5].copy()
    pref[1, 3:] = 0
    cache = run(target, pref, _pos(2, 0, 5), cache).cache
    # One step: row 0 at position 5, row 1 at position 3 (overwriting its pad).
    tok = np.array([[ids[0, 5]], [ids[1, 3]]], np.int32)
    pos = np.array([[5], [3]], np.int32)
    out = run(target, tok, pos, cache)
    got = np.asarray(out.logits[:, 0])
    np.testing.assert_allclose(got[0], want[0, 5], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], want[1, 3], atol=TOL, rtol=0)
    # Then a block of 3 each: row 0 at 6..8, row 1 at 4..6.
    tok = np.stack([ids[0, 6:9], ids[1, 4:7]]).astype(np.int32)
    pos = np.stack([np.arange(6, 9), np.arange(4, 7)]).astype(np.int32)
    got = np.asarray(run(target, tok, pos, out.cache).logits)
    np.testing.assert_allclose(got[0], want[0, 6:9], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], want[1, 4:7], atol=TOL, rtol=0)


def test_taps_match_hidden_states(pair):
    from dspark_jax.models.layers import rms_norm

    model, target, cfg = pair
    ids = _tokens(seed=5)
    _, hs = _hf_forward(model, ids)
    L = cfg.num_layers
    assert len(hs) == L + 1
    scale = max(1.0, max(np.abs(h).max() for h in hs))
    f = np.asarray(run(target, ids, _pos(2, 0, 12), taps=tuple(range(L))).features)
    assert f.shape == (2, 12, L * HIDDEN)
    for i in range(L - 1):  # tap i == hidden_states[i + 1]
        assert np.abs(f[..., i * HIDDEN : (i + 1) * HIDDEN] - hs[i + 1]).max() <= TOL * scale, f"tap {i}"
    # The last layer's tap is the pre-norm residual; HF's hidden_states[L] is after the norm.
    normed = np.asarray(rms_norm(f[..., (L - 1) * HIDDEN :], target.final_norm[...], cfg.rms_eps))
    assert np.abs(normed - hs[L]).max() <= TOL * scale
    # Through the cache path, taps in any order, concatenated in the order given.
    taps = (L - 2, 0)
    out = run(target, ids, _pos(2, 0, 12), target.init_cache(2, 16), taps=taps)
    want = np.concatenate([hs[t + 1] for t in taps], axis=-1)
    assert np.abs(np.asarray(out.features) - want).max() <= TOL * scale
    with pytest.raises(ValueError, match="out of range"):
        target(ids, _pos(2, 0, 12), taps=(L,))


def test_eager_forward_matches_transformers(pair):
    """Calling the module eagerly (no jit, as a notebook would) gives the same logits."""
    model, target, _ = pair
    ids = _tokens(seed=6)
    want, _ = _hf_forward(model, ids)
    got = np.asarray(target(ids, _pos(2, 0, 12)).logits)
    assert np.abs(got - want).max() <= TOL
