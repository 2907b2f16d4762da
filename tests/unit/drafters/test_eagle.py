"""The Eagle3-style baseline drafter (:mod:`dspark_jax.drafters.eagle`).

* training-time test equals decoding: the block ``train_blocks`` builds for an anchor
  (teacher-forced on the draft's own tokens) has exactly the distributions ``draft``
  sampled from, at every block position (so the TTT unroll and its diagonal mask are
  what decoding sees);
* shapes of the cache, the draft and the training blocks; the draft's ``probs`` is the
  law its tokens are drawn from;
* a short training run on stories260K continuations lowers the loss, and with the
  trained drafter greedy speculative decoding equals greedy autoregressive decoding
  token for token while accepting drafts; export -> load -> ``python -m dspark_jax.eval``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.drafters.build import build_drafter
from dspark_jax.drafters.eagle import EagleCache, EagleDrafter, eagle_taps
from dspark_jax.models.sampling import sampling_arrays
from dspark_jax.models.target import Target, random_params

GAMMA = 4


@pytest.fixture(scope="module")
def s260k(stories260k):
    from dspark_jax.models.weights import params_fingerprint

    cfg, params, tok = stories260k
    return Target(cfg, params, fingerprint=params_fingerprint(params)), tok


def random_eagle(target: Target, block_size=GAMMA, seed=0, scale=0.5) -> EagleDrafter:
    """An eagle3 drafter whose zero-initialised residual branches are randomised."""
    cfg = DrafterConfig.for_target(
        target.cfg,
        variant="eagle3",
        num_layers=1,
        block_size=block_size,
        markov_rank=0,
        taps=eagle_taps(target.cfg),
        target_fingerprint=target.fingerprint,
    )
    d = build_drafter(cfg, nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    for var in (d.wo, d.w_down):
        var[...] = jnp.asarray(
            rng.standard_normal(var[...].shape).astype(np.float32) * scale / np.sqrt(var[...].shape[0])
        )
    return d


def test_eagle_taps_and_config():
    deep = TargetConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=30,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position=16,
    )
    assert eagle_taps(deep) == (2, 15, 27)
    assert eagle_taps(dataclasses.replace(deep, num_layers=5)) == (1, 2, 3)
    with pytest.raises(ValueError, match="one decoder layer"):
        DrafterConfig.for_target(deep, variant="eagle3", num_layers=2)
    cfg = DrafterConfig.for_target(deep, variant="eagle3", num_layers=1, block_size=5)
    assert not cfg.markov and not cfg.has_confidence and cfg.num_block_positions == 5
    assert isinstance(build_drafter(cfg, nnx.Rngs(0)), EagleDrafter)


def test_training_time_test_equals_decoding(s260k):
    """TTT block of anchor P (teacher-forced on the drafted tokens) == the draft's q, all positions."""
    target, _ = s260k
    d = random_eagle(target)
    L, P = 24, 9
    rng = np.random.default_rng(3)
    seq = rng.integers(3, target.cfg.vocab_size, size=(1, L)).astype(np.int32)
    pos = jnp.arange(L, dtype=jnp.int32)[None]
    out = target(jnp.asarray(seq), pos, taps=d.cfg.taps)
    cache = d.extend_cache(
        d.init_cache(1, 32), out.features, jnp.where(pos < P, pos, -1), target=target, tokens=jnp.asarray(seq)
    )
    assert isinstance(cache, EagleCache) and cache.k.shape == (1, 32, target.cfg.num_kv_heads, target.cfg.head_dim)
    for temp in (1.0, 0.0):
        draft = d.draft(
            target,
            jnp.asarray(seq[:, P]),
            jnp.array([P], jnp.int32),
            cache,
            jax.random.PRNGKey(temp == 0)[None],
            sampling_arrays(1, temp),
        )
        assert draft.tokens.shape == (1, GAMMA) and draft.probs.shape == (1, GAMMA, target.cfg.vocab_size)
        assert np.all(np.isinf(draft.confidence_logit)) and np.all(draft.confidence == 1)
        forced = seq.copy()
        forced[0, P + 1 : P + 1 + GAMMA] = np.asarray(draft.tokens[0])
        # Features of the forced sequence: the target sees the drafted tokens, like verification.
        f_out = target(jnp.asarray(forced), pos, taps=d.cfg.taps)
        blk = d.train_blocks(target, f_out.features, jnp.asarray(forced), jnp.array([[P, 3]], jnp.int32))
        assert blk.hidden.shape == (1, 2, GAMMA, target.cfg.hidden_size)
        assert blk.logits.shape == (1, 2, GAMMA, target.cfg.vocab_size)
        if temp == 1.0:
            np.testing.assert_allclose(jax.nn.softmax(blk.logits[0, 0], -1), draft.probs[0], atol=2e-6)
            # the drafts are not all identical: later positions depend on the drafter's own state
            assert len(set(np.asarray(draft.tokens[0]).tolist())) > 1
        else:
            assert np.asarray(jnp.argmax(blk.logits[0, 0], -1)).tolist() == np.asarray(draft.tokens[0]).tolist()


def test_draft_probs_are_the_sampling_law():
    """Tiny target (V = 6): x_1 ~ q_1 and x_2 | x_1 ~ the recorded q_2 over 40k draws."""
    v = 6
    tcfg = TargetConfig(
        vocab_size=v,
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
    target = Target(tcfg, random_params(tcfg, seed=7, scale=0.4))
    d = random_eagle(target, block_size=3, scale=8.0)
    d.final_norm[...] = jnp.full(d.final_norm.shape, 0.3, jnp.float32)  # flat enough that every token occurs
    ctx = jnp.asarray([[1, 4, 2, 5]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    out = target(ctx, pos, taps=d.cfg.taps)
    cache = d.extend_cache(d.init_cache(1, 16), out.features, pos, target=target, tokens=ctx)
    n = 40_000
    cache_n = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:]), cache)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n, dtype=jnp.uint32))
    draft = jax.jit(
        lambda k: d.draft(
            target, jnp.full((n,), 5, jnp.int32), jnp.full((n,), 3, jnp.int32), cache_n, k, sampling_arrays(n, 1.0)
        )
    )(keys)
    x, q = np.asarray(draft.tokens), np.asarray(draft.probs)
    assert 0.5 * np.abs(np.bincount(x[:, 0], minlength=v) / n - q[0, 0]).sum() < 0.015
    conds = []
    for t in range(v):
        rows = np.nonzero(x[:, 0] == t)[0]
        if len(rows) < 3000:
            continue
        np.testing.assert_allclose(q[rows, 1], np.broadcast_to(q[rows[0], 1], (len(rows), v)), atol=1e-5)
        assert 0.5 * np.abs(np.bincount(x[rows, 1], minlength=v) / len(rows) - q[rows[0], 1]).sum() < 0.04
        conds.append(q[rows[0], 1])
    assert len(conds) >= 2 and max(0.5 * np.abs(conds[0] - c).sum() for c in conds[1:]) > 0.02


@pytest.fixture(scope="module")
def trained(s260k, tmp_path_factory):
    """An eagle3 drafter trained for 60 steps on stories260K's own continuations."""
    from dspark_jax.data.prompts import tinystories_openings
    from dspark_jax.training.data import batches
    from dspark_jax.training.train_config import TrainConfig, drafter_config
    from dspark_jax.training.trainer import Trainer

    target, tok = s260k
    prompts = [tok.encode(t) for t in tinystories_openings()[50:82]]
    gen = generate_autoregressive(target, prompts, max_new_tokens=56, temperature=0)
    L = 72
    toks = np.zeros((len(prompts), L), np.int32)
    lens = np.zeros(len(prompts), np.int32)
    for i, (p, g) in enumerate(zip(prompts, gen.generations)):
        s = (p + g.token_ids)[:L]
        toks[i, : len(s)], lens[i] = s, len(s)
    data = {"tokens": toks, "lengths": lens, "prompt_lengths": np.array([min(len(p), L) for p in prompts], np.int32)}
    cfg = TrainConfig.from_keys(
        variant="eagle3", block_size=GAMMA, steps=60, batch_size=8, anchors_per_seq=16, learning_rate=3e-3
    )
    tr = Trainer(cfg, target, build_drafter(drafter_config(cfg, target), nnx.Rngs(0)))
    it = batches(data, cfg.batch_size, cfg.seed)
    losses = [float(tr.step(next(it), s)[0].loss) for s in range(cfg.steps)]
    return tr.drafter(), losses, prompts


@pytest.mark.slow
def test_training_lowers_loss(trained):
    d, losses, _ = trained
    assert isinstance(d, EagleDrafter) and d.cfg.num_layers == 1 and d.cfg.taps == (1, 2, 3)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:3]), losses


@pytest.mark.slow
@pytest.mark.exactness
def test_greedy_speculative_equals_autoregressive(s260k, trained):
    target, tok = s260k
    d, _, prompts = trained
    held = [tok.encode(t) for t in ["Once upon a time", "Tom and Lily went to the park."]] + prompts[:6]
    ar = generate_autoregressive(target, held, max_new_tokens=40, temperature=0)
    sp = generate_speculative(
        target, d, held, max_new_tokens=40, temperature=0, num_speculative_tokens=d.cfg.block_size
    )
    for a, s in zip(ar.generations, sp.generations):
        assert s.token_ids == a.token_ids
    # the accept path runs (a random drafter accepts ~nothing: tau 1.0)
    assert sum(g.num_accepted for g in sp.generations) > 0.05 * sum(g.num_verified for g in sp.generations)
    assert np.mean([g.tau for g in sp.generations]) > 1.1


@pytest.mark.slow
def test_export_load_and_eval_cli(s260k, trained, tmp_path):
    from dspark_jax.commands import eval as eval_cli
    from dspark_jax.drafters.checkpoint import export_drafter, load_drafter

    target, _ = s260k
    d, _, _ = trained
    path = export_drafter(d, tmp_path / "eagle")
    loaded, meta = load_drafter(path)
    assert isinstance(loaded, EagleDrafter) and meta["config"]["variant"] == "eagle3"
    for a, b in zip(jax.tree.leaves(nnx.state(d, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    args = eval_cli.build_parser().parse_args(
        [
            "--target",
            "stories260k",
            "--drafter",
            str(path),
            "--prompts",
            "tinystories",
            "--num-prompts",
            "3",
            "--max-new-tokens",
            "24",
            "--out",
            str(tmp_path / "ev"),
        ]
    )
    out = eval_cli.run(args)
    assert out["variant"] == "eagle3" and out["tau"] >= 1.0 and out["calibration"] is None
    assert (tmp_path / "ev" / "eval.json").is_file() and (tmp_path / "ev" / "position_acceptance.png").is_file()
