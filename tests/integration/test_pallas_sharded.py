"""The ``pallas_tpu`` attention path under ``shard_map`` on a device mesh (docs/design.md#attention-backends).

With 8 forced CPU devices (subprocess ``tests/helpers/pallas_shard_worker.py``) and a vectorised stand-in
for the kernel (the Mosaic kernel runs on a TPU only; jax 0.10.2's TPU interpret mode cannot run
it), the paged view, the split of the query and KV heads over the mesh (one KV head a device on
``model:4``; two devices a head with 2 KV heads; whole heads with 3) and the Gemma options
(query scale, soft-cap, window) give the ``xla`` path's output within float32 round-off. A
query-head to KV-head mismatch on any device would miss by far more.
"""

from __future__ import annotations

import pytest

from tests.helpers.forced_devices import run_worker


@pytest.fixture(scope="module")
def report() -> dict:
    return run_worker("pallas_shard_worker", timeout=300)


@pytest.mark.parametrize(
    "case,heads",
    [("model4_kv4", [2, 1]), ("model4_kv2", [2, 1]), ("model4_kv3", [6, 3]), ("data2_model4_kv4", [2, 1]),
     ("gemma_kv2", [2, 1])],
)  # fmt: skip
def test_sharded_kernel_path_equals_xla(report, case, heads):
    assert report[case]["max_diff"] <= 2e-6, report[case]
    assert report[case]["kernel_heads"] == [heads]  # (query, KV) heads one kernel call sees
