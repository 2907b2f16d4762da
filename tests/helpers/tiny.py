"""Tiny models shared by the tests: one definition of the tiny target and drafter configs, their
random weights and their seeds, so that tests which mean "the tiny target" build the same one.

* :data:`TINY_TARGET`, :func:`tiny_target`: a 4-layer Llama-style target (V = 64, H = 32, GQA
  4/2 heads) with random weights (seed 1, scale 0.2) and the fingerprint ``"tinyfp"``.
* :data:`TINY_TRAIN`, :func:`tiny_train_config`: the drafter shape of the tiny training runs
  (block size block_size = 4, one layer, Markov rank 8); :func:`tiny_drafter` builds a drafter of any
  kind (``"dspark"``, ``"dflash"``, ``"eagle3"``) for a target from it, the way a run does.
* :func:`tiny_data`: self-distillation-shaped rows (``tokens``, ``lengths``, ``prompt_lengths``).
* :data:`LAW_TARGET`, :func:`law_target`: a V = 6 target small enough to enumerate every draft
  sequence (the exact-law tests).

Random weights only, so each builds in well under a second (compilation is what costs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.build import build_drafter
from dspark_jax.models.target import Target, random_params
from dspark_jax.training.train_config import TrainConfig, drafter_config

TINY_TARGET = TargetConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position=128,
    name="tiny",
)
TINY_FINGERPRINT = "tinyfp"
TARGET_SEED = 1
TARGET_SCALE = 0.2
DRAFTER_SEED = 0
TINY_TRAIN = TrainConfig.from_keys(block_size=4, num_layers=1, markov_rank=8)

LAW_TARGET = TargetConfig(
    vocab_size=6,
    hidden_size=16,
    intermediate_size=32,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position=32,
    tie_embeddings=False,
    name="law",
)


def tiny_target(seed: int = TARGET_SEED, fingerprint: str = TINY_FINGERPRINT) -> Target:
    """The tiny target: :data:`TINY_TARGET` with random float32 weights (``seed``, scale 0.2)."""
    return Target(TINY_TARGET, random_params(TINY_TARGET, seed=seed, scale=TARGET_SCALE), fingerprint=fingerprint)


def tiny_train_config(**overrides: Any) -> TrainConfig:
    """:data:`TINY_TRAIN` with ``overrides`` (any :class:`TrainConfig` key, flat drafter keys included)."""
    return TINY_TRAIN.with_keys(**overrides)


def tiny_drafter_config(target: Target, variant: str = "dspark", train: TrainConfig = TINY_TRAIN) -> DrafterConfig:
    """The :class:`DrafterConfig` a ``train`` run of ``variant`` builds for ``target``."""
    return drafter_config(train.with_keys(variant=variant), target)


def tiny_drafter(target: Target, variant: str = "dspark", seed: int = DRAFTER_SEED, train: TrainConfig = TINY_TRAIN):
    """A freshly initialised drafter of ``variant`` for ``target`` (a ``Drafter`` for
    dspark/dflash, an ``EagleDrafter`` for eagle3), parameters from ``nnx.Rngs(seed)``."""
    return build_drafter(tiny_drafter_config(target, variant, train), nnx.Rngs(seed))


def tiny_data(
    n: int, length: int, seed: int = 0, prompt_len: int = 4, vocab_size: int = TINY_TARGET.vocab_size
) -> dict[str, np.ndarray]:
    """``n`` random rows of ``length`` int32 tokens in ``[3, vocab_size)`` (ids 0-2 are special),
    each really ``lengths[i]`` in ``[length // 2, length]`` long, after a ``prompt_len`` prompt."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, vocab_size, (n, length)).astype(np.int32)
    lens = rng.integers(length // 2, length + 1, n).astype(np.int32)
    return {"tokens": toks, "lengths": lens, "prompt_lengths": np.full(n, prompt_len, np.int32)}


def law_target(seed: int = 7, scale: float = 0.4) -> Target:
    """:data:`LAW_TARGET` with random weights (seed 7, scale 0.4: peaked enough that drafts are
    both accepted and rejected), no fingerprint."""
    return Target(LAW_TARGET, random_params(LAW_TARGET, seed=seed, scale=scale))


def hf_logits(model, ids) -> np.ndarray:
    """A transformers model's float32 logits ``[T, V]`` for one sequence of token ids ``[T]``."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None], dtype=torch.long)).logits[0].float().numpy()


def cached_logits(target, ids, splits, tol: float):
    """``target``'s full causal logits ``[T, V]`` for ``ids [T]``, after checking (within ``tol``) that
    the KV-cache path fed in blocks of ``splits`` tokens gives the same; returns ``(full, cache
    after the first block)``."""
    pos = np.arange(len(ids), dtype=np.int32)[None]
    full = np.asarray(target(ids[None], pos).logits[0])
    cache = target.init_cache(1, len(ids))
    parts, start, first = [], 0, None
    for n in splits:
        out = target(ids[None, start : start + n], pos[:, start : start + n], cache)
        cache = out.cache
        first = cache if first is None else first
        parts.append(np.asarray(out.logits[0]))
        start += n
    np.testing.assert_allclose(np.concatenate(parts), full, atol=tol, rtol=0)
    return full, first
