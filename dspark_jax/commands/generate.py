"""``python -m dspark_jax.generate``: one request, speculative (lossless) or plain.

Examples::

    python -m dspark_jax.generate --target stories260k --drafter runs/stories260k/export \\
        --prompt "Once upon a time" --max-new-tokens 128 --temperature 0 --compare-ar --json
    python -m dspark_jax.generate --target smollm2-135m-instruct --prompt "What is the capital of France?"

Without ``--drafter`` it decodes autoregressively with the target alone. ``text`` never ends
in half a character (a multi-byte character the last token did not complete is dropped).
``tau`` follows :class:`dspark_jax.decoding.results.Generation` (tokens per target verification pass,
the prefill token excluded; 1.0 for autoregressive decoding; null when no pass ran). Exit
status 2 with a one-line ``error:`` message on bad input (missing model files,
a drafter exported for another target, an empty or too-long prompt, a NaN/inf sampling
setting, a number beyond what the device holds such as ``--top-k 2147483648``, ...). A
temperature so small that the scaled logits overflow float32 (``--temperature 2e-38``) decodes
greedily, its T -> 0 limit.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax.commands.flags import (
    add_attention_argument,
    add_dtype_argument,
    add_sampling_arguments,
    add_verification_argument,
    request_defaults,
)
from dspark_jax.decoding import disk_cache


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.generate",
        description="Generate text from a target model, speculatively with a DSpark/DFlash drafter "
        "(output distributed exactly as the target alone) or autoregressively without one.",
    )
    p.add_argument(
        "--target",
        required=True,
        help="preset (stories260k, smollm2-135m-instruct) or path to a .gguf file, a llama2.c "
        ".bin (tok*.bin beside it) or a Hugging Face model directory",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter export directory written by `python -m dspark_jax.train` "
        "(omit for plain autoregressive decoding)",
    )
    p.add_argument("--prompt", required=True, help="prompt text (must not be empty)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the tokenizer's chat template (default for chat presets)",
    )
    chat.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="use the prompt text as is (e.g. an already formatted ChatML string)",
    )
    d = request_defaults()
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=d["max_new_tokens"],
        help=f"maximum generated tokens (default {d['max_new_tokens']})",
    )
    add_sampling_arguments(p, d)
    add_verification_argument(p, d)
    p.add_argument("--seed", type=int, default=d["seed"], help=f"PRNG seed of the request (default {d['seed']})")
    add_dtype_argument(p)
    add_attention_argument(p)
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="also decode autoregressively in the same process and report the speedup "
        "(both runs are timed after one untimed warm-up run)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    disk_cache.add_cache_arguments(p)
    return p


def _check_args(args: argparse.Namespace) -> None:
    """Flag checks that need no model (one ``error:`` line each)."""
    from dspark_jax.decoding.validation import check_max_new_tokens, check_sampling, check_seeds
    from dspark_jax.drafters.checkpoint import read_export_meta
    from dspark_jax.errors import DSparkInputError

    check_max_new_tokens(args.max_new_tokens, 1, "--max-new-tokens")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
        check_seeds(args.seed, 1)
    except DSparkInputError as e:  # "top_k must ..." -> "--top-k must ..."
        raise DSparkInputError(f"--{str(e).replace('_', '-', 1)}") from None
    if args.drafter:
        read_export_meta(args.drafter)  # fail fast, before loading the target
    if args.num_speculative_tokens != request_defaults()["num_speculative_tokens"] and not args.drafter:
        raise DSparkInputError("--num-speculative-tokens needs --drafter")


def _request(args: argparse.Namespace, ids: list[int]):
    """The command's :class:`~dspark_jax.decoding.request.DecodeRequest`."""
    from dspark_jax.decoding.request import DecodeRequest

    return DecodeRequest(
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_speculative_tokens=args.num_speculative_tokens,
    )


def _compare_ar(target, tok, req, res, out: dict, speculative: bool) -> None:
    """``--compare-ar``: the autoregressive run's tokens, speed and the speedup."""
    from dspark_jax.decoding.request import decode
    from dspark_jax.models.tokenizer import decode_complete

    if not speculative:
        out.update(ar_token_ids=out["token_ids"], ar_tokens_per_s=res.tokens_per_s, speedup=1.0, matches_ar=True)
        return
    decode(target, None, [req])  # warm-up, as for the speculative run
    ar = decode(target, None, [req])
    ag = ar.generations[0]
    out.update(
        ar_token_ids=ag.token_ids,
        ar_text=decode_complete(tok, ag.token_ids),
        ar_tokens_per_s=ar.tokens_per_s,
        ar_seconds=ar.seconds,
        speedup=out["tokens_per_s"] / ar.tokens_per_s if ar.tokens_per_s else None,
        matches_ar=ag.token_ids == out["token_ids"],
    )


def run(args: argparse.Namespace) -> dict:
    """Runs the command through the decoding front door (:mod:`dspark_jax.decoding.request`);
    returns the JSON object ``--json`` prints.

    Raises:
      DSparkInputError: bad flags or prompt, missing model files, a drafter for another target.
    """
    from dspark_jax.decoding.loading import encode_prompt, load_target
    from dspark_jax.decoding.request import decode, load_drafter_for, summary
    from dspark_jax.models.presets import preset_info

    _check_args(args)
    disk_cache.apply_cache_arguments(args)
    target, tok = load_target(args.target, dtype=args.dtype, attention_backend=args.attention_backend)
    chat = args.chat if args.chat is not None else bool(preset_info(args.target).get("chat"))
    req = _request(args, encode_prompt(tok, args.prompt, chat))
    out: dict = {"target": target.cfg.name, "prompt_tokens": len(req.prompt_ids), "mode": "autoregressive"}
    drafter = None
    if args.drafter:
        drafter = load_drafter_for(target, tok, args.drafter, target.dtype)[0]
        out.update(mode="speculative", variant=drafter.cfg.variant, block_size=drafter.cfg.block_size)
        if args.compare_ar:  # warm-up run: the timed runs below then compare steady-state speed
            decode(target, drafter, [req])
    res = decode(target, drafter, [req])
    g = res.generations[0]
    if drafter is not None:
        out["num_speculative_tokens"] = res.num_speculative_tokens  # as the front door resolved it
    out.update(summary(tok, g))
    out.update(
        num_generated_tokens=len(g.token_ids),
        position_acceptance=g.position_acceptance if drafter is not None else None,
        tokens_per_s=res.tokens_per_s,
        seconds=res.seconds,
        compile_seconds=res.compile_seconds,
    )
    if args.compare_ar:
        _compare_ar(target, tok, req, res, out, drafter is not None)
    return out


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.errors import run_cli

    args = build_parser().parse_args(argv)
    status, out = run_cli(run, args)
    if status or out is None:
        return status
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        stats = (
            f"[{out['mode']}: {out['num_generated_tokens']} tokens, {out['tokens_per_s']:.1f} tokens/s, "
            f"{out['finish_reason']}"
        )
        if out["mode"] == "speculative" and out["tau"] is not None:
            stats += f", tau {out['tau']:.2f}, acceptance {out['acceptance_rate'] or 0:.2f}"
        if out.get("speedup"):
            stats += f", speedup {out['speedup']:.2f}x vs autoregressive"
        print(stats + "]", file=sys.stderr)
    return 0
