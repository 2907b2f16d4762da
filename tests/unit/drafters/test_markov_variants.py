"""DSpark sequential-head variants: vanilla / gated / rnn (``DrafterConfig.markov_head``).

For every variant, on a tiny random target (V = 6) with every head weight randomised:

* forward shapes of the teacher-forced heads (training) and of the sampler (decoding);
* the sampler's ``probs`` equal the teacher-forced distributions of the drafted prefix
  (training and decoding compute the same model) and are the law the tokens are drawn
  from (40k draws: x_1 ~ q_1, x_2 | x_1 ~ q_2);
* what each head may read: vanilla's q_3 depends on x_2 only, the RNN head's on the
  whole prefix (x_1 too), the gated head's bias on the backbone hidden state;
* exports round-trip, and an export written before ``markov_head`` existed loads as vanilla.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.drafters.markov import sample_block
from dspark_jax.models.sampling import process_logits, sampling_arrays
from dspark_jax.models.target import Target, random_params

V, G, N = 6, 3, 40_000
CTX = [1, 4, 2, 5]
HEADS = ["vanilla", "gated", "rnn"]  # the legacy gated_v0 / rnn_v0: load and round-trip tests only


@pytest.fixture(scope="module")
def target():
    tcfg = TargetConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position=32,
        tie_embeddings=False,
        name="law",
    )
    return Target(tcfg, random_params(tcfg, seed=7, scale=0.4))


def make_drafter(target, head, seed=1) -> DSparkDrafter:
    cfg = DrafterConfig.for_target(target.cfg, block_size=G, num_layers=1, markov_rank=4, taps=(0, 1), markov_head=head)
    d = DSparkDrafter(cfg, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    d.final_norm[...] = jnp.full(d.final_norm.shape, 0.05, jnp.float32)  # flat base logits: the head dominates
    for name in ("markov_w2", "conf_w", "markov_gate_w", "markov_rnn_wx", "markov_rnn_wh", "markov_rnn_b"):
        # the head's weights live on its module: markov_<x> is markov_head.<x>
        var = getattr(d.markov_head, name[len("markov_") :], None) if name.startswith("markov_") else getattr(d, name)
        if var is not None:
            var[...] = jnp.asarray(rng.normal(size=var[...].shape) * (1.5 if name == "markov_w2" else 1.0), jnp.float32)
    return d


def block_of(target, d, b):
    ctx = jnp.asarray([CTX], jnp.int32)
    pos = jnp.arange(len(CTX), dtype=jnp.int32)[None]
    out = target(ctx, pos, target.init_cache(1, 16), taps=d.cfg.taps)
    cache = d.extend_cache(d.init_cache(1, 16), out.features, pos)
    blk = d.draft_block(target, ctx[:, -1], jnp.asarray([len(CTX) - 1], jnp.int32), cache)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:]), blk)


@pytest.fixture(scope="module", params=HEADS)
def drawn(request, target):
    """``(drafter, block, draft)`` of N draws at T = 1 for one head type."""
    d = make_drafter(target, request.param)
    blk = block_of(target, d, N)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(N, dtype=jnp.uint32))
    draft = jax.jit(lambda k: sample_block(d, blk, jnp.full((N,), CTX[-1], jnp.int32), k, sampling_arrays(N, 1.0)))(
        keys
    )
    return d, blk, draft


def test_config_field():
    tcfg = TargetConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position=32,
    )
    assert DrafterConfig.for_target(tcfg).markov_head == "vanilla"
    with pytest.raises(ValueError, match="markov_head"):
        DrafterConfig.for_target(tcfg, markov_head="lstm")


def test_shapes(drawn):
    d, blk, draft = drawn
    r = d.cfg.markov_rank
    prev = jnp.concatenate([jnp.full((N, 1), CTX[-1], jnp.int32), draft.tokens[:, :-1]], axis=1)
    bias, e = d.teacher_forced_heads(blk.hidden, prev)
    assert bias.shape == (N, G, V) and bias.dtype == jnp.float32 and e.shape == (N, G, r)
    assert draft.tokens.shape == (N, G) and draft.tokens.dtype == jnp.int32
    assert draft.probs.shape == (N, G, V) and draft.confidence.shape == (N, G)
    assert np.all((np.asarray(draft.confidence) > 0) & (np.asarray(draft.confidence) < 1))
    # extra axes (the trainer's [B, A, block_size]) are carried through
    b2, e2 = d.teacher_forced_heads(blk.hidden[:8].reshape(2, 4, G, -1), prev[:8].reshape(2, 4, G))
    np.testing.assert_allclose(b2.reshape(8, G, V), bias[:8], atol=1e-6)


def test_sampler_probs_equal_teacher_forced_distributions(drawn):
    """Decoding's q_k == training's softmax(U_k + B_k) on the drafted prefix (all positions)."""
    d, blk, draft = drawn
    n = 2000
    prev = jnp.concatenate([jnp.full((n, 1), CTX[-1], jnp.int32), draft.tokens[:n, :-1]], axis=1)
    bias, e = d.teacher_forced_heads(blk.hidden[:n], prev)
    want = process_logits(blk.logits[:n] + bias, sampling_arrays(n, 1.0))
    np.testing.assert_allclose(draft.probs[:n], want, atol=2e-6)
    np.testing.assert_allclose(draft.confidence_logit[:n], d.confidence_logit(blk.hidden[:n], e), atol=1e-5)


def test_probs_are_the_sampling_law(drawn):
    d, _, draft = drawn
    x, q = np.asarray(draft.tokens), np.asarray(draft.probs)
    np.testing.assert_allclose(q[:, 0], np.broadcast_to(q[0, 0], q[:, 0].shape), atol=1e-6)
    assert 0.5 * np.abs(np.bincount(x[:, 0], minlength=V) / N - q[0, 0]).sum() < 0.015
    seen = 0
    for v in range(V):
        rows = np.nonzero(x[:, 0] == v)[0]
        if len(rows) < 3000:
            continue
        seen += 1
        np.testing.assert_allclose(q[rows, 1], np.broadcast_to(q[rows[0], 1], (len(rows), V)), atol=1e-5)
        assert 0.5 * np.abs(np.bincount(x[rows, 1], minlength=V) / len(rows) - q[rows[0], 1]).sum() < 0.04
    assert seen >= 2


def test_what_each_head_reads(drawn):
    """q_3 given x_2: a function of x_2 alone for vanilla/gated, of (x_1, x_2) for the RNN head."""
    d, _, draft = drawn
    x, q = np.asarray(draft.tokens), np.asarray(draft.probs)
    spread = 0.0
    for v in range(V):
        rows = np.nonzero(x[:, 1] == v)[0]
        if len(rows) < 100:
            continue
        spread = max(spread, float(np.max(np.abs(q[rows, 2] - q[rows[0], 2]))))
    if d.cfg.markov_head in ("rnn", "rnn_v0"):
        assert spread > 0.02, "the RNN head ignored the earlier prefix"
    else:
        assert spread < 1e-5, "a Markov head read more than the previous token"


def test_gate_reads_the_hidden_state(target):
    d = make_drafter(target, "gated")
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16)), jnp.float32)
    prev = jnp.asarray([3, 3], jnp.int32)
    _, e, bias = d.markov_step(None, prev, h)
    assert float(jnp.max(jnp.abs(bias[0] - bias[1]))) > 1e-3  # same token, different hidden states
    _, e_van, _ = make_drafter(target, "vanilla").markov_step(None, prev, h)
    assert np.all(np.abs(np.asarray(e)) <= np.abs(np.asarray(d.markov_embedding(prev))) + 1e-7)  # gate in (0, 1)


@pytest.mark.parametrize("head", HEADS + ["gated_v0", "rnn_v0"])
def test_export_round_trip(target, head, tmp_path):
    from dspark_jax.drafters.checkpoint import export_drafter, load_drafter

    d = make_drafter(target, head)
    path = export_drafter(d, tmp_path / head)
    loaded, _ = load_drafter(path)
    assert loaded.cfg.markov_head == head
    for a, b in zip(jax.tree.leaves(nnx.state(d, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_format1_export_loads_under_its_versioned_head_name(target, head, tmp_path):
    """A format-1 export's "gated"/"rnn" meant the first variants: it loads as gated_v0/rnn_v0
    and drafts exactly what it drafted before."""
    from dspark_jax.drafters.checkpoint import export_drafter, load_drafter

    d = make_drafter(target, head + "_v0")
    path = export_drafter(d, tmp_path / head)
    meta = json.loads((path / "drafter.json").read_text())
    meta["format"], meta["config"]["markov_head"] = "dspark_jax.drafter/1", head
    (path / "drafter.json").write_text(json.dumps(meta))
    _rewrite_params_in_format1_layout(path)
    loaded, _ = load_drafter(path)
    assert loaded.cfg.markov_head == head + "_v0"
    blk = block_of(target, d, 4)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(4, dtype=jnp.uint32))
    run = lambda m: sample_block(m, blk, jnp.full((4,), CTX[-1], jnp.int32), keys, sampling_arrays(4, 1.0))
    np.testing.assert_array_equal(run(d).probs, run(loaded).probs)


def _rewrite_params_in_format1_layout(path):
    """Formats 1 and 2 kept the Markov head's weights at the top level (``markov_w1``, ...)."""
    ckptr = ocp.StandardCheckpointer()
    tree = ckptr.restore(path / "params")
    head = tree.pop("markov_head")
    tree.update({"markov_" + k: v for k, v in head.items()})
    shutil.rmtree(path / "params")
    ckptr.save(path / "params", tree)
    ckptr.wait_until_finished()


def test_reference_maths(target):
    """gated and rnn compute DeepSpec's equations (written out here in numpy)."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(2, 16)).astype(np.float32)
    prev = np.array([3, 5], np.int32)
    sig = lambda z: 1 / (1 + np.exp(-z))
    d = make_drafter(target, "gated")
    e = np.asarray(d.markov_head.w1[...])[prev]
    g = sig(np.concatenate([h, e], -1) @ np.asarray(d.markov_head.gate_w[...]) + np.asarray(d.markov_head.gate_b[...]))
    _, _, bias = d.markov_step(None, jnp.asarray(prev), jnp.asarray(h))
    np.testing.assert_allclose(bias, (g * e) @ np.asarray(d.markov_head.w2[...]), rtol=1e-5, atol=1e-5)
    d = make_drafter(target, "rnn")
    r, w, b = 4, np.asarray(d.markov_head.rnn_wx[...]), np.asarray(d.markov_head.rnn_b[...])
    s = np.zeros((2, r), np.float32)
    state = d.markov_init((2,))
    for _k in range(3):  # three positions, the state carried
        e = np.asarray(d.markov_head.w1[...])[prev]
        z = np.concatenate([s, e, h], -1) @ w + b
        u = sig(z[:, :r])
        s = u * s + (1 - u) * np.tanh(z[:, r : 2 * r])
        state, _, bias = d.markov_step(state, jnp.asarray(prev), jnp.asarray(h))
        np.testing.assert_allclose(
            bias, np.tanh(z[:, 2 * r :]) @ np.asarray(d.markov_head.w2[...]), rtol=1e-4, atol=1e-4
        )


def test_export_without_markov_head_field_loads_as_vanilla(target, tmp_path):
    """Exports written before ``markov_head`` existed have no such key in drafter.json."""
    from dspark_jax.drafters.checkpoint import export_drafter, load_drafter

    d = make_drafter(target, "vanilla")
    path = export_drafter(d, tmp_path / "old")
    meta = json.loads((path / "drafter.json").read_text())
    del meta["config"]["markov_head"]
    (path / "drafter.json").write_text(json.dumps(meta))
    loaded, _ = load_drafter(path)
    assert loaded.cfg.markov_head == "vanilla"
    blk = block_of(target, d, 4)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(4, dtype=jnp.uint32))
    run = lambda m: sample_block(m, blk, jnp.full((4,), CTX[-1], jnp.int32), keys, sampling_arrays(4, 1.0))
    a, b = run(d), run(loaded)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.probs, b.probs, atol=0)
