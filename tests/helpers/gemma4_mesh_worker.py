"""Worker for tests/integration/test_gemma4_mesh.py: a Gemma 4 target on device meshes.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.gemma4_mesh_worker

Writes test_gemma4's tiny ``k_eq_v`` model with transformers, loads it on one device and on
``data:2,model:4`` / ``fsdp:2,model:4`` meshes of 8 forced CPU devices, and compares the cache-less
logits and greedy plain and speculative decoding (a random drafter). Prints one JSON object.
"""

from __future__ import annotations

import json
import tempfile

import jax
import numpy as np

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.models.hf_io import load_hf_dir
from dspark_jax.models.sharding import make_mesh
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint
from tests.helpers.drafters import random_drafter
from tests.unit.models.test_gemma4 import VARIANTS, _write


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        _write(d, **VARIANTS["k_eq_v"])
        cfg, params = load_hf_dir(d)
    ids = np.random.default_rng(0).integers(3, 256, 30).astype(np.int32)
    pos = np.arange(30, dtype=np.int32)[None]
    prompts = [[1] + ids[:20].tolist(), [1] + ids[:9].tolist()]
    out = {"devices": jax.device_count()}
    for spec in (None, "data:2,model:4", "fsdp:2,model:4"):
        t = Target(cfg, params, fingerprint=params_fingerprint(params), mesh=None if spec is None else make_mesh(spec))
        logits = np.asarray(t(ids[None], pos).logits[0])
        ar = generate_autoregressive(t, prompts, max_new_tokens=10, cache_len=64)
        sp = generate_speculative(
            t, random_drafter(t, block_size=4), prompts, max_new_tokens=10, cache_len=64, num_speculative_tokens=4
        )
        out[spec or "one_device"] = {
            "logits": logits.tolist(),
            "plain": [g.token_ids for g in ar.generations],
            "speculative": [g.token_ids for g in sp.generations],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
