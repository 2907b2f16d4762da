"""A draft vocabulary's decode-time LM head (dspark_jax.drafters.decode_head) and the draft-space
sampler (models.sampling.sample_subset): bit-identical to gathering / sampling over the full
vocabulary, refused for another target, never trained or exported."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.drafters.base import BlockOutput, prepare_drafter
from dspark_jax.drafters.checkpoint import export_drafter, load_drafter
from dspark_jax.drafters.decode_head import DecodeHead, DecodeLayer, without_decode_state
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.drafters.markov import sample_block
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.sampling import first_argmax, process_logits, sample, sample_subset, sampling_arrays
from dspark_jax.models.target import Target, random_params
from tests.helpers.tiny import TARGET_SCALE, TINY_TARGET, tiny_drafter, tiny_target, tiny_train_config

N_DRAFT = 24


def _drafter(target: Target, seed: int = 0) -> DSparkDrafter:
    """A tiny DSpark drafter over ``N_DRAFT`` of the 64 ids with a non-zero Markov correction."""
    d = tiny_drafter(target, train=tiny_train_config(draft_vocab_size=N_DRAFT))
    assert isinstance(d, DSparkDrafter) and d.markov_w2 is not None
    d.set_draft_vocab(np.random.default_rng(seed).choice(TINY_TARGET.vocab_size, N_DRAFT, replace=False))
    rng = np.random.default_rng(seed + 1)
    d.markov_w2[...] = jnp.asarray(rng.normal(size=d.markov_w2.shape), jnp.float32)
    return d


def _ids(d: DSparkDrafter) -> jax.Array:
    ids = d.draft_vocab_ids()
    assert ids is not None
    return ids


def _rows(d: DSparkDrafter) -> np.ndarray:
    """The installed decode head's rows."""
    assert d.decode_head is not None
    return np.asarray(d.decode_head[...])


def _draft(target, d, temperatures=(0.0, 1.0), b: int = 3):
    """One drafting round of ``b`` rows on a random context per temperature (one program, jitted
    through nnx.split as decoding does)."""
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(d)

    @jax.jit
    def run(t_state, d_state, samp):
        t, dd = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
        feats = jax.random.normal(jax.random.PRNGKey(1), (b, 6, len(dd.cfg.taps) * t.cfg.hidden_size))
        pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (b, 6))
        cache = dd.extend_cache(dd.init_cache(b, 16), feats, pos)
        keys = jax.random.split(jax.random.PRNGKey(7), b)
        anchors = jnp.arange(b, dtype=jnp.int32) + 5
        return dd.draft(t, anchors, jnp.full((b,), 6, jnp.int32), cache, keys, samp)

    return [run(t_state, d_state, sampling_arrays(b, t)) for t in temperatures]


def test_sample_subset_equals_sample_over_the_zero_padded_vocabulary():
    v, n, b = 300, 90, 256
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.sort(rng.choice(v, n, replace=False)), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(3), b)
    logits = jnp.asarray(rng.normal(size=(b, n)) * 2.0, jnp.float32)
    q = jax.nn.softmax(logits, -1).at[:, ::5].set(0.0)  # zero-probability entries
    q = q.at[:7].set(jnp.where(jnp.arange(n) < 3, 1.0 / 3, 0.0))  # exact ties
    full = jnp.zeros((b, v), jnp.float32).at[:, ids].set(q)
    ref = np.asarray(sample(keys, full))
    got = np.asarray(ids[jax.jit(sample_subset, static_argnums=3)(keys, q, ids, v)])
    np.testing.assert_array_equal(got, ref)
    assert np.all(np.asarray(q)[np.arange(b), np.searchsorted(np.asarray(ids), got)] > 0)
    # typed keys take the full-vocabulary noise path: the same draws
    typed = jax.vmap(jax.random.wrap_key_data)(keys)
    np.testing.assert_array_equal(np.asarray(ids[sample_subset(typed, q, ids, v)]), ref)


def test_first_argmax_is_argmax():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(0, 4, size=(64, 33)), jnp.float32)  # many ties
    x = x.at[3].set(-jnp.inf).at[4, :10].set(jnp.inf)
    np.testing.assert_array_equal(np.asarray(first_argmax(x)), np.asarray(jnp.argmax(x, -1)))


@pytest.mark.exactness
def test_block_sampler_equals_full_vocabulary_reference():
    """The draft-space sampler gives the tokens and q of the former sampler (q scattered to V
    at every position, the draw over V), hence the same law and the same coupled draws."""
    d = _drafter(tiny_target())
    b, g = 3, d.cfg.block_size
    graph, state = nnx.split(d)
    hidden = jax.random.normal(jax.random.PRNGKey(1), (b, g, d.cfg.model_width))
    block = BlockOutput(hidden, 3.0 * jax.random.normal(jax.random.PRNGKey(2), (b, g, N_DRAFT)))
    anchors, keys = jnp.arange(b, dtype=jnp.int32) + 5, jax.random.split(jax.random.PRNGKey(7), b)

    @jax.jit
    def both(state, samp):
        dd = nnx.merge(graph, state)
        got = sample_block(dd, block, anchors, keys, samp)
        prev, carry, ref = anchors, dd.markov_init((b,)), []
        for k in range(g):  # the reference: each position processed and drawn over V
            carry, _, bias = dd.markov_step(carry, prev, hidden[:, k])
            q = dd.to_target_probs(process_logits(block.logits[:, k] + bias, samp))
            prev = sample(jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, k), q)
            ref.append((prev, q))
        return got, jnp.stack([x for x, _ in ref], 1), jnp.stack([q for _, q in ref], 1)

    off = np.setdiff1d(np.arange(TINY_TARGET.vocab_size), np.asarray(_ids(d)))
    for temperature in (0.0, 1.0):
        got, tokens, probs = both(state, sampling_arrays(b, temperature))
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(tokens))
        np.testing.assert_allclose(np.asarray(got.probs), np.asarray(probs), rtol=1e-5, atol=1e-7)
        assert np.all(np.asarray(got.probs)[..., off] == 0.0)


@pytest.mark.exactness
def test_decode_head_is_bit_identical_to_the_gather_and_idempotent():
    target = tiny_target()
    d = _drafter(target)
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 5, d.cfg.model_width))
    gathered = np.asarray(d.base_logits(target, h))
    before = [[np.asarray(x) for x in out] for out in _draft(target, d)]
    prepare_drafter(target, d)
    assert isinstance(d.decode_head, DecodeHead) and d.decode_head.shape == (N_DRAFT, TINY_TARGET.hidden_size)
    np.testing.assert_array_equal(_rows(d), np.asarray(target.lm_head_rows(_ids(d))))
    np.testing.assert_array_equal(np.asarray(d.base_logits(target, h)), gathered)
    after = _draft(target, d)  # the jitted round reads the installed rows (an argument)
    for out_before, out_after in zip(before, after):
        for x, y in zip(out_before, out_after):
            np.testing.assert_array_equal(x, np.asarray(y))
    rows = d.decode_head.get_value()
    d.prepare_decoding(target)  # idempotent: nothing recomputed
    assert d.decode_head is not None and d.decode_head.get_value() is rows
    d.set_draft_vocab(range(N_DRAFT))  # another vocabulary: the rows go
    assert d.decode_head is None


@pytest.mark.exactness
def test_decode_layers_are_per_layer_copies_read_by_the_round_and_refreshed():
    """On the CPU, prepare_decoding copies each backbone layer's weights into buffers of their own;
    the drafting round reads them (no copy of a layer out of the stacked arrays in the compiled
    program) and drafts what the scan over the stacks drafts; new weights are copied again; the
    copies are never parameters."""
    target = tiny_target()
    d = tiny_drafter(target, train=tiny_train_config(num_layers=2))
    assert isinstance(d, DSparkDrafter)
    before = _draft(target, d)
    prepare_drafter(target, d)
    assert d.decode_layers is not None and len(d.decode_layers) == 2
    for i, layer in enumerate(d.decode_layers):
        for k, v in layer.items():
            assert isinstance(v, DecodeLayer)
            np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(d.layers[k][...][i]))
    for out_before, out_after in zip(before, _draft(target, d)):
        np.testing.assert_array_equal(np.asarray(out_before.tokens), np.asarray(out_after.tokens))
        np.testing.assert_allclose(np.asarray(out_after.probs), np.asarray(out_before.probs), rtol=1e-6, atol=1e-7)
    kept = d.decode_layers[1]["wq"].get_value()
    d.prepare_decoding(target)  # idempotent
    assert d.decode_layers[1]["wq"].get_value() is kept
    assert "decode_layers" not in nnx.to_pure_dict(nnx.state(d, nnx.Param))
    assert without_decode_state(d).decode_layers is None and d.decode_layers is not None

    # the compiled round slices no layer weight out of a stack ([2, d, ...] -> [d, ...])
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(d)
    cache = d.init_cache(1, 16)
    hlo = (
        jax.jit(
            lambda ts, ds, c: nnx.merge(d_graph, ds).draft_block(
                nnx.merge(t_graph, ts), jnp.ones((1,), jnp.int32), jnp.full((1,), 6, jnp.int32), c
            )
        )
        .lower(t_state, d_state, cache)
        .compile()
        .as_text()
    )
    shapes = {",".join(map(str, v.shape[1:])) for v in d.layers.values() if v.ndim == 3}
    copies = [m for m in re.findall(r"%[\w.-]*slice[\w.-]* = f32\[([\d,]+)\]", hlo) if m in shapes]
    assert not copies, f"layer weights sliced out of the stacks: {copies}"

    # new weights: the next prepare copies them (a round reads the new values)
    d.layers["wq"][...] = 2.0 * d.layers["wq"][...]
    d.prepare_decoding(target)
    np.testing.assert_array_equal(np.asarray(d.decode_layers[1]["wq"][...]), np.asarray(d.layers["wq"][...][1]))
    d.release_decoding()
    assert d.decode_layers is None


def test_decode_head_of_another_target_is_refused_or_replaced():
    a = tiny_target()
    d = _drafter(a)
    d.prepare_decoding(a)
    h = jnp.ones((1, d.cfg.model_width), jnp.float32)
    other = tiny_target(seed=5, fingerprint="otherfp")
    with pytest.raises(DSparkInputError, match="prepare_decoding"):
        d.base_logits(other, h)
    with pytest.raises(DSparkInputError, match="prepare_decoding"):  # no fingerprint: cannot be checked
        d.base_logits(Target(TINY_TARGET, random_params(TINY_TARGET, seed=5, scale=TARGET_SCALE)), h)
    d.prepare_decoding(other)  # replaced
    np.testing.assert_array_equal(_rows(d), np.asarray(other.lm_head_rows(_ids(d))))
    # the same fingerprint on other weights (hand-set): a new install gathers again
    same_fp = tiny_target(seed=6, fingerprint="otherfp")
    d.prepare_decoding(same_fp)
    np.testing.assert_array_equal(_rows(d), np.asarray(same_fp.lm_head_rows(_ids(d))))
    # a target without a fingerprint gets no head: the rows are gathered per call
    bare = Target(TINY_TARGET, random_params(TINY_TARGET, seed=5, scale=TARGET_SCALE))
    d.prepare_decoding(bare)
    assert d.decode_head is None
    rows = bare.lm_head_rows(_ids(d))
    np.testing.assert_array_equal(
        np.asarray(d.base_logits(bare, h)),
        np.asarray(jnp.einsum("...h,nh->...n", h, rows, preferred_element_type=jnp.float32)),
    )


def test_decode_head_is_never_exported_or_trained(tmp_path):
    from dspark_jax.training.trainer import Trainer

    target = tiny_target()
    d = _drafter(target)
    plain = nnx.to_pure_dict(nnx.state(d, nnx.Param))
    d.prepare_decoding(target)
    assert jax.tree.structure(nnx.to_pure_dict(nnx.state(d, nnx.Param))) == jax.tree.structure(plain)
    d2, _ = load_drafter(export_drafter(d, tmp_path / "export"))
    assert isinstance(d2, DSparkDrafter) and d2.decode_head is None and d2.draft_vocab == d.draft_vocab
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(d2, nnx.Param)), plain)
    # the trainer works on parameters only and leaves the caller's drafter prepared
    assert without_decode_state(d2) is d2
    trainer = Trainer(tiny_train_config(draft_vocab_size=N_DRAFT), target, d)
    trained = trainer.drafter()
    assert d.decode_head is not None and isinstance(trained, DSparkDrafter) and trained.decode_head is None


def test_eagle3_prepare_decoding_is_a_no_op():
    target = tiny_target()
    e = tiny_drafter(target, "eagle3")
    graph = nnx.split(e)[0]
    prepare_drafter(target, e)
    e.release_decoding()
    assert nnx.split(e)[0] == graph


def test_entry_points_install_the_decode_head():
    """generate_speculative and the serving engine prepare the drafter before anything else (an
    input error raised right after shows it; decoding with the head: the bit-identity above)."""
    from dspark_jax.decoding.speculative import generate_speculative
    from dspark_jax.serving.engine import Engine, EngineConfig

    target = tiny_target()
    for start in (
        lambda d: generate_speculative(target, d, [[5, 6]], num_speculative_tokens=99),
        lambda d: Engine(target, d, EngineConfig(suspend_after=-1)),
    ):
        d = _drafter(target)
        with pytest.raises(DSparkInputError):
            start(d)
        assert d.decode_head is not None and (d.decode_head_key or ("",))[0] == target.fingerprint
