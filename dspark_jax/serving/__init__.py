"""Serving: :mod:`dspark_jax.serving.config` (:class:`~dspark_jax.serving.config.EngineConfig`, the
engine's settings and the server's defaults), :mod:`dspark_jax.serving.engine` (the engine and its
schedulers, no HTTP),
:mod:`dspark_jax.serving.http` (the HTTP server on top of it) and :mod:`dspark_jax.serving.build`
(an engine and its server from the settings)."""
