"""Serving: :mod:`dspark_jax.serving.engine` (the engine and its schedulers, no HTTP) and
:mod:`dspark_jax.serving.http` (the HTTP server and command line on top of it)."""
