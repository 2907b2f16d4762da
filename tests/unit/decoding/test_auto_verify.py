"""The within-request acceptance correction of ``num_speculative_tokens="auto"``
(:mod:`dspark_jax.decoding.auto_verify`); its exactness runs through the decode loop in
tests/unit/test_decode.py (``test_auto_num_speculative_tokens_greedy`` and the law of first tokens).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import auto_verify as A

G = 4


def test_observations_are_the_positions_verification_reached():
    """Every (verified, accepted) pair of a 4-token block, against the definition: position k is
    observed iff k <= verified and k <= accepted + 1, and accepted iff k <= accepted."""
    pairs = [(ell, acc) for ell in range(G + 1) for acc in range(ell + 1)]
    ell = jnp.asarray([p[0] for p in pairs] + [3], jnp.int32)
    acc = jnp.asarray([p[1] for p in pairs] + [2], jnp.int32)
    running = jnp.asarray([True] * len(pairs) + [False])  # a finished row observes nothing
    conf = jnp.tile(jnp.asarray([0.9, 0.7, 0.5, 0.3], jnp.float32), (len(pairs) + 1, 1))
    state = A.init_auto_state(len(pairs) + 1, G)
    state = state._replace(hits=state.hits + 1.0, predicted=state.predicted + 2.0, seen=state.seen + 3.0)
    hits, predicted, seen_sum = A.observe_acceptance(state, conf, ell, acc, running, decay=0.5)
    for r, (e, a) in enumerate(pairs + [(3, 2)]):
        live = r < len(pairs)
        seen = np.array([live and k <= e and k <= a + 1 for k in range(1, G + 1)])
        hit = seen & (np.arange(1, G + 1) <= a)
        keep = 0.5 if live and e > 0 else 1.0  # only a row that verified drafts forgets
        np.testing.assert_allclose(hits[r], keep + hit, err_msg=str((e, a)))
        np.testing.assert_allclose(
            predicted[r], 2 * keep + np.where(seen, conf[r], 0.0), rtol=1e-6, err_msg=str((e, a))
        )
        np.testing.assert_allclose(seen_sum[r], 3 * keep + seen, err_msg=str((e, a)))


def test_a_request_that_rejects_everything_stops_drafting():
    """Calibrated confidences promise 0.6 per draft, but nothing is accepted: with verification
    as cheap as a plain step, drafting first pays, then the correction stops it within a dozen
    rounds; a request whose drafts are accepted as predicted keeps drafting, its ratio near 1."""
    widths, t_verify, t_draft = (0, 1, 2, 4), jnp.asarray([1.0, 1.05, 1.1, 1.2]), jnp.asarray(0.1)
    conf, running = jnp.full((1, G), 0.6, jnp.float32), jnp.ones((1,), bool)
    assert bool(A.should_draft(conf, running, widths, t_verify, t_draft))
    for accepted, expect_stop in ((0, True), (None, False)):
        state, rounds = A.init_auto_state(1, G), []
        rng = np.random.default_rng(0)
        for _ in range(40):
            c = A.corrected_confidence(conf, state)
            ell = A.choose_width(c, running, widths, t_verify)
            ell = jnp.asarray([widths[int(ell)]], jnp.int32)
            # as predicted: each verified draft accepted with probability 0.6, in order
            acc = accepted if accepted is not None else int(np.argmin(np.append(rng.random(G) < 0.6, False)))
            acc = jnp.minimum(jnp.asarray([acc], jnp.int32), ell)
            hits, predicted, seen = A.observe_acceptance(state, conf, ell, acc, running)
            state = state._replace(hits=hits, predicted=predicted, seen=seen)
            forecast = A.forecast_acceptance(A.corrected_confidence(conf, state), state.hits, state.seen)
            rounds.append(bool(A.should_draft(forecast, running, widths, t_verify, t_draft)))
        if expect_stop:
            assert not any(rounds[12:]), rounds  # stopped, and stays stopped while nothing is accepted
        else:
            assert sum(rounds) >= 0.9 * len(rounds), rounds  # an early unlucky rejection may pause it
            ratio = A.corrected_confidence(jnp.full((1, G), 0.5), state) / 0.5  # the factor the loop applies
            assert abs(float(ratio[0, 0]) - 1.0) < 0.3, ratio


def test_the_loop_is_forced_to_each_width_it_is_priced_at():
    """``measure_round_costs`` prices a width by running ``auto`` under costs that force it: for any
    confidences in (0, 1], every round drafts and verifies exactly that width (width 0: no round
    drafts), so the timed loop is the loop at that width."""
    from dspark_jax.decoding.decode_profile import forcing_costs

    widths = A.default_widths(8)
    rng = np.random.default_rng(0)
    conf = jnp.asarray(np.concatenate([rng.uniform(0.01, 1.0, (63, 8)), np.full((1, 8), 1e-3)]), jnp.float32)
    running = jnp.ones((1,), bool)
    for i in range(len(widths)):
        t = jnp.asarray(forcing_costs(widths, i))
        for row in conf:
            assert int(A.choose_width(row[None], running, widths, t)) == i
            assert bool(A.should_draft(row[None], running, widths, t, jnp.float32(0.0))) == (i > 0)


def test_auto_prices_are_the_loops_rounds_when_measured():
    """With loop rounds, a drafting round at width w costs round(w) (T=0; T>0 adds the sampled
    drafting's extra), a wider pass never less than a narrower one, a plain round round(0);
    without them, the standalone programs' prices."""
    from dspark_jax.decoding.cost_table import CostTable

    widths = (0, 1, 2, 4)
    base = CostTable.from_decode_costs(
        span=64, t_step=1.0, t_verify={0: 1.1, 1: 1.2, 2: 1.3, 4: 1.4}, t_draft_greedy=0.3, t_draft_sampled=0.5,
        t_context=0.1,
    )  # fmt: skip
    t_verify, t_draft = base.auto_prices(widths, greedy=True, span=64)
    np.testing.assert_allclose(t_verify, [1.1, 1.2, 1.3, 1.4], rtol=1e-6)
    assert t_draft == 0.3 and base.round_array(widths, 64) is None
    rounds = {(("round", w), 64): t for w, t in zip(widths, (0.9, 1.0, 1.25, 1.2))}  # round(4) < round(2): noise
    table = CostTable(base.meta, {**base.seconds, **rounds})
    t_verify, t_draft = table.auto_prices(widths, greedy=True, span=64)
    np.testing.assert_allclose(t_verify, [0.9, 0.7, 0.95, 0.95], rtol=1e-6)
    assert t_draft == 0.3
    t_verify_s, t_draft_s = table.auto_prices(widths, greedy=False, span=64)
    np.testing.assert_allclose(t_verify_s, t_verify)
    assert t_draft_s == 0.5  # the sampled round: round(w) + 0.2
    assert table.decode_ms(64)["t_round_ms"] == {0: 900.0, 1: 1000.0, 2: 1250.0, 4: 1200.0}


def test_probe_floor_prices_the_wait():
    """A drafting round priced at one plain step waits at least 1 / PROBE_BUDGET = 50 rounds between
    probes (then doubles to 100, then the 128-round cap); one at 0.1 of a step keeps the 8-round start."""
    assert int(A.probe_floor(jnp.float32(1.0), jnp.float32(1.0))) == round(1 / A.PROBE_BUDGET) == 50
    assert int(A.probe_floor(jnp.float32(0.1), jnp.float32(1.0))) == 5
    assert int(A.probe_floor(jnp.float32(1.0), jnp.float32(0.0))) == 2**20  # a zero step price: capped
    state, drafted = A.init_auto_state(1, G, probe_every=8), []
    for _ in range(500):
        drafted.append(bool(state.draft_on))
        state = A.schedule(state, jnp.ones((), bool), jnp.float32(1.0), jnp.float32(2.0), jnp.float32(1.0), 8, 50)
    starts = [i for i, d in enumerate(drafted) if d]
    gaps = [b - a for a, b in zip(starts, starts[1:]) if b - a > 1]
    assert gaps[:4] == [51, 101, 129, 129], starts


def test_first_round_drafts_only_where_a_good_drafter_would_pay():
    """The first round drafts iff drafting pays with every position accepted at
    FIRST_ROUND_ACCEPTANCE = 0.7 (8 drafts: 1 + 2.2 expected tokens): a round priced at 0.5 of a step
    plus a 2-step pass pays (3.2 / 2.5 > 1), one priced at 5 steps does not (3.2 / 7 < 1), nor at
    1.4 steps, 3.4 with the pass (3.2 / 3.4; at 0.8 it would pay: 4.3 / 3.4). A state that does
    not draft first waits max(probe_every, floor) rounds for its first probe."""
    widths = (0, 1, 2, 4, 8)
    t_verify = jnp.asarray([1.0, 1.1, 1.2, 1.5, 2.0], jnp.float32)

    def first(t_draft):
        return bool(A.first_round_drafts(A.AutoWidths(widths, t_verify, jnp.float32(t_draft)), 8))

    assert first(0.5) and not first(5.0) and not first(1.4)
    on = A.init_auto_state(2, 8, 8, jnp.bool_(True), 50)
    off = A.init_auto_state(2, 8, 8, jnp.bool_(False), 50)
    assert bool(on.draft_on) and int(on.wait) == 8
    assert not bool(off.draft_on) and int(off.wait) == 50 and int(off.idle) == 0


def test_probes_back_off_and_the_realized_rate_stops_drafting():
    """:func:`auto_verify.schedule`, the loop's drafting decision: rounds priced at two plain steps
    that emit one token each (nothing accepted) while the forecast keeps promising: drafting stops
    after the realized rate's first rounds, and the probes come after 8, 16, 32, 64, then 128
    rounds without drafts (not every 8th); rounds that emit three tokens keep drafting."""
    t_step, price = jnp.float32(1.0), jnp.float32(2.0)
    yes = jnp.ones((), bool)
    for emitted, expect in ((1.0, "backoff"), (3.0, "always")):
        state, drafted = A.init_auto_state(1, G, probe_every=8), []
        for _ in range(400):
            drafted.append(bool(state.draft_on))
            state = A.schedule(state, yes, jnp.float32(emitted), price, t_step, 8)
        starts = [i for i, d in enumerate(drafted) if d]
        if expect == "always":
            assert all(drafted), starts
            continue
        first = [i for i in range(1, len(starts)) if starts[i] - starts[i - 1] > 1]
        assert starts[: first[0]] == list(range(first[0])) and first[0] <= 3, starts  # stops at once
        assert list(np.diff(starts[first[0] - 1 :])[:6]) == [9, 17, 33, 65, 129, 129], starts
