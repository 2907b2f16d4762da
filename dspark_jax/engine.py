"""Deprecated module path, kept for one release: use :mod:`dspark_jax.serving.engine`."""

import warnings

from dspark_jax.serving.engine import *  # noqa: F403
from dspark_jax.serving.engine import __all__  # noqa: F401

warnings.warn(
    "dspark_jax.engine is deprecated; import from dspark_jax.serving.engine", DeprecationWarning, stacklevel=2
)
