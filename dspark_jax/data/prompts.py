"""Prompt sets and the contamination guard shared by evaluation, training and the benchmarks.

docs/design.md#pipeline / docs/design.md#metrics: evaluation and self-distillation draw prompts from
the same shared data (``$DSPARK_DATA``), so the split between them lives here, below
both (neither imports the other for its prompts).

* :data:`PROMPT_SETS` / :func:`load_prompt_texts`: the named evaluation sets (``mt_bench``,
  ``gsm8k``, ``humaneval``, ``alpaca``, ``tinystories``) or a JSONL file, as ``--prompts`` of the
  eval and calibrate commands and the benchmarks name them;

* :func:`tinystories_openings`: the opening sentence of each story paragraph of
  ``$DSPARK_DATA/text/tinystories_val_head.txt`` (stories260k);
* :func:`read_prompt_file`: a JSONL (``{"prompt": ...}``, ``{"text": ...}``,
  ``{"question": ...}`` or MT-Bench style ``{"turns": [...]}``) or gzip JSONL file;
* :func:`chat_training_prompts`: the built-in :data:`CHAT_PROMPTS` interleaved with shared
  prompt sets that are disjoint from every evaluation slice (Vicuna-Bench, QA, the tail of
  GSM8K test and HumanEval);
* :func:`split_prompts`: a run's deterministic train / held-out split;
* :func:`evaluation_texts` / :func:`drop_contaminated`: every prompt an evaluation uses,
  and which training texts contain one (the contamination guard).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark_jax.errors import DSparkInputError
from dspark_jax.models.tokenizer import Tokenizer

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
    # parents[2] is the repository root (dspark_jax/data/prompts.py), beside which the
    # shared data folder sits in a checkout.
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        cands += [base / "../shared/data", base / "shared/data"]
    for c in cands:
        if (c / "text").is_dir() or (c / "prompts").is_dir():
            return c.resolve()
    raise DSparkInputError("shared data not found: set DSPARK_DATA=/path/to/shared/data")


# Named evaluation prompt sets: file under ``$DSPARK_DATA/prompts`` (tinystories: the openings of
# the TinyStories text, :func:`tinystories_openings`).
PROMPT_SETS = {
    "tinystories": None,
    "mt_bench": "mt_bench_question.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
    "alpaca": "eagle_alpaca_question.jsonl",
}


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


def load_prompt_texts(spec: str, export_meta: dict | None = None) -> tuple[list[str], str]:
    """Prompt texts of a named set (:data:`PROMPT_SETS`) or a JSONL file, and a description of
    their source.

    ``tinystories``: when ``export_meta`` records a TinyStories training run, the
    held-out split of that run (the prompts its training never saw), else all openings.

    Raises:
      DSparkInputError: unknown set / missing file / unreadable rows.
    """
    if spec == "tinystories":
        texts = tinystories_openings()
        cfg = ((export_meta or {}).get("extra") or {}).get("config") or {}
        if cfg.get("prompts") == "tinystories" and not cfg.get("prompts_file"):
            n_eval = min(int(cfg.get("num_eval_prompts", 0)), len(texts) // 5)
            if n_eval > 0:
                _, held = split_prompts(texts, n_eval, int(cfg.get("seed", 0)))
                return held, f"tinystories openings: the {n_eval} held-out prompts of the drafter's training run"
        return texts, "tinystories openings (the export records no TinyStories training split: may overlap training)"
    file_name = PROMPT_SETS.get(spec)
    if file_name is not None:
        path = shared_data_dir() / "prompts" / file_name
        if not path.exists():
            raise DSparkInputError(f"prompt set {spec!r} not found at {path} (set DSPARK_DATA)")
        return read_prompt_file(path), str(path)
    path = Path(spec)
    if not path.is_file():
        raise DSparkInputError(f"--prompts {spec!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a file")
    return read_prompt_file(path), str(path.resolve())


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
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


def fold_text(text: str) -> str:
    """``text`` lower-cased with punctuation and whitespace runs folded to single spaces (the
    contamination guard's and deduplication's notion of "the same prompt")."""
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
    long_ev = sorted({e for e in map(fold_text, eval_texts) if len(e) >= _MIN_GUARD_CHARS}, key=len)
    short_ev = {e for e in map(fold_text, eval_texts) if 0 < len(e) < _MIN_GUARD_CHARS}
    out = []
    for t in texts:
        n = fold_text(t)
        out.append(n in short_ev or any(e in n for e in long_ev))
    return out
