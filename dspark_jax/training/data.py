"""Training data by self-distillation: prompts -> target continuations -> token-id shards.

docs/design.md#pipeline / docs/design.md#training: the target generates continuations for prompts
and only token ids are stored; the frozen target runs inside the train step for
features and p_target, unless a run opts into :mod:`dspark_jax.training.feature_cache`
(``feature_cache=DIR``), whose per-sequence arrays join the data dict and are
indexed by :func:`batches` with the same rows as the tokens.

Prompts come from :mod:`dspark_jax.data.prompts` (``tinystories`` openings, or
``chat``: :func:`~dspark_jax.data.prompts.chat_training_prompts`, disjoint from every
evaluation slice, plus an optional JSONL file wrapped in the tokenizer's chat template), which
also holds the contamination guard applied to them and to a distillation corpus.

Shards are ``shard_XXXXX.npz`` files holding ``tokens [N, L] int32`` (padded
with 0), ``lengths [N] int32`` and ``prompt_lengths [N] int32``; generation
resumes at the first missing shard.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark_jax.errors import DSparkInputError

if TYPE_CHECKING:  # annotation only: this module stays numpy-only at import
    from dspark_jax.models.target import Target


def generate_shards(
    out_dir: str | Path,
    prompt_ids: Sequence[Sequence[int]],
    generate_fn: Callable[[list[list[int]], int], list[list[int]]],
    *,
    seq_len: int,
    shard_size: int = 256,
    batch_size: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Generates target continuations and writes them as token-id shards (resumable).

    Args:
      out_dir: shard folder; existing complete shards are kept and skipped.
      prompt_ids: tokenized prompts.
      generate_fn: ``(prompts, batch_index) -> continuations`` (token ids, prompt
        excluded), e.g. the target's own batched jitted decoding.
      seq_len: stored sequence length L (prompt + continuation, truncated/padded).
      shard_size: sequences per shard; batch_size: sequences per generate call.
      progress: optional callback ``(done_sequences, total_sequences)``.
    Returns:
      Paths of all shards.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(prompt_ids)
    paths = []
    for s, start in enumerate(range(0, n, shard_size)):
        path = out_dir / f"shard_{s:05d}.npz"
        paths.append(path)
        chunk = prompt_ids[start : start + shard_size]
        if path.exists():
            if progress:
                progress(min(start + shard_size, n), n)
            continue
        toks = np.zeros((len(chunk), seq_len), np.int32)
        lens = np.zeros((len(chunk),), np.int32)
        plens = np.zeros((len(chunk),), np.int32)
        for bstart in range(0, len(chunk), batch_size):
            batch = [list(p)[: seq_len - 1] for p in chunk[bstart : bstart + batch_size]]
            conts = generate_fn(batch, (start + bstart) // batch_size)
            for i, (p, c) in enumerate(zip(batch, conts)):
                seq = (list(p) + list(c))[:seq_len]
                toks[bstart + i, : len(seq)] = seq
                lens[bstart + i] = len(seq)
                plens[bstart + i] = min(len(p), len(seq))
            if progress:
                progress(start + bstart + len(batch), n)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, tokens=toks, lengths=lens, prompt_lengths=plens)
        os.replace(tmp, path)  # atomic: a killed run never leaves a half-written shard
    return paths


def heldout_sequences(
    target: Target,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    seq_len: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, np.ndarray]:
    """Target-generated continuations of held-out prompts, in the training-shard format.

    Same recipe as :func:`generate_shards` (prompt truncated to
    ``seq_len - 1``, prompt + continuation truncated/padded to ``seq_len``).
    """
    from dspark_jax.decoding.speculative import generate_autoregressive

    n = len(prompt_ids)
    toks = np.zeros((n, seq_len), np.int32)
    lens = np.zeros((n,), np.int32)
    plens = np.zeros((n,), np.int32)
    for s in range(0, n, batch_size):
        batch = [list(p)[: seq_len - 1] for p in prompt_ids[s : s + batch_size]]
        res = generate_autoregressive(
            target,
            batch,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=[seed * 1_000_003 + 7_777_777 + s + i for i in range(len(batch))],
        )
        for i, (p, gen) in enumerate(zip(batch, res.generations)):
            seq = (p + gen.token_ids)[:seq_len]
            toks[s + i, : len(seq)] = seq
            lens[s + i] = len(seq)
            plens[s + i] = min(len(p), len(seq))
    return {"tokens": toks, "lengths": lens, "prompt_lengths": plens}


def load_shards(paths: Sequence[Path]) -> dict[str, np.ndarray]:
    """Concatenates shards into ``tokens [N, L]``, ``lengths [N]``, ``prompt_lengths [N]`` (int32).

    Raises:
      DSparkInputError: no shards, or a corrupt shard file.
    """
    if not paths:
        raise DSparkInputError("no training shards found")
    parts: dict[str, list] = {"tokens": [], "lengths": [], "prompt_lengths": []}
    for p in paths:
        try:
            with np.load(p) as z:
                for k in parts:
                    parts[k].append(z[k])
        except (OSError, KeyError, ValueError) as e:
            raise DSparkInputError(f"corrupt data shard {p}: {e} (delete it to regenerate)") from None
    return {k: np.concatenate(v) for k, v in parts.items()}


def batches(
    data: dict[str, np.ndarray], batch_size: int, seed: int, start_step: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Deterministic epoch-shuffled batches; batch ``s`` depends only on (seed, s).

    Resuming at ``start_step`` yields exactly the batches an uninterrupted run
    would have produced from that step on.
    """
    n = data["tokens"].shape[0]
    if n < batch_size:
        raise DSparkInputError(f"only {n} training sequences for a batch of {batch_size}")
    per_epoch = n // batch_size
    step = start_step
    while True:
        epoch, i = divmod(step, per_epoch)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        idx = perm[i * batch_size : (i + 1) * batch_size]
        yield {k: v[idx] for k, v in data.items()}
        step += 1


def draft_vocabulary(data: dict[str, np.ndarray], size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` most frequent target-generated token ids of the training data (FR-Spec /
    Eagle3 ``draft_vocab_size``; docs/design.md#draft-vocabulary).

    Only generated positions count (``prompt_lengths <= i < lengths``): they are what the
    drafter has to predict. Ties (and ids never generated, when fewer than ``size`` distinct
    ids were) are ranked by how often the id occurs anywhere in the sequences, then by id.

    Args:
      data: :func:`load_shards` arrays (``tokens [n, L]``, ``lengths [n]``, ``prompt_lengths [n]``).
      size: N, 1 <= N <= ``vocab_size``.
      vocab_size: the target's V.
    Returns:
      ``[N]`` int32 token ids, ascending.
    Raises:
      DSparkInputError: ``size`` out of range or a token id outside ``[0, vocab_size)``.
    """
    if not 1 <= size <= vocab_size:
        raise DSparkInputError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    tokens = np.asarray(data["tokens"])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DSparkInputError(f"training tokens outside [0, {vocab_size}): cannot build a draft vocabulary")
    col = np.arange(tokens.shape[1])[None, :]
    gen = (col >= np.asarray(data["prompt_lengths"])[:, None]) & (col < np.asarray(data["lengths"])[:, None])
    anywhere = col < np.asarray(data["lengths"])[:, None]
    generated = np.bincount(tokens[gen], minlength=vocab_size)
    seen = np.bincount(tokens[anywhere], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -seen, -generated))  # last key is the primary one
    return np.sort(order[:size]).astype(np.int32)


# -- distillation on a corpus ----------------------------------------------------------------
# A corpus row is either plain text (every token after the first is a target) or a chat turn:
# the messages before an assistant reply and the reply (only the reply's tokens are targets).
CorpusRow = tuple  # ("text", str) | ("chat", list[dict[str, str]], str)


def read_corpus(path: str | Path) -> list[CorpusRow]:
    """Distillation rows from a text or JSONL file.

    Formats:
      * ``.txt``: documents separated by blank lines or ``<|endoftext|>``, each a ``("text", doc)`` row;
      * ``.jsonl`` / ``.jsonl.gz`` rows: ``{"text": ...}``; ``{"prompt": ..., "response": ...}``
        (also ``completion`` / ``output`` for the reply); ``{"messages": [{"role", "content"}, ...]}``
        (one chat row per assistant message, with every message before it as context).
    Raises:
      DSparkInputError: missing file, bad JSON, a row of none of these shapes, or no rows.
    """
    path = Path(path)
    if not path.exists():
        raise DSparkInputError(f"corpus file not found: {path}")
    rows: list[CorpusRow] = []
    if path.suffix == ".txt":
        docs = re.split(r"\n\s*\n|<\|endoftext\|>", path.read_text(encoding="utf-8"))
        rows = [("text", d.strip()) for d in docs if d.strip()]
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DSparkInputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                reply = (
                    next((row[k] for k in ("response", "completion", "output") if k in row), None)
                    if isinstance(row, dict)
                    else None
                )
                if isinstance(row, dict) and isinstance(row.get("messages"), list):
                    msgs = row["messages"]
                    for i, m in enumerate(msgs):
                        if not (isinstance(m, dict) and "role" in m and "content" in m):
                            raise DSparkInputError(f"{path}:{n}: messages need 'role' and 'content'")
                        if m["role"] == "assistant" and i > 0:
                            rows.append(("chat", [dict(x) for x in msgs[:i]], str(m["content"])))
                elif isinstance(row, dict) and "prompt" in row and reply is not None:
                    rows.append(("chat", [{"role": "user", "content": str(row["prompt"])}], str(reply)))
                elif isinstance(row, dict) and "text" in row:
                    rows.append(("text", str(row["text"])))
                else:
                    raise DSparkInputError(f"{path}:{n}: expected 'text', 'prompt' + 'response', or 'messages'")
    if not rows:
        raise DSparkInputError(f"corpus {path} has no rows")
    return rows


def corpus_row_text(row: CorpusRow) -> str:
    """All the text of a row (for the contamination guard)."""
    if row[0] == "text":
        return row[1]
    return "\n".join([m["content"] for m in row[1]] + [row[2]])


def encode_corpus_row(tokenizer, row: CorpusRow, chat: bool) -> tuple[list[int], int]:
    """``(token ids, prompt length)``: the tokens before ``prompt length`` are context only.

    Chat rows with ``chat=True`` use the tokenizer's chat template: the prompt is the
    template of the earlier messages with the generation prompt, the sequence the template
    with the reply appended (so the reply's end-of-turn token is a target too).

    Raises:
      DSparkInputError: the template does not extend the prompt (then the reply's span is unknown).
    """
    if row[0] == "text":
        return tokenizer.encode(row[1]), 1
    msgs, reply = row[1], row[2]
    if chat:
        p_text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        prompt = tokenizer.encode(p_text, add_bos=False)
        full_text = tokenizer.apply_chat_template(
            msgs + [{"role": "assistant", "content": reply}], add_generation_prompt=False
        )
        full = tokenizer.encode(full_text, add_bos=False)
        if full[: len(prompt)] != prompt:
            raise DSparkInputError("the chat template's reply does not extend its prompt; cannot mark the reply span")
        return full, len(prompt)
    prompt = tokenizer.encode("\n".join(m["content"] for m in msgs))
    return prompt + tokenizer.encode(" " + reply, add_bos=False), len(prompt)


def write_sequence_shards(
    out_dir: str | Path,
    seqs: Sequence[tuple[list[int], int]],
    *,
    seq_len: int,
    shard_size: int = 256,
    prefix: str = "corpus",
) -> list[Path]:
    """Writes ``(ids, prompt_len)`` sequences as shards (:func:`load_shards` format), truncated
    to ``seq_len``; sequences with no target token inside ``seq_len`` are skipped.

    Returns:
      Paths of the shards (rewritten every call: cheap, no generation involved).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keep = [(list(ids)[:seq_len], p) for ids, p in seqs if min(len(ids), seq_len) > max(p, 1)]
    paths = []
    for s, start in enumerate(range(0, len(keep), shard_size)):
        chunk = keep[start : start + shard_size]
        toks = np.zeros((len(chunk), seq_len), np.int32)
        lens = np.array([len(ids) for ids, _ in chunk], np.int32)
        plens = np.array([max(p, 1) for _, p in chunk], np.int32)
        for i, (ids, _) in enumerate(chunk):
            toks[i, : len(ids)] = ids
        path = out_dir / f"{prefix}_{s:05d}.npz"
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, tokens=toks, lengths=lens, prompt_lengths=plens)
        os.replace(tmp, path)
        paths.append(path)
    return paths


def sampled_rows(rows: Sequence[int], frac: float) -> list[bool]:
    """Which prompt rows (global indices) get a sampled continuation in a mix with fraction
    ``frac`` of sampled data: row i iff ``floor((i + 1) frac) > floor(i frac)``, an even spread
    that depends only on the row index (so resumed generation makes the same choice).

    Raises:
      DSparkInputError: ``frac`` outside [0, 1].
    """
    if not 0.0 <= frac <= 1.0:
        raise DSparkInputError(f"gen_sampled_frac must be in [0, 1], got {frac}")
    return [int((r + 1) * frac) > int(r * frac) for r in rows]
