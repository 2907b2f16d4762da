"""The Python API in a few calls: load a target and a drafter, generate text.

Example (notebook)::

    from dspark_jax import load_target, load_drafter, generate_text
    target, tok = load_target("stories260k")
    drafter, meta = load_drafter("runs/stories260k/export")
    out = generate_text(target, tok, "Once upon a time", drafter=drafter, max_new_tokens=64)
    print(out["text"], out["tau"])

The loaders (``load_target``, ``load_target_and_drafter``, ``encode_prompt``) live in
:mod:`dspark_jax.decoding.loading` and ``load_drafter`` in :mod:`dspark_jax.drafters.checkpoint`;
this module gathers them with :func:`generate_text` under one roof.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dspark_jax.decoding.loading import encode_prompt, load_target, load_target_and_drafter
from dspark_jax.decoding.request import DecodeRequest, decode, summary
from dspark_jax.drafters.base import Drafter
from dspark_jax.drafters.checkpoint import load_drafter
from dspark_jax.models.target import Target

_DEFAULTS = DecodeRequest.field_defaults()

__all__ = ["encode_prompt", "generate_text", "load_drafter", "load_target", "load_target_and_drafter"]


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
