"""Drives a serving engine's slots by hand, as the server's engine loop would, for the tests that
compare chunked prefill with one-shot prefill."""

from __future__ import annotations


def chunked_engine(target, drafter):
    """The three-slot engine the model-family tests drive: ``fixed:3`` verification, one step bucket
    of 12 tokens, one-shot prefill buckets of 32, and a chunked prefiller of 12-token chunks (3 lanes,
    4-token blocks, so a prompt spans passes); warmed up."""
    from dspark_jax.serving.engine import Engine, EngineConfig
    from dspark_jax.serving.engine.prefill import ChunkedPrefill

    cfg = EngineConfig(
        num_slots=3,
        cache_len=64,
        policy="fixed:3",
        buckets=(12,),
        row_buckets=(3,),
        prefill_buckets=(32,),
        profile_iters=1,
        suspend_after=None,
        prefill_chunk_tokens=0,
    )
    eng = Engine(target, drafter, cfg)
    eng.prefiller = ChunkedPrefill(eng.device, eng.planner, eng.limits, eng.prefill_buckets, 12, lanes=3, block=4)
    eng.warmup()
    return eng


def drive(engine, requests, chunked: bool, slots: int):
    """Decodes ``requests`` (admitted FIFO into free slots, by chunked or one-shot prefill, one
    prefill pass per step; at most ``slots`` requests active or being prefilled); returns
    ``{id: (tokens, finish reason)}``."""
    pending, pre = list(requests), engine.prefiller
    toks, reasons = {}, {}
    while pending or engine.active_slots() or len(pre):
        if chunked:
            while pending and len(engine.active_slots()) + len(pre) < slots:
                pre.submit(pending.pop(0))
            for req, prefix in pre.step():
                assert req is prefix.request
                engine.insert(prefix, engine.free_slots()[0])
        elif pending and engine.free_slots():
            engine.insert(engine.prefill(pending.pop(0)), engine.free_slots()[0])
        for o in engine.generate():
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return {k: (v, reasons[k]) for k, v in toks.items()}
