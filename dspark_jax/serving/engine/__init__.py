"""The serving engine: device-resident continuous batching with speculative decoding, and the
host-side schedulers that only serving uses (docs/design.md#serving, docs/design.md#scheduler).

* :mod:`.engine` -- :class:`Engine` (``prefill`` / ``insert`` / ``generate`` / ``free``);
  its settings are :class:`EngineConfig` (:mod:`dspark_jax.serving.config`: the server's defaults);
* :mod:`.device` -- :class:`~.device.EngineDevice`, the device state and compiled programs
  (``Engine.device``); :mod:`.step_programs` and :mod:`.chunk_programs` the jitted bodies;
  :mod:`.state` the donated per-row state;
* :mod:`.requests` -- the public request types; :mod:`.slots` the host's slot table;
  :mod:`.prefill` batched, chunked prefill; :mod:`.counters` the cumulative counters;
* :mod:`.planner` -- per-step verification lengths from :mod:`.scheduler` (paper Section 7),
  the measured steps per second of every bucket (the SPS table: a
  :class:`~dspark_jax.decoding.cost_table.CostTable` profiled by ``EngineDevice.profile``) and
  online calibration (:mod:`.online_calibration`).

It imports nothing from :mod:`dspark_jax.serving.http` (the HTTP server sits on top of it).
"""

from dspark_jax.serving.config import EngineConfig
from dspark_jax.serving.engine.engine import Engine, Prefix, Request, SamplingParams, StepOutput, parse_policy

__all__ = ["Engine", "EngineConfig", "Prefix", "Request", "SamplingParams", "StepOutput", "parse_policy"]
