"""Loading what decoding runs: a target (by preset name or path), its drafter checked and prepared
for it, and a prompt tokenized the way the preset expects.

These sit in ``decoding/`` because loading a target also turns on JAX's persistent compilation
cache (:mod:`~dspark_jax.decoding.disk_cache`) and a drafter is prepared for the target it will
draft for (:func:`~dspark_jax.decoding.request.load_drafter_for`). The commands, evaluation,
training, serving and the Python API (:mod:`dspark_jax.api`, which re-exports them) all read them
from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dspark_jax.decoding import disk_cache
from dspark_jax.decoding.request import load_drafter_for
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.precision import resolve_dtype
from dspark_jax.models.presets import preset_info, resolve_target
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint

__all__ = ["encode_prompt", "load_target", "load_target_and_drafter"]


def load_target(spec: str, dtype: Any = "auto", mesh=None, attention_backend: str | None = None):
    """Loads a target by preset name or path.

    Args:
      spec: ``stories260k``, ``smollm2-135m-instruct``, or a path to a ``.gguf``
        file, a llama2.c ``.bin`` or a Hugging Face directory.
      dtype: weight/compute dtype: ``"auto"`` (bfloat16 on a GPU/TPU, float32 on a CPU:
        :func:`~dspark_jax.models.precision.resolve_dtype`), a name or a dtype.
      mesh: optional device mesh: the weights go from the host straight to their shards
        (see :class:`~dspark_jax.models.target.Target`); None: the default device.
      attention_backend: overrides the config's ``attention_backend`` (``auto``, ``xla``,
        ``cudnn``, ``pallas_tpu``: docs/design.md#attention-backends); None keeps ``auto``.
    Returns:
      ``(target, tokenizer)``.
    Raises:
      DSparkInputError: unknown preset or dtype, or missing/corrupt files.
      ValueError: an unknown attention backend.

    Also turns on JAX's persistent compilation cache (``DSPARK_CACHE_DIR``, default
    ``~/.cache/dspark_jax``; ``off`` disables it: :mod:`~dspark_jax.decoding.disk_cache`), so a
    second notebook or process skips most of the compiling.
    """
    disk_cache.enable_compilation_cache()
    cfg, params, tokenizer = resolve_target(spec)
    if attention_backend is not None:
        cfg = dataclasses.replace(cfg, attention_backend=attention_backend)
    target = Target(cfg, params, dtype=resolve_dtype(dtype), fingerprint=params_fingerprint(params), mesh=mesh)
    return target, tokenizer


def load_target_and_drafter(
    target_spec: str,
    drafter_dir: str | None,
    dtype: Any = "auto",
    mesh=None,
    attention_backend: str | None = None,
):
    """Loads a target and, when ``drafter_dir`` is given, its drafter, checked against it and
    prepared for it (:func:`~dspark_jax.drafters.base.prepare_drafter`); ``attention_backend``
    as :func:`load_target`.

    Returns:
      ``(target, tokenizer, drafter_or_None)``.
    Raises:
      DSparkInputError: as :func:`load_target` / :func:`~dspark_jax.drafters.checkpoint.load_drafter`, or a drafter
        trained for another target (vocabulary, depth, taps or weights).
    Warns:
      UserWarning: a drafter imported from another format whose first draft token agrees with
        the target on almost no position of plain text
        (:func:`~dspark_jax.drafters.formats.warn_if_misaligned`).
    """
    target, tokenizer = load_target(target_spec, dtype=dtype, mesh=mesh, attention_backend=attention_backend)
    drafter = load_drafter_for(target, tokenizer, drafter_dir, target.dtype)[0] if drafter_dir else None
    return target, tokenizer, drafter


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, spec: str = "") -> list[int]:
    """Tokenizes a prompt; ``chat=True`` wraps it in the tokenizer's chat template.

    ``chat=None`` uses the preset default (chat models get the template).

    Raises:
      DSparkInputError: empty prompt.
    """
    if not prompt or not prompt.strip():
        raise DSparkInputError("the prompt is empty: give some text to continue")
    if chat is None:
        chat = bool(preset_info(spec).get("chat")) if spec else False
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer.encode(text, add_bos=False)
    return tokenizer.encode(prompt)
