"""Bad prompts, settings and drafters are refused with a clear one-line error before any compilation."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.drafters.base import check_compatible
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target
from tests.unit.decoding.helpers import TINY, V, tiny_params


def test_input_errors(peaked, drafters):
    """(g) bad prompts / settings raise DSparkInputError before any compilation."""
    d = drafters["bigram"]
    calls = [
        lambda p, **k: generate_autoregressive(peaked, p, **k),
        lambda p, **k: generate_speculative(peaked, d, p, **{"num_speculative_tokens": 4, **k}),
    ]
    for fn in calls:
        for bad, match in [
            ([[]], "empty"),
            ([[1, 2], []], "empty"),
            ([[1, V]], "outside the vocabulary"),
            ([[-1, 3]], "outside the vocabulary"),
            ([], "no prompts"),
        ]:
            with pytest.raises(DSparkInputError, match=match):
                fn(bad, max_new_tokens=4)
        with pytest.raises(DSparkInputError, match="max_new_tokens"):
            fn([[1, 2]], max_new_tokens=0)
        # NaN/inf settings are refused (they used to decode <unk> tokens), per request too
        for kw, match in [
            (dict(temperature=float("nan")), "temperature must be a finite number"),
            (dict(temperature=[0.5, float("inf")]), "temperature must be a finite number"),
            (dict(top_p=float("nan")), "top_p must be a finite number"),
            (dict(top_k=float("inf")), "top_k must be a finite number"),
            (dict(temperature=-1.0), "temperature must be >= 0"),
            (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ]:
            with pytest.raises(DSparkInputError, match=match):
                fn([[1, 2], [3, 4]], max_new_tokens=4, **kw)
        # numbers the device arrays cannot hold are refused, never wrapped (issue 27)
        for kw, match in [
            (dict(top_k=2**31), r"top_k must be an integer in \[0, 2147483647\] \(0 is off\), got 2147483648"),
            (dict(top_k=[0, 2**70]), "top_k must be an integer in"),
            (dict(temperature=1e39), "temperature must be at most 3.4"),
            (dict(max_new_tokens=2**31), "max_new_tokens must be at most 2147483647, got 2147483648"),
            (dict(max_new_tokens=[4, 2**70]), "max_new_tokens must be at most 2147483647"),
            (dict(seed=2**70), "seed must be an integer in"),
            (dict(seed=[1, 2.5]), "seed must be an integer in"),
        ]:
            with pytest.raises(DSparkInputError, match=match):
                fn([[1, 2], [3, 4]], **{"max_new_tokens": 4, **kw})
        with pytest.raises(DSparkInputError, match="token id 1180591620717411303424 outside the vocabulary"):
            fn([[1, 2**70]], max_new_tokens=4)
    for g in (0, 5, -1):
        with pytest.raises(DSparkInputError, match=r"num_speculative_tokens must be in \[1, 4\]"):
            generate_speculative(peaked, d, [[1, 2]], max_new_tokens=4, num_speculative_tokens=g)


def test_incompatible_drafter(peaked):
    """(h) a drafter built for another vocabulary / width / depth / weights is refused."""
    from dspark_jax.models.weights import params_fingerprint

    p = tiny_params("peaked")
    fp_target = Target(TINY, p, fingerprint=params_fingerprint(p))
    others = {
        "vocabulary": dataclasses.replace(TINY, vocab_size=V + 1),
        "hidden size": dataclasses.replace(TINY, hidden_size=48),
        "layers": dataclasses.replace(TINY, num_layers=4),
    }
    for what, cfg in others.items():
        d = DSparkDrafter(DrafterConfig.for_target(cfg, block_size=2, num_layers=1, markov_rank=4), nnx.Rngs(0))
        for t in (peaked, fp_target):
            with pytest.raises(DSparkInputError, match=what):
                check_compatible(t, d)
            with pytest.raises(DSparkInputError, match=what):
                generate_speculative(t, d, [[1, 2, 3]], max_new_tokens=4, num_speculative_tokens=2)
    # same architecture, other weights (recorded fingerprint differs)
    d = DSparkDrafter(
        DrafterConfig.for_target(
            TINY, block_size=2, num_layers=1, markov_rank=4, target_fingerprint="0123456789abcdef"
        ),
        nnx.Rngs(0),
    )
    with pytest.raises(DSparkInputError, match="weights"):
        generate_speculative(fp_target, d, [[1, 2, 3]], max_new_tokens=4, num_speculative_tokens=2)
    check_compatible(peaked, d)  # a target without a fingerprint cannot be checked: allowed
