"""A small stand-in for :class:`dspark_jax.serving.engine.Engine` for server tests that only check
HTTP behaviour (validation, auth, model names, ``n``, streaming options, defaults, metrics).

It honours the engine's interface (``prefill/insert/generate/free/active_slots/free_slots/
metrics``, ``num_slots``, ``cache_len``, ``target.cfg``, ``max_logit_bias``) and the
meaning of :class:`~dspark_jax.serving.engine.SamplingParams`, without JAX: a request's tokens are
a deterministic function of its prompt, seed and temperature (or a script), emitted in
speculative-looking blocks (the prefill token first, then 3, 1, 2, 3, 1, 2, ... tokens per
step, each block = accepted drafts + one correction/bonus token). ``logit_bias`` <= -50
bans a token (the next id is used), >= 50 forces it; ``min_tokens`` masks EOS and
``stop_token_ids``; ``logprobs`` gives fake but consistent values. Every received
request is kept in ``requests``.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from types import SimpleNamespace

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine.requests import SamplingParams, StepOutput

BLOCKS = (3, 1, 2)
GAMMA = 3


@dataclasses.dataclass
class _Slot:
    request: object
    tokens: list[int]  # the whole planned output (stop token included)
    pos: int = 0  # tokens handed out
    steps: int = 0


class FakeEngine:
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

    # ---- the output law

    def plan(self, request) -> list[int]:
        """The full output of ``request`` (what the engine would emit, stop token included)."""
        p: SamplingParams = request.params
        ids = list(request.prompt_ids)
        script = self.scripts.get(tuple(ids))
        rng = random.Random(f"{ids}|{p.seed if p.temperature > 0 else 0}|{p.temperature}")
        bias = dict(p.logit_bias)
        stops = set(self.eos_ids) | set(p.stop_token_ids)
        room = min(p.max_tokens, self.cache_len - len(ids))
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

    def prefill(self, request):
        p = request.params
        if not isinstance(p, SamplingParams):
            raise DSparkInputError("request.params must be a SamplingParams")
        if not request.prompt_ids:
            raise DSparkInputError("the prompt is empty: give at least one token")
        if len(request.prompt_ids) >= self.cache_len:
            raise DSparkInputError(
                f"the prompt has {len(request.prompt_ids)} tokens but at most {self.cache_len - 1} fit"
            )
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

    def generate(self) -> list[StepOutput]:
        import time

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
            n_acc, n_ver = min(block - 1, keep), (min(GAMMA, keep) if keep < block else GAMMA)
            ids = rec.tokens[rec.pos : start + keep]
            p = rec.request.params
            lps = None if p.logprobs is None else [self.logprob(t, rec.pos + j, p.logprobs) for j, t in enumerate(ids)]
            rec.pos += len(ids)
            rec.steps += 1
            done = rec.pos >= len(rec.tokens)
            reason = None
            if done:
                last = rec.tokens[-1]
                reason = "stop" if last in (set(self.eos_ids) | set(p.stop_token_ids)) else "length"
                del self._slots[slot]
            outs.append(StepOutput(slot, rec.request.request_id, ids, done, reason, n_ver, n_acc, lps))
        return outs

    def metrics(self) -> dict:
        return {"steps": self._steps, "compiles": 0, "num_active": len(self._slots)}
