"""Offline batch serving: JSONL requests in, JSONL completions out, speculative or plain.

    python serve/batch_generate.py --target stories260k --drafter runs/stories260k/export \
        --input requests.jsonl --output completions.jsonl --batch-size 16

Each input line is ``{"prompt": str, "max_tokens"?: int, "temperature"?: float, "top_k"?: int,
"top_p"?: float, "seed"?: int}``. Requests are decoded in batches with per-request sampling
settings (randomness is per request, so a completion does not depend on its batch-mates).
Each output line carries the completion, its finish reason and its speculative metrics.
The online, continuously batched HTTP server is `python -m dspark_jax.serve` (to come).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="preset or model path")
    p.add_argument("--drafter", default=None, help="drafter export directory (omit for plain decoding)")
    p.add_argument("--input", required=True, help="JSONL file of requests")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--batch-size", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    args = p.parse_args(argv)

    from dspark_jax.api import encode_prompt, load_drafter, load_target
    from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
    from dspark_jax.errors import DSparkInputError

    try:
        target, tok = load_target(args.target)
        drafter = load_drafter(args.drafter)[0] if args.drafter else None
        with open(args.input) as f:
            reqs = [json.loads(line) for line in f if line.strip()]
        with open(args.output, "w") as out:
            for s in range(0, len(reqs), args.batch_size):
                chunk = reqs[s : s + args.batch_size]
                ids = [encode_prompt(tok, r.get("prompt", ""), args.chat) for r in chunk]
                kw = dict(
                    max_new_tokens=[int(r.get("max_tokens", 128)) for r in chunk],
                    temperature=[float(r.get("temperature", 0.0)) for r in chunk],
                    top_k=[int(r.get("top_k", 0)) for r in chunk],
                    top_p=[float(r.get("top_p", 1.0)) for r in chunk],
                    seed=[int(r.get("seed", s + i)) for i, r in enumerate(chunk)],
                )
                res = (
                    generate_speculative(target, drafter, ids, **kw)
                    if drafter
                    else generate_autoregressive(target, ids, **kw)
                )
                for r, g in zip(chunk, res.generations):
                    out.write(
                        json.dumps(
                            {
                                "prompt": r.get("prompt"),
                                "text": tok.decode(g.token_ids, skip_special_tokens=True),
                                "token_ids": g.token_ids,
                                "finish_reason": g.finish_reason,
                                "tau": g.tau if drafter else 1.0,
                                "acceptance_rate": g.acceptance_rate,
                            }
                        )
                        + "\n"
                    )
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
