"""RoPE frequency tables and their scalings, exactly as transformers computes them.

:func:`rope_table` turns ``(rope_theta, head_dim, RopeScaling)`` into the inverse-frequency
table ``[head_dim / 2]`` and the factor on cos/sin (YaRN's ``attention_factor``). It is computed
once per config in float64 (transformers computes it in float32; the difference is round-off)
and enters the compiled programs as a constant, so scaling adds nothing to a decode step.

:func:`hf_rope_scaling` reads a Hugging Face ``rope_parameters`` / legacy ``rope_scaling`` dict,
:func:`gguf_rope_scaling` a GGUF file's ``{arch}.rope.scaling.*`` metadata and its
``rope_freqs.weight`` tensor (llama.cpp's llama3 factors). Both refuse, by name, a scaling that
is not implemented exactly (``dynamic`` and ``longrope`` change their frequencies with each
call's length; a partial rotary factor).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from dspark_jax.config import RopeScaling
from dspark_jax.errors import DSparkInputError

# rope_type -> why it is refused (the types transformers knows and this package does not implement).
REFUSED_ROPE_TYPES = {
    "dynamic": "its frequencies change with each call's sequence length",
    "longrope": "its frequencies switch with each call's sequence length",
    "proportional": "partial / proportional rotary dimensions",
}


@functools.lru_cache(maxsize=64)
def rope_table(theta: float, head_dim: int, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """The inverse frequencies ``[head_dim // 2]`` float32 [radians / token] and the cos/sin factor.

    Follows transformers' ``ROPE_INIT_FUNCTIONS`` (``modeling_rope_utils``): default, linear,
    yarn, llama3, proportional (Gemma 4: a leading share of the frequencies turns, the rest are 0);
    ``freq_factors`` divides the default frequencies by llama.cpp's per-frequency
    factors (``rope_freqs.weight``), as llama.cpp's ``ggml_rope_ext`` does.
    """
    dim = head_dim
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    s = scaling or RopeScaling()
    scale = 1.0
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "proportional":  # transformers' int(partial_rotary_factor * head_dim // 2) turning
        inv = np.where(np.arange(dim // 2) < int(s.partial_rotary_factor * dim // 2), inv, 0.0) / s.factor
    elif s.rope_type == "freq_factors":
        inv = inv / np.asarray(s.freq_factors, np.float64)
    elif s.rope_type == "llama3":
        low_wl = s.original_max_position / s.low_freq_factor
        high_wl = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled)
    elif s.rope_type == "yarn":

        def corr_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the context
            return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against 0 / 0
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate (divide by factor)
        inv = (inv / s.factor) * (1 - extrapolation) + inv * extrapolation
        scale = s.attention_factor
    out = inv.astype(np.float32)
    out.setflags(write=False)
    return out, float(scale)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1), transformers' ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_rope_scaling(
    rp: dict[str, Any] | None, *, max_position: int, where: str
) -> tuple[float | None, RopeScaling | None]:
    """``(rope_theta or None, RopeScaling or None)`` from a Hugging Face ``rope_parameters`` dict
    (transformers 5) or a legacy ``rope_scaling`` dict (``type`` for ``rope_type``).

    Defaults follow transformers (``original_max_position_embeddings`` defaults to
    ``max_position``; yarn's factor to ``max_position / original``, its attention factor to
    ``0.1 ln(factor) + 1`` or the ``mscale`` / ``mscale_all_dim`` ratio, ``beta_fast`` 32,
    ``beta_slow`` 1, ``truncate`` True).

    Raises:
      DSparkInputError: a RoPE type not implemented exactly (dynamic, longrope, per-layer-type
        parameters, an unknown type) or a partial rotary factor.
    """
    rp = dict(rp or {})
    if any(isinstance(v, dict) for v in rp.values()):
        raise DSparkInputError(f"{where}: per-layer-type RoPE parameters ({sorted(rp)}) are not supported")
    kind = rp.get("rope_type", rp.get("type")) or "default"
    theta = rp.get("rope_theta")
    if rp.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise DSparkInputError(f"{where}: partial rotary embedding (partial_rotary_factor) is not supported")
    if kind in REFUSED_ROPE_TYPES:
        raise DSparkInputError(f"{where}: RoPE scaling {kind!r} is not supported ({REFUSED_ROPE_TYPES[kind]})")
    if kind == "default":
        return theta, None
    if kind not in ("linear", "yarn", "llama3"):
        raise DSparkInputError(f"{where}: RoPE scaling {kind!r} is not supported (default, linear, yarn, llama3)")
    orig = int(rp.get("original_max_position_embeddings") or max_position)
    if kind in ("yarn", "llama3") and orig <= 0:
        raise DSparkInputError(f"{where}: RoPE scaling {kind!r} without original_max_position_embeddings")
    if rp.get("factor") is None and kind != "yarn":
        raise DSparkInputError(f"{where}: RoPE scaling {kind!r} without a factor")
    # yarn without a factor: max_position / original (DeepSeek-V3's rule in transformers)
    factor = float(rp["factor"]) if rp.get("factor") is not None else max_position / orig
    if kind == "linear":
        return theta, RopeScaling("linear", factor=factor)
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=factor,
            original_max_position=orig,
            low_freq_factor=float(rp["low_freq_factor"]),
            high_freq_factor=float(rp["high_freq_factor"]),
        )
    attn = rp.get("attention_factor")
    if attn is None:
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    return theta, RopeScaling(
        "yarn",
        factor=factor,
        original_max_position=orig,
        beta_fast=float(rp.get("beta_fast") or 32),
        beta_slow=float(rp.get("beta_slow") or 1),
        attention_factor=float(attn),
        truncate=bool(rp.get("truncate", True)),
    )


def gguf_rope_scaling(meta: Any, arch: str, freq_factors: np.ndarray | None, *, where: str) -> RopeScaling | None:
    """The :class:`RopeScaling` of a GGUF file, read the way llama.cpp reads it.

    ``rope_freqs.weight`` (``freq_factors``, written by llama.cpp's converter for llama3
    scaling): every frequency divided by its factor. ``{arch}.rope.scaling.type`` ``linear``
    (``factor``) or ``yarn`` (``factor``, ``original_context_length``, ``yarn_beta_fast`` /
    ``yarn_beta_slow``; llama.cpp's attention factor ``0.1 ln(factor) + 1``).

    Args:
      meta: ``meta(key, default)`` reads one metadata value.
      arch: the GGUF architecture (metadata prefix).
      freq_factors: the ``rope_freqs.weight`` values, or None.
    Raises:
      DSparkInputError: a scaling type or YaRN setting llama.cpp applies and this package does not
        (longrope, ``yarn_ext_factor`` != 1, ``yarn_attn_factor`` / ``attn_factor`` != 1,
        ``yarn_log_multiplier`` != 0), or rope_freqs.weight together with another scaling.
    """
    kind = str(meta(f"{arch}.rope.scaling.type", "none") or "none")
    factor = float(meta(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    if freq_factors is not None:
        if kind != "none":
            raise DSparkInputError(f"{where}: rope_freqs.weight together with RoPE scaling {kind!r} is not supported")
        return RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in np.ravel(freq_factors)))
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind != "yarn":
        raise DSparkInputError(f"{where}: GGUF RoPE scaling {kind!r} is not supported (linear, yarn, rope_freqs)")
    for key, neutral in (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0), ("attn_factor", 1.0),
                         ("yarn_log_multiplier", 0.0)):  # fmt: skip
        v = meta(f"{arch}.rope.scaling.{key}", None)
        if v is not None and float(v) != neutral:
            raise DSparkInputError(f"{where}: GGUF RoPE setting {arch}.rope.scaling.{key}={v} is not supported")
    orig = int(meta(f"{arch}.rope.scaling.original_context_length", 0) or 0)
    if not orig or factor <= 0:
        raise DSparkInputError(f"{where}: yarn RoPE scaling without factor / original_context_length")
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position=orig,
        beta_fast=float(meta(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=_yarn_mscale(factor),
    )


def hf_rope_dict(scaling: RopeScaling | None, *, where: str) -> dict[str, Any] | None:
    """The Hugging Face ``rope_scaling`` dict of ``scaling`` (None for plain RoPE); the inverse of
    :func:`hf_rope_scaling` (yarn's attention factor written explicitly).

    Raises:
      DSparkInputError: ``freq_factors`` (a GGUF file's table), which no Hugging Face rope type expresses.
    """
    if scaling is None or scaling.rope_type == "default":
        return None
    s = scaling
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.rope_type == "proportional":
        d = {"rope_type": "proportional", "partial_rotary_factor": s.partial_rotary_factor}
        return d if s.factor == 1.0 else {**d, "factor": s.factor}
    if s.rope_type == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position}  # fmt: skip
    if s.rope_type == "yarn":
        d = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_position,
             "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "attention_factor": s.attention_factor}  # fmt: skip
        return d if s.truncate else {**d, "truncate": False}
    raise DSparkInputError(
        f"{where}: RoPE frequency factors read from a GGUF file (rope_freqs.weight) have no Hugging Face rope type"
    )
