"""The Python API in a few calls: load a target and a drafter, generate text.

Example (notebook)::

    from dspark_jax import load_target, load_drafter, generate_text
    target, tok = load_target("stories260k")
    drafter, meta = load_drafter("runs/stories260k/export")
    out = generate_text(target, tok, "Once upon a time", drafter=drafter, max_new_tokens=64)
    print(out["text"], out["tau"])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dspark_jax.decoding import disk_cache
from dspark_jax.decoding.request import DecodeRequest, decode, load_drafter_for, summary
from dspark_jax.drafters.base import Drafter
from dspark_jax.drafters.checkpoint import load_drafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.precision import resolve_dtype
from dspark_jax.models.presets import preset_info, resolve_target
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint

_DEFAULTS = DecodeRequest.field_defaults()

__all__ = ["encode_prompt", "generate_text", "load_drafter", "load_target", "load_target_and_drafter"]


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
      DSparkInputError: as :func:`load_target` / :func:`load_drafter`, or a drafter
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


def generate_text(
    target: Target,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    drafter: Drafter | None = None,
    max_new_tokens: int = _DEFAULTS["max_new_tokens"],
    temperature: float = _DEFAULTS["temperature"],
    top_k: int = _DEFAULTS["top_k"],
    top_p: float = _DEFAULTS["top_p"],
    seed: int = _DEFAULTS["seed"],
    num_speculative_tokens: int | str = _DEFAULTS["num_speculative_tokens"],
    chat: bool = False,
) -> dict[str, Any]:
    """Generates one completion, speculatively when a drafter is given.

    One :class:`~dspark_jax.decoding.request.DecodeRequest` through the decoding front door
    (:func:`~dspark_jax.decoding.request.decode`), as the generate and eval commands and the batch
    script run it: the same defaults, tokens, tau and acceptance.

    Args:
      prompt: text (tokenized, with the chat template when ``chat``) or token ids.
      temperature: finite, in ``[0, 3.4e38]`` (float32's range; 0 = greedy, and so is one so
        small that the scaled logits overflow float32, e.g. ``2e-38``: its T -> 0 limit).
        top_k: integer in ``[0, 2**31 - 1]`` (0 = off). top_p: in (0, 1] (1 = off).
      max_new_tokens: in ``[1, 2**31 - 1]`` (generation also ends at the context's end).
      seed: PRNG seed of the request, an int64.
      num_speculative_tokens: draft tokens verified per round (1..the drafter's block size) or
        ``"auto"``, the default for block drafters (:mod:`dspark_jax.decoding.auto_verify`; the first call
        measures this machine's cost table). At T > 0 the sampled tokens then depend on the
        lengths it chose (the output law does not).
    Returns:
      dict with ``text`` (UTF-8-safe: never ends in half a character), ``token_ids``,
      ``finish_reason``, ``tau`` (tokens per target verification pass, the prefill token
      excluded, as defined in :class:`dspark_jax.decoding.results.Generation`; None when no pass
      ran), ``acceptance_rate``, ``num_target_passes``, ``tokens_per_s`` (compilation
      excluded) and ``position_acceptance``.
    Raises:
      DSparkInputError: empty prompt, NaN/inf or out-of-range sampling settings,
        max_new_tokens or seed (one line naming the setting), a drafter for another target.
    """
    settings = DecodeRequest(  # checked before the prompt is encoded or a model touched
        (),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_speculative_tokens=num_speculative_tokens,
    )
    ids = list(prompt) if not isinstance(prompt, str) else encode_prompt(tokenizer, prompt, chat)
    res = decode(target, drafter, [settings.with_prompt(ids)])
    return {**summary(tokenizer, res.generations[0]), "tokens_per_s": res.tokens_per_s}
