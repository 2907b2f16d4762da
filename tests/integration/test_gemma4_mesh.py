"""A Gemma 4 target (two attention shapes, two KV caches) on device meshes (docs/design.md#device-mesh).

With 8 forced CPU devices (subprocess ``tests/helpers/gemma4_mesh_worker.py``): the tiny transformers-written
Gemma 4 model on ``data:2,model:4`` and ``fsdp:2,model:4`` gives the one-device logits (1e-4) and
the one-device tokens of greedy plain and speculative decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.forced_devices import run_worker


@pytest.fixture(scope="module")
def report() -> dict:
    return run_worker("gemma4_mesh_worker", timeout=900)


@pytest.mark.parametrize("mesh", ("data:2,model:4", "fsdp:2,model:4"))
def test_gemma4_on_a_mesh_equals_one_device(report, mesh):
    assert report["devices"] == 8
    ref, got = report["one_device"], report[mesh]
    np.testing.assert_allclose(np.asarray(got["logits"]), np.asarray(ref["logits"]), atol=1e-4, rtol=0)
    assert got["plain"] == ref["plain"] and got["speculative"] == ref["speculative"] == ref["plain"]
