"""One choice's output on the asyncio side of the HTTP server: UTF-8-safe incremental
detokenization, stop strings, logprobs and the choice's speculative counts.

The engine thread hands token ids (:class:`~dspark_jax.serving.http.engine_loop.RequestEvent`); an
:class:`OutputState` turns them into text with the tokenizer's incremental detokenizer
(``Tokenizer.detokenizer``: O(1) per token, never half a character), holds back text that
could still become a stop string, and cuts the output at the first token whose text completes
one (the token is kept in ``token_ids``), so a response is the same whether the engine emitted
those tokens in one step or several. Speculative counts: ``num_steps`` (target verification
passes that gave the choice at least one token), ``num_draft_tokens`` / ``num_accepted_tokens``
(none counted after a stop) and ``tau = (completion_tokens - 1) / num_steps``, the prefill
token excluded: :class:`dspark_jax.decoding.speculative.Generation`'s tau, the one definition.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dspark_jax.serving.http.engine_loop import RequestEvent, TrackedRequest

__all__ = ["OutputState", "Update", "spec_dict", "spec_total", "usage"]


@dataclasses.dataclass
class Update:
    """What one engine output adds to a choice: ``text`` safe to send now (complete
    characters, nothing that could still become a stop string), the ``token_ids`` kept
    (after a stop-string cut), their ``logprobs`` (or None) and ``finish_reason`` (None
    while running)."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


class OutputState:
    """One choice's output on the asyncio side: incremental detokenization, stop
    strings, logprobs and speculative counts.

    Args:
      tracked: the engine request.
      tokenizer: a :class:`dspark_jax.models.tokenizer.Tokenizer` (``detokenizer()``).
      stop: stop strings (non-empty).
      min_tokens: stop strings are not matched before this many generated tokens.
    """

    def __init__(self, tracked: TrackedRequest, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.tracked = tracked
        self.detok = tokenizer.detokenizer(skip_special_tokens=True)
        self.stop = tuple(stop)
        self.hold = max((len(x) for x in self.stop), default=1) - 1
        self.min_tokens = int(min_tokens)
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out
        self.token_ids: list[int] = []
        self.logprobs: list | None = None
        self.num_steps = self.num_emitted = self.num_verified = self.num_accepted = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def index(self) -> int:
        return self.tracked.index

    def feed(self, ev: RequestEvent) -> Update:
        """Applies one ``delta``/``final`` event (see :class:`RequestEvent`)."""
        ids = [int(i) for i in ev.token_ids]
        keep, finish = len(ids), (ev.finish_reason or "stop") if ev.kind == "final" else None
        for j, tid in enumerate(ids):
            before = len(self.text)
            self.text += self.detok.step(tid)
            if self.stop and len(self.token_ids) + j + 1 >= self.min_tokens and len(self.text) > before:
                # an occurrence that ends in this token's text (earlier ones were found earlier,
                # or held back by min_tokens)
                hits = [k for k in (self.text.find(x, max(0, before - len(x) + 1)) for x in self.stop) if k >= 0]
                if hits:
                    self.text, keep, finish = self.text[: min(hits)], j + 1, "stop"
                    break
        pre = 1 if ev.with_prefill_token else 0
        total_pass, kept_pass = max(0, len(ids) - pre), max(0, keep - pre)
        n_ver, n_acc = int(ev.num_verified), int(ev.num_accepted)
        if kept_pass < total_pass:  # a stop string inside the block: nothing after it counts
            n_ver, n_acc = min(n_ver, kept_pass), min(n_acc, kept_pass)
        if kept_pass:
            self.num_steps += 1
            self.num_emitted += kept_pass
        self.num_verified += n_ver
        self.num_accepted += n_acc
        new_ids = ids[:keep]
        new_lps = None
        if ev.logprobs is not None:
            new_lps = list(ev.logprobs[:keep])
            self.logprobs = (self.logprobs or []) + new_lps
        self.token_ids += new_ids
        if new_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if finish is not None:
            end = len(self.text)
            self.finish_reason, self.finished_at = finish, time.monotonic()
        else:
            end = max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent : end], end
        return Update(text, new_ids, new_lps, finish)

    def spec_decode(self) -> dict[str, Any]:
        """Per-choice speculative metrics (tau as :class:`dspark_jax.decoding.speculative.Generation`)."""
        return spec_dict(self.num_steps, self.num_emitted, self.num_verified, self.num_accepted)


def spec_dict(steps: int, emitted: int, verified: int, accepted: int) -> dict[str, Any]:
    """A ``spec_decode`` object: ``steps`` verification passes that emitted ``emitted`` tokens
    (the prefill token excluded), ``accepted`` of ``verified`` draft tokens; rates None when
    undefined."""
    return {
        "num_steps": steps,
        "num_draft_tokens": verified,
        "num_accepted_tokens": accepted,
        "acceptance_rate": (accepted / verified) if verified else None,
        "tau": (emitted / steps) if steps else None,
    }


def usage(n_prompt: int, states: list[OutputState]) -> dict[str, int]:
    """OpenAI ``usage`` of a request: its prompt once, the tokens of every choice."""
    n_gen = sum(len(st.token_ids) for st in states)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def spec_total(states: list[OutputState]) -> dict[str, Any]:
    """The ``spec_decode`` object of a whole request (its choices' counts summed)."""
    return spec_dict(
        sum(st.num_steps for st in states),
        sum(st.num_emitted for st in states),
        sum(st.num_verified for st in states),
        sum(st.num_accepted for st in states),
    )
