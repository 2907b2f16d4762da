"""``dspark_jax.training.distributed``: flag validation and the process layout of a plan (no devices)."""

from __future__ import annotations

import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.training.distributed import DistributedSpec, process_layout


def test_explicit_spec_needs_all_three_and_a_valid_rank():
    DistributedSpec("h:1", 2, 1).validate()
    DistributedSpec(None, 4, None).validate(plan_only=True)  # --dry-run --num-processes 4
    DistributedSpec(None, None, None, auto=True).validate()
    for bad in (DistributedSpec("h:1", 2, None), DistributedSpec("h:1", 2, 2), DistributedSpec("h", 2, 0)):
        with pytest.raises(DSparkInputError):
            bad.validate()


@pytest.mark.parametrize(
    "devices,procs,sizes,rows,spans",
    [
        (16, 4, {"data": 16, "fsdp": 1, "model": 1}, 16, False),  # pure data parallel: B / P per process
        (16, 2, {"data": 4, "fsdp": 1, "model": 4}, 32, False),  # two model groups per process
        (16, 4, {"data": 2, "fsdp": 1, "model": 8}, 32, True),  # a model group spans two processes
        (16, 4, {"data": 2, "fsdp": 2, "model": 4}, 16, False),
    ],
)
def test_process_layout_rows_per_process(devices, procs, sizes, rows, spans):
    lay = process_layout(devices, procs, sizes, 64)
    assert lay["devices_per_process"] == devices // procs
    assert lay["per_process_batch"] == rows and lay["model_group_spans_processes"] is spans


def test_process_layout_refuses_an_uneven_split():
    with pytest.raises(DSparkInputError, match="split evenly"):
        process_layout(10, 4, {"data": 10, "fsdp": 1, "model": 1}, 40)
