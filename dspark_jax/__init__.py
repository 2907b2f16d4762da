"""dspark_jax: DSpark speculative decoding in JAX/Flax NNX.

The public face, in a few names (each loads its module on first use, so that ``import dspark_jax``
and the commands' ``--help`` stay instant)::

    from dspark_jax import load_target, load_drafter, generate_text
    target, tok = load_target("stories260k")
    drafter, meta = load_drafter("runs/stories260k/export", target=target)
    out = generate_text(target, tok, "Once upon a time", drafter=drafter, max_new_tokens=64)

* ``load_target``, ``load_drafter``, ``load_target_and_drafter``, ``encode_prompt``,
  ``generate_text``: :mod:`dspark_jax.api`, the Python API.
* ``DecodeRequest``: :mod:`dspark_jax.decoding.request`, the decoding front door every entry point
  goes through (one request type with its defaults; ``decode`` there runs a batch of them).
* ``Generation``, ``BatchResult``: :mod:`dspark_jax.decoding.results`, what decoding returns.
* ``Engine``, ``Request``, ``SamplingParams``: :mod:`dspark_jax.serving.engine`, the continuously
  batched serving engine.
* ``__version__``: the installed distribution's version.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, typed, for checkers and editors
    from dspark_jax.api import encode_prompt, generate_text, load_drafter, load_target, load_target_and_drafter
    from dspark_jax.decoding.request import DecodeRequest
    from dspark_jax.decoding.results import BatchResult, Generation
    from dspark_jax.serving.engine import Engine, Request, SamplingParams

try:
    __version__ = version("dspark_jax")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

# name -> the module that defines it (loaded on first access: PEP 562)
_PUBLIC = {
    "encode_prompt": "dspark_jax.api",
    "generate_text": "dspark_jax.api",
    "load_drafter": "dspark_jax.api",
    "load_target": "dspark_jax.api",
    "load_target_and_drafter": "dspark_jax.api",
    "DecodeRequest": "dspark_jax.decoding.request",
    "BatchResult": "dspark_jax.decoding.results",
    "Generation": "dspark_jax.decoding.results",
    "Engine": "dspark_jax.serving.engine",
    "Request": "dspark_jax.serving.engine",
    "SamplingParams": "dspark_jax.serving.engine",
}

__all__ = [
    "BatchResult",
    "DecodeRequest",
    "Engine",
    "Generation",
    "Request",
    "SamplingParams",
    "__version__",
    "encode_prompt",
    "generate_text",
    "load_drafter",
    "load_target",
    "load_target_and_drafter",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first access.

    Raises:
      AttributeError: ``name`` is not public.
    """
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dspark_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
