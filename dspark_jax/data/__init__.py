"""Data every stage reads: the prompt sets (:mod:`dspark_jax.data.prompts`)."""
