"""Parity with DeepSpec's own modules on the committed fixtures ``tests/data/deepspec``.

The fixtures (``tests/data/deepspec/README.md``) hold a tiny random Qwen3 target written by
transformers and four drafters written by DeepSpec's ``build_draft_config`` / ``Qwen3DSparkModel``
(vanilla, gated and rnn Markov heads with confidence heads, and DeepSpec's DFlash), each tapping the
target's last layer (``target_layer_ids`` L - 1), with the draft and confidence logits DeepSpec's
training forward computed for fixed tokens and anchors from the features DeepSpec trains on (its
target-cache hooks: the last layer's raw output, before the final norm). Checked: each imports
with logits within 1e-4 of DeepSpec's (and far from the logits on transformers'
``hidden_states[L]``, the final-normed output, which DeepSpec's evaluator refuses to feed); re-export
in DeepSpec's format writes the same tensors (byte-equal) and an equivalent config; a speculators
export re-imports to the same drafter; an older ``DSparkDraftModel`` config (keys under
``dflash_config``) imports to the same drafter; an embedding tap is refused by name.

DeepSeek's ``Gemma4DSparkModel`` (``gemma4_keqv``: values from the key projection, vanilla Markov head;
``gemma4_v``: a ``v_proj``, gated head): self-contained drafters, fed DeepSpec's fixed target
features directly (no Gemma 4 target needed). Their draft and confidence logits match DeepSpec's
within 1e-4, the cached decode path agrees with the training path, a re-export writes the same
tensors and config, a target whose tables differ from the drafter's copies is refused, and what the
importer does not implement is refused by name. End to end, ``gemma4_keqv`` decodes a tiny Gemma 4
target written by transformers for its config (with its embedding / head tables): greedy
speculative == plain.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from dspark_jax.drafters.checkpoint import load_drafter
from dspark_jax.drafters.format_export import export_to_format
from dspark_jax.drafters.formats import detect_format
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.hf_io import load_hf_dir
from dspark_jax.models.target import Target

pytestmark = pytest.mark.exactness
DATA = Path(__file__).resolve().parents[1] / "data" / "deepspec"
NAMES = ("vanilla", "gated", "rnn", "dflash")
ATOL = 1e-4
# DeepSpec's config keys that say what the drafter is (the rest are the target's copied config).
DRAFT_KEYS = (
    "architectures", "block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "markov_rank",
    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_hidden_layers",
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "rms_norm_eps", "layer_types", "tie_word_embeddings", "model_type",
)  # fmt: skip


@pytest.fixture(scope="module")
def target() -> Target:
    cfg, params = load_hf_dir(DATA / "target")
    return Target(cfg, params)


def _params(drafter):
    return nnx.to_pure_dict(nnx.state(drafter, nnx.Param))


def _ours(target, drafter, ref):
    """Our teacher-forced draft logits (Markov bias included) and confidence logits at DeepSpec's
    anchors, ``[A, block_size, V]`` and ``[A, block_size]``."""
    ids, anchors = ref["input_ids"], ref["anchors"]
    t, g = len(ids), drafter.cfg.block_size
    tokens = jnp.asarray(ids, jnp.int32)[None]
    feats = target(tokens, jnp.arange(t, dtype=jnp.int32)[None], taps=drafter.cfg.taps).features
    block = drafter.train_blocks(target, feats, tokens, jnp.asarray(anchors, jnp.int32)[None])
    # DeepSpec's previous tokens: the anchor, then the labels (clamped to the sequence's end).
    prev = jnp.asarray([[ids[min(p + k, t - 1)] for k in range(g)] for p in anchors], jnp.int32)[None]
    bias, e = drafter.teacher_forced_heads(block.hidden, prev)
    return np.asarray(block.logits + bias)[0], np.asarray(drafter.confidence_logit(block.hidden, e))[0]


@pytest.mark.parametrize("name", NAMES)
def test_imports_with_deepspec_logits(target, name):
    ref = dict(np.load(DATA / name / "reference.npz"))
    drafter, meta = load_drafter(DATA / name, target=target)
    assert meta["extra"]["source_format"] == "deepspec"
    assert target.cfg.num_layers - 1 in drafter.cfg.taps  # the last layer is tapped
    logits, z = _ours(target, drafter, ref)
    m = ref["eval_mask"]
    assert m.any() and np.max(np.abs(logits[m] - ref["draft_logits"][m])) <= ATOL
    # Fed the final-normed output instead (transformers' hidden_states[L]), the logits are far off.
    assert np.max(np.abs(logits[m] - ref["eval_draft_logits"][m])) > 0.1
    if ref["confidence_logits"].size:
        assert np.max(np.abs(z[m] - ref["confidence_logits"][m])) <= ATOL
    else:  # DeepSpec's DFlash has no confidence head: confidence 1
        assert np.all(np.isposinf(z))


@pytest.mark.parametrize("name", NAMES)
def test_reexport_is_lossless(target, name, tmp_path):
    drafter, _ = load_drafter(DATA / name, target=target)
    out, _ = export_to_format(drafter, target, "deepspec", tmp_path / "deepspec")
    mine, theirs = load_file(str(out / "model.safetensors")), load_file(str(DATA / name / "model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and mine[k].tobytes() == theirs[k].tobytes(), k
    a, b = json.loads((out / "config.json").read_text()), json.loads((DATA / name / "config.json").read_text())
    assert {k: a.get(k) for k in DRAFT_KEYS} == {k: b.get(k) for k in DRAFT_KEYS}
    # speculators' format holds the same drafter (tap L - 1 <-> aux_hidden_state_layer_ids L, the
    # last layer's output before the final norm in both).
    spec, _ = export_to_format(drafter, target, "speculators", tmp_path / "speculators")
    aux = json.loads((spec / "config.json").read_text())["aux_hidden_state_layer_ids"]
    assert aux == [t + 1 for t in b["target_layer_ids"]] and aux[-1] == target.cfg.num_layers
    for again in (load_drafter(out, target=target)[0], load_drafter(spec, target=target)[0]):
        assert again.cfg == drafter.cfg
        x, y = jax.tree.leaves(_params(drafter)), jax.tree.leaves(_params(again))
        assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))


def _rewrite(tmp_path: Path, edit, name: str = "vanilla") -> Path:
    d = tmp_path / "edited"
    shutil.copytree(DATA / name, d)
    c = json.loads((d / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
    return d


def test_older_dspark_draft_model_config_is_normalised(target, tmp_path):
    def legacy(c):
        c["architectures"] = ["DSparkDraftModel"]
        c["dflash_config"] = {"target_layer_ids": c.pop("target_layer_ids"), "mask_token_id": c.pop("mask_token_id")}

    d = _rewrite(tmp_path, legacy)
    assert detect_format(d) == "deepspec"
    with pytest.warns(UserWarning, match="dflash_config"):
        got, _ = load_drafter(d, target=target)
    want, _ = load_drafter(DATA / "vanilla", target=target)
    assert got.cfg == want.cfg
    assert all(np.array_equal(p, q) for p, q in zip(jax.tree.leaves(_params(got)), jax.tree.leaves(_params(want))))


def test_embedding_tap_is_refused_by_name(target, tmp_path):
    d = _rewrite(tmp_path, lambda c: c.update(target_layer_ids=[-1, 2]))
    with pytest.raises(DSparkInputError, match=r"embedding output \(target_layer_ids -1\)"):
        load_drafter(d, target=target)


GEMMA4 = ("gemma4_keqv", "gemma4_v")


def _gemma4_ours(drafter, ref):
    """:func:`_ours` for a self-contained Gemma 4 drafter on DeepSpec's fixed features (no target)."""
    ids, anchors = ref["input_ids"], ref["anchors"]
    t, g = len(ids), drafter.cfg.block_size
    tokens, feats = jnp.asarray(ids, jnp.int32)[None], jnp.asarray(ref["features"])[None]
    block = drafter.train_blocks(None, feats, tokens, jnp.asarray(anchors, jnp.int32)[None])
    prev = jnp.asarray([[ids[min(p + k, t - 1)] for k in range(g)] for p in anchors], jnp.int32)[None]
    bias, e = drafter.teacher_forced_heads(block.hidden, prev)
    z = drafter.confidence_logit(block.hidden, e)
    return np.asarray(block.logits + bias)[0], np.asarray(z)[0], np.asarray(block.logits)[0]


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_imports_with_deepspec_logits(name):
    ref = dict(np.load(DATA / name / "reference.npz"))
    drafter, meta = load_drafter(DATA / name)
    c = drafter.cfg
    assert meta["extra"]["source_format"] == "deepspec" and c.own_embeddings and c.k_eq_v == (name == "gemma4_keqv")
    logits, z, base = _gemma4_ours(drafter, ref)
    m = ref["eval_mask"]
    assert m.all() and np.max(np.abs(logits - ref["draft_logits"])) <= ATOL
    assert np.max(np.abs(z - ref["confidence_logits"])) <= ATOL
    # Decoding: the context written into the cache and one block drafted from it give the same logits.
    feats, ids = jnp.asarray(ref["features"])[None], ref["input_ids"]
    for a, p in enumerate(ref["anchors"][-1:].tolist(), start=len(ref["anchors"]) - 1):
        pos = jnp.arange(p, dtype=jnp.int32)[None]
        cache = drafter.extend_cache(drafter.init_cache(1, len(ids)), feats[:, :p], pos)
        out = drafter.draft_block(None, jnp.asarray([ids[p]], jnp.int32), jnp.asarray([p], jnp.int32), cache)
        assert np.max(np.abs(np.asarray(out.logits)[0] - base[a])) <= ATOL


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_reexport_is_lossless(name, tmp_path):
    drafter, _ = load_drafter(DATA / name)
    theirs_cfg = json.loads((DATA / name / "config.json").read_text())
    out, _ = export_to_format(drafter, None, "deepspec", tmp_path / "out", base_config=theirs_cfg)
    mine, theirs = load_file(str(out / "model.safetensors")), load_file(str(DATA / name / "model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and mine[k].tobytes() == theirs[k].tobytes(), k
    assert json.loads((out / "config.json").read_text()) == theirs_cfg
    # Without the source config every key the drafter reads is still written, the same (the local
    # layers' head_dim and KV heads, which no draft layer reads, are then the global ones).
    out2, _ = export_to_format(drafter, None, "deepspec", tmp_path / "bare")
    bare = json.loads((out2 / "config.json").read_text())
    kv = "num_key_value_heads" if drafter.cfg.k_eq_v else "num_global_key_value_heads"
    unread = {"rope_parameters", "head_dim", kv}
    assert {k: theirs_cfg[k] for k in bare if k not in unread} == {k: v for k, v in bare.items() if k not in unread}
    assert bare["rope_parameters"]["full_attention"] == theirs_cfg["rope_parameters"]["full_attention"]
    for d in (out, out2):
        again, _ = load_drafter(d)
        assert dataclasses.replace(again.cfg, target_name=name) == drafter.cfg
        x, y = jax.tree.leaves(_params(drafter)), jax.tree.leaves(_params(again))
        assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))
    with pytest.raises(DSparkInputError, match="speculators's format has no own embedding"):
        export_to_format(drafter, None, "speculators", tmp_path / "spec")
    # The command line writes the same files without a target.
    from dspark_jax.commands.export import main

    assert main([str(DATA / name), "--format", "deepspec", "--out", str(tmp_path / "cli")]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == theirs_cfg
    cli = load_file(str(tmp_path / "cli" / "model.safetensors"))
    assert all(cli[k].tobytes() == theirs[k].tobytes() for k in theirs)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(attention_bias=True), "attention_bias is set"),
        (lambda c: c.update(hidden_size_per_layer_input=8), "per-layer inputs"),
        (lambda c: c.update(attn_logit_softcapping=50.0), "attention soft-cap"),
        (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "other than full_attention"),
        (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"), "RoPE 'yarn' is not supported"),
        (lambda c: c.pop("global_head_dim"), "lacks global_head_dim"),
        (lambda c: c.update(use_double_wide_mlp=True, num_kv_shared_layers=1), "double-wide MLP"),
    ],
)
def test_gemma4_settings_not_implemented_are_refused_by_name(tmp_path, edit, match):
    d = _rewrite(tmp_path, edit, "gemma4_keqv")
    with pytest.raises(DSparkInputError, match=match):
        load_drafter(d)


def test_gemma4_tensor_not_read_is_refused_by_name(tmp_path):
    from safetensors.numpy import save_file

    d = _rewrite(tmp_path, lambda c: None, "gemma4_keqv")
    t = load_file(str(d / "model.safetensors"))
    t["layers.0.self_attn.v_proj.weight"] = t["layers.0.self_attn.k_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(DSparkInputError, match="does not read: layers.0.self_attn.v_proj.weight"):
        load_drafter(d)


def test_gemma4_drafter_is_checked_against_the_target_it_is_given():
    """The drafter's own embedding / head are DeepSpec's copies of its target's: a target whose
    tables differ is refused (rows compared unscaled: a Gemma target scales its embedding)."""
    from dspark_jax.config import TargetConfig
    from dspark_jax.models.target import random_params

    drafter, _ = load_drafter(DATA / "gemma4_keqv")
    c = drafter.cfg
    tcfg = TargetConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=32, num_layers=4,
                        num_heads=2, num_kv_heads=1, head_dim=8, max_position=64, tie_embeddings=False,
                        embed_scale=c.embed_scale, name="g4-tiny")  # fmt: skip
    params = random_params(tcfg, seed=3)
    with pytest.raises(DSparkInputError, match="stored embed_tokens copy differs"):
        load_drafter(DATA / "gemma4_keqv", target=Target(tcfg, params))
    params.update(embed=np.asarray(drafter.embed[...]), lm_head=np.asarray(drafter.lm_head[...]))
    again, _ = load_drafter(DATA / "gemma4_keqv", target=Target(tcfg, params))
    assert again.cfg.target_name == "g4-tiny"


def test_confidence_head_keeps_its_zero_markov_half_and_untied_deepspec_warns(target, tmp_path):
    """Beside a vanilla Markov head the confidence head is written ``[1, H + r]`` with
    ``confidence_head_with_markov: true`` even when its Markov half is zero (llama.cpp refuses a
    ``[1, H]`` head: ``conf_proj.weight`` has wrong shape), with the same confidences on re-import;
    a DeepSpec export of an untied target notes that llama.cpp drafts with the wrong head there."""
    drafter, _ = load_drafter(DATA / "vanilla", target=target)
    d = drafter.cfg.model_width
    drafter.conf_w[...] = drafter.conf_w[...].at[d:].set(0.0)
    out, notes = export_to_format(drafter, target, "deepspec", tmp_path / "ds")
    assert json.loads((out / "config.json").read_text())["confidence_head_with_markov"] is True
    w = load_file(str(out / "model.safetensors"))["confidence_head.proj.weight"]
    assert w.shape == (1, d + drafter.cfg.markov_rank) and not np.any(w[0, d:])
    again, _ = load_drafter(out, target=target)
    np.testing.assert_array_equal(np.asarray(again.conf_w[...]), np.asarray(drafter.conf_w[...]))
    assert not target.cfg.tie_embeddings and any("--format speculators" in n for n in notes)
    assert not export_to_format(drafter, target, "speculators", tmp_path / "sp")[1]


def test_gemma4_drafter_decodes_a_gemma4_target_exactly(tmp_path):
    """End to end: a tiny Gemma 4 target written by transformers (``Gemma4ForCausalLM``, fp32) with the
    config the fixture drafter was built for (the manifest's text config, 4 layers, taps 0 and L - 1)
    and the drafter's own embedding / LM head as its tables (untied, so the loader's copy check
    passes), loaded with ``load_drafter(..., target=)`` and decoded through the front door: greedy
    speculative == plain greedy, token for token, on three prompts (one past the 8-token window)
    with rounds + accepted drafts = the generated tokens after the prefill one; T = 1 runs (seeded)."""
    import torch
    import transformers as tr

    from dspark_jax import load_drafter as api_load_drafter
    from dspark_jax.decoding.request import DecodeRequest, decode
    from dspark_jax.models.weights import params_fingerprint

    man = json.loads((DATA / "manifest.json").read_text())["gemma4"]
    text = {**man["target_text_config"], **man["drafters"]["gemma4_keqv"]["text_config"], "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = tr.Gemma4ForCausalLM(tr.Gemma4TextConfig(**text, initializer_range=0.1, attn_implementation="eager"))
    own = load_file(str(DATA / "gemma4_keqv" / "model.safetensors"))
    with torch.no_grad():  # DeepSpec's drafter stores copies of its target's (unscaled) tables
        model.model.embed_tokens.weight.copy_(torch.from_numpy(own["embed_tokens.weight"]))
        model.lm_head.weight.copy_(torch.from_numpy(own["lm_head.weight"]))
    model.float().save_pretrained(tmp_path)
    cfg, params = load_hf_dir(tmp_path)
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    drafter, _ = api_load_drafter(DATA / "gemma4_keqv", target=target)
    assert drafter.cfg.taps == (0, cfg.num_layers - 1) and drafter.cfg.target_fingerprint == target.fingerprint
    rng = np.random.default_rng(5)
    prompts = [[2] + rng.integers(5, cfg.vocab_size, k - 1).tolist() for k in (3, 11, 20)]

    def run(d, temperature=0.0):
        reqs = [DecodeRequest(p, max_new_tokens=32, temperature=temperature, seed=7, num_speculative_tokens=4,
                              stop_ids=()) for p in prompts]  # fmt: skip
        return decode(target, d, reqs).generations

    plain, spec = run(None), run(drafter)
    for a, s in zip(plain, spec, strict=True):
        assert s.token_ids == a.token_ids and len(s.token_ids) == 32 and s.finish_reason == "length"
        assert s.num_target_passes + s.num_accepted == 31 and s.num_accepted <= s.num_draft_tokens
    assert sum(s.num_accepted for s in spec) >= 1  # random weights: few drafts agree, some do
    for s in run(drafter, temperature=1.0):
        assert len(s.token_ids) == 32 and s.num_target_passes + s.num_accepted == 31
        assert all(0 <= t < cfg.vocab_size for t in s.token_ids)
