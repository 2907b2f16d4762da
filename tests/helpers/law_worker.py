"""Runs the decodes of ``tests/unit/decoding/test_law.py``'s law of the first tokens and saves them.

    python -m tests.helpers.law_worker OUT.npz

A process of its own because the decodes are run-bound (24,000 rows per loop) while the suite turns
XLA's optimisation down for its compile-bound tests: the fixture starts this script with the
user's ``XLA_FLAGS`` (``conftest.user_xla_env``). The target, drafters, seeds and settings are the
test's own (:func:`tests.unit.decoding.law.law_decodes`); OUT holds, per loop ``NAME`` (``ar``,
``spec-bigram``, ``spec-random``, ``spec-bigram-auto``, ``bf16-spec-bigram``), ``NAME/tokens`` ``[rows, 6]``
int32 (-1 past the end), ``NAME/lengths``, ``NAME/accepted`` and ``NAME/drafted`` ``[rows]`` int64.
"""

from __future__ import annotations

import sys

import numpy as np

from tests.unit.decoding.law import law_decodes


def main(out: str) -> None:
    arrays = {}
    for name, res in law_decodes().items():
        gens = res.generations
        width = max(len(g.token_ids) for g in gens)
        tokens = np.full((len(gens), width), -1, np.int32)
        for i, g in enumerate(gens):
            tokens[i, : len(g.token_ids)] = g.token_ids
        arrays[f"{name}/tokens"] = tokens
        arrays[f"{name}/lengths"] = np.array([len(g.token_ids) for g in gens], np.int64)
        arrays[f"{name}/accepted"] = np.array([g.num_accepted for g in gens], np.int64)
        arrays[f"{name}/drafted"] = np.array([g.num_draft_tokens for g in gens], np.int64)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
