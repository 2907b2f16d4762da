"""The LM head over a few positions on the CPU: a tied head (or a drafter's rows of it) as one
reduction over H per vocabulary row, which streams each row once (docs/design.md#target-model).
Used by the target's unembedding and the DSpark drafter's drafting round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models.attention import current_platform

# Up to this many positions, a tied LM head on the CPU runs as a row reduction (tied_head_row_reduce).
ROW_REDUCE_MAX_TOKENS = 32


def tied_head_row_reduce(h: jax.Array, embed: jax.Array) -> jax.Array:
    """``h @ embed.T`` as one reduction over H for every embedding row: ``[..., H]`` x ``[V, H]``
    -> ``[..., V]`` float32.

    Why: XLA's CPU backend runs a dot with one row as a matrix-vector product near memory bandwidth, but a
    dot with 2-32 rows through a GEMM kernel that read SmolLM2's 113 MB embedding 2.6x slower (2 cores,
    3 rows: 8.1 ms against 3.1 ms for one row); the reduction streams each embedding row once for every
    position (4.7 ms at 3 rows; 7.8 against 9.7 ms at 9). Equal to the dot up to round-off (summation order).
    """
    lead, hidden = h.shape[:-1], h.shape[-1]
    flat = h.reshape(-1, hidden).astype(jnp.float32)
    logits = jnp.sum(embed.astype(jnp.float32)[:, None, :] * flat[None, :, :], axis=-1)  # [V, N]
    return logits.T.reshape(*lead, embed.shape[0])


def row_reduce_head(h: jax.Array) -> bool:
    """Whether a head over ``h [..., H]`` runs as :func:`tied_head_row_reduce`: on the CPU, for 2 to
    :data:`ROW_REDUCE_MAX_TOKENS` positions (a verification pass, a drafting round's block)."""
    return 1 < int(np.prod(h.shape[:-1])) <= ROW_REDUCE_MAX_TOKENS and current_platform() == "cpu"
