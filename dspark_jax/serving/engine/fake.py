"""A stand-in for :class:`dspark_jax.serving.engine.Engine` without models or compilation: the
HTTP server over it shows its own behaviour (validation, auth, model names, ``n``, streaming,
defaults, metrics, queueing) in milliseconds.

:class:`FakeEngine` implements :class:`~dspark_jax.serving.engine.interface.EngineInterface` (one-shot
prefill) and the meaning of :class:`~dspark_jax.serving.engine.SamplingParams`: a request's tokens are
a deterministic function of its prompt, seed and temperature (or a script), emitted in
speculative-looking blocks (the prefill token first, then 3, 1, 2, 3, 1, 2, ... tokens per
step, each block = accepted drafts + one correction/bonus token). ``logit_bias`` <= -50
bans a token (the next id is used), >= 50 forces it; ``min_tokens`` masks EOS and
``stop_ids``; ``logprobs`` gives fake but consistent values. Every received
request is kept in ``requests``.

Usage::

    from dspark_jax.serving.build import build_server
    from dspark_jax.serving.engine.fake import FakeEngine

    app, loop = build_server(FakeEngine(vocab_size=tokenizer.vocab_size), tokenizer, model_name="fake")
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from types import SimpleNamespace

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine.interface import EngineInterface, OneShotPrefill, PrefillResult
from dspark_jax.serving.engine.requests import Request, SamplingParams, StepOutput

__all__ = ["FakeEngine"]

BLOCKS = (3, 1, 2)  # tokens per step, cycled: accepted drafts + one correction/bonus token
DRAFTS = 3  # draft tokens verified per step (the block size)


@dataclasses.dataclass
class _Slot:
    request: Request
    tokens: list[int]  # the whole planned output (stop token included)
    pos: int = 0  # tokens handed out
    steps: int = 0


class FakeEngine(EngineInterface):
    """The fake engine (see the module docstring).

    Args:
      vocab_size: token ids are drawn from ``[3, vocab_size)``.
      num_slots / cache_len: as the engine's; a prompt must leave room for one token.
      eos_ids: ids that end every request.
      step_delay: seconds each :meth:`generate` sleeps (a slow device).

    Attributes:
      scripts: ``{tuple(prompt ids): token ids}``: the output of those prompts (then random).
      requests: every request prefilled, in order.
    """

    def __init__(
        self, vocab_size: int = 512, num_slots: int = 4, cache_len: int = 128, eos_ids=(2,), step_delay: float = 0.0
    ):
        self.num_slots, self.cache_len = num_slots, cache_len
        self.eos_ids = tuple(eos_ids)
        self.vocab_size = vocab_size
        self.target = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab_size, max_position=cache_len))
        self.max_logit_bias = 300
        self.verification = "coupled"
        self.scripts: dict[tuple[int, ...], list[int]] = {}
        self.requests: list = []
        self.step_delay = step_delay
        self._slots: dict[int, _Slot] = {}
        self._pending: dict[int, _Slot] = {}
        self._steps = 0
        self._lock = threading.Lock()
        self._queue = OneShotPrefill(self.prefill, self._check)

    # ---- the output law

    def plan(self, request) -> list[int]:
        """The full output of ``request`` (what the engine would emit, stop token included)."""
        p: SamplingParams = request.params
        ids = list(request.prompt_ids)
        script = self.scripts.get(tuple(ids))
        rng = random.Random(f"{ids}|{p.seed if p.temperature > 0 else 0}|{p.temperature}")
        bias = dict(p.logit_bias)
        stops = set(self.eos_ids) | set(p.stop_ids)
        room = min(p.max_new_tokens, self.cache_len - len(ids))
        out: list[int] = []
        while len(out) < room:
            k = len(out)
            t = script[k] if script is not None and k < len(script) else rng.randrange(3, self.vocab_size)
            forced = [i for i, b in bias.items() if b >= 50]
            if forced:
                t = forced[0]
            while bias.get(t, 0.0) <= -50 or (k < p.min_tokens and t in stops):
                t = 3 + (t - 2) % (self.vocab_size - 3)
            out.append(t)
            if t in stops:
                break
        return out

    def logprob(self, tid: int, k: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        lp = -0.25 - 0.001 * k
        top = [(tid, lp)] + [((tid + j) % self.vocab_size, lp - j) for j in range(1, n)]
        return lp, top[:n]

    # ---- the engine interface

    def warmup(self) -> None:
        pass

    def _check(self, request: Request) -> None:
        if not isinstance(request.params, SamplingParams):
            raise DSparkInputError("request.params must be a SamplingParams")
        if not request.prompt_ids:
            raise DSparkInputError("the prompt is empty: give at least one token")
        if len(request.prompt_ids) >= self.cache_len:
            raise DSparkInputError(
                f"the prompt has {len(request.prompt_ids)} tokens but at most {self.cache_len - 1} fit"
            )

    def prefill(self, request: Request) -> _Slot:
        self._check(request)
        with self._lock:
            self.requests.append(request)
        return _Slot(request, self.plan(request))

    def insert(self, prefix: _Slot, slot: int) -> None:
        if slot in self._slots:
            raise DSparkInputError(f"slot {slot} is busy: free it first")
        self._slots[slot] = prefix

    def free(self, slot: int) -> None:
        self._slots.pop(int(slot), None)

    def active_slots(self) -> list[int]:
        return sorted(self._slots)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self._slots]

    def supports_chunked_prefill(self) -> bool:
        return False

    def queue_prefill(self, request: Request, tag) -> None:
        self._queue.submit(request, tag)

    def run_prefill(self) -> list[PrefillResult]:
        return self._queue.step()

    def cancel_prefill(self, tag) -> None:
        self._queue.cancel(tag)

    def generate(self) -> list[StepOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        self._steps += 1
        outs = []
        for slot, rec in list(self._slots.items()):
            first = rec.pos == 0
            block = BLOCKS[rec.steps % len(BLOCKS)]
            start = rec.pos + (1 if first else 0)  # the prefill token rides along with the first step
            new = rec.tokens[start : start + block]
            keep = len(new)
            n_acc, n_ver = min(block - 1, keep), (min(DRAFTS, keep) if keep < block else DRAFTS)
            ids = rec.tokens[rec.pos : start + keep]
            p = rec.request.params
            lps = None if p.logprobs is None else [self.logprob(t, rec.pos + j, p.logprobs) for j, t in enumerate(ids)]
            rec.pos += len(ids)
            rec.steps += 1
            done = rec.pos >= len(rec.tokens)
            reason = None
            if done:
                last = rec.tokens[-1]
                reason = "stop" if last in (set(self.eos_ids) | set(p.stop_ids)) else "length"
                del self._slots[slot]
            outs.append(StepOutput(slot, rec.request.request_id, ids, done, reason, n_ver, n_acc, lps))
        return outs

    def metrics(self) -> dict:
        return {"steps": self._steps, "compiles": 0, "num_active": len(self._slots)}
