"""dspark_jax: DSpark speculative decoding in JAX/Flax NNX."""

__version__ = "0.1.0"
