"""Worker for tests/integration/test_mesh_decode.py: speculative decoding with a target on a device mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.mesh_decode_worker

Loads stories260K once on one device and once on a ``data:2,model:4`` mesh of 8 forced CPU
devices, the drafter each time from the same export (restored arrays are committed to one
device: what failed before drafters followed their target), and decodes the same prompts with
``generate_speculative`` greedily and at T=1 with seeds. Also the serving mesh ``model:4`` on
this 8-device host. Prints one JSON object; the test asserts on it.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.api import load_target, load_target_and_drafter
from dspark_jax.config import DrafterConfig
from dspark_jax.decoding.speculative import generate_speculative
from dspark_jax.drafters.base import place_like_target, prepare_drafter
from dspark_jax.drafters.checkpoint import export_drafter, load_drafter
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.serving.engine.state import serving_mesh

N_DEV = 8
PROMPTS = [[1, 403, 407, 261, 378], [1, 261, 376, 298]]
SETTINGS = {"greedy": dict(temperature=0.0, seed=0), "t1": dict(temperature=1.0, top_k=0, seed=[11, 12])}
KW = dict(max_new_tokens=24, num_speculative_tokens=4)


def bigram_drafter(target) -> DSparkDrafter:
    """A drafter whose Markov head holds the target's next-token logits after each token, so
    drafts get accepted (the tokens then depend on acceptance, not only on the target)."""
    v = target.cfg.vocab_size
    dcfg = DrafterConfig.for_target(
        target.cfg, block_size=4, num_layers=1, markov_rank=v, target_fingerprint=target.fingerprint
    )
    d = DSparkDrafter(dcfg, nnx.Rngs(0))
    x = np.stack([np.full(v, 1), np.arange(v)], axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(2, dtype=np.int32), x.shape)
    d.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1]))
    d.final_norm[...] = d.final_norm[...] * 0.1
    return d


def decode(target, drafter) -> dict:
    out = {}
    for name, s in SETTINGS.items():
        res = generate_speculative(target, drafter, PROMPTS, **KW, **s)
        out[name] = {
            "tokens": [g.token_ids for g in res.generations],
            "accepted": int(sum(g.num_accepted for g in res.generations)),
            "passes": [g.num_target_passes for g in res.generations],
        }
    return out


def devices_of(tree) -> list[list[int]]:
    return sorted({tuple(sorted(d.id for d in x.sharding.device_set)) for x in jax.tree.leaves(tree)})


def serving_mesh_checks(out) -> None:
    m = serving_mesh("model:4")
    out["serving_model4"] = {"shape": dict(m.shape), "device_ids": [d.id for d in m.devices.flat]}
    for spec in ("model:16", "data:2,model:4"):
        try:
            serving_mesh(spec)
            out[f"serving_error {spec}"] = None
        except DSparkInputError as e:
            out[f"serving_error {spec}"] = str(e)
    # The engine's mesh is the one the CLI loads the target on: decoding on model:4 (devices 0-3).
    target4, _ = load_target("stories260k", mesh=m)
    return target4


def main():
    assert jax.device_count() == N_DEV, jax.devices()
    t_start = time.perf_counter()
    out: dict = {"devices": jax.device_count()}
    target1, _ = load_target("stories260k")
    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(bigram_drafter(target1), Path(tmp) / "export")
        drafter1, _ = load_drafter(Path(tmp) / "export", target=target1)
        prepare_drafter(target1, drafter1)
        out["one_device"] = decode(target1, drafter1)

        mesh = shd.make_mesh("data:2,model:4")
        target8, _, drafter8 = load_target_and_drafter("stories260k", str(Path(tmp) / "export"), mesh=mesh)
        assert drafter8 is not None
        out["drafter_on_mesh"] = {
            "devices": devices_of(nnx.state(drafter8)),
            "wq_spec": str(drafter8.layers["wq"][...].sharding.spec),
            "moved_again": place_like_target(target8, drafter8),
        }
        out["mesh_2x4"] = decode(target8, drafter8)

        # A drafter restored without a target (committed to device 0), decoding straight away.
        drafter_late, _ = load_drafter(Path(tmp) / "export")
        out["late_drafter_2x4"] = decode(target8, drafter_late)

        target4 = serving_mesh_checks(out)
        out["model4_first_devices"] = decode(target4, drafter8)  # the drafter follows onto devices 0-3
        out["drafter_devices_after_model4"] = devices_of(nnx.state(drafter8))
        # ... and back to one device.
        out["back_to_one_device"] = decode(target1, drafter8)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
