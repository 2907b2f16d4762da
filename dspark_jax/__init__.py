"""dspark_jax: DSpark speculative decoding in JAX/Flax NNX.

Top-level API (see :mod:`dspark_jax.api`)::

    from dspark_jax import load_target, load_drafter, generate_text
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dspark_jax")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

from dspark_jax.api import encode_prompt, generate_text, load_drafter, load_target

__all__ = ["__version__", "encode_prompt", "generate_text", "load_drafter", "load_target"]
