"""The dtype policy and the bfloat16 exactness contract (docs/design.md#numerics).

``dtype="auto"`` resolves per platform; on stories260K in bfloat16, every greedy token speculative
decoding commits is the argmax of a bfloat16 forward pass over the committed text, except at
near-ties of that pass (two logits within bfloat16 rounding), which are counted and must be rare.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.models.precision import DTYPE_CHOICES, resolve_dtype

PROMPTS = ("Once upon a time, there was a little", "The dog ran to the park and", "Lily wanted to")
MAX_NEW = 40
# A near-tie: the committed token's logit within this much of the pass's maximum [logit units].
# bfloat16 keeps 8 bits of mantissa, so a logit near 10 is rounded to 1/16; a 1-token pass and a
# (w + 1)-token pass accumulate that rounding through 5 layers differently.
NEAR_TIE = 0.25


@pytest.mark.parametrize(
    ("dtype", "platform", "want"),
    [
        ("auto", "cpu", jnp.float32),
        ("auto", "gpu", jnp.bfloat16),
        ("auto", "rocm", jnp.bfloat16),
        ("auto", "tpu", jnp.bfloat16),
        (None, "tpu", jnp.bfloat16),
        ("float32", "tpu", jnp.float32),
        ("bfloat16", "cpu", jnp.bfloat16),
        (jnp.bfloat16, "cpu", jnp.bfloat16),
        (np.float32, "gpu", jnp.float32),
    ],
)
def test_resolve_dtype(dtype, platform, want):
    assert resolve_dtype(dtype, platform) == jnp.dtype(want)


def test_resolve_dtype_refuses_what_is_not_a_float_dtype():
    assert set(DTYPE_CHOICES) == {"auto", "float32", "bfloat16"}
    for bad in ("int32", "float33", "bool"):
        with pytest.raises(DSparkInputError, match="dtype"):
            resolve_dtype(bad, "cpu")
    assert resolve_dtype("auto") == jnp.float32  # this machine: a CPU


def test_bfloat16_greedy_tokens_are_the_targets_argmax(stories260k_dir, stories260k_export):
    from dspark_jax.api import encode_prompt, generate_text, load_target
    from dspark_jax.decoding.request import load_drafter_for

    target, tok = load_target(str(stories260k_dir), dtype="bfloat16")
    assert target.dtype == jnp.bfloat16 and target.lm_head_weight().dtype == jnp.bfloat16
    _, summary = stories260k_export
    drafter = load_drafter_for(target, tok, summary["export_dir"], target.dtype)[0]
    checked = accepted = ties = 0
    for prompt in PROMPTS:
        prompt_ids = encode_prompt(tok, prompt)
        out = generate_text(
            target, tok, prompt_ids, drafter=drafter, max_new_tokens=MAX_NEW, temperature=0.0, num_speculative_tokens=4
        )
        ids = jnp.asarray([[*prompt_ids, *out["token_ids"]]], jnp.int32)
        logits = np.asarray(target(ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None]).logits[0], np.float32)
        assert np.isfinite(logits).all()
        toks = np.asarray(out["token_ids"])
        rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(toks)]  # the logits that chose each token
        gaps = rows.max(axis=-1) - rows[np.arange(len(toks)), toks]
        assert (gaps <= NEAR_TIE).all(), (prompt, gaps.max(), int(gaps.argmax()))
        ties += int((gaps > 0).sum())
        checked += len(toks)
        accepted += len(out["token_ids"]) - 1 - out["num_target_passes"]  # beyond one token per pass
    assert checked == len(PROMPTS) * MAX_NEW
    assert accepted > 0  # drafts were really verified and accepted in bfloat16
    assert ties <= checked // 10, (ties, checked)
