"""RoPE frequency scaling as configuration: :class:`RopeScaling` and the types implemented
(:func:`dspark_jax.models.rope.rope_table` computes the tables). Re-exported by
:mod:`dspark_jax.config`.
"""

from __future__ import annotations

import dataclasses

# RoPE frequency scalings implemented exactly (dspark_jax.models.rope); "freq_factors" is llama.cpp's
# per-frequency divisors (a GGUF file's rope_freqs.weight tensor).
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "freq_factors", "proportional")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a target, as transformers' ``rope_parameters`` define it.

    The inverse-frequency table it gives (:func:`dspark_jax.models.rope.rope_table`) is a constant
    computed once per config, so scaling costs nothing in the decode loop.

    Attributes:
      rope_type: one of :data:`ROPE_TYPES`: ``linear`` (every frequency divided by ``factor``),
        ``yarn`` (YaRN's ramp between interpolated and original frequencies, plus
        ``attention_factor`` on cos/sin), ``llama3`` (Llama 3.1's smoothed low-frequency
        division), ``freq_factors`` (each frequency divided by its entry of ``freq_factors``).
      factor: the context-extension factor (linear, yarn, llama3).
      original_max_position: the pretraining context length [tokens] (yarn, llama3).
      low_freq_factor / high_freq_factor: llama3's wavelength bounds.
      beta_fast / beta_slow: yarn's ramp bounds [rotations].
      attention_factor: yarn's multiplier of cos and sin (resolved at load, transformers' rule).
      truncate: yarn rounds its ramp bounds to whole dimensions.
      freq_factors: ``head_dim / 2`` divisors (rope_type ``freq_factors``).
      partial_rotary_factor: ``proportional`` (Gemma 4's global layers): the first
        ``int(partial_rotary_factor * head_dim // 2)`` default frequencies turn, the rest are 0; all / ``factor``.
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    freq_factors: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not one of {ROPE_TYPES}")
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))
        if (self.rope_type == "freq_factors") != bool(self.freq_factors):
            raise ValueError("freq_factors are given exactly when rope_type is 'freq_factors'")
