"""Magpie-style prompts: the target writes the user turns it is then distilled on.

Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing" (arXiv:2406.08464): an instruction-tuned model given its chat template only up to the
user's header (for ChatML ``...<|im_start|>user\\n``) continues it with a user request of the kind
it was aligned on. Sampling many such continuations gives prompts as diverse as the target's own
training mix, at no download, where a fixed prompt list can be dominated by one dataset (82% GSM8K in one).

Every request the target ends with the token that closes a user turn (``<|im_end|>``) is kept
unless it is too short, a duplicate (case, punctuation and whitespace folded), or contains an
evaluation prompt (:func:`dspark_jax.data.prompts.drop_contaminated`); a request cut by
the length limit is dropped, since a truncated question teaches the drafter a truncated regime.

Used by ``python -m dspark_jax.train ... magpie_prompts=N`` (the prompts are written once into
``<workdir>/magpie_prompts.jsonl`` and mixed evenly into the training prompts,
:func:`mix_prompts`) and on its own::

    python -m dspark_jax.training.magpie --target smollm2-135m-instruct --num-prompts 256 --out magpie.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dspark_jax.data import prompts as prompts_mod
from dspark_jax.errors import DSparkInputError

# Stands in for the user's message when the template is rendered; the text before it is the header.
_SENTINEL = "MAGPIEUSERCONTENT"
MIN_PROMPT_CHARS = 12  # shorter "requests" are greetings or fragments


def user_turn_prefix(tok) -> tuple[list[int], list[int]]:
    """``(header ids, stop ids)``: the chat template rendered up to where the user's message
    starts (system prompt included, no BOS added twice), and the id that closes a user turn
    (the first token after the message) with the tokenizer's EOS ids.

    Raises:
      DSparkInputError: the tokenizer has no chat template, or its template does not place the
        user's message verbatim (nothing to continue from).
    """
    if not tok.has_chat_template:
        raise DSparkInputError("Magpie prompts need a chat target: this tokenizer has no chat template")
    text = tok.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    head, found, tail = text.partition(_SENTINEL)
    if not found or not head:
        raise DSparkInputError("the chat template does not place the user's message verbatim: no Magpie header")
    head_ids = tok.encode(head, add_bos=False)
    close = tok.encode(tail, add_bos=False)[:1] if tail.strip() else []
    stop = list(dict.fromkeys([*close, *tok.eos_ids]))
    if not head_ids or not stop:
        raise DSparkInputError("the chat template gives no user header or no token that ends a user turn")
    return head_ids, stop


def select_prompts(
    texts: Sequence[str], finished: Sequence[bool], guard: Sequence[str], seen: set[str], stats: dict[str, int]
) -> list[str]:
    """The usable requests of one generated batch, in order; ``seen`` (folded texts) and the
    counters in ``stats`` (``incomplete``, ``too_short``, ``duplicate``, ``contaminated``, ``kept``)
    are updated in place. ``finished[i]``: row ``i`` ended with a stop id, not the length limit."""
    candidates = []
    for text, done in zip(texts, finished):
        text = text.strip()
        folded = prompts_mod.fold_text(text)
        if not done:
            stats["incomplete"] += 1
        elif len(text) < MIN_PROMPT_CHARS:
            stats["too_short"] += 1
        elif folded in seen:
            stats["duplicate"] += 1
        else:
            seen.add(folded)
            candidates.append(text)
    drop = prompts_mod.drop_contaminated(candidates, guard) if candidates else []
    stats["contaminated"] += sum(drop)
    kept = [t for t, d in zip(candidates, drop) if not d]
    stats["kept"] += len(kept)
    return kept


def magpie_prompts(
    target,
    tok,
    num_prompts: int,
    *,
    seed: int = 0,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 32,
    max_seconds: float = 1200.0,
    guard: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Up to ``num_prompts`` user requests written by ``target`` (module docstring).

    Args:
      target: a :class:`~dspark_jax.models.target.Target` with a chat tokenizer ``tok``.
      num_prompts: requests wanted; generation stops there, or after ``max_seconds`` [s] of
        generation (the prompts so far are returned), or after ``4 * num_prompts`` rows.
      seed: row ``i`` samples with seed ``seed * 1_000_003 + i`` (deterministic given the target).
      max_new_tokens [tokens]: length limit of one request (longer ones are dropped as incomplete).
      temperature / top_p: sampling of the requests (Magpie samples at T = 1).
      batch_size: rows per ``generate_autoregressive`` call.
      guard: evaluation texts no request may contain (default: every shared evaluation set,
        :func:`~dspark_jax.data.prompts.evaluation_texts`).
      progress: ``progress(kept, num_prompts)`` after each batch.

    Returns:
      ``(requests, stats)``: ``stats`` counts ``generated`` rows, the ``kept`` ones, the ``surplus``
      of the last batch and why each other row was dropped, plus ``seconds`` of generation and ``rows_per_s``.

    Raises:
      DSparkInputError: not a chat target (:func:`user_turn_prefix`), ``num_prompts < 1``.
    """
    from dspark_jax.decoding.speculative import generate_autoregressive

    if num_prompts < 1:
        raise DSparkInputError(f"num_prompts must be >= 1, got {num_prompts}")
    head, stop = user_turn_prefix(tok)
    guard = prompts_mod.evaluation_texts() if guard is None else guard
    stats: dict[str, Any] = dict(generated=0, incomplete=0, too_short=0, duplicate=0, contaminated=0, kept=0)
    out: list[str] = []
    seen: set[str] = set()
    t0 = time.perf_counter()
    while len(out) < num_prompts and stats["generated"] < 4 * num_prompts:
        if time.perf_counter() - t0 > max_seconds:
            print(f"magpie: {max_seconds:.0f} s budget spent, {len(out)} of {num_prompts} prompts", file=sys.stderr)
            break
        first = stats["generated"]
        res = generate_autoregressive(
            target,
            [head] * batch_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=[seed * 1_000_003 + first + i for i in range(batch_size)],
            stop_ids=stop,
        )
        stats["generated"] += batch_size
        texts = [tok.decode([t for t in g.token_ids if t not in stop]) for g in res.generations]
        finished = [g.finish_reason == "stop" for g in res.generations]
        out += select_prompts(texts, finished, guard, seen, stats)
        if progress is not None:
            progress(min(len(out), num_prompts), num_prompts)
    stats["surplus"] = max(0, len(out) - num_prompts)  # kept by the last batch past num_prompts
    stats["kept"] -= stats["surplus"]
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    stats["rows_per_s"] = round(stats["generated"] / max(stats["seconds"], 1e-9), 2)
    return out[:num_prompts], stats


def mix_prompts(base: Sequence[str], extra: Sequence[str], n: int) -> list[str]:
    """``base`` with ``extra`` spread evenly over its first ``n`` entries (the prompts a run with
    ``num_prompts=n`` generates from), the rest of ``base`` after them; ``extra`` entries already in
    ``base`` are left out. Deterministic."""
    have = set(base)
    extra = [e for e in dict.fromkeys(extra) if e not in have][:n]
    head, tail = list(base[: max(n - len(extra), 0)]), list(base[max(n - len(extra), 0) :])
    if not extra:
        return head + tail
    mixed, step = [], (len(head) + len(extra)) / len(extra)
    slots = {int(i * step + step / 2) for i in range(len(extra))}  # len(extra) distinct positions
    it_b, it_e = iter(head), iter(extra)
    for pos in range(len(head) + len(extra)):
        mixed.append(next(it_e) if pos in slots else next(it_b))
    return mixed + tail


def read_or_generate(path: Path, target, tok, num_prompts: int, seed: int, guard: Sequence[str]) -> list[str]:
    """The Magpie prompts in ``path`` (a JSONL of ``{"prompt"}`` rows), generated and written there
    first (atomically, with ``<path>.json`` stats beside it) when the file is missing; ``guard``:
    the evaluation texts no prompt may contain."""
    if path.is_file():
        return prompts_mod.read_prompt_file(path)[:num_prompts]
    from tqdm.auto import tqdm

    bar = tqdm(total=num_prompts, desc="magpie prompts", unit="prompt", dynamic_ncols=True)

    def progress(done, total):
        bar.n = done
        bar.refresh()

    texts, stats = magpie_prompts(target, tok, num_prompts, seed=seed, guard=guard, progress=progress)
    bar.close()
    print(f"magpie: {json.dumps(stats)}", file=sys.stderr)
    write_prompts(path, texts, stats)
    return texts


def write_prompts(path: Path, texts: Sequence[str], stats: dict[str, Any]) -> None:
    """Writes ``texts`` as JSONL ``{"prompt": ...}`` rows (atomically) and ``stats`` to ``<path>.json``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    os.replace(tmp, path)
    path.with_name(path.name + ".json").write_text(json.dumps(stats, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.training.magpie",
        description="User requests written by a chat target itself (Magpie), deduplicated and "
        "contamination-guarded, as a JSONL prompt file (prompts_file= of dspark_jax.train).",
    )
    p.add_argument("--target", required=True, help="preset name or model path (a chat model)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--out", required=True, help="JSONL file to write ({'prompt': ...} per line)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="length limit of one request [tokens]")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=1200.0, help="generation budget [s] (default 20 min)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from dspark_jax.models.presets import resolve_target
    from dspark_jax.models.target import Target

    try:
        cfg, params, tok = resolve_target(args.target)
        texts, stats = magpie_prompts(
            Target(cfg, params),
            tok,
            args.num_prompts,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            batch_size=args.batch_size,
            max_seconds=args.max_seconds,
        )
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_prompts(Path(args.out), texts, stats)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
