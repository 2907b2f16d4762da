"""dspark_jax: DSpark speculative decoding in JAX/Flax NNX.

Top-level API (see :mod:`dspark_jax.api`)::

    from dspark_jax import load_target, load_drafter, generate_text
"""

__version__ = "0.1.0"

from .api import encode_prompt, generate_text, load_drafter, load_target  # noqa: E402

__all__ = ["load_target", "load_drafter", "generate_text", "encode_prompt", "__version__"]
