"""The decoding front door: one request type with its defaults, one way to run it.

The Python API (:func:`dspark_jax.api.generate_text`), ``python -m dspark_jax.generate``,
``python -m dspark_jax.eval`` and ``serve/batch_generate.py`` all describe what to decode as
:class:`DecodeRequest` and decode through :func:`decode`, so that they resolve every default in
one place and give the same tokens, tau and acceptance for the same request:

* :class:`DecodeRequest`: prompt ids and the request's settings; its field defaults are THE
  defaults (128 new tokens, greedy, no top-k / top-p, seed 0, ``num_speculative_tokens="auto"``).
* :func:`resolve_num_speculative_tokens`: the one place ``num_speculative_tokens`` is resolved
  for a drafter: ``"auto"`` stays ``"auto"`` for a block drafter
  (:mod:`dspark_jax.decoding.auto_verify` reads its block confidences) and is the block size for
  any other drafter (eagle3: nothing to choose from); an int is checked against the block size.
  :func:`decode` resolves it once per call and reports the result
  (:attr:`~dspark_jax.decoding.results.BatchResult.num_speculative_tokens`).
* :func:`load_drafter_for`: loads an export for a target, checks and prepares it.
* :func:`decode`: a batch of requests through the speculative loop (with a drafter) or the
  autoregressive one (without), returning :class:`~dspark_jax.decoding.results.BatchResult`.
* :func:`summary`: the JSON record of one generation the entry points print (UTF-8-safe text,
  ``tau`` None when no verification pass ran).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dspark_jax.decoding import validation
from dspark_jax.errors import DSparkInputError

if TYPE_CHECKING:  # the models load lazily: the CLIs read the defaults below for --help without JAX
    from dspark_jax.decoding.results import BatchResult, Generation
    from dspark_jax.drafters.base import Drafter
    from dspark_jax.models.target import Target

__all__ = [
    "DecodeRequest",
    "decode",
    "load_drafter_for",
    "resolve_num_speculative_tokens",
    "summary",
]


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """One decoding request: its prompt ids and settings, with the defaults every entry point uses.

    Attributes:
      prompt_ids: token ids of the prompt (non-empty, inside the vocabulary and the context;
        checked by :func:`decode`), stored as a tuple.
      max_new_tokens: cap on generated tokens, in ``[1, 2**31 - 1]`` (generation also ends at the
        context's end or a stop id).
      temperature: 0 = greedy; finite, at most float32's largest (a temperature so small that
        the scaled logits overflow float32 decodes greedily, its T -> 0 limit).
      top_k: keep the k most likely tokens, an integer in ``[0, 2**31 - 1]`` (0 = off).
      top_p: nucleus mass in (0, 1] (1 = off).
      seed: PRNG seed of the request, an int64 (randomness is per request: the output does not
        depend on batch-mates, except through ``"auto"``'s batch-wide lengths at T > 0).
      num_speculative_tokens: draft tokens verified per round (verification length), an int in
        ``1..block_size`` or ``"auto"`` (:func:`resolve_num_speculative_tokens`). Ignored without
        a drafter.
      stop_ids: token ids that end the request (None: the target's EOS ids).
    Raises:
      DSparkInputError: on construction, out-of-range sampling settings, max_new_tokens or seed,
        or a num_speculative_tokens that is neither a positive int nor ``"auto"`` (one line naming
        the setting; :mod:`dspark_jax.decoding.validation`).
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_speculative_tokens: int | str = "auto"
    stop_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        # Tuples keep the frozen request hashable and free of aliasing with the caller's lists.
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if self.stop_ids is not None:
            object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        validation.check_sampling(self.temperature, self.top_k, self.top_p)
        validation.check_max_new_tokens(self.max_new_tokens, 1)
        validation.check_seeds(self.seed, 1)
        object.__setattr__(
            self, "num_speculative_tokens", validation.check_num_speculative_tokens(self.num_speculative_tokens)
        )

    def with_prompt(self, prompt_ids: Sequence[int]) -> DecodeRequest:
        """This request's settings (checked already, not again) with the prompt ``prompt_ids``."""
        new = copy.copy(self)
        object.__setattr__(new, "prompt_ids", tuple(prompt_ids))
        return new

    @classmethod
    def field_defaults(cls) -> dict[str, Any]:
        """``{setting: default}`` of every setting but ``prompt_ids`` (the CLIs' flag defaults)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "prompt_ids"}


def resolve_num_speculative_tokens(drafter: Drafter, num_speculative_tokens: int | str) -> int | str:
    """The verification length a request decodes with: ``"auto"`` for a block drafter (dspark /
    dflash: :mod:`~dspark_jax.decoding.auto_verify` reads their block confidences), the block size
    for ``"auto"`` with any other drafter, else the int, checked.

    Raises:
      DSparkInputError: None, an int outside ``[1, block_size]``, or neither an int nor ``"auto"``.
    """
    from dspark_jax.drafters.base import BlockDrafter

    n = validation.check_num_speculative_tokens(num_speculative_tokens, drafter.cfg.block_size)
    return drafter.cfg.block_size if n == "auto" and not isinstance(drafter, BlockDrafter) else n


def load_drafter_for(target: Target, tokenizer: Any, drafter_dir: str, dtype: Any = None) -> tuple[Drafter, dict]:
    """Loads the drafter export ``drafter_dir`` for ``target``, checked and prepared for it
    (:func:`~dspark_jax.drafters.base.prepare_drafter`).

    Returns:
      ``(drafter, export metadata)``.
    Raises:
      DSparkInputError: a missing or corrupt export, or one trained for another target.
    Warns:
      UserWarning: a drafter imported from another format whose first draft token agrees with
        the target on almost no position of plain text
        (:func:`~dspark_jax.drafters.formats.warn_if_misaligned`).
    """
    from dspark_jax.drafters.base import prepare_drafter
    from dspark_jax.drafters.checkpoint import load_drafter

    drafter, meta = load_drafter(drafter_dir, dtype=dtype, target=target)
    prepare_drafter(target, drafter)
    if str(meta.get("format", "")).startswith("external/"):  # another project's layout: check it
        from dspark_jax.drafters.formats import warn_if_misaligned

        warn_if_misaligned(target, tokenizer, drafter, str(drafter_dir))
    return drafter, meta


def _shared(requests: Sequence[DecodeRequest], name: str) -> Any:
    values = {getattr(r, name) for r in requests}
    if len(values) > 1:
        raise DSparkInputError(f"requests decoded together must share {name}, got {sorted(map(str, values))}")
    return values.pop()


def decode(
    target: Target,
    drafter: Drafter | None,
    requests: Sequence[DecodeRequest],
    *,
    record_rounds: bool = False,
    cost_table: Any = None,
    cache_len: int | None = None,
) -> BatchResult:
    """Decodes ``requests`` together: speculatively (lossless) with ``drafter``, else autoregressively.

    Args:
      drafter: a drafter for ``target`` (prepared here), or None for plain decoding.
      requests: one or more; their ``num_speculative_tokens`` and ``stop_ids`` must agree (one
        compiled loop per batch), the other settings may differ per request.
      record_rounds / cost_table / cache_len: as in
        :func:`~dspark_jax.decoding.speculative.generate_speculative`.
    Returns:
      :class:`~dspark_jax.decoding.results.BatchResult`, one generation per request in order;
      its ``num_speculative_tokens`` is the resolved one (:func:`resolve_num_speculative_tokens`;
      0 without a drafter).
    Raises:
      DSparkInputError: no requests, requests that disagree on the shared settings, bad prompts,
        a verification length outside the drafter's block, a drafter for another target.
      FloatingPointError: the target produced NaN/inf logits.
    """
    from dspark_jax.decoding.loop import make_batch, run_autoregressive
    from dspark_jax.decoding.speculative import speculate_batch
    from dspark_jax.drafters.base import prepare_drafter

    # Each request's settings were checked when it was made; the prompts, limits and seeds are
    # checked here (make_batch), the drafter and the verification length once each.
    if not requests:
        raise DSparkInputError("no requests given")
    prompts = [list(r.prompt_ids) for r in requests]
    sampling = ([r.temperature for r in requests], [r.top_k for r in requests], [r.top_p for r in requests])
    seeds = [r.seed for r in requests]
    max_new = [r.max_new_tokens for r in requests]
    stop_ids = _shared(requests, "stop_ids")
    if drafter is None:
        return run_autoregressive(target, make_batch(target, prompts, max_new, 0, cache_len, sampling, seeds, stop_ids))
    prepare_drafter(target, drafter)
    n_spec = resolve_num_speculative_tokens(drafter, _shared(requests, "num_speculative_tokens"))
    bt = make_batch(target, prompts, max_new, drafter.cfg.block_size, cache_len, sampling, seeds, stop_ids)
    return speculate_batch(target, drafter, bt, n_spec, record_rounds=record_rounds, cost_table=cost_table)


def summary(tokenizer: Any, generation: Generation) -> dict[str, Any]:
    """The record of one generation that the entry points report.

    Returns:
      dict with ``text`` (UTF-8-safe: never ends in half a character,
      :func:`~dspark_jax.models.tokenizer.decode_complete`), ``token_ids``, ``finish_reason``,
      ``tau`` (:class:`~dspark_jax.decoding.results.Generation`'s; None when no verification pass
      ran), ``acceptance_rate``, ``num_target_passes`` and ``position_acceptance``.
    """
    from dspark_jax.models.tokenizer import decode_complete

    g = generation
    return {
        "text": decode_complete(tokenizer, g.token_ids),
        "token_ids": g.token_ids,
        "finish_reason": g.finish_reason,
        "tau": g.tau if g.num_target_passes else None,
        "acceptance_rate": g.acceptance_rate,
        "num_target_passes": g.num_target_passes,
        "position_acceptance": g.position_acceptance,
    }
