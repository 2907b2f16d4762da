"""Plain decoding with the target's two weight layouts, alternated in one process: per-layer weight
buffers under an unrolled layer loop (the CPU default) against stacked ``[L, ...]`` weights under a
``lax.scan`` (what accelerators run; on XLA's CPU each scan step copies its layer's weights out of
the stack). Same weights, same prompt, the same tokens checked; wall and process CPU time a token,
the first call's compile time, and the ratio.

    python -m benchmarks.layer_layout --target smollm2-135m-instruct --max-new-tokens 64 --reps 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import command_line, device_description, markdown_table, write_json

LAYOUTS = ("stacked", "per_layer")


def measure(name: str, max_new_tokens: int, reps: int, prompt: str) -> dict[str, Any]:
    """Per layout: first-call seconds (compile + run), median ms a token (wall, process CPU), and
    the median of the per-round ratios stacked / per-layer (each round runs both, alternating order).

    Raises:
      RuntimeError: the two layouts decoded different tokens.
    """
    from dspark_jax.api import encode_prompt
    from dspark_jax.decoding.speculative import generate_autoregressive
    from dspark_jax.models.presets import resolve_target
    from dspark_jax.models.target import Target

    cfg, params, tok = resolve_target(name)
    ids = encode_prompt(tok, prompt, False)
    targets = {lay: Target(cfg, params, layer_layout=lay) for lay in LAYOUTS}
    kw = dict(max_new_tokens=max_new_tokens, stop_ids=[-1])
    first, tokens = {}, {}
    for lay, t in targets.items():
        t0 = time.perf_counter()
        tokens[lay] = generate_autoregressive(t, [ids], **kw).generations[0].token_ids
        first[lay] = time.perf_counter() - t0
    if tokens["stacked"] != tokens["per_layer"]:
        raise RuntimeError("the two layouts decoded different tokens")
    wall: dict[str, list[float]] = {lay: [] for lay in LAYOUTS}
    cpu: dict[str, list[float]] = {lay: [] for lay in LAYOUTS}
    for i in range(reps):
        for lay in LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]:
            c0 = time.process_time()
            res = generate_autoregressive(targets[lay], [ids], **kw)
            n = len(res.generations[0].token_ids)
            wall[lay].append(1000 * res.seconds / n)
            cpu[lay].append(1000 * (time.process_time() - c0) / n)
    rows = [
        {
            "layout": lay,
            "first_call_s": first[lay],
            "ms_per_token": statistics.median(wall[lay]),
            "cpu_ms_per_token": statistics.median(cpu[lay]),
            "tokens_per_s": 1000 / statistics.median(wall[lay]),
        }
        for lay in LAYOUTS
    ]
    speedup = statistics.median(a / b for a, b in zip(wall["stacked"], wall["per_layer"], strict=True))
    return {"rows": rows, "per_layer_speedup": speedup, "tokens": len(tokens["stacked"])}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_layout", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="a preset or a model path")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=6, help="alternated rounds (each runs both layouts)")
    p.add_argument("--prompt", default="Once upon a time, a robot", help="raw text (no chat template)")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    out = measure(a.target, a.max_new_tokens, a.reps, a.prompt)
    print(markdown_table(out["rows"]))
    print(f"per-layer speedup (median of alternated rounds): {out['per_layer_speedup']:.3f}x")
    if a.json:
        write_json(a.json, {**out, "device": device_description(), "command": command_line("layer_layout", argv)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
