"""Deprecated module path, kept for one release: use :mod:`dspark_jax.decoding.speculative`
(the loops), :mod:`dspark_jax.decoding.results` (their result types) and
:mod:`dspark_jax.decoding.validation` (input checks; ``check_compatible`` is in
:mod:`dspark_jax.drafters.base`)."""

import warnings

from dspark_jax.decoding.results import BatchResult, DecodeStats, Generation, RoundLog
from dspark_jax.decoding.round import draft_tokens
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.decoding.validation import check_sampling, resolve_num_speculative_tokens
from dspark_jax.drafters.base import check_compatible

__all__ = [
    "BatchResult",
    "DecodeStats",
    "Generation",
    "RoundLog",
    "check_compatible",
    "check_sampling",
    "draft_tokens",
    "generate_autoregressive",
    "generate_speculative",
    "resolve_num_speculative_tokens",
]

warnings.warn(
    "dspark_jax.decode is deprecated; import from dspark_jax.decoding.speculative (or the top-level dspark_jax API)",
    DeprecationWarning,
    stacklevel=2,
)
