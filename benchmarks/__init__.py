"""The benchmark suite: each module runs as ``python -m benchmarks.<name>`` from the repository root.

Three kinds (``benchmarks/README.md`` maps each script to what it measures and to the section of
``docs/results.md`` it feeds):

* performance: ``speedup``, ``speed_table``, ``decode_costs``, ``serve_load`` (and its long-prompt
  scenario ``prefill_load``), ``engine_overhead``, ``engine_policies``, ``cache_length``,
  ``sampling_filter``, ``train_step_cost``, ``device_check``;
* studies: ``compare_drafters``, ``learning_curve`` (with ``learning_curve_report``),
  ``verification_modes``, on the helpers of ``drafter_study``;
* developer tools: ``engine_hlo`` (the engine's compiled programs' fingerprints, run as
  ``tests/integration/test_engine_hlo.py``), ``hot_step`` (the engine's hot step against another
  checkout).

Shared helpers: :mod:`benchmarks.harness` (alternated timing, medians, tables, JSON, another
checkout's package) and :mod:`benchmarks.http_load` (the HTTP load client and in-process server of
``serve_load`` and ``prefill_load``). Importing this package imports nothing else.
"""
