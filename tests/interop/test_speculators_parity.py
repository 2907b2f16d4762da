"""Parity with the reference implementation (vllm-project/speculators 0.9.0) and DeepSpec's layout.

A tiny random Qwen3 target (transformers, saved as safetensors) and tiny speculators
``DSparkDraftModel`` drafters with random weights, saved by speculators' own ``save_pretrained``
(:mod:`interop.speculators_ref`), are read by :func:`~dspark_jax.drafters.checkpoint.load_drafter`.
From the same token ids, speculators' modules get transformers' ``hidden_states[aux_ids]`` and ours
get our target's taps; per slot our block logits after the Markov bias, our confidences, labels and
greedy drafts must equal speculators'. Exports reload in speculators with no missing or unexpected
keys and reproduce the logits; import -> export -> import is bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.api import load_target
from dspark_jax.drafters.checkpoint import load_drafter
from dspark_jax.drafters.format_export import export_to_format
from dspark_jax.errors import DSparkInputError

try:  # CI installs speculators (.ci/run): there a missing reference fails, it never skips
    import speculators  # noqa: F401

    from tests.interop import speculators_ref as ref
except ImportError as e:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise
    pytest.skip(f"speculators is not installed ({e}); .ci/run installs it", allow_module_level=True)

pytestmark = pytest.mark.exactness
ATOL = 1e-4
T = 24
ANCHORS = [0, 3, 9, 14, 19]  # speculators anchors p <= T - 1 - block_size
SEQ_SEED = 7
# (head, draft vocabulary size, block size, markov rank, draft layers)
CASES = {
    "vanilla": ("vanilla", None, 4, 8, 1),
    "gated": ("gated", None, 4, 8, 1),
    "rnn": ("rnn", None, 4, 8, 2),
    "draft_vocab": ("vanilla", 100, 4, 8, 1),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Qwen3 target: its directory, the transformers model and our Target."""
    root = tmp_path_factory.mktemp("specparity")
    tdir, hf_model = ref.make_tiny_qwen3_target(root, seed=0)
    target, tok = load_target(str(tdir))
    ids = np.random.default_rng(SEQ_SEED).integers(0, target.cfg.vocab_size, size=T)
    target.tokenizer_for_tests = tok
    return root, tdir, hf_model, target, ids


def _ours(target, drafter, ids, anchors):
    """Our teacher-forced block outputs at ``anchors``: biased logits, confidence logits, labels,
    greedy drafts (target ids)."""
    cfg = drafter.cfg
    tokens = jnp.asarray(ids, jnp.int32)[None]
    out = target(tokens, jnp.arange(len(ids), dtype=jnp.int32)[None], taps=cfg.taps)
    a = jnp.asarray(anchors, jnp.int32)[None]
    block = drafter.train_blocks(target, out.features, tokens, a)
    g = cfg.block_size
    prev = jnp.asarray([[ids[p + k] for k in range(g)] for p in anchors], jnp.int32)[None]
    bias, e = drafter.teacher_forced_heads(block.hidden, prev)
    logits = np.asarray(block.logits + bias)[0]
    z = np.asarray(drafter.confidence_logit(block.hidden, e))[0]
    labels = np.asarray([[ids[p + k + 1] for k in range(g)] for p in anchors])
    greedy = np.asarray(drafter.to_target_ids(jnp.argmax(jnp.asarray(logits), axis=-1)))
    return logits, z, labels, greedy


def _theirs(model, hf_model, drafter_cfg, ids, anchors):
    aux = [t + 1 for t in drafter_cfg.taps]
    feats = ref.target_features(hf_model, ids, aux)
    return ref.speculators_block_outputs(model, feats["hidden_states"], ids, anchors)


def _build(tiny, name):
    root, tdir, _, _, _ = tiny
    head, n, block, r, layers = CASES[name]
    return ref.make_tiny_speculators_dspark(
        tdir, root / name, seed=11, block_size=block, markov_rank=r, markov_head_type=head,
        draft_vocab_size=n, num_layers=layers, name=name,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_block_logits_confidences_labels_drafts_match(tiny, name):
    _, _, hf_model, target, ids = tiny
    sdir, model = _build(tiny, name)
    drafter, meta = load_drafter(sdir, target=target)
    assert meta["extra"]["source_format"] == "speculators" and not meta["extra"]["notes"]
    logits, z, labels, greedy = _ours(target, drafter, ids, ANCHORS)
    theirs = _theirs(model, hf_model, drafter.cfg, ids, ANCHORS)
    diff_logits = float(np.max(np.abs(logits - theirs["logits"])))
    diff_conf = float(np.max(np.abs(z - theirs["confidence_logits"])))
    print(f"{name}: max |logits diff| {diff_logits:.2e}, max |confidence-logit diff| {diff_conf:.2e}")
    assert diff_logits <= ATOL and diff_conf <= ATOL
    np.testing.assert_array_equal(labels, theirs["labels"])
    np.testing.assert_array_equal(greedy, theirs["draft_ids"])
    # The Markov bias matters in these weights (a parity test of the base logits alone would pass
    # without the head).
    assert np.any(np.argmax(theirs["base_logits"], -1) != np.argmax(theirs["logits"], -1))


@pytest.mark.parametrize("name", ["rnn", "draft_vocab"])
def test_export_reloads_in_speculators_and_round_trips(tiny, name, tmp_path):
    _, _, hf_model, target, ids = tiny
    sdir, _ = _build(tiny, name)
    drafter, _ = load_drafter(sdir, target=target)
    out, notes = export_to_format(drafter, target, "speculators", tmp_path / "exp", verifier=str(tiny[1]))
    assert bool(notes) == (CASES[name][0] != "vanilla")
    conf = json.loads((out / "config.json").read_text())
    assert conf["sample_from_anchor"] is True and "draft_vocab_size" in conf
    # Same tensor names, shapes and values as speculators' own save.
    mine, orig = load_file(str(out / "model.safetensors")), load_file(str(sdir / "model.safetensors"))
    assert sorted(mine) == sorted(orig)
    for k in orig:
        np.testing.assert_array_equal(mine[k], orig[k], err_msg=k)
    reloaded = ref.load_speculators_dspark(out)  # strict: raises on missing / unexpected keys
    logits, z, _, _ = _ours(target, drafter, ids, ANCHORS)
    theirs = _theirs(reloaded, hf_model, drafter.cfg, ids, ANCHORS)
    assert np.max(np.abs(logits - theirs["logits"])) <= ATOL
    assert np.max(np.abs(z - theirs["confidence_logits"])) <= ATOL
    again, _ = load_drafter(out, target=target)
    a, b = jax.tree.leaves(_params(drafter)), jax.tree.leaves(_params(again))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _params(drafter):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(drafter, nnx.Param))


def _deepspec_from_speculators(sdir, dst, tdir):
    """A DeepSpec-format directory made from a speculators save with docs/interop.md#format-details's remap (flat
    config, ``target_layer_ids = aux - 1``, embedding / LM-head copies added): not our exporter."""
    c = json.loads((sdir / "config.json").read_text())
    flat = dict(c["transformer_layer_config"])
    tcfg = json.loads((tdir / "config.json").read_text())
    flat.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=tcfg["num_hidden_layers"],
        block_size=c["block_size"],
        target_layer_ids=[i - 1 for i in c["aux_hidden_state_layer_ids"]],
        mask_token_id=c["mask_token_id"],
        markov_rank=c["markov_rank"],
        markov_head_type=c["markov_head_type"],
        enable_confidence_head=c["enable_confidence_head"],
        confidence_head_with_markov=c["confidence_head_with_markov"],
        num_anchors=512,
    )
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(flat))
    t = load_file(str(sdir / "model.safetensors"))
    hf = load_file(str(tdir / "model.safetensors"))
    t["embed_tokens.weight"] = hf["model.embed_tokens.weight"]
    t["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_deepspec_layout_imports_to_the_same_drafter(tiny, tmp_path):
    _, tdir, _, target, ids = tiny
    sdir, _ = _build(tiny, "gated")
    ddir = _deepspec_from_speculators(sdir, tmp_path / "deepspec", tdir)
    a, _ = load_drafter(sdir, target=target)
    b, meta = load_drafter(ddir, target=target)
    assert meta["extra"]["source_format"] == "deepspec" and b.cfg == a.cfg
    for x, y in zip(jax.tree.leaves(_params(a)), jax.tree.leaves(_params(b))):
        np.testing.assert_array_equal(x, y)
    # Our DeepSpec export of it writes the same tensors the remap made.
    out, _ = export_to_format(b, target, "deepspec", tmp_path / "ours")
    mine, theirs = load_file(str(out / "model.safetensors")), load_file(str(ddir / "model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(mine[k], theirs[k], err_msg=k)
    # Embedding copies of another target are refused.
    t = dict(theirs)
    t["embed_tokens.weight"] = t["embed_tokens.weight"] + 1.0
    save_file(t, str(ddir / "model.safetensors"))
    with pytest.raises(DSparkInputError, match="embed_tokens copy differs"):
        load_drafter(ddir, target=target)


def test_unseen_speculators_checkpoint_decodes_losslessly_and_reexports(tiny, tmp_path):
    """A shape and draft vocabulary no other test uses: 2 layers, block 6, rank 16, N = 37, rnn."""
    from dspark_jax.api import generate_text

    root, tdir, _, target, ids = tiny
    sdir, _ = ref.make_tiny_speculators_dspark(
        tdir, tmp_path / "unseen", seed=5, block_size=6, markov_rank=16, markov_head_type="rnn",
        draft_vocab_size=37, num_layers=2, aux_hidden_state_layer_ids=[1, 3], name="unseen",
    )  # fmt: skip
    drafter, _ = load_drafter(sdir, target=target)
    prompt = [int(i) for i in ids[:6]]
    tok = target.tokenizer_for_tests
    plain = generate_text(target, tok, prompt, max_new_tokens=20, temperature=0.0)
    spec = generate_text(
        target, tok, prompt, drafter=drafter, max_new_tokens=20, temperature=0.0, num_speculative_tokens=6
    )
    assert spec["token_ids"] == plain["token_ids"]
    out, _ = export_to_format(drafter, target, "speculators", tmp_path / "re")
    mine, orig = load_file(str(out / "model.safetensors")), load_file(str(sdir / "model.safetensors"))
    assert sorted(mine) == sorted(orig)
    for k in orig:
        np.testing.assert_array_equal(mine[k], orig[k], err_msg=k)


def test_last_layer_tap_matches_speculators(tiny, tmp_path):
    """``aux_hidden_state_layer_ids`` L is the last layer's output before the final norm (what
    speculators' vLLM extraction stores as the final hidden state and normalises itself with
    ``verifier_norm``): our tap L - 1. Logits match speculators' own modules on those features;
    the export writes its tensors."""
    _, tdir, hf_model, target, ids = tiny
    L = target.cfg.num_layers
    sdir, _ = ref.make_tiny_speculators_dspark(
        tdir, tmp_path / "last", seed=13, block_size=4, markov_rank=8, aux_hidden_state_layer_ids=[1, L], name="last"
    )
    drafter, _ = load_drafter(sdir, target=target)
    assert drafter.cfg.taps == (0, L - 1)
    logits, z, _, _ = _ours(target, drafter, ids, ANCHORS)
    theirs = _theirs(ref.load_speculators_dspark(sdir), hf_model, drafter.cfg, ids, ANCHORS)
    assert np.max(np.abs(logits - theirs["logits"])) <= ATOL
    assert np.max(np.abs(z - theirs["confidence_logits"])) <= ATOL
    out, _ = export_to_format(drafter, target, "speculators", tmp_path / "re")
    assert json.loads((out / "config.json").read_text())["aux_hidden_state_layer_ids"] == [1, L]
    mine, orig = load_file(str(out / "model.safetensors")), load_file(str(sdir / "model.safetensors"))
    assert sorted(mine) == sorted(orig) and all(np.array_equal(mine[k], orig[k]) for k in orig)


def _edited_copy(sdir, dst, **changes):
    shutil.copytree(sdir, dst)
    c = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k.startswith("layer."):
            c["transformer_layer_config"][k[6:]] = v
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_refusals_name_what_is_not_supported(tiny, tmp_path):
    _, _, _, target, _ = tiny
    sdir, _ = _build(tiny, "vanilla")
    cases = [
        ({"aux_hidden_state_layer_ids": [0, 1, 2]}, "embedding output"),
        ({"layer.layer_types": ["sliding_attention"]}, "sliding-window"),
        (
            {"layer.rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
            "RoPE scaling 'dynamic'",
        ),
        ({"layer.model_type": "gemma3"}, "Gemma"),
        ({"markov_head_type": "lstm"}, "Markov head type 'lstm'"),
        ({"speculators_model_type": "eagle3"}, "not a DSpark/DFlash drafter"),
    ]
    for i, (changes, msg) in enumerate(cases):
        with pytest.raises(DSparkInputError, match=msg):
            load_drafter(_edited_copy(sdir, tmp_path / f"c{i}", **changes), target=target)
    # A config written before speculators recorded the layout: the documented default, said aloud.
    c = _edited_copy(sdir, tmp_path / "nolayout")
    conf = json.loads((c / "config.json").read_text())
    del conf["sample_from_anchor"]
    (c / "config.json").write_text(json.dumps(conf))
    with pytest.warns(UserWarning, match="assumed True"):
        _, meta = load_drafter(c, target=target)
    assert meta["extra"]["notes"]


def test_hub_id_resolves_from_a_prefilled_cache(tiny, tmp_path, monkeypatch):
    _, _, _, target, _ = tiny
    sdir, _ = _build(tiny, "vanilla")
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-dspark"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(sdir, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    drafter, meta = load_drafter("someone/tiny-dspark", target=target)
    assert meta["extra"]["source_format"] == "speculators" and drafter.cfg.block_size == CASES["vanilla"][2]
    with pytest.raises(DSparkInputError, match="could not be resolved"):
        load_drafter("someone/not-cached", target=target)


@pytest.mark.parametrize("anchor_first", [True, False])
def test_dflash_layouts_match(tiny, tmp_path, anchor_first):
    """DFlash checkpoints: anchor-first (DeepSpec's DFlash: ``markov_rank=0``, no confidence head;
    here as speculators writes it and as DeepSpec's flat layout) imports as a ``dspark`` drafter of
    confidence 1; the 1 + N layout (z-lab's, speculators' ``sample_from_anchor=false``) as ``dflash``."""
    _, tdir, hf_model, target, ids = tiny
    sdir, model = ref.make_tiny_speculators_dspark(
        tdir, tmp_path / "dflash", seed=3, block_size=5, markov_rank=0, enable_confidence_head=False,
        sample_from_anchor=anchor_first, name="dflash",
    )  # fmt: skip
    drafter, _ = load_drafter(sdir, target=target)
    assert drafter.cfg.variant == ("dspark" if anchor_first else "dflash") and not drafter.cfg.markov
    cfg = drafter.cfg
    tokens = jnp.asarray(ids, jnp.int32)[None]
    out = target(tokens, jnp.arange(len(ids), dtype=jnp.int32)[None], taps=cfg.taps)
    anchors = ANCHORS[:-1] + [17]  # p <= T - 1 - block_size
    block = drafter.train_blocks(target, out.features, tokens, jnp.asarray(anchors, jnp.int32)[None])
    theirs = _theirs(model, hf_model, cfg, ids, anchors)
    slots = slice(0, 5) if anchor_first else slice(1, 5)  # 1 + N: slot 0 is the anchor (loss-masked)
    assert np.max(np.abs(np.asarray(block.logits)[0] - theirs["logits"][:, slots])) <= ATOL
    np.testing.assert_array_equal(theirs["loss_mask"][:, 0], 1 if anchor_first else 0)
    if anchor_first:
        assert np.all(np.isinf(np.asarray(drafter.confidence_logit(block.hidden, None))))
        c = json.loads((sdir / "config.json").read_text())
        ddir = tmp_path / "deepspec-dflash"
        ddir.mkdir()
        flat = dict(c["transformer_layer_config"])
        flat.update(
            architectures=["Qwen3DSparkModel"], block_size=5, markov_rank=0, enable_confidence_head=False,
            target_layer_ids=[i - 1 for i in c["aux_hidden_state_layer_ids"]], mask_token_id=c["mask_token_id"],
            num_target_layers=target.cfg.num_layers,
        )  # fmt: skip
        (ddir / "config.json").write_text(json.dumps(flat))
        shutil.copy(sdir / "model.safetensors", ddir / "model.safetensors")
        other, _ = load_drafter(ddir)
        out, _ = export_to_format(other, target, "deepspec", tmp_path / "re")
        conf = json.loads((out / "config.json").read_text())
        assert conf["markov_rank"] == 0 and conf["enable_confidence_head"] is False
    else:
        c = json.loads((sdir / "config.json").read_text())
        zdir = tmp_path / "zlab"
        zdir.mkdir()
        flat = dict(c["transformer_layer_config"])
        flat.update(
            architectures=["DFlashDraftModel"], block_size=5, num_target_layers=target.cfg.num_layers,
            dflash_config={"target_layer_ids": [i - 1 for i in c["aux_hidden_state_layer_ids"]],
                           "mask_token_id": c["mask_token_id"]},
        )  # fmt: skip
        (zdir / "config.json").write_text(json.dumps(flat))
        shutil.copy(sdir / "model.safetensors", zdir / "model.safetensors")
        other, meta = load_drafter(zdir, target=target)
        assert meta["extra"]["source_format"] == "zlab-dflash"
    for x, y in zip(jax.tree.leaves(_params(drafter)), jax.tree.leaves(_params(other))):
        np.testing.assert_array_equal(x, y)


def test_misaligned_drafter_warns(tiny, tmp_path):
    """A random-weight drafter agrees with the target on ~1/V of the positions: the loaders that
    know the target warn (the field's layout mismatches fail the same way, silently)."""
    from dspark_jax.api import load_target_and_drafter

    _, tdir, _, target, _ = tiny
    sdir, _ = _build(tiny, "vanilla")
    with pytest.warns(UserWarning, match="agrees with the target on only"):
        _, _, drafter = load_target_and_drafter(str(tdir), str(sdir))
    assert drafter is not None and drafter.cfg.target_fingerprint == target.fingerprint


def test_export_cli_of_a_drafter_built_here(tiny, tmp_path, capsys):
    """A drafter of this project's default architecture (random weights, a draft vocabulary) goes
    through ``python -m dspark_jax.export``, reloads in speculators strictly and gives our logits;
    a first-architecture drafter is refused with one line naming every reason."""
    from flax import nnx

    from dspark_jax.commands import export as export_cli
    from dspark_jax.config import LEGACY_ARCH, DrafterConfig
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.checkpoint import export_drafter

    _, tdir, hf_model, target, ids = tiny
    cfg = DrafterConfig.for_target(
        target.cfg, block_size=4, num_layers=1, markov_rank=8, markov_head="gated", taps=(0, 1),
        draft_vocab_size=50, target_fingerprint=target.fingerprint,
    )  # fmt: skip
    assert cfg.qk_norm and cfg.mask_token_id == target.cfg.vocab_size - 1 and cfg.confidence_input == "raw"
    d = build_drafter(cfg, nnx.Rngs(4))
    d.set_draft_vocab(range(3, 253, 5))
    state = nnx.state(d, nnx.Param)  # non-zero W2 / wo / w_down / confidence, so parity means something
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(d, jax.tree.unflatten(treedef, leaves))
    export_drafter(d, tmp_path / "ours")
    argv = [str(tmp_path / "ours"), "--target", str(tdir), "--format", "speculators", "--out", str(tmp_path / "spec")]
    assert export_cli.main(argv) == 0
    reloaded = ref.load_speculators_dspark(tmp_path / "spec")
    logits, z, _, greedy = _ours(target, d, ids, ANCHORS)
    theirs = _theirs(reloaded, hf_model, cfg, ids, ANCHORS)
    assert np.max(np.abs(logits - theirs["logits"])) <= ATOL
    assert np.max(np.abs(z - theirs["confidence_logits"])) <= ATOL
    np.testing.assert_array_equal(greedy, theirs["draft_ids"])
    # DeepSpec has no draft vocabulary; the first architecture is refused with its reasons.
    assert export_cli.main([*argv[:4], "deepspec", "--out", str(tmp_path / "ds")]) == 2
    assert "no draft vocabulary" in capsys.readouterr().err
    legacy = build_drafter(DrafterConfig.for_target(target.cfg, block_size=4, num_layers=1, markov_rank=8,
                                                    taps=(0, 1), **LEGACY_ARCH), nnx.Rngs(0))  # fmt: skip
    export_drafter(legacy, tmp_path / "legacy")
    assert export_cli.main([str(tmp_path / "legacy"), *argv[1:4], "speculators", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q/k-norm" in err[0] and "learned vector" in err[0]
