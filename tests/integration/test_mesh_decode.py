"""Speculative decoding with a target on a device mesh (docs/design.md#device-mesh).

With 8 forced CPU devices (subprocess ``tests/helpers/mesh_decode_worker.py``, one process for every
case), stories260K and a drafter restored from an export (its arrays committed to one device):

* ``generate_speculative`` with the target on a ``data:2,model:4`` mesh (``load_target_and_drafter``,
  or a drafter loaded on its own) emits the one-device tokens exactly, greedy and at T=1 with
  seeds, with drafts accepted;
* the drafter is placed on the target's mesh once (by the sharding rules), follows a target on
  another mesh (the first 4 devices) and comes back to one device;
* the serving mesh ``model:4`` on an 8-device host is the first 4 devices; impossible or
  data-splitting meshes are one-line errors.
"""

from __future__ import annotations

import pytest

from tests.helpers.forced_devices import run_worker

CASES = ("mesh_2x4", "late_drafter_2x4", "model4_first_devices", "back_to_one_device")


@pytest.fixture(scope="module")
def report(stories260k_dir) -> dict:
    return run_worker("mesh_decode_worker", timeout=900)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("setting", ("greedy", "t1"))
def test_sharded_target_decodes_like_one_device(report, case, setting):
    assert report["devices"] == 8
    ref, got = report["one_device"][setting], report[case][setting]
    assert ref["accepted"] > 0  # drafts get accepted: the tokens depend on the drafter's part too
    assert got["tokens"] == ref["tokens"]
    assert got["accepted"] == ref["accepted"] and got["passes"] == ref["passes"]


def test_drafter_is_placed_on_the_target_mesh_once(report):
    d = report["drafter_on_mesh"]
    assert d["devices"] == [list(range(8))]
    assert d["wq_spec"] == "P(None, None, 'model')"  # 8 heads over model:4, by the sharding rules
    assert d["moved_again"] is False
    assert report["drafter_devices_after_model4"] == [[0, 1, 2, 3]]


def test_serving_mesh_model_n_takes_the_first_n_devices(report):
    assert report["serving_model4"] == {"shape": {"data": 1, "fsdp": 1, "model": 4}, "device_ids": [0, 1, 2, 3]}
    assert report["serving_error model:16"] == "mesh model:16 needs 16 devices, but 8 are available"
    assert "also splits data: use mesh=model:N" in report["serving_error data:2,model:4"]
