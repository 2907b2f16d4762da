"""Multi-process training: starting ``jax.distributed`` and the process layout of a ``--dry-run`` plan.

A run over several hosts (a TPU VM pod slice, several GPU nodes) is the same command started once
per process; every process computes the same global batch from ``(seed, step)`` and transfers only
the rows its own devices hold (:meth:`~dspark_jax.training.trainer.Trainer.shard_batch`). Process 0
writes the logs, the run's JSON files and the export's metadata; Orbax writes the checkpoints and
the export's parameters from every process into one folder, so ``workdir`` must be a filesystem
every host sees (NFS, a GCS FUSE mount).

How the processes find each other (:func:`initialize_distributed`):

* ``--coordinator-address HOST:PORT --num-processes N --process-id I``: explicit, e.g. one process
  per GPU node started by hand or by ``srun``; every local device belongs to the process (JAX's
  cluster auto-detection, which would give a SLURM task one GPU, is turned off);
* ``--distributed``: ``jax.distributed.initialize()`` with no arguments, which reads the TPU VM pod
  metadata, SLURM or Open MPI variables;
* neither: the environment route of :func:`maybe_initialize_distributed` (``JAX_COORDINATOR_ADDRESS``
  or ``DSPARK_DISTRIBUTED=1``), else a single process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from dspark_jax.errors import DSparkInputError


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """How this process joins a multi-process run (module docstring); all None/False: one process.

    Attributes:
      coordinator_address: ``HOST:PORT`` of process 0's coordinator service.
      num_processes: processes in the run (one per host or node).
      process_id: this process's index in ``[0, num_processes)``.
      auto: let ``jax.distributed.initialize()`` detect everything (TPU pod, SLURM, Open MPI).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    @property
    def explicit(self) -> bool:
        """True when the coordinator address, process count and process id are all given."""
        return None not in (self.coordinator_address, self.num_processes, self.process_id)

    def validate(self, plan_only: bool = False) -> None:
        """Raises DSparkInputError on an incomplete or inconsistent spec (``plan_only``: a ``--dry-run``
        plan, where ``--num-processes`` alone is enough)."""
        given = [x is not None for x in (self.coordinator_address, self.num_processes, self.process_id)]
        if any(given) and not all(given) and not (self.auto or plan_only):
            raise DSparkInputError(
                "--coordinator-address, --num-processes and --process-id go together "
                "(or use --distributed to detect them on a TPU pod / SLURM / Open MPI)"
            )
        if self.num_processes is not None and self.num_processes < 1:
            raise DSparkInputError(f"--num-processes must be >= 1, got {self.num_processes}")
        if (
            self.process_id is not None
            and self.num_processes is not None
            and not 0 <= self.process_id < self.num_processes
        ):
            raise DSparkInputError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise DSparkInputError(f"--coordinator-address must be HOST:PORT, got {self.coordinator_address!r}")


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    """The multi-process flags of ``python -m dspark_jax.train`` (module docstring)."""
    g = p.add_argument_group("multi-process (TPU pod slices, multi-node GPU)")
    g.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address and a free port; with --num-processes and --process-id",
    )
    g.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="processes in the run (one per host/node); with --dry-run: plan the layout for N processes",
    )
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index, 0..N-1")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="jax.distributed.initialize() with auto-detection (TPU VM pod metadata, SLURM, Open MPI)",
    )


def spec_from_args(args: argparse.Namespace) -> DistributedSpec:
    """The :class:`DistributedSpec` of parsed flags (:func:`add_distributed_arguments`), validated
    (with ``args.dry_run``: as a plan, :meth:`DistributedSpec.validate`).

    Raises:
      DSparkInputError: an incomplete or inconsistent spec.
    """
    spec = DistributedSpec(args.coordinator_address, args.num_processes, args.process_id, bool(args.distributed))
    spec.validate(plan_only=bool(getattr(args, "dry_run", False)))
    return spec


def _initialize(**kwargs) -> None:
    import jax

    if not jax.distributed.is_initialized():  # e.g. the CLI started it, then run() asks again
        jax.distributed.initialize(**kwargs)


def initialize_distributed(spec: DistributedSpec) -> None:
    """Joins the multi-process run ``spec`` describes (before any device is touched); idempotent.

    A spec that asks for nothing falls back to :func:`maybe_initialize_distributed`.

    Raises:
      DSparkInputError: an invalid spec.
    """
    spec.validate()
    if spec.explicit and spec.num_processes == 1:
        return
    if spec.explicit:
        # All local devices belong to this process: JAX's SLURM detection would otherwise pin one GPU per task.
        _initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            cluster_detection_method="deactivate",
        )
    elif spec.auto:
        _initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
        )
    else:
        maybe_initialize_distributed()


def maybe_initialize_distributed() -> None:
    """Calls ``jax.distributed.initialize()`` when launched as one of several processes.

    Triggered by the standard coordinator variables (``JAX_COORDINATOR_ADDRESS``,
    or TPU VM pod metadata via ``DSPARK_DISTRIBUTED=1``). Idempotent.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("DSPARK_DISTRIBUTED") == "1":
        _initialize()


def process_layout(devices: int, num_processes: int, sizes: dict[str, int], global_batch: int) -> dict:
    """Which devices and batch rows each of ``num_processes`` processes holds (no devices needed).

    Devices are numbered process by process (``jax.devices()`` order) and laid on the
    ``(data, fsdp, model)`` mesh ``sizes`` with ``model`` fastest
    (:func:`~dspark_jax.models.sharding.make_mesh`), so a process holds ``devices / num_processes``
    consecutive devices; the global batch is split over ``data x fsdp`` and devices along ``model``
    hold the same rows.

    Returns:
      ``processes``, ``devices_per_process``, ``per_process_batch`` (rows of the global batch one
      process feeds per step), ``batch_shards_per_process`` and ``model_group_spans_processes``.
    Raises:
      DSparkInputError: a device count that does not split evenly over the processes.
    """
    if num_processes < 1 or devices % num_processes:
        raise DSparkInputError(f"{devices} devices do not split evenly over {num_processes} processes")
    per = devices // num_processes
    m = sizes["model"]
    n_batch = sizes["data"] * sizes["fsdp"]
    shards = len({i // m for i in range(per)})  # batch shards of process 0's devices (the same for every process)
    return {
        "processes": num_processes,
        "devices_per_process": per,
        "per_process_batch": global_batch // n_batch * shards,
        "batch_shards_per_process": shards,
        "model_group_spans_processes": m > per,
    }
