"""The OpenAI-compatible HTTP server over the serving engine (docs/design.md#serving).

:mod:`.server` the FastAPI app, :mod:`.protocol` the request/response bodies, :mod:`.streaming`
SSE and response assembly, :mod:`.detokenize` incremental detokenization and stop strings,
:mod:`.engine_loop` the engine thread, :mod:`.prometheus` the ``/metrics`` series,
:mod:`.preflight` the start's checks and :mod:`.thread` a server in a background thread. The
``python -m dspark_jax.serve`` command is :mod:`dspark_jax.commands.serve`; engines and apps are
built by :mod:`dspark_jax.serving.build`.
"""
