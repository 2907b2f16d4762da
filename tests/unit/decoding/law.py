"""The law of the first generated tokens at T > 0 through the real loops: the exact law enumerated
from the target, chi-square tests, and the decodes (:func:`law_decodes`, run by
``tests/law_worker.py`` in a process of its own; checked by ``test_law.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.models.sampling import process_logits, sampling_arrays
from dspark_jax.models.target import Target
from tests.unit.decoding.helpers import COSTLY, TINY, V, bigram_drafter, random_drafter, tiny_params

DIST_PROMPT = [3, 7, 1, 12]
N_LAW = 12000  # rows per sampling setting
SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=6, top_p=0.9)]


def exact_law(target, prompt, temperature, top_k, top_p, n_tokens=3) -> np.ndarray:
    """Exact ``[V] * n_tokens`` joint law of the first generated tokens, by enumerating
    every prefix through one cache-less target pass (causal: position t sees <= t)."""
    assert n_tokens == 3
    v = target.cfg.vocab_size
    y1, y2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    seqs = np.concatenate(
        [np.broadcast_to(prompt, (v * v, len(prompt))), y1.reshape(-1, 1), y2.reshape(-1, 1)], axis=1
    ).astype(np.int32)
    pos = np.broadcast_to(np.arange(seqs.shape[1], dtype=np.int32), seqs.shape)
    logits = target(jnp.asarray(seqs), jnp.asarray(pos)).logits[:, len(prompt) - 1 :]  # [V*V, 3, V]
    probs = np.asarray(process_logits(logits, sampling_arrays(v * v, temperature, top_k, top_p)), np.float64)
    probs /= probs.sum(-1, keepdims=True)
    p1 = probs[0, 0]
    p2 = probs[::v, 1]  # rows with y1 = i (any y2)
    p3 = probs[:, 2].reshape(v, v, v)
    law = p1[:, None, None] * p2[:, :, None] * p3
    return law / law.sum()


def counts_of(tokens: np.ndarray, rows, n_tokens=3) -> np.ndarray:
    """``[V] * n_tokens`` counts of the first ``n_tokens`` generated tokens (``tokens``: ``[rows, T]``)."""
    counts = np.zeros((V,) * n_tokens)
    np.add.at(counts, tuple(tokens[rows, :n_tokens].T), 1)
    return counts


# Pearson chi-square tests on outcomes with expected count >= 5, the rest pooled into one
# bin (a TV bound over ~4000 mostly tiny outcomes is far too loose to catch a real bug).
# The upper 1e-6 quantile of chi2(df) by Wilson-Hilferty (no scipy dependency): the seeds
# are fixed, so a pass/fail flip needs a code change, and a false alarm has odds ~1e-6.
Z_TAIL = 4.75


def chi2_quantile(df: int) -> float:
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_TAIL * np.sqrt(c)) ** 3


def _bins(law, n):
    return law.reshape(-1) * n >= 5


def _binned(x, keep):
    x = x.reshape(-1)
    return np.append(x[keep], x[~keep].sum())


def chi2_goodness(counts, law, keep) -> tuple[float, float]:
    """``(statistic, 1e-6 critical value)`` of counts against an exact law."""
    n = counts.sum()
    obs, exp = _binned(counts, keep), _binned(law, keep) * n
    m = exp > 0
    assert obs[~m].sum() == 0, "an outcome of probability 0 was generated"
    return float(((obs[m] - exp[m]) ** 2 / exp[m]).sum()), chi2_quantile(int(m.sum()) - 1)


def chi2_two_sample(c1, c2, keep) -> tuple[float, float]:
    """``(statistic, critical value)`` of homogeneity of two equal-size samples."""
    a, b = _binned(c1, keep), _binned(c2, keep)
    m = (a + b) > 0
    return float(((a[m] - b[m]) ** 2 / (a[m] + b[m])).sum()), chi2_quantile(max(int(m.sum()) - 1, 1))


def law_decodes() -> dict:
    """The law's decodes, one batch per loop: N_LAW rows per sampling setting, seeds 0..2N-1,
    max_new 6 (the first round verifies the full block_size = 4). ``{name: DecodeResult}`` for
    ``ar``, ``spec-bigram``, ``spec-random``, ``spec-bigram-auto`` and ``bf16-spec-bigram``
    (``tests/law_worker.py`` runs it)."""
    peaked = Target(TINY, tiny_params("peaked"))
    drafters = {"random": random_drafter(peaked, seed=3), "bigram": bigram_drafter(peaked, seed=4)}
    b = N_LAW * len(SETTINGS)
    kw = dict(
        max_new_tokens=6,
        seed=list(range(b)),
        cache_len=32,
        temperature=[s["temperature"] for s in SETTINGS for _ in range(N_LAW)],
        top_k=[s["top_k"] for s in SETTINGS for _ in range(N_LAW)],
        top_p=[s["top_p"] for s in SETTINGS for _ in range(N_LAW)],
    )
    prompts = [DIST_PROMPT] * b
    out = {"ar": generate_autoregressive(peaked, prompts, **kw)}
    block = dict(kw, num_speculative_tokens=4)
    out |= {
        f"spec-{name}": generate_speculative(peaked, drafters[name], prompts, **block) for name in ("bigram", "random")
    }
    out["spec-bigram-auto"] = generate_speculative(
        peaked, drafters["bigram"], prompts, num_speculative_tokens="auto", cost_table=COSTLY, **kw
    )
    # bfloat16 target and drafter (the same weights, rounded): the sampled half of the contract
    peaked16 = Target(TINY, tiny_params("peaked"), dtype=jnp.bfloat16)
    out["bf16-spec-bigram"] = generate_speculative(
        peaked16, in_dtype(drafters["bigram"], jnp.bfloat16), prompts, **block
    )
    return out


def in_dtype(drafter: DSparkDrafter, dtype) -> DSparkDrafter:
    """``drafter``'s weights in a drafter built for ``dtype`` (each parameter rounded to the dtype that
    ``dtype``'s build gives it: the compute weights to ``dtype``, any kept in float32 unchanged)."""
    out = DSparkDrafter(drafter.cfg, nnx.Rngs(0), dtype=dtype)
    ref = nnx.state(out, nnx.Param)
    nnx.update(out, jax.tree.map(lambda a, r: a.astype(r.dtype), nnx.state(drafter, nnx.Param), ref))
    return out
