"""stories260K (a real trained model): greedy autoregressive decoding reproduces the published golden
ids; speculative decoding equals it token for token on 50 TinyStories prompts with several drafters
(random with a random Markov head, a bigram "oracle", and -- marked slow -- the quickly trained one
of ``conftest.stories260k_export``)."""

from __future__ import annotations

import pytest

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from tests.unit.decoding.helpers import assert_same_outputs, check_stats

GOLDEN = [
    1,
    403,
    407,
    261,
    378,
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
    401,
    396,
    267,
    337,
    410,
    408,
    419,
    292,
    411,
    322,
    265,
    282,
    295,
    433,
    426,
    385,
    328,
    432,
    358,
    394,
    261,
    370,
    432,
]


@pytest.mark.exactness
def test_stories260k_greedy_golden(s260k):
    target, tok = s260k
    assert tok.encode("Once upon a time") == GOLDEN[:5]
    # Both prompts in one call (one compilation); [1] alone gives the same ids.
    res = generate_autoregressive(target, [GOLDEN[:5], [1]], max_new_tokens=35, temperature=0)
    assert res.generations[0].token_ids == GOLDEN[5:40]
    assert res.generations[1].token_ids == GOLDEN[1:36]
    assert all(g.finish_reason == "length" for g in res.generations)
    check_stats(res, 1, speculative=False)


@pytest.mark.exactness
def test_stories260k_speculative_equals_autoregressive(s260k, s260k_prompts, s260k_ar, s260k_drafter):
    target, _ = s260k
    n_spec = s260k_drafter.cfg.block_size
    sp = generate_speculative(
        target, s260k_drafter, s260k_prompts, max_new_tokens=48, temperature=0, num_speculative_tokens=n_spec
    )
    assert_same_outputs(s260k_ar, sp)
    check_stats(sp, s260k_drafter.cfg.block_size)
    check_stats(s260k_ar, 1, speculative=False)
    assert sum(g.num_draft_tokens for g in sp.generations) > 0
