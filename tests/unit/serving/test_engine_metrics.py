"""The serving engine's counters, SPS table (stored, reused, profiled per attention span), the dspark
policy's reported decision and the program cache (the shared engine: conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import Engine, EngineConfig
from dspark_jax.serving.engine.step_programs import ProgramCache

BLOCK_SIZE, CACHE = 3, 64  # the shared engine's (conftest.py)


def test_metrics_and_calibration_exported(engine, requests, drive):
    engine.set_policy("fixed:3")
    engine.reset_metrics()
    drive(engine, requests[:3])
    m = engine.metrics()
    cal = m["calibration"]
    assert len(cal["temperatures"]) == BLOCK_SIZE and all(t > 0 for t in cal["temperatures"])
    assert sum(cal["observations"]) > 0
    assert m["drafts"] > 0 and m["mean_accepted_length"] >= 1.0
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert engine.sps_table is not None and engine.sps_table.sps(2, 8, True) > 0


def test_sps_table_is_stored_and_reused_by_a_new_engine(engine, target, drafter, tmp_path, monkeypatch):
    """Issue 26: a second engine of the same shapes (a later process) adopts the SPS table the
    first profiled, from disk, instead of profiling again; the weights' fingerprint is not part
    of the key (costs do not depend on weight values)."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    engine.set_policy("dspark")
    table = engine.profile_sps(iters=1)
    assert list((tmp_path / "costs").glob("sps_table-*.json"))
    cfg = EngineConfig(
        num_slots=2, cache_len=CACHE, policy="dspark", buckets=(8,), prefill_buckets=(32,), suspend_after=2
    )
    twin = Engine(target, drafter, cfg, program_cache=engine.program_cache)
    twin.ensure_sps_table()  # what warmup() does after compiling
    assert twin.table_source == "stored" and twin.sps_table is not None
    assert twin.sps_table.seconds == table.seconds and twin.sps_table.matches(twin.device.meta())
    assert table.spans() == [CACHE]  # one span by default: the (one-block) cache a step of inactive rows reads
    monkeypatch.setenv("DSPARK_REFRESH_COSTS", "1")
    assert twin.device.stored_table() is None  # a refresh measures again


def test_sps_is_profiled_at_the_spans_asked_for(target, tmp_path):
    """Issue 24: the SPS table is a function of the attention span. At one KV block every row
    is inactive; beyond, row 0 runs live with its anchor in the block below the span (reset
    before every timing, restored after; an idle engine only). A table file of the previous
    format is refused with a one-line error. (The step is faked: no program to compile.)"""
    eng = Engine(
        target,
        None,
        EngineConfig(num_slots=2, cache_len=600, policy="plain", profile_spans=[700, 1, 300], prefill_chunk_tokens=0),
    )
    assert eng.profile_spans == (256, 512, 600)
    seen = []

    def fake_step(rows, tokens, ell, active, draft_next):
        seen.append((bool(active[0]), int(np.asarray(eng.device.state.pos)[0])))
        eng.device.state = eng.device.state._replace(pos=eng.device.state.pos + 1)  # a step advances the row

    eng.device.run_step = fake_step
    table = eng.device.profile([(1, 1), (2, 2)], iters=2, spans=eng.profile_spans)
    assert table.spans() == [256, 512, 600] and table.covers_steps([(1, 1), (2, 2)], [False], [256, 512, 600])
    # warm calls, then 2 rotated rounds: row 0's position reset before each (inactive rows at their own)
    assert len(seen) == 3 * 2 * 3 and set(seen) == {(False, 0), (True, 256), (True, 512)}
    assert seen[:6] == [(False, 0), (False, 0), (True, 256), (True, 256), (True, 512), (True, 512)]
    assert np.asarray(eng.device.state.pos).tolist() == [0, 0]  # restored
    with pytest.raises(DSparkInputError, match="idle engine"):
        eng.device.profile([(1, 1)], iters=1, spans=[512], busy=1)
    assert eng.device.spans_now(eng.profile_spans, busy=1) == (256,)
    old = tmp_path / "sps.json"
    old.write_text('{"meta": {}, "entries": [{"rows": 1, "tokens": 1, "draft": false, "sps": 9.0}]}')
    with pytest.raises(DSparkInputError, match="previous format"):
        Engine(target, None, EngineConfig(num_slots=1, cache_len=300, policy="plain"), sps_table=old)


def test_dspark_policy_reports_its_decision(engine, requests, caplog, drive):
    """The dspark policy exposes why it drafts or not (expected tokens/s both ways, the priced
    catch-up) and logs one line when it suspends and when it resumes drafting."""
    import logging

    engine.set_policy("dspark")
    engine.reset_metrics()
    with caplog.at_level(logging.INFO, logger="dspark_jax.serving.engine"):
        drive(engine, requests)  # records decisions (whether it drafts depends on timings)
        engine.set_policy("plain")  # never drafts: suspends after suspend_after=2 steps
        drive(engine, requests[:1])
        engine.set_policy("fixed:3")  # always drafts: resumes
        drive(engine, requests[:1])
        engine.set_policy("dspark")
    dec = engine.metrics()["scheduler_decision"]
    assert dec is not None and dec["tokens_per_s_drafting"] > 0 and dec["tokens_per_s_plain"] > 0
    wins = dec["tokens_per_s_drafting"] > dec["tokens_per_s_plain"]
    if dec["catchup_seconds"] == 0:
        assert dec["draft"] == wins
    else:  # resuming must also pay back the catch-up
        assert wins or not dec["draft"]
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_jax.serving.engine"]
    assert any(m.startswith("suspending drafting") and "tokens/s drafting vs" in m for m in lines), lines
    assert any(m.startswith("resuming drafting") for m in lines), lines


def test_program_cache_is_a_bounded_lru():
    """The engine's compile cache keeps at most ``max_size`` executables, dropping the least
    recently used; engine signatures get stable small ids."""
    cache = ProgramCache(max_size=2)
    a, b = cache.intern(("sig", 1)), cache.intern(("sig", 2))
    assert a != b and cache.intern(("sig", 1)) == a
    cache.put((a, "step"), "x")
    cache.put((a, "move"), "y")
    assert cache.get((a, "step")) == "x"  # now the most recently used
    cache.put((b, "step"), "z")  # drops (a, "move")
    assert (a, "move") not in cache and cache.get((a, "move")) is None
    assert len(cache) == 2 and cache.get((a, "step")) == "x" and cache.get((b, "step")) == "z"
    with pytest.raises(ValueError):
        ProgramCache(max_size=0)
