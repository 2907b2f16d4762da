"""Drives a serving engine's slots by hand, as the server's engine loop would, for the tests that
compare chunked prefill with one-shot prefill."""

from __future__ import annotations


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
