"""The decoding flags the commands share: sampling, verification length, dtype and attention
backend, each with the decoding front door's default
(:meth:`~dspark_jax.decoding.request.DecodeRequest.field_defaults`). Read by generate, eval, serve
and ``serve/batch_generate.py``; the imports stay lazy so that ``--help`` is instant."""

from __future__ import annotations

import argparse

__all__ = [
    "add_attention_argument",
    "add_dtype_argument",
    "add_sampling_arguments",
    "add_verification_argument",
    "request_defaults",
]


def request_defaults() -> dict:
    """The request defaults of the decoding front door (a module without JAX: ``--help`` stays instant)."""
    from dspark_jax.decoding.request import DecodeRequest

    return DecodeRequest.field_defaults()


def add_sampling_arguments(p: argparse.ArgumentParser, d: dict) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` with the front door's defaults ``d``
    (:meth:`~dspark_jax.decoding.request.DecodeRequest.field_defaults`); shared by generate and eval."""
    t, k, tp = d["temperature"], d["top_k"], d["top_p"]
    p.add_argument("--temperature", type=float, default=t, help=f"sampling temperature; 0 = greedy (default {t:g})")
    p.add_argument("--top-k", type=int, default=k, help=f"keep the k most likely tokens; 0 = off (default {k})")
    p.add_argument("--top-p", type=float, default=tp, help=f"nucleus sampling mass; 1 = off (default {tp:g})")


def add_verification_argument(p: argparse.ArgumentParser, d: dict) -> None:
    """``--num-speculative-tokens N|auto`` with the front door's default ``d`` (``auto``: automatic
    for dspark/dflash drafters, the block size for others); shared by generate, eval and the batch script."""
    p.add_argument(
        "--num-speculative-tokens",
        default=d["num_speculative_tokens"],
        metavar="N|auto",
        help="draft tokens verified per round: 1..the drafter's block size, or 'auto' (default for "
        "dspark/dflash drafters: per round the length that maximises expected tokens/s from the "
        "drafter's confidences and costs measured on this machine; 0 when drafting does not pay)",
    )


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """``--dtype`` (docs/design.md#numerics); shared by generate, eval and serve."""
    from dspark_jax.models.precision import DTYPE_CHOICES

    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weight/compute dtype (default auto: bfloat16 on a GPU or TPU, float32 on a CPU; softmax, "
        "norms and logits are float32 either way)",
    )


def add_attention_argument(p: argparse.ArgumentParser) -> None:
    """``--attention-backend`` (the target's cached attention, docs/design.md#attention-backends);
    shared by generate, eval and serve."""
    from dspark_jax.config import ATTENTION_BACKENDS

    p.add_argument(
        "--attention-backend",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="implementation of the target's cached attention (default auto: cudnn on a CUDA GPU for "
        "bfloat16 where it fits the model, else xla; a backend named here that "
        "does not fit is refused)",
    )
