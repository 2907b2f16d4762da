"""Helpers shared by the server tests (real engine: test_server.py; fake engine: test_server_http.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dspark_jax.serving.engine.fake import FakeEngine

CACHE_LEN, NUM_SLOTS = 128, 4  # the fake engine's context and slots
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def serve_fake(tok, engine=None, **cfg):
    """A :class:`~dspark_jax.serving.http.thread.ServerThread` (started) serving a fake engine
    (:mod:`dspark_jax.serving.engine.fake`) as ``fake-model`` with ``tok``; ``cfg``: ``max_queue`` and
    :class:`~dspark_jax.serving.http.server.ServerConfig` fields (``chat_template`` defaults to
    :data:`CHAT_TEMPLATE`). The thread has ``engine``, ``loop`` and ``tok`` attributes."""
    from dspark_jax.serving.http.server import EngineLoop, ServerConfig, create_app
    from dspark_jax.serving.http.thread import ServerThread

    engine = engine or FakeEngine(vocab_size=tok.vocab_size, num_slots=NUM_SLOTS, cache_len=CACHE_LEN)
    loop = EngineLoop(engine, tok, max_queue=cfg.pop("max_queue", 64), model_name="fake-model")
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    config = ServerConfig(
        model_name="fake-model",
        context_len=CACHE_LEN,
        vocab_size=tok.vocab_size,
        policy="fake",
        max_logit_bias=engine.max_logit_bias,
        **cfg,
    )
    srv = ServerThread(create_app(loop, tok, config)).start()
    srv.engine, srv.loop, srv.tok = engine, loop, tok
    return srv


def metric(text: str, name: str, **labels) -> float:
    """Sum of the Prometheus samples of ``name`` in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(client, timeout: float = 10.0, poll: float = 0.01) -> dict:
    """Polls ``/health`` until no request runs or waits (or ``timeout`` seconds); returns it."""
    t0 = time.monotonic()
    while True:
        h = client.get("/health").json()
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() - t0 > timeout:
            return h
        time.sleep(poll)


def stories260k_drafter_meta(folder: Path, **config) -> Path:
    """``folder`` with the ``drafter.json`` of a block-3 drafter for stories260K (all a dry run reads of an
    export: ``tiny_export_v2``'s, for stories260K's vocabulary, width and depth), ``config`` overriding."""
    from dspark_jax.models.presets import target_config

    t = target_config("stories260k")
    meta = json.loads((Path(__file__).resolve().parents[1] / "data" / "tiny_export_v2" / "drafter.json").read_text())
    meta["config"].update(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, target_num_layers=t.num_layers, taps=[0, t.num_layers - 2]
    )
    meta["config"].update(target_name=t.name, **config)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "drafter.json").write_text(json.dumps(meta))
    return folder
