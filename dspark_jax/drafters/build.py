"""Building the drafter of a config: one class per ``DrafterConfig.variant``.

Sits above the drafter kinds (:mod:`dspark_jax.drafters.dspark`, :mod:`dspark_jax.drafters.eagle`),
which share only :mod:`dspark_jax.drafters.base`, so no kind imports another.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafters.base import Drafter
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.drafters.eagle import EagleDrafter

DRAFTER_TYPES: dict[str, type[DSparkDrafter] | type[EagleDrafter]] = {
    "dspark": DSparkDrafter,
    "dflash": DSparkDrafter,
    "eagle3": EagleDrafter,
}

# The variants whose drafters are BlockDrafters (one backbone pass per block: what the serving
# engine needs), known from the config alone (tested against the built classes).
BLOCK_VARIANTS = frozenset({"dspark", "dflash"})


def build_drafter(cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32) -> Drafter:
    """A freshly initialised drafter of ``cfg.variant``: :class:`~dspark_jax.drafters.dspark.DSparkDrafter`
    (dspark / dflash) or :class:`~dspark_jax.drafters.eagle.EagleDrafter` (eagle3).

    Args:
      cfg: the drafter's architecture.
      rngs: ``nnx.Rngs`` for initialisation (same seed, same weights).
      dtype: parameter and compute dtype.
    Raises:
      KeyError: an unknown variant (:class:`DrafterConfig` refuses those first).
    """
    return DRAFTER_TYPES[cfg.variant](cfg, rngs, dtype=dtype)
