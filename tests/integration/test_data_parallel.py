"""Data parallel equivalence (docs/design.md#training): an 8-way data-parallel step equals a
one-device step on the same global batch.

The pytest process has already initialised JAX with one CPU device, so the check runs in
a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(``tests/helpers/dp_worker.py``), which prints its measurements as JSON.
"""

from __future__ import annotations

import pytest

from tests.helpers.forced_devices import run_worker


@pytest.fixture(scope="module")
def dp_report() -> dict:
    return run_worker("dp_worker", timeout=900)


def test_eight_way_step_equals_one_device_step(dp_report):
    r = dp_report
    assert r["devices"] == 8
    assert r["params_allclose"], r.get("params_error")  # rtol 1e-5 after two steps
    assert r["max_abs_param_diff_8_vs_1"] < 1e-6
    for a, b in zip(r["losses_1"], r["losses_8"]):
        assert a == pytest.approx(b, rel=1e-5)


def test_batch_is_really_sharded_and_params_replicated(dp_report):
    r = dp_report
    assert r["input_spec"] == "P('data',)" and r["input_num_devices"] == 8
    assert r["input_shard_shapes"] == [[2, 40]]  # 16 rows / 8 devices
    assert r["input_shards_match_rows"] and r["param_fully_replicated"]
    assert r["hlo_has_all_reduce"]  # gradients/loss sums reduced across devices


def test_multi_process_feeding_path_builds_the_same_global_arrays(dp_report):
    """The process-local feeding code (taken when jax.process_count() > 1), run in one process."""
    r = dp_report
    assert r["local_rows"] == [0, 16]
    assert r["multiprocess_path_same_arrays"] and r["multiprocess_replicate_ok"]


def test_loss_normalisation_is_global(dp_report):
    """Rows of very different lengths per device: the 8-way loss is the weighted mean over the
    whole global batch (the single-device value), not the mean of per-device means."""
    r = dp_report
    glob, per_dev = r["loss_global_single_device"], r["loss_mean_of_device_means"]
    assert r["losses_8"][0] == pytest.approx(glob, rel=1e-5)
    # The two normalisations really differ here (by 4e-4 relative), 40x the tolerance above.
    assert abs(per_dev - glob) > 1e-4 * abs(glob)


def test_gradient_accumulation_on_eight_devices_equals_big_batch(dp_report):
    r = dp_report
    assert r["max_abs_param_diff_8dev_accum2_vs_1"] < 1e-6
    for a, b in zip(r["losses_1"], r["losses_8_accum2"]):
        assert a == pytest.approx(b, rel=1e-5)
