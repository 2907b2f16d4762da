"""Measured costs kept on disk between processes (``dspark_jax.decoding.disk_cache``): the store
itself, the batch-1 cost table of ``auto`` verification, and the serving engine's SPS table."""

from __future__ import annotations

import json
import logging

import pytest

from dspark_jax.decoding import cost_table as ct
from dspark_jax.decoding import decode_profile as dp
from dspark_jax.decoding import disk_cache
from tests.helpers.tiny import tiny_drafter, tiny_target


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DSPARK_REFRESH_COSTS", raising=False)
    return tmp_path


def test_store_round_trip_refresh_off_and_corrupt_files(store, monkeypatch):
    key = disk_cache.cost_key("sps_table", cache_len=64, model={"layers": 2})
    assert disk_cache.load_costs(key) is None
    path = disk_cache.save_costs(key, {"a": 1.5})
    assert path is not None and path.parent == store / "costs"
    assert disk_cache.load_costs(key) == {"a": 1.5}
    other = disk_cache.cost_key("sps_table", cache_len=128, model={"layers": 2})
    assert disk_cache.load_costs(other) is None  # another shape is another table
    monkeypatch.setenv("DSPARK_REFRESH_COSTS", "1")
    assert disk_cache.load_costs(key) is None  # refresh: measure again
    monkeypatch.delenv("DSPARK_REFRESH_COSTS")
    path.write_text("{not json")
    assert disk_cache.load_costs(key) is None  # unreadable: measured again, no error
    path.write_text(json.dumps({"key": other, "table": {"a": 2}}))
    assert disk_cache.load_costs(key) is None  # a file for another key (a hash collision) is not trusted
    monkeypatch.setenv("DSPARK_CACHE_DIR", "off")
    assert disk_cache.cache_dir() is None and disk_cache.save_costs(key, {"a": 1}) is None


def test_cost_table_is_measured_once_and_reused_by_a_later_process(store, monkeypatch, caplog):
    """The second "process" (an empty in-memory cache) gets the very table the first measured,
    without measuring: same chosen lengths, same tau. Measuring says so first (a command shows it
    on stderr: the minutes a first ``auto`` run spends are not silent); reusing says nothing."""
    monkeypatch.setattr(logging.getLogger(dp.__name__), "propagate", True)  # a command may have turned it off
    caplog.set_level(logging.INFO, logger=dp.__name__)
    target = tiny_target()
    drafter = tiny_drafter(target)
    calls = []
    real = dp.measure_costs

    def counting(*a, **kw):
        calls.append(kw.get("cache_len"))
        return real(*a, **{**kw, "repeats": 1, "inner": 1, "widths": (0, 1)})  # few programs to compile

    monkeypatch.setattr(dp, "measure_costs", counting)
    monkeypatch.setattr(dp, "_COST_TABLES", dp.LRUCache(maxsize=8))
    first = dp.cached_cost_table(target, drafter, 32)
    assert calls == [32] and list((store / "costs").glob("cost_table-*.json"))
    said = sum("measuring decode costs" in r.getMessage() for r in caplog.records)
    assert said >= 1  # once per capturing handler in the chain (a worker's earlier command may add one)
    assert first.spans() == [32] and first.meta["cache_len"] == 32  # one span: the whole (one-block) cache
    # and the auto loop's own rounds at each of its widths (the prices it decides by)
    assert first.round_widths == dp.default_widths(drafter.cfg.block_size)
    assert all(first.cost(("round", w), 32) >= dp.MIN_ROUND_SECONDS for w in first.round_widths)
    monkeypatch.setattr(dp, "_COST_TABLES", dp.LRUCache(maxsize=8))  # a new process
    assert dp.cached_cost_table(target, drafter, 32) == first and calls == [32]
    assert sum("measuring decode costs" in r.getMessage() for r in caplog.records) == said  # reused: silent
    key = ct.table_key("cost_table", cache_len=32)
    ct.store_table(key, first)
    assert ct.stored_table(key) == first
