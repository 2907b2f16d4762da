"""Writes ``tests/data/tiny_export_v2``: a tiny drafter export in format ``dspark_jax.drafter/2``.

The export pins the on-disk format written until the drafter modules were split (one class
per Markov head): the parameter tree has the Markov head's weights at the top level
(``markov_w1``, ``markov_w2``, ``markov_gate_w``, ``markov_gate_b``) and the metadata keys of
format 2. The tree and ``drafter.json`` are written here by hand, from a seeded numpy
generator, so rerunning the script gives the same export whatever the drafter code looks like
today (``tests/unit/drafters/test_drafters.py`` loads it and checks a greedy draft pinned when it was made).

The drafter: DSpark, gated Markov head (the 2-input gate of format 2's ``"gated"``), rank 4,
one backbone layer, block size 3, taps (0, 2), calibrated confidences; for the target
``TINY_TARGET`` below (V = 16, H = 8, 3 layers). About 15 KB on disk.

Run: ``python tests/data/make_tiny_export.py`` (from the repository root).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

OUT = Path(__file__).resolve().parent / "tiny_export_v2"
SEED = 20261130

# dspark_jax.config.TargetConfig fields of the target the drafter is for.
TINY_TARGET = dict(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    max_position=64,
    tie_embeddings=False,
    name="tiny",
)

# DrafterConfig.to_dict() as format 2 wrote it (every field, taps as a list).
CONFIG = dict(
    vocab_size=16,
    hidden_size=8,
    target_num_layers=3,
    taps=[0, 2],
    variant="dspark",
    block_size=3,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    markov_rank=4,
    rope_theta=10000.0,
    rms_eps=1e-5,
    target_name="tiny",
    target_fingerprint="",
    markov_head="gated",
    width=0,
    draft_vocab_size=0,
)
CALIBRATION = [0.8, 1.25, 1.6]


def params(rng: np.random.Generator) -> dict:
    """The format-2 parameter tree (float32), every weight random (none left at its zero init)."""
    d, f, r, v = 8, 16, 4, 16  # width, FFN, Markov rank, vocabulary
    qd, kd, f_in = 8, 4, 2 * 8  # heads x head_dim, kv heads x head_dim, taps x H

    def mat(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    def norm(*shape):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    return {
        "fc": mat(f_in, d),
        "ctx_norm": norm(d),
        "mask_embed": (0.5 * rng.standard_normal(d)).astype(np.float32),
        "layers": {
            "attn_norm": norm(1, d),
            "wq": mat(1, d, qd),
            "wk": mat(1, d, kd),
            "wv": mat(1, d, kd),
            "wo": mat(1, qd, d),
            "mlp_norm": norm(1, d),
            "w_gate": mat(1, d, f),
            "w_up": mat(1, d, f),
            "w_down": mat(1, f, d),
        },
        "final_norm": norm(d),
        "markov_w1": mat(v, r),
        "markov_w2": (2.0 * mat(r, v)),
        "markov_gate_w": mat(d + r, r),
        "markov_gate_b": (rng.standard_normal(r)).astype(np.float32),
        "conf_w": (rng.standard_normal(d + r) / np.sqrt(d + r)).astype(np.float32),
        "conf_b": np.asarray(0.5, np.float32),
    }


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(OUT / "params", params(np.random.default_rng(SEED)))
    ckptr.wait_until_finished()
    meta = {
        "format": "dspark_jax.drafter/2",
        "config": CONFIG,
        "dtype": "float32",
        "calibration": CALIBRATION,
        "calibration_greedy": None,
        "draft_vocab": None,
        "extra": {"made_by": "tests/data/make_tiny_export.py", "seed": SEED},
    }
    (OUT / "drafter.json").write_text(json.dumps(meta, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
