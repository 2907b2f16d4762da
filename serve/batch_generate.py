"""Offline batch serving: JSONL requests in, JSONL completions out, speculative or plain.

    python serve/batch_generate.py --target stories260k --drafter runs/stories260k/export \
        --input requests.jsonl --output completions.jsonl --batch-size 16

Each input line is ``{"prompt": str, "max_tokens"?: int, "temperature"?: float, "top_k"?: int,
"top_p"?: float, "seed"?: int}``; a missing setting takes the decoding front door's default
(:class:`dspark_jax.decoding.request.DecodeRequest`, as the Python API and ``python -m
dspark_jax.generate``), except ``seed``, which defaults to the line's index (0 for the first line),
so that identical prompts at T > 0 get different completions. Requests are decoded in batches
through the front door (:func:`dspark_jax.decoding.request.decode`) with per-request sampling
settings; randomness is per request, and with a fixed ``--num-speculative-tokens`` a completion does
not depend on its batch-mates (``auto``, the default, chooses one verification length per round for
the whole batch: at T > 0 the sampled tokens, not their distribution, then depend on the batch).
Each output line carries the completion (UTF-8-safe text), its finish reason and its speculative
metrics (``tau`` null when no verification pass ran). The online, continuously batched HTTP server
is ``python -m dspark_jax.serve``.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    from dspark_jax.commands.flags import add_verification_argument
    from dspark_jax.decoding.request import DecodeRequest

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--target", required=True, help="preset or model path")
    p.add_argument("--drafter", default=None, help="drafter export directory (omit for plain decoding)")
    p.add_argument("--input", required=True, help="JSONL file of requests")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--batch-size", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    add_verification_argument(p, DecodeRequest.field_defaults())
    return p


def _requests(tok, lines: list[dict], start: int, chat: bool, n_spec):
    """The front door's requests of the JSONL rows ``lines`` (``start``: the first one's index)."""
    from dspark_jax.decoding.loading import encode_prompt
    from dspark_jax.decoding.request import DecodeRequest

    d = DecodeRequest.field_defaults()
    return [
        DecodeRequest(
            encode_prompt(tok, r.get("prompt", ""), chat),
            max_new_tokens=int(r.get("max_tokens", d["max_new_tokens"])),
            temperature=float(r.get("temperature", d["temperature"])),
            top_k=int(r.get("top_k", d["top_k"])),
            top_p=float(r.get("top_p", d["top_p"])),
            seed=int(r.get("seed", start + i)),
            num_speculative_tokens=n_spec,
        )
        for i, r in enumerate(lines)
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from dspark_jax.decoding.loading import load_target_and_drafter
    from dspark_jax.decoding.request import decode, summary
    from dspark_jax.errors import DSparkInputError

    try:
        target, tok, drafter = load_target_and_drafter(args.target, args.drafter)
        with open(args.input) as f:
            reqs = [json.loads(line) for line in f if line.strip()]
        with open(args.output, "w") as out:
            for s in range(0, len(reqs), args.batch_size):
                chunk = reqs[s : s + args.batch_size]
                res = decode(target, drafter, _requests(tok, chunk, s, args.chat, args.num_speculative_tokens))
                for r, g in zip(chunk, res.generations):
                    rec = summary(tok, g)
                    out.write(json.dumps({"prompt": r.get("prompt"), **rec}) + "\n")
                print(
                    f"{min(s + args.batch_size, len(reqs))}/{len(reqs)} requests, {res.tokens_per_s:.1f} tokens/s",
                    file=sys.stderr,
                )
    except (DSparkInputError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
