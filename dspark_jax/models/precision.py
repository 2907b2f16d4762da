"""The dtype policy: which dtype ``dtype="auto"`` means on this machine (docs/design.md#numerics).

``auto`` is bfloat16 weights and activations on a GPU or TPU, where memory traffic decides the
speed and the matrix units run bfloat16, and float32 on a CPU (the reference numerics the
exactness tests assume). Whatever the dtype, softmax and normalisation statistics, the attention
accumulators and the logits stay float32 (:mod:`~dspark_jax.models.layers`,
:meth:`~dspark_jax.models.target.Target.unembed`).

The bfloat16 exactness contract: every committed greedy token is the target's argmax in the
verification pass that committed it, and sampled tokens follow the law of the logits that pass
computed, so speculative decoding is exact with respect to the bfloat16 target as it ran
(``tests/unit/models/test_precision.py`` checks the greedy half on stories260K against a bfloat16
teacher-forced pass, allowing near-ties). Token-for-token equality with plain decoding holds
only where both compile the same shapes: a pass over 1 token and one over ``w + 1`` tokens round
differently, and a near-tie in the logits (within bfloat16's 8-bit mantissa) can flip the argmax.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from dspark_jax.errors import DSparkInputError

__all__ = ["DTYPE_CHOICES", "resolve_dtype"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
"""The names ``--dtype`` takes."""

_ACCELERATORS = ("gpu", "rocm", "tpu")


def resolve_dtype(dtype: Any = "auto", platform: str | None = None) -> jnp.dtype:
    """The weight/compute dtype ``dtype`` means here.

    Args:
      dtype: ``"auto"`` (or None), a dtype name (``"float32"``, ``"bfloat16"``, ...) or a dtype.
      platform: the JAX platform to resolve ``auto`` for (default: the current one,
        :func:`~dspark_jax.models.attention.current_platform`).
    Returns:
      bfloat16 for ``auto`` on ``gpu``/``rocm``/``tpu``, else float32; otherwise ``jnp.dtype(dtype)``.
    Raises:
      DSparkInputError: a name that is not a floating dtype.
    """
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        if platform is None:
            from dspark_jax.models.attention import current_platform

            platform = current_platform()
        return jnp.dtype(jnp.bfloat16 if platform in _ACCELERATORS else jnp.float32)
    try:
        out = jnp.dtype(dtype)
    except TypeError as e:
        raise DSparkInputError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_CHOICES)}") from e
    if not jnp.issubdtype(out, jnp.floating):
        raise DSparkInputError(f"dtype {out.name} is not a floating dtype: use one of {', '.join(DTYPE_CHOICES)}")
    return out
