"""Building a server: the engine from an :class:`~dspark_jax.serving.engine.EngineConfig`
(:func:`build_engine`, :func:`warmup_engine`) and the FastAPI app around it (:func:`build_server`).
``python -m dspark_jax.serve`` (:mod:`dspark_jax.commands.serve`), the serving benchmarks and the
tests build servers with these.

Usage::

    from dspark_jax.serving.build import build_engine, build_server
    from dspark_jax.serving.engine import EngineConfig
    from dspark_jax.serving.http.thread import ServerThread

    engine = build_engine(target, drafter, EngineConfig(num_slots=4, cache_len=512))
    app, loop = build_server(engine, tokenizer, model_name="stories260k")
    with ServerThread(app) as srv:
        print(srv.url)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import Engine, EngineConfig
from dspark_jax.serving.http.preflight import check_engine_shape

__all__ = ["build_engine", "build_server", "warmup_engine"]


def build_engine(
    target,
    drafter=None,
    config: EngineConfig | None = None,
    *,
    sps_table: Any = None,
    mesh=None,
    warmup: bool = True,
) -> Engine:
    """Builds (and warms up) an :class:`~dspark_jax.serving.engine.Engine`.

    Args:
      config: the engine's settings (default :class:`EngineConfig`'s, the server's). Its
        ``policy`` None is ``dspark`` with a drafter, ``plain`` without; a ``plain`` engine gets
        no drafter (plain decoding has no drafter context to keep).
      sps_table: the SPS table (a ``CostTable``), or a JSON path: loaded when it exists (the
        engine reuses it only if it was measured for this device, model and shape), and after
        warm-up the table in use (loaded or freshly profiled) is written there.
      mesh: tensor-parallel serving (a ``jax.sharding.Mesh`` or a spec such as ``"model:8"``).
      warmup: compile every shape now (:func:`warmup_engine`).
    Raises:
      DSparkInputError: bad slot count / cache length, a speculative policy without a drafter, or
        what the engine refuses.
    """
    config = config if config is not None else EngineConfig()
    check_engine_shape(config.num_slots, config.cache_len)
    policy = config.policy_for(drafter is not None)
    if policy != "plain" and drafter is None:
        raise DSparkInputError(f"policy {policy!r} needs a drafter (--drafter EXPORT_DIR); use --policy plain")
    table_path = Path(sps_table) if isinstance(sps_table, (str, Path)) else None
    table = (table_path if table_path.exists() else None) if table_path is not None else sps_table
    engine = Engine(target, drafter if policy != "plain" else None, config, sps_table=table, mesh=mesh)
    if warmup:
        warmup_engine(engine, sps_table)
    return engine


def warmup_engine(engine: Engine, sps_table: Any = None) -> None:
    """Compiles every shape of ``engine`` (and profiles its SPS table); when ``sps_table`` is
    a path, writes the table in use there."""
    engine.warmup()
    if isinstance(sps_table, (str, Path)) and engine.sps_table is not None:
        path = Path(sps_table)
        path.parent.mkdir(parents=True, exist_ok=True)
        engine.sps_table.save(path)


def build_server(
    engine,
    tokenizer,
    *,
    model_name: str,
    max_queue: int = 256,
    default_max_tokens: int | None = None,
    chat_template: str | None = None,
    policy: str = "",
    api_key: str | None = None,
    api_key_health_metrics: bool = False,
    max_request_bytes: int | None = None,
):
    """``(app, engine_loop)``: the FastAPI app around an engine (the loop starts with the app).

    ``engine``: an :class:`~dspark_jax.serving.engine.Engine` or another
    :class:`~dspark_jax.serving.engine.interface.EngineInterface`. ``default_max_tokens`` None:
    vLLM's defaults (16 for completions, the rest of the context for chat). ``api_key``,
    ``max_request_bytes`` (None: derived from the context, 0: no limit): see
    :class:`dspark_jax.serving.http.server.ServerConfig`.
    """
    from dspark_jax.serving.http.server import EngineLoop, ServerConfig, create_app

    loop = EngineLoop(engine, tokenizer, max_queue=max_queue, model_name=model_name)
    tcfg = engine.target.cfg
    cfg = ServerConfig(
        model_name=model_name,
        context_len=int(min(engine.cache_len, tcfg.max_position)),
        vocab_size=int(tcfg.vocab_size),
        default_max_tokens=default_max_tokens,
        chat_template=chat_template,
        policy=policy,
        api_key=api_key or None,
        auth_health_metrics=bool(api_key_health_metrics),
        max_logit_bias=int(engine.max_logit_bias),
        max_request_bytes=max_request_bytes,
    )
    return create_app(loop, tokenizer, cfg), loop
