"""Warm starts (:mod:`dspark_jax.training.warm_start`): the drafter's layers start as the named
target layers, everything else as a fresh drafter of the same seed; warm starts that cannot be
done are refused with one clear error, by a run before it generates any data."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax.drafters.build import build_drafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.warm_start import check_init_from_target_layers, init_from_target_layers
from tests.helpers.tiny import tiny_drafter, tiny_drafter_config, tiny_target, tiny_train_config


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_layers_are_the_targets_and_the_rest_is_a_fresh_drafter(target, variant):
    train = tiny_train_config(num_layers=2)
    fresh, warm = (tiny_drafter(target, variant, train=train) for _ in range(2))
    init_from_target_layers(warm, target, (-1, 1))  # any order; -1 is layer 3 of 4
    theirs = target.layer_weights()
    copied = {k for k in warm.layers if k in theirs}
    assert copied == {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}
    for k in copied:
        np.testing.assert_array_equal(np.asarray(warm.layers[k][...]), np.asarray(theirs[k])[[3, 1]])
    np.testing.assert_array_equal(np.asarray(warm.final_norm[...]), np.asarray(target.final_norm[...]))
    # every other parameter (fc, q/k norms the Llama target lacks, heads) is the fresh drafter's
    flat = lambda d: dict(nnx.to_flat_state(nnx.state(d, nnx.Param)))
    a, b = flat(fresh), flat(warm)
    assert a.keys() == b.keys()
    for path, v in a.items():
        if path[0] == "final_norm" or (path[0] == "layers" and path[1] in copied):
            continue
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(b[path][...]), err_msg=str(path))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(warm, nnx.Param)))


def test_refusals(target):
    two = tiny_drafter(target, train=tiny_train_config(num_layers=2))
    with pytest.raises(DSparkInputError, match="names 1 target layers; the drafter has 2"):
        init_from_target_layers(two, target, (3,))
    with pytest.raises(DSparkInputError, match=r"layer\(s\) \[4, -5\] outside the target's 4 layers"):
        init_from_target_layers(two, target, (4, -5))
    wide = tiny_drafter(target, train=tiny_train_config(num_layers=1, drafter_width=64))
    with pytest.raises(DSparkInputError, match="drafter_width=0"):
        init_from_target_layers(wide, target, (-1,))
    with pytest.raises(DSparkInputError, match="only DSpark and DFlash"):
        init_from_target_layers(tiny_drafter(target, "eagle3"), target, (-1,))
    # shapes only: an abstract drafter is checked without weights
    abstract = nnx.eval_shape(lambda: build_drafter(tiny_drafter_config(target), nnx.Rngs(0)))
    assert check_init_from_target_layers(abstract, target, (-1,)) == [3]


def test_run_refuses_a_bad_warm_start_before_any_data(target, tmp_path):
    from dspark_jax.training.pipeline import run

    cfg = dataclasses.replace(
        tiny_train_config(), workdir=str(tmp_path / "run"), init_from_target_layers=(0, 1), steps=1
    )
    with pytest.raises(DSparkInputError, match="names 2 target layers; the drafter has 1"):
        run(cfg, target_and_tokenizer=(target, None))
    assert not (tmp_path / "run" / "data").exists()
