"""Session-scoped fixtures of the decode-loop tests: each test file of this folder runs on its
own xdist worker (``--dist loadfile``), so the targets, drafters and reference decodes are built
once per worker, and the compiled loops they share stay in the process's compile cache."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.decoding.speculative import generate_autoregressive
from dspark_jax.models.target import Target
from tests.unit.decoding.helpers import TINY, ar_std, bigram_drafter, random_drafter, tiny_params


@pytest.fixture(scope="session")
def s260k(stories260k):
    from dspark_jax.models.weights import params_fingerprint

    cfg, params, tok = stories260k
    return Target(cfg, params, fingerprint=params_fingerprint(params)), tok


@pytest.fixture(scope="session")
def s260k_prompts(s260k):
    from dspark_jax.data.prompts import tinystories_openings

    _, tok = s260k
    prompts = [tok.encode(t) for t in tinystories_openings()[:50]]
    assert len(prompts) == 50
    return prompts


@pytest.fixture(scope="session")
def s260k_ar(s260k, s260k_prompts):
    target, _ = s260k
    return generate_autoregressive(target, s260k_prompts, max_new_tokens=48, temperature=0)


# "trained" uses the session's quickly trained drafter (conftest.stories260k_export).
@pytest.fixture(scope="session", params=["random", "bigram", pytest.param("trained", marks=pytest.mark.slow)])
def s260k_drafter(request, s260k):
    target, _ = s260k
    if request.param == "random":
        return random_drafter(target, block_size=4, markov_rank=target.cfg.vocab_size)
    if request.param == "bigram":  # same config as "random": shares its compilation
        return bigram_drafter(target, block_size=4, alpha=3.0, base_scale=0.0, bos=1)
    from dspark_jax.drafters.checkpoint import load_drafter

    _, summary = request.getfixturevalue("stories260k_export")
    return load_drafter(summary["export_dir"])[0]


@pytest.fixture(scope="session")
def peaked():
    # No fingerprint: every tiny target shares one compiled loop (the fingerprint is a
    # static attribute of the module, so distinct fingerprints would recompile).
    return Target(TINY, tiny_params("peaked"))


@pytest.fixture(scope="session")
def pure_bigram():
    return Target(TINY, tiny_params("bigram"))


@pytest.fixture(scope="session")
def drafters(peaked, pure_bigram):
    """All share one config (one compiled speculative loop)."""
    return {
        "random": random_drafter(peaked, seed=3),
        "bigram": bigram_drafter(peaked, seed=4),
        "perfect": bigram_drafter(pure_bigram, alpha=50.0, base_scale=0.0, seed=5),
    }


@pytest.fixture(scope="session")
def ar_peaked(peaked):
    return ar_std(peaked, temperature=0)


@pytest.fixture(scope="session")
def ar_pure(pure_bigram):
    return ar_std(pure_bigram, temperature=0)


@pytest.fixture(scope="session")
def law_runs(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """:func:`law_decodes` in a process of its own at the user's XLA flags (it is run-bound):
    ``{name: {"tokens": [rows, 6], "lengths", "accepted", "drafted": [rows]}}``."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.env import user_xla_env

    out = tmp_path_factory.mktemp("law") / "law.npz"
    root = Path(__file__).resolve().parents[3]
    p = subprocess.run(
        [sys.executable, "-m", "tests.helpers.law_worker", str(out)],
        env=user_xla_env(),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=root,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    runs: dict[str, dict[str, np.ndarray]] = {}
    with np.load(out) as z:
        for key in z.files:
            name, field = key.split("/")
            runs.setdefault(name, {})[field] = z[key]
    return runs
