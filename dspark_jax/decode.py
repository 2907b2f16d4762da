"""Deprecated module path, kept for one release: use :mod:`dspark_jax.decoding.speculative`."""

import warnings

from dspark_jax.decoding.speculative import *  # noqa: F403
from dspark_jax.decoding.speculative import __all__  # noqa: F401

warnings.warn(
    "dspark_jax.decode is deprecated; import from dspark_jax.decoding.speculative (or the top-level dspark_jax API)",
    DeprecationWarning,
    stacklevel=2,
)
