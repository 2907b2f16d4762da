"""``TrainConfig``'s nested drafter config: the flat keys of recipes and command lines, the dotted
keys and a nested mapping all set the same field, and the drafter built from it is the same."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from dspark_jax.config import TargetConfig
from dspark_jax.training.overrides import apply_overrides
from dspark_jax.training.recipes import load_config_file
from dspark_jax.training.train_config import DrafterSettings, TrainConfig, drafter_config

TARGET = TargetConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position=128,
    name="tiny",
)


def test_every_alias_names_a_drafter_field_and_every_field_has_one():
    fields = {f"drafter.{f.name}" for f in dataclasses.fields(DrafterSettings)}
    assert set(TrainConfig.KEY_ALIASES.values()) == fields
    plain = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not plain & set(TrainConfig.KEY_ALIASES), "an alias must not shadow a field"


@pytest.mark.parametrize(
    "flat, nested",
    [
        ("block_size=4", "drafter.block_size=4"),
        ("drafter_width=0", "drafter.width=0"),
        ("drafter_arch=legacy", "drafter.arch=legacy"),
        ("drafter_intermediate_size=48", "drafter.intermediate_size=48"),
        ("taps=1,2", "drafter.taps=1,2"),
        ("variant=dflash", "drafter.variant=dflash"),
    ],
)
def test_flat_and_dotted_keys_set_the_same_field(flat, nested):
    base = TrainConfig.from_keys(drafter_width=128)
    assert apply_overrides(base, [flat]) == apply_overrides(base, [nested]) != base


def test_a_nested_mapping_and_from_keys():
    want = apply_overrides(TrainConfig(), ["block_size=4", "num_layers=1", "steps=3"])
    assert apply_overrides(TrainConfig(), {"drafter": {"block_size": 4, "num_layers": 1}, "steps": 3}) == want
    assert apply_overrides(TrainConfig(), ['drafter={"block_size": 4, "num_layers": 1}', "steps=3"]) == want
    assert TrainConfig.from_keys(block_size=4, num_layers=1, steps=3) == want
    assert want.drafter == DrafterSettings(block_size=4, num_layers=1) and want.steps == 3
    with pytest.raises(ValueError, match="unknown config key 'drafter.block'"):
        apply_overrides(TrainConfig(), ["drafter.block=4"])
    with pytest.raises(ValueError, match="takes a mapping"):
        apply_overrides(TrainConfig(), ["drafter=4"])


def test_a_config_file_may_nest_the_drafter(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("preset: stories260k\nblock_size: 4\ndrafter_width: 0\nsteps: 9\n")
    nested.write_text("preset: stories260k\ndrafter:\n  block_size: 4\n  width: 0\nsteps: 9\n")
    assert load_config_file(str(flat)) == load_config_file(str(nested))
    assert load_config_file(str(nested)).drafter.width == 0


def test_the_drafter_built_from_the_nested_config():
    target = SimpleNamespace(cfg=TARGET, fingerprint="fp")
    d = drafter_config(TrainConfig.from_keys(block_size=4, num_layers=1, markov_rank=8, drafter_width=64), target)
    assert (d.block_size, d.num_layers, d.markov_rank, d.width, d.head_dim) == (4, 1, 8, 64, 16)
    assert d.intermediate_size == 128 and d.target_fingerprint == "fp"  # the target's, scaled by 64 / 32
    eagle = drafter_config(TrainConfig.from_keys(variant="eagle3", num_layers=3), target)
    assert eagle.num_layers == 1 and eagle.markov_rank == 0
