"""Training data by self-distillation: prompts -> target continuations -> token-id shards.

DESIGN.md "Pipeline"/"Training": the target generates continuations for prompts
and only token ids are stored; the frozen target runs inside the train step for
features and p_target, unless a run opts into :mod:`dspark_jax.training.feature_cache`
(``feature_cache=DIR``), whose per-sequence arrays join the data dict and are
indexed by :func:`batches` with the same rows as the tokens.

Prompt sources:
* ``tinystories``: the opening sentence of each story paragraph of
  ``$DSPARK_DATA/text/tinystories_val_head.txt`` (stories260k);
* ``chat``: :func:`chat_training_prompts`, the built-in :data:`CHAT_PROMPTS`
  interleaved with shared prompt sets that are disjoint from every evaluation
  slice (Vicuna-Bench, QA, the tail of GSM8K test and HumanEval),
  plus an optional JSONL file (``{"prompt": ...}``, ``{"text": ...}``, or
  MT-Bench style ``{"turns": [...]}``), wrapped in the tokenizer's chat template.

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

import numpy as np

from dspark_jax.errors import DSparkInputError

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a short poem about the ocean.",
    "How do I reverse a list in Python?",
    "What are the benefits of regular exercise?",
    "Give me three tips for better sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a rainbow form?",
    "Write a haiku about autumn leaves.",
    "What is 15 multiplied by 12? Explain step by step.",
    "Why is the sky blue?",
    "Describe how to make a cup of tea.",
    "What are prime numbers? Give examples.",
    "Write a Python function that checks if a number is even.",
    "What causes the seasons on Earth?",
    "Tell me a fun fact about elephants.",
    "How do airplanes stay in the air?",
    "What is the water cycle?",
    "Write a short story about a brave little mouse.",
    "What is machine learning?",
    "List five fruits that are rich in vitamin C.",
    "How can I improve my writing skills?",
    "What is the Pythagorean theorem?",
    "Explain what a computer program is to a child.",
    "What should I pack for a weekend camping trip?",
    "Translate 'good morning' into Spanish and French.",
    "What are the main parts of a plant?",
    "Write a thank-you note to a teacher.",
    "How do I calculate the area of a circle?",
    "What is the role of the heart in the human body?",
    "Give me a recipe for a simple salad.",
    "Why do we need to recycle?",
    "Write a SQL query that selects all rows from a table named users.",
    "What is gravity?",
    "Describe a sunset in three sentences.",
    "What are the planets in our solar system?",
    "How do I stay focused while studying?",
    "Explain the difference between weather and climate.",
    "Write a limerick about a cat.",
    "If a train travels 60 miles in 1.5 hours, what is its average speed?",
    "What is an API?",
    "Give me a motivational quote and explain it.",
    "How does the internet work, briefly?",
    "What is the boiling point of water at sea level?",
    "Write a JavaScript function that adds two numbers.",
    "What is democracy?",
    "Name three famous painters and one work by each.",
    "How do bees make honey?",
    "Write a short dialogue between a robot and a child.",
]


def shared_data_dir() -> Path:
    """Folder of the shared real data (``$DSPARK_DATA``, else ``../shared/data`` near the CWD/repo).

    Raises:
      DSparkInputError: no such folder.
    """
    env = os.environ.get("DSPARK_DATA")
    cands = [Path(env)] if env else []
    if os.environ.get("DSPARK_MODELS"):
        cands.append(Path(os.environ["DSPARK_MODELS"]).parent)
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        cands += [base / "../shared/data", base / "shared/data"]
    for c in cands:
        if (c / "text").is_dir() or (c / "prompts").is_dir():
            return c.resolve()
    raise DSparkInputError("shared data not found: set DSPARK_DATA=/path/to/shared/data")


def tinystories_openings(path: str | Path | None = None, min_words: int = 4) -> list[str]:
    """Opening sentences of TinyStories paragraphs, in file order, deduplicated.

    Args:
      path: the text file (default ``<shared data>/text/tinystories_val_head.txt``).
      min_words: shortest opening kept.
    """
    path = Path(path) if path else shared_data_dir() / "text/tinystories_val_head.txt"
    if not path.exists():
        raise DSparkInputError(f"TinyStories text not found at {path}")
    seen, out = set(), []
    for para in path.read_text(encoding="utf-8").split("\n\n"):
        para = " ".join(para.split())
        if not para:
            continue
        m = re.match(r"(.+?[.!?])(\s|$)", para)
        first = m.group(1) if m else para
        if len(first.split()) < min_words or first in seen:
            continue
        seen.add(first)
        out.append(first)
    return out


def read_prompt_file(path: str | Path) -> list[str]:
    """User prompts from a JSONL (``prompt``/``text``/``question``/``turns``) or gzip JSONL file.

    Raises:
      DSparkInputError: missing file, bad JSON, or a row without a prompt field.
    """
    path = Path(path)
    if not path.exists():
        raise DSparkInputError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DSparkInputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if isinstance(row, str):
                out.append(row)
            elif row.get("turns"):
                out.append(row["turns"][0])
            else:
                for k in ("prompt", "text", "question", "instruction"):
                    if k in row:
                        out.append(row[k])
                        break
                else:
                    raise DSparkInputError(f"{path}:{n}: no 'prompt', 'text', 'question' or 'turns' field")
    return out


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Tokenizes prompts, wrapping each in the chat template when ``chat``."""
    out = []
    for p in prompts:
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            out.append(tokenizer.encode(text, add_bos=False))
        else:
            out.append(tokenizer.encode(p))
    return out


# Evaluation uses the first N (<= EVAL_PROMPT_HOLDOUT) prompts of GSM8K test and HumanEval and
# all of MT-Bench / Alpaca; training takes only what lies beyond, so no eval prompt is trained on.
EVAL_PROMPT_HOLDOUT = 100
_CHAT_TRAIN_SOURCES = (
    ("vicuna_bench_question.jsonl", 0),
    ("eagle_qa_question.jsonl", 0),
    ("HumanEval.jsonl.gz", EVAL_PROMPT_HOLDOUT),
    ("gsm8k_test.jsonl", EVAL_PROMPT_HOLDOUT),
)


def chat_training_prompts(data_dir: str | Path | None = None) -> list[str]:
    """Chat prompts for self-distillation, disjoint from the evaluation prompt sets.

    Round-robin over :data:`CHAT_PROMPTS` and the shared sets in
    ``_CHAT_TRAIN_SOURCES`` (skipping the first :data:`EVAL_PROMPT_HOLDOUT` rows of
    GSM8K test and HumanEval, which ``python -m dspark_jax.eval`` uses), so any
    prefix of the list mixes every source. Sets missing from ``data_dir`` are skipped.

    Returns:
      Deduplicated prompt strings, deterministic order.
    """
    base = Path(data_dir) if data_dir else None
    if base is None:
        try:
            base = shared_data_dir()
        except DSparkInputError:
            return list(CHAT_PROMPTS)
    pools = [list(CHAT_PROMPTS)]
    for name, skip in _CHAT_TRAIN_SOURCES:
        path = base / "prompts" / name
        if path.exists():
            pools.append(read_prompt_file(path)[skip:])
    out, seen = [], set()
    for i in range(max(len(p) for p in pools)):
        for pool in pools:
            if i < len(pool) and pool[i] not in seen:
                seen.add(pool[i])
                out.append(pool[i])
    return out


def split_prompts(prompts: Sequence, num_eval: int, seed: int = 0) -> tuple[list, list]:
    """Deterministic train / held-out split (held-out prompts never appear in training)."""
    idx = np.random.default_rng(seed).permutation(len(prompts))
    ev = sorted(idx[:num_eval].tolist())
    tr = sorted(idx[num_eval:].tolist())
    return [prompts[i] for i in tr], [prompts[i] for i in ev]


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
    Eagle3 ``draft_vocab_size``; DESIGN.md "Drafter" 5).

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


# -- contamination guard -------------------------------------------------------------------------
# What `python -m dspark_jax.eval` and the benchmarks evaluate on: every row of these sets
# (first EVAL_PROMPT_HOLDOUT rows of the large ones), including their copies inside Spec-Bench.
_EVAL_SETS = (
    ("mt_bench_question.jsonl", None),
    ("eagle_alpaca_question.jsonl", None),
    ("eagle_gsm8k_question.jsonl", None),
    ("eagle_humaneval_question.jsonl", None),
    ("gsm8k_test.jsonl", EVAL_PROMPT_HOLDOUT),
    ("HumanEval.jsonl.gz", EVAL_PROMPT_HOLDOUT),
)
_MIN_GUARD_CHARS = 24  # shorter eval strings would match ordinary phrases


def _normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def evaluation_texts(held_out: Sequence[str] = (), data_dir: str | Path | None = None) -> list[str]:
    """Every prompt an evaluation uses: ``held_out`` (a run's held-out prompts) plus the
    shared evaluation sets (all MT-Bench turns, the EAGLE subsets, the first
    :data:`EVAL_PROMPT_HOLDOUT` rows of GSM8K test and HumanEval). Missing files are skipped."""
    texts = list(held_out)
    base = Path(data_dir) if data_dir else None
    if base is None:
        try:
            base = shared_data_dir()
        except DSparkInputError:
            return texts
    for name, n in _EVAL_SETS:
        path = base / "prompts" / name
        if not path.exists():
            continue
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()][:n]
        for r in rows:
            texts += [str(t) for t in r.get("turns", [])] or [str(r.get("question") or r.get("prompt") or "")]
    return [t for t in texts if t]


def drop_contaminated(texts: Sequence[str], eval_texts: Sequence[str]) -> list[bool]:
    """Which training texts contain an evaluation prompt (contamination guard).

    A text is contaminated when it contains (after lower-casing and collapsing punctuation
    and whitespace) any evaluation prompt of at least 24 characters, or equals a shorter
    one. Catches verbatim and lightly reformatted copies (Spec-Bench's MT-Bench / GSM8K
    rows, a corpus that includes the held-out TinyStories openings).

    Returns:
      ``[len(texts)]`` booleans, True = drop.
    """
    long_ev = sorted({e for e in map(_normalise, eval_texts) if len(e) >= _MIN_GUARD_CHARS}, key=len)
    short_ev = {e for e in map(_normalise, eval_texts) if 0 < len(e) < _MIN_GUARD_CHARS}
    out = []
    for t in texts:
        n = _normalise(t)
        out.append(n in short_ev or any(e in n for e in long_ev))
    return out


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
