"""Side-by-side timing of the top-k / top-p masking: the sort-based filter it replaced against the
sort-free threshold search (``dspark_jax.models.sampling.filter_top_k_top_p``).

Both are jitted on the same float32 logits ``[rows, V]`` (default ``[8, 49152]``, SmolLM2's
vocabulary) and timed alternately in one process (old then new, then new then old, ...), ``--reps``
times per case; the table gives the medians. Cases: top-k alone, top-p alone, both, per-row mixed
parameters (some rows off), and logits with long runs of ties (the tie searches run).

    python -m benchmarks.sampling_filter --rows 8 --vocab 49152 --reps 7 --out runs/sampling_filter

Prints a table (median milliseconds, new / old) and writes ``OUT/sampling_filter.json``, which also
counts the distributions whose masks differ (only near-boundary nuclei may: see
``tests/unit/models/test_sampling_thresholds.py``).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.harness import alternate, write_json


def sort_filter(scaled, top_k, top_p):
    """The sort-based filter as of commit e2dc73b (stable sort, cumsum, lexicographic cut)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    v = scaled.shape[-1]
    scaled = jnp.where(scaled == 0.0, jnp.zeros_like(scaled), scaled)
    ids = lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    neg_sorted, ids_sorted = lax.sort((-scaled, ids), dimension=scaled.ndim - 1, is_stable=True, num_keys=1)
    sorted_logits = -neg_sorted
    k_eff = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)
    in_top_k = lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1) < k_eff
    probs_sorted = jax.nn.softmax(jnp.where(in_top_k, sorted_logits, -jnp.inf), axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1)
    exclusive = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    n_p = jnp.sum((exclusive < top_p) & in_top_k, axis=-1, keepdims=True, dtype=jnp.int32)
    n_p = jnp.where(top_p >= 1.0, v, n_p)
    cut = jnp.clip(jnp.minimum(k_eff, n_p), 1, v) - 1
    thr_logit = jnp.take_along_axis(sorted_logits, cut, axis=-1)
    thr_id = jnp.take_along_axis(ids_sorted, cut, axis=-1)
    keep = (scaled > thr_logit) | ((scaled == thr_logit) & (ids <= thr_id))
    return jnp.where(keep, scaled, -jnp.inf)


def cases(rows: int, vocab: int, seed: int) -> dict[str, tuple[Any, Any, Any]]:
    """``{name: (logits [rows, V] f32, top_k [rows, 1] int32, top_p [rows, 1] f32)}``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, vocab)) * 3.0).astype(np.float32)
    tied = (np.round(logits) / 2.0).astype(np.float32)

    def col(values, dtype):
        return np.resize(np.asarray(values, dtype), rows)[:, None]

    return {
        "top_k=50": (logits, col([50], np.int32), col([1.0], np.float32)),
        "top_p=0.9": (logits, col([0], np.int32), col([0.9], np.float32)),
        "top_k=50 top_p=0.9": (logits, col([50], np.int32), col([0.9], np.float32)),
        "mixed rows": (
            logits,
            col([0, 50, 0, 5, 1000, 0, 20, 0], np.int32),
            col([0.9, 1, 0.5, 0.95, 0.8, 1, 0.99, 0], np.float32),
        ),
        "ties top_k=50 top_p=0.9": (tied, col([50], np.int32), col([0.9], np.float32)),
    }


def measure(rows: int, vocab: int, reps: int, seed: int) -> list[dict[str, Any]]:
    """Median seconds of the old and new filters per case, alternated; mask disagreements counted."""
    import jax
    import numpy as np

    from dspark_jax.models.sampling import filter_top_k_top_p

    fns = {"old": jax.jit(sort_filter), "new": jax.jit(filter_top_k_top_p)}
    out = []
    for name, (x, k, p) in cases(rows, vocab, seed).items():
        args = tuple(jax.device_put(a) for a in (x, k, p))
        results = {tag: np.asarray(jax.block_until_ready(f(*args))) for tag, f in fns.items()}  # compile

        def timed(f, args=args) -> None:
            jax.block_until_ready(f(*args))

        med = alternate({tag: partial(timed, f) for tag, f in fns.items()}, reps, warmup=0)  # compiled above
        differ = int(np.any(np.isfinite(results["old"]) != np.isfinite(results["new"]), axis=-1).sum())
        old_s, new_s = med["old"], med["new"]
        out.append(
            {"case": name, "old_ms": 1e3 * old_s, "new_ms": 1e3 * new_s, "ratio": new_s / old_s, "rows_differ": differ}
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sampling_filter", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--rows", type=int, default=8, help="rows of the logits batch (default 8)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default 49152)")
    p.add_argument("--reps", type=int, default=7, help="timed repeats per filter and case (default 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/sampling_filter", help="output directory")
    args = p.parse_args(argv)
    import jax

    table = measure(args.rows, args.vocab, args.reps, args.seed)
    print(
        f"top-k / top-p masking, float32 [{args.rows}, {args.vocab}], jit, {jax.default_backend()},"
        f" median of {args.reps}"
    )
    print(f"{'case':<26}{'sort (ms)':>11}{'search (ms)':>13}{'new/old':>9}{'rows differ':>13}")
    for row in table:
        print(
            f"{row['case']:<26}{row['old_ms']:>11.2f}{row['new_ms']:>13.2f}{row['ratio']:>9.3f}{row['rows_differ']:>13}"
        )
    out = Path(args.out)
    record = {
        "rows": args.rows,
        "vocab": args.vocab,
        "reps": args.reps,
        "backend": jax.default_backend(),
        "cases": table,
    }
    write_json(out / "sampling_filter.json", record)
    print(f"wrote {out / 'sampling_filter.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
