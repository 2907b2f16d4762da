"""Distillation data beyond greedy self-generation: corpus rows, chat reply spans, the serving-
temperature mix and the contamination guard (issue: data-efficient distillation)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.data import prompts as prompts_mod
from dspark_jax.errors import DSparkInputError
from dspark_jax.training import data as data_mod
from dspark_jax.training.losses import position_weights, sample_anchors


class CharChat:
    """A character-level tokenizer with a ChatML-like template (ids = code points)."""

    def encode(self, text, add_bos=True):
        return ([1] if add_bos else []) + [ord(c) for c in text]

    def apply_chat_template(self, msgs, add_generation_prompt=False):
        out = "".join(f"<{m['role']}>{m['content']}</>" for m in msgs)
        return out + ("<assistant>" if add_generation_prompt else "")


def test_read_corpus_formats(tmp_path):
    (tmp_path / "a.txt").write_text("First doc.\nstill first.\n\nSecond doc.\n\n\n")
    assert data_mod.read_corpus(tmp_path / "a.txt") == [("text", "First doc.\nstill first."), ("text", "Second doc.")]
    rows = [
        {"text": "plain"},
        {"prompt": "hi", "response": "hello"},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"},
            ]
        },
    ]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got = data_mod.read_corpus(tmp_path / "b.jsonl")
    assert got[0] == ("text", "plain") and got[1] == ("chat", [{"role": "user", "content": "hi"}], "hello")
    assert [r[2] for r in got[2:]] == ["a1", "a2"] and len(got[3][1]) == 4  # a2 sees s, u1, a1, u2
    (tmp_path / "c.jsonl").write_text('{"question": 1}\n')
    with pytest.raises(DSparkInputError, match="c.jsonl:1"):
        data_mod.read_corpus(tmp_path / "c.jsonl")


def test_chat_loss_counts_only_reply_tokens():
    """Hand-built two-turn chat: every loss slot with weight > 0 predicts a reply token."""
    msgs = [
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "Yes!"},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Yes again."},
    ]
    rows = [("chat", msgs[:1], "Yes!"), ("chat", msgs[:3], "Yes again.")]
    tok = CharChat()
    seqs = [data_mod.encode_corpus_row(tok, r, chat=True) for r in rows]
    for (ids, plen), r in zip(seqs, rows):
        reply = "".join(map(chr, ids[plen:]))
        assert reply == r[2] + "</>"  # the reply and its end-of-turn, nothing of the prompt
    L, g = 96, 4
    toks = np.zeros((2, L), np.int32)
    for i, (ids, _) in enumerate(seqs):
        toks[i, : len(ids)] = ids
    lens = jnp.asarray([len(s[0]) for s in seqs], jnp.int32)
    plens = jnp.asarray([s[1] for s in seqs], jnp.int32)
    anchors = sample_anchors(jax.random.PRNGKey(0), lens, plens, 256)
    w = np.asarray(position_weights(anchors, lens, g, 4.0))
    predicted = np.asarray(anchors)[..., None] + np.arange(1, g + 1)  # position of the predicted token
    for b in range(2):
        pos = predicted[b][w[b] > 0]
        assert pos.size and pos.min() >= seqs[b][1] and pos.max() < len(seqs[b][0])
        assert set(range(seqs[b][1], len(seqs[b][0]))) <= set(pos.tolist())  # every reply token is taught


def test_contamination_guard_catches_copies():
    ev = prompts_mod.evaluation_texts(["Once upon a time, there was a tiny frog who loved the rain."])
    mt = json.loads((prompts_mod.shared_data_dir() / "prompts" / "mt_bench_question.jsonl").read_text().splitlines()[3])
    spec = [
        json.loads(line)
        for line in (prompts_mod.shared_data_dir() / "prompts" / "spec_bench_question.jsonl").read_text().splitlines()
    ]
    eagle_gsm = [
        json.loads(line)["turns"][0]
        for line in (prompts_mod.shared_data_dir() / "prompts" / "eagle_gsm8k_question.jsonl").read_text().splitlines()
    ]
    gsm_copy = next(
        r
        for r in spec
        if r["category"] == "math_reasoning"  # Spec-Bench's copy of an eval row
        and any(q.strip() in r["turns"][0] for q in eagle_gsm)
    )
    texts = [
        "Some preamble.\n" + mt["turns"][1].upper().replace(" ", "  ") + "\nThe end.",  # reformatted MT-Bench turn
        gsm_copy["turns"][0],
        "ONCE UPON A TIME there was a tiny frog, who loved the rain! And then...",  # held-out opening
        "A completely unrelated story about a fox and a kite.",
    ]
    assert prompts_mod.drop_contaminated(texts, ev) == [True, True, True, False]


def test_sampled_rows_spread():
    s = data_mod.sampled_rows(range(1000), 0.25)
    assert sum(s) == 250 and all(sum(s[i : i + 4]) == 1 for i in range(0, 1000, 4))
    assert data_mod.sampled_rows(range(5, 10), 0.25) == s[5:10]  # depends on the row only (resume)
    with pytest.raises(DSparkInputError):
        data_mod.sampled_rows([0], 1.5)
