"""The serving scheduler's suspension, probing and resumption (``dspark_jax.serving.engine.planner``),
driven without JAX: a scripted drafter whose acceptance changes over time, an SPS table in
which drafting pays only when drafts are accepted, and the engine's host loop in miniature."""

import numpy as np
import pytest

from dspark_jax.decoding.auto_verify import ACCEPTANCE_DECAY
from dspark_jax.decoding.cost_table import CostTable
from dspark_jax.serving.engine.online_calibration import OnlineCalibrator
from dspark_jax.serving.engine.planner import MAX_PROBE_INTERVAL, Planner
from dspark_jax.serving.engine.slots import SlotRecord

GAMMA = 4
LADDER = (2, 4, 8, 16)


def _sps(rows: int = 1) -> dict:
    """Steps/s falling with packed tokens; a drafting step costs 25% more than a plain one."""
    entries = {}
    for k in range(rows, rows * (GAMMA + 1) + 1):
        for d in (False, True):
            entries[(rows, k, d)] = 100.0 / (1.0 + 0.1 * (k - rows)) / (1.25 if d else 1.0)
    return entries


def _table(rows: int = 1) -> CostTable:
    return CostTable.from_steps_per_s(_sps(rows), span=256)


def _record() -> SlotRecord:
    return SlotRecord(None, 0, 4, 5, 10**9, frozenset(), [])  # pyright: ignore[reportArgumentType]


def _drive(planner: Planner, rec: SlotRecord, script, steps: int) -> list[dict]:
    """Runs ``steps`` engine steps of one request; ``script(step) -> (z, accepted_per_draft)``
    gives the drafter's raw confidence logit and whether each verified draft is accepted."""
    log = []
    for step in range(steps):
        ell, rows, tokens, draft_next = planner.plan([rec])
        planner.drafting = bool(draft_next)
        suspended = planner.suspend_now(rows, tokens, draft_next)
        rec.stale_from = (rec.length - 1 if rec.stale_from is None else rec.stale_from) if suspended else None
        planner.record_step(rows, tokens, draft_next)
        z, good = script(step)
        acc = int(ell[0]) if good else 0
        if ell[0] > 0:
            planner.calibrator.observe(np.asarray(rec.z)[None], ell, np.asarray([acc]))
            planner.calibrator.update()
            rec.observe_round(int(ell[0]), acc, GAMMA, ACCEPTANCE_DECAY)
        rec.length += 1 + acc
        rec.push_z(np.full(GAMMA, z) if draft_next else None)
        log.append({"step": step, "verified": int(ell[0]), "drafted": bool(draft_next), "suspended": suspended})
    return log


@pytest.mark.parametrize("policy", ["dspark", "greedy"])
def test_suspended_policy_probes_backs_off_and_resumes(policy):
    """Bad drafts: the policy stops drafting, suspends, and probes at doubling intervals (never
    stopping); once drafts are accepted again, a probe sees it and drafting resumes for good."""
    cal = OnlineCalibrator(GAMMA, min_obs=4)
    planner = Planner(GAMMA, True, LADDER, [1], cal, suspend_after=4, policy=policy)
    planner.set_table(_table())
    rec = _record()
    rec.push_z(np.full(GAMMA, -4.0))  # the prefill's block: hopeless
    switch = 300
    log = _drive(planner, rec, lambda s: (-4.0, False) if s < switch else (4.0, True), switch + 2 * MAX_PROBE_INTERVAL)
    bad, good = log[:switch], log[switch:]
    assert sum(e["suspended"] for e in bad) > 0.8 * switch  # it gave up on the drafter ...
    probes = [e["step"] for e in bad if e["drafted"]]
    gaps = np.diff(probes)
    assert len(probes) >= 4 and np.all(gaps[1:] >= gaps[:-1])  # ... but kept probing, backing off
    resumed = next(e["step"] for e in good if e["verified"] > 0)  # the first probe after the switch
    assert resumed - switch <= MAX_PROBE_INTERVAL + 1
    after = [e for e in good if e["step"] > resumed + 2]
    assert all(e["drafted"] and not e["suspended"] for e in after)  # drafting stayed on
    assert np.mean([e["verified"] for e in after]) >= 2
    assert planner.probe_interval == 4 and planner.probes == len(probes) + 1
    assert planner.decision is not None and planner.decision["draft"]


def test_one_unlucky_round_does_not_switch_drafting_off():
    """The report that motivated probing: the first round's drafts are all rejected, later
    ones are good. The prior over requests without confidences is shrunk towards 1/2, so the
    drafter is back within a few probes (today's first failure pinned it at 0 forever)."""
    cal = OnlineCalibrator(GAMMA, min_obs=4)
    planner = Planner(GAMMA, True, LADDER, [1], cal, suspend_after=4, policy="dspark")
    planner.set_table(_table())
    rec = _record()
    rec.push_z(np.full(GAMMA, 3.0))
    log = _drive(planner, rec, lambda s: (3.0, s > 0), 200)
    assert log[0]["verified"] > 0
    assert sum(e["verified"] > 0 for e in log) > 150
    assert cal.prior_survival()[0] > 0.5  # the good rounds, not the first one, set the prior


def test_probes_are_priced():
    """When a drafting round costs far more than the plain time since the last probe could pay
    for, the probe waits (its extra seconds are at most PROBE_BUDGET of that time)."""
    cal = OnlineCalibrator(GAMMA, min_obs=4)
    planner = Planner(GAMMA, True, LADDER, [1], cal, suspend_after=4, policy="dspark")
    sps = _sps()
    for k in range(1, GAMMA + 2):
        sps[(1, k, True)] = 1.0  # a drafting step costs 100 plain steps
    planner.set_table(CostTable.from_steps_per_s(sps, span=256))
    rec = _record()
    log = _drive(planner, rec, lambda s: (-4.0, False), 1100)
    probes = [e["step"] for e in log if e["drafted"]]
    assert len(probes) == 1 and probes[0] >= 990  # ~1000 plain steps (10 s) pay for one probe (1 s)


def test_the_plan_reads_the_sps_of_the_live_span():
    """The SPS table is a function of the attention span: the same confident drafts pay at a
    short live length and do not at a long one, where (in this table) a drafting step costs
    100 plain steps."""
    slow = {k: (1.0 if k[2] else v) for k, v in _sps().items()}
    table = CostTable({}, {**_table().seconds, **CostTable.from_steps_per_s(slow, span=1024).seconds})
    drafts = []
    for length in (5, 900):
        planner = Planner(GAMMA, True, LADDER, [1], OnlineCalibrator(GAMMA), suspend_after=4, policy="dspark")
        planner.set_table(table)
        rec = _record()
        rec.length = length
        rec.push_z(np.full(GAMMA, 4.0))
        assert planner.live_span([rec]) == length + GAMMA
        drafts.append(planner.plan([rec])[3])
    assert drafts == [True, False]


def test_observe_round_counts_what_verification_reached():
    """Position k was reached iff k <= verified and k <= accepted + 1; older rounds decay."""
    rec = _record()
    rec.observe_round(3, 1, GAMMA, 0.5)  # positions 1, 2 reached; 1 accepted
    rec.observe_round(4, 4, GAMMA, 0.5)  # every position reached and accepted
    np.testing.assert_allclose(rec.seen, [1.5, 1.5, 1.0, 1.0])
    np.testing.assert_allclose(rec.hits, [1.5, 1.0, 1.0, 1.0])


def _observed_request(accepted: int | None) -> tuple[Planner, SlotRecord]:
    """A one-row dspark planner and a request that had ``accepted`` of ``GAMMA`` drafts accepted in
    each of 64 verified rounds (None: no round observed yet)."""
    planner = Planner(GAMMA, True, LADDER, [1], OnlineCalibrator(GAMMA), suspend_after=4, policy="dspark")
    planner.set_table(_table())
    rec = _record()
    for _ in range(0 if accepted is None else 64):
        rec.observe_round(GAMMA, int(accepted or 0), GAMMA, ACCEPTANCE_DECAY)
    return planner, rec


def test_drafting_decision_follows_the_requests_observed_acceptance():
    """The next block is not drafted yet, so whether to draft it is forecast from the request's
    observed acceptance, shrunk towards its latest confidences: a request whose drafts were
    mostly accepted keeps drafting after one block with low confidence, one whose drafts were
    rejected stops after a fairly confident block. Without observations the latest confidences decide."""
    decisions = {}
    cases = (("good, z=-4", -4.0, GAMMA), ("none, z=-4", -4.0, None), ("bad, z=1", 1.0, 0), ("none, z=1", 1.0, None))
    for name, z, accepted in cases:
        planner, rec = _observed_request(accepted)
        rec.push_z(np.full(GAMMA, z))
        decisions[name] = bool(planner.plan([rec])[3])
    assert decisions == {"good, z=-4": True, "none, z=-4": False, "bad, z=1": False, "none, z=1": True}


def test_deployed_budget_follows_the_requests_observed_acceptance():
    """The dspark policy fixes a step's budget before the verified block's confidences exist, from
    the block two steps old: forecast with the request's observed acceptance. At one row that
    budget is the verified length, so a request whose drafts were rejected verifies few drafts
    after a fairly confident stale block, one whose drafts were accepted verifies the whole block after
    a doubtful one; without observations the stale confidences decide."""
    tokens = {}
    cases = (("bad, z=1", 1.0, 0), ("none, z=1", 1.0, None), ("good, z=-4", -4.0, GAMMA), ("none, z=-4", -4.0, None))
    for name, z_old, accepted in cases:
        planner, rec = _observed_request(accepted)
        for z in (z_old, 0.0, 4.0):  # the verified block itself is confident in every case
            rec.push_z(np.full(GAMMA, z))
        tokens[name] = planner.plan([rec])[2]
    full = 1 + GAMMA
    assert tokens["none, z=1"] == full and tokens["good, z=-4"] == full
    assert tokens["bad, z=1"] < full and tokens["none, z=-4"] < full


def test_one_row_budgets_include_one_and_two_drafts():
    """Below the ladder's first budget the dspark/greedy policies compile whole drafts per row, so
    one row can verify 1 or 2 drafts without paying for a 3-draft step; fixed:G compiles its own."""
    planner = Planner(8, True, (4, 8, 16), [1, 2, 4], OnlineCalibrator(8), suspend_after=4, policy="dspark")
    assert [planner.budgets(r) for r in (1, 2, 4)] == [[1, 2, 3, 4, 8, 9], [2, 4, 8, 16], [4, 8, 16]]
    planner.set_policy("fixed:2")
    assert planner.budgets(1) == [1, 3]


def test_a_plan_made_ahead_bounds_room_by_the_step_in_flight():
    """Planned before the step in flight is read (engine overlap), a row's room before its end
    counts the most that step can add (its verified drafts + 1), so no step runs past a row's
    end; the block it verifies is known to exist only if the step in flight drafts one, and is
    forecast from the latest confidences read."""
    from dspark_jax.serving.engine.planner import Lookahead

    planner = Planner(GAMMA, True, LADDER, [1], OnlineCalibrator(GAMMA), suspend_after=4, policy="fixed:3")
    rec = _record()
    rec.end = rec.length + 7  # synchronously: room for min(GAMMA, 6) drafts
    rec.push_z(np.full(GAMMA, 2.0))
    assert planner.plan([rec])[0].tolist() == [3]
    ahead = lambda adv, has: planner.plan([rec], Lookahead(np.array([adv]), np.array([has])))[0].tolist()
    assert ahead(4, True) == [2]  # the step in flight verifies 3 drafts: at most 4 more tokens
    assert ahead(6, True) == [0]  # ... or 5: nothing left to verify
    assert ahead(1, False) == [0]  # the step in flight does not draft: no block to verify
    rec.z = None  # the block verified in flight had no confidences: the latest read stand in
    assert ahead(1, True) == [3]


@pytest.mark.parametrize("policy", ["dspark", "fixed:2"])
def test_a_plan_made_ahead_defers_resuming_a_suspended_drafter(policy):
    """While suspended, resuming needs a catch-up over tokens a plan made ahead has not read: such
    a plan stays plain, takes no probe and sets ``deferred``; the engine then plans the next
    step after the read (``plans_ahead`` is False), where the same decision drafts."""
    from dspark_jax.serving.engine.planner import Lookahead

    planner = Planner(GAMMA, True, LADDER, [1], OnlineCalibrator(GAMMA), suspend_after=4, policy=policy)
    planner.set_table(_table())
    rec = _record()
    rec.push_z(np.full(GAMMA, 4.0))  # confident: the dspark policy wants to draft
    planner.idle_steps, rec.stale_from = 4, 2  # suspended, context missing from position 2
    planner.speculative_ahead = True  # opt-in
    assert planner.suspended() and planner.plans_ahead(1, 1) and not planner.plans_ahead(1, 3)
    la = Lookahead(np.array([1]), np.array([False]), may_draft=False)
    probes = planner.probes
    ell, rows, tokens, draft_next = planner.plan([rec], la)
    assert (ell.tolist(), tokens, draft_next) == ([0], 1, False) and planner.deferred
    assert planner.probes == probes and planner.suspend_now(rows, tokens, draft_next)
    assert not planner.plans_ahead(1, 1)
    planner.deferred = False  # the engine's next plan, after the read
    assert planner.plan([rec])[3]
