"""Magpie-style prompts (dspark_jax.training.magpie): the user header, the selection rules, the even
mix into the training prompts, and real requests written by SmolLM2-135M-Instruct."""

import json

import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.training import magpie


def _stats():
    return dict(generated=0, incomplete=0, too_short=0, duplicate=0, contaminated=0, kept=0)


def test_select_prompts_drops_incomplete_short_duplicate_and_contaminated():
    guard = ["Natalia sold clips to 48 of her friends in April"]
    texts = [
        "  How do I bake sourdough bread at home?  ",
        "Write a haiku about the sea, please.",
        "how do I bake SOURDOUGH bread at home",  # the first one again, folded
        "Hi!",
        "Explain how tides work in detail and",  # cut by the length limit
        "Solve: natalia sold clips to 48 of her friends in April, then half as many in May.",
    ]
    finished = [True, True, True, True, False, True]
    seen, stats = set(), _stats()
    kept = magpie.select_prompts(texts, finished, guard, seen, stats)
    assert kept == ["How do I bake sourdough bread at home?", "Write a haiku about the sea, please."]
    assert stats == dict(generated=0, incomplete=1, too_short=1, duplicate=1, contaminated=1, kept=2)
    # a later batch repeating an earlier request is a duplicate across batches too
    assert magpie.select_prompts(["Write a haiku about the sea, please"], [True], guard, seen, stats) == []
    assert stats["duplicate"] == 2


@pytest.mark.parametrize("n_base,n_extra,n", [(10, 3, 8), (5, 5, 20), (7, 0, 4), (3, 4, 2)])
def test_mix_prompts_spreads_extra_over_the_first_n(n_base, n_extra, n):
    base = [f"b{i}" for i in range(n_base)]
    extra = [f"e{i}" for i in range(n_extra)]
    mixed = magpie.mix_prompts(base, extra + ["b0"], n)  # an extra already in base is left out
    used = extra[:n]
    assert sorted(mixed) == sorted(base + used)  # nothing lost, nothing twice
    assert [x for x in mixed if x.startswith("b")] == base  # base order kept
    assert [x for x in mixed if x.startswith("e")] == used
    first = mixed[: min(n, len(mixed))]
    assert sum(x.startswith("e") for x in first) == len(used)  # every extra inside the first n
    if len(used) > 1 and n > len(used):
        pos = [i for i, x in enumerate(first) if x.startswith("e")]
        assert pos[0] > 0 or pos[-1] < len(first) - 1  # spread, not bunched at one end


def test_user_turn_prefix_needs_a_chat_template(stories260k):
    _, _, tok = stories260k
    with pytest.raises(DSparkInputError, match="chat template"):
        magpie.user_turn_prefix(tok)


@pytest.mark.slow
def test_smollm2_writes_complete_guarded_requests(smollm2, tmp_path):
    from dspark_jax.models.target import Target

    cfg, params, tok = smollm2
    head, stop = magpie.user_turn_prefix(tok)
    assert tok.decode(head).endswith("<|im_start|>user\n")
    assert tok.encode("<|im_end|>", add_bos=False)[0] in stop
    target = Target(cfg, params)
    texts, stats = magpie.magpie_prompts(target, tok, 6, max_new_tokens=48, batch_size=8, seed=3)
    assert 1 <= len(texts) <= 6 and stats["generated"] >= 8
    dropped = stats["incomplete"] + stats["too_short"] + stats["duplicate"] + stats["contaminated"]
    assert stats["generated"] == stats["kept"] + stats["surplus"] + dropped and stats["kept"] == len(texts)
    for t in texts:
        assert t == t.strip() and len(t) >= magpie.MIN_PROMPT_CHARS
        assert "<|im_" not in t
    # the file a training run writes and reads back
    path = tmp_path / "magpie.jsonl"
    magpie.write_prompts(path, texts, stats)
    assert magpie.read_or_generate(path, None, tok, 6, 0, []) == texts
    assert json.loads(path.with_name("magpie.jsonl.json").read_text())["kept"] == stats["kept"]
