"""The OpenAI-compatible HTTP server over the serving engine (docs/design.md#serving).

:mod:`.server` the FastAPI app, :mod:`.protocol` the request/response bodies, :mod:`.streaming`
SSE and response assembly, :mod:`.detokenize` incremental detokenization and stop strings,
:mod:`.engine_loop` the engine thread, :mod:`.prometheus` the ``/metrics`` series and
:mod:`.cli` the ``python -m dspark_jax.serve`` command.
"""
