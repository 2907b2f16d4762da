"""Recipes: the packaged ``dspark_jax/recipes/*.yaml`` are the only preset definitions; every one
loads, round-trips through a config file, and ``--preset NAME``, ``--config NAME`` and
``--config PATH`` give the same config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from dspark_jax.commands.train import build_parser, load_config
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.recipes import TRAIN_PRESETS, load_config_file, load_recipe, recipe_names
from dspark_jax.training.train_config import TrainConfig

REPO = Path(__file__).resolve().parents[3]

# The presets as they were defined in Python before the YAML files became their only source
# (fields that differ from TrainConfig's defaults): the recipes must still give exactly these.
_QWEN3 = dict(
    prompts="chat",
    variant="dspark",
    block_size=7,
    num_layers=5,
    markov_rank=256,
    taps=(1, 9, 17, 25, 33),
    num_prompts=100_000,
    num_eval_prompts=32,
    gen_max_new_tokens=1536,
    gen_temperature=0.7,
    gen_top_p=0.8,
    gen_batch_size=256,
    gen_shard_size=4096,
    seq_len=2048,
    steps=10_000,
    batch_size=64,
    anchors_per_seq=64,
    learning_rate=6e-4,
    dtype="bfloat16",
    remat=True,
    log_every=50,
    ckpt_every=500,
    eval_max_new_tokens=512,
)
LEGACY_PRESETS = {
    "stories260k": TrainConfig.from_keys(drafter_width=128, steps=1100, feature_cache="auto"),
    "smollm2-135m-instruct": TrainConfig.from_keys(
        target="smollm2-135m-instruct",
        workdir="runs/smollm2-135m-instruct",
        prompts="chat",
        markov_rank=128,
        num_prompts=512,
        num_eval_prompts=16,
        gen_max_new_tokens=160,
        gen_batch_size=16,
        seq_len=256,
        steps=600,
        batch_size=8,
        learning_rate=1e-3,
        eval_max_new_tokens=96,
    ),
    "qwen3-4b": TrainConfig.from_keys(target="qwen3-4b", workdir="runs/qwen3-4b", grad_accum_steps=4, **_QWEN3),
    "qwen3-8b": TrainConfig.from_keys(target="qwen3-8b", workdir="runs/qwen3-8b", grad_accum_steps=8, **_QWEN3),
}


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_every_packaged_yaml_is_a_recipe():
    on_disk = sorted(p.stem for p in (REPO / "dspark_jax" / "recipes").glob("*.yaml"))
    assert recipe_names() == on_disk and sorted(TRAIN_PRESETS) == on_disk
    assert set(LEGACY_PRESETS) <= set(on_disk)


@pytest.mark.parametrize("name", sorted(LEGACY_PRESETS))
def test_recipe_equals_the_former_python_preset(name):
    assert TRAIN_PRESETS[name] == load_recipe(name) == LEGACY_PRESETS[name]


def test_dflash_recipe_inherits_stories260k():
    want = TRAIN_PRESETS["stories260k"].with_keys(workdir="runs/stories260k-dflash", variant="dflash")
    assert TRAIN_PRESETS["stories260k-dflash"] == want


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_loads_and_round_trips(name, tmp_path):
    """Every recipe -> TrainConfig -> YAML / JSON file of all its keys -> the same TrainConfig,
    whatever preset the file is applied over; --preset, --config NAME and --config PATH agree."""
    cfg = TRAIN_PRESETS[name]
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.drafter.taps, tuple)
    keys = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
    (tmp_path / "all.yaml").write_text(yaml.safe_dump(keys))
    (tmp_path / "all.json").write_text(json.dumps(keys))
    for base in (None, "qwen3-8b", "stories260k"):
        assert load_config_file(str(tmp_path / "all.yaml"), base) == cfg
        assert load_config_file(str(tmp_path / "all.json"), base) == cfg
    packaged = str(REPO / "dspark_jax" / "recipes" / f"{name}.yaml")
    assert load_config(_args("--preset", name)) == cfg
    assert load_config(_args("--config", name)) == cfg
    assert load_config(_args("--config", f"{name}.yaml")) == cfg
    assert load_config(_args("--config", packaged)) == cfg


def test_config_file_over_presets_and_overrides(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("preset: smollm2-135m-instruct\nsteps: 7\n")
    assert load_config(_args("--config", str(f))) == dataclasses.replace(
        TRAIN_PRESETS["smollm2-135m-instruct"], steps=7
    )
    # --preset wins over the file's preset: key; key=value overrides come last.
    assert load_config(_args("--preset", "qwen3-4b", "--config", str(f), "steps=9")) == dataclasses.replace(
        TRAIN_PRESETS["qwen3-4b"], steps=9
    )
    # No preset anywhere: the default recipe.
    (tmp_path / "plain.yaml").write_text("steps: 3\n")
    assert load_config(_args("--config", str(tmp_path / "plain.yaml"))) == dataclasses.replace(
        TRAIN_PRESETS["stories260k"], steps=3
    )
    assert load_config(_args()) == TRAIN_PRESETS["stories260k"]


def test_bad_config_sources_are_input_errors(tmp_path):
    with pytest.raises(DSparkInputError, match="config file not found"):
        load_config(_args("--config", "no-such-recipe"))
    with pytest.raises(DSparkInputError, match="qwen3-30b-a3b is a target: --config RECIPE target=qwen3-30b-a3b"):
        load_config(_args("--config", "qwen3-30b-a3b"))
    with pytest.raises(DSparkInputError, match="config file not found"):
        load_config(_args("--config", str(tmp_path / "missing.yaml")))
    (tmp_path / "bad.yaml").write_text("preset: nope\n")
    with pytest.raises(DSparkInputError, match="unknown preset 'nope'"):
        load_config(_args("--config", str(tmp_path / "bad.yaml")))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(DSparkInputError, match="expected a mapping"):
        load_config(_args("--config", str(tmp_path / "list.yaml")))
    (tmp_path / "key.yaml").write_text("no_such_key: 1\n")
    with pytest.raises(DSparkInputError, match="unknown config key"):
        load_config(_args("--config", str(tmp_path / "key.yaml")))
    with pytest.raises(DSparkInputError, match="unknown recipe"):
        load_recipe("no-such-recipe")


def test_gamma_is_still_read_as_block_size(tmp_path, caplog):
    """``gamma`` (the paper's name, this project's before issue 25) in a config file, an override
    or an old export still means ``block_size``, with a note; nothing else is renamed."""
    from dspark_jax.config import DrafterConfig, TargetConfig

    f = tmp_path / "old.yaml"
    f.write_text("preset: stories260k\ngamma: 5\n")
    want = TRAIN_PRESETS["stories260k"].with_keys(block_size=5)
    with caplog.at_level("WARNING", logger="dspark_jax.config"):
        assert load_config(_args("--config", str(f))) == want
        assert load_config(_args("gamma=5")) == want
    assert "'gamma' is now called 'block_size'" in caplog.text
    t = TargetConfig(64, 16, 32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, max_position=64)
    new = DrafterConfig.for_target(t, block_size=3, num_layers=1)
    old = {("gamma" if k == "block_size" else k): v for k, v in new.to_dict().items()}
    assert DrafterConfig.from_dict(old) == new == DrafterConfig.for_target(t, gamma=3, num_layers=1)
    with pytest.raises(DSparkInputError, match="unknown config key 'gama'"):
        load_config(_args("gama=5"))


# The published model configs the new-family recipes train against (values of the hub's config.json).
_FAMILY_TARGETS = {
    "llama-3.1-8b-instruct": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        tie_embeddings=False,
        eos_ids=(128001, 128008, 128009),
        layer_types=(),
    ),
    "gemma-3-12b": dict(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rope_theta=1e6,
        sliding_rope_theta=10000.0,
        sliding_window=1024,
        tie_embeddings=True,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        final_logit_softcap=None,
        eos_ids=(1, 106),
        layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(48)),
    ),
}


@pytest.mark.parametrize("name", sorted(_FAMILY_TARGETS))
def test_family_recipe_targets_the_published_config(name):
    """The Llama 3.1 / Gemma 3 recipes name a built-in config with the published values (no weights
    needed), tap the default layers of that depth, and draft over a 32768-token vocabulary."""
    from dspark_jax.models.presets import target_config

    cfg = TRAIN_PRESETS[name]
    t = target_config(cfg.target)
    assert {k: getattr(t, k) for k in _FAMILY_TARGETS[name]} == _FAMILY_TARGETS[name]
    assert cfg.drafter.taps == t.default_taps() and cfg.drafter.draft_vocab_size == 32768 and cfg.dtype == "bfloat16"
    assert t.default_mask_token_id() == t.vocab_size - 1
    if name.startswith("llama"):
        s = t.rope_scaling
        assert (s.rope_type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position) == (
            "llama3",
            8.0,
            1.0,
            4.0,
            8192,
        )
    else:
        assert (t.rope_scaling.rope_type, t.rope_scaling.factor) == ("linear", 8.0)
        assert t.embed_scale == pytest.approx(3840**0.5, rel=1e-6)


def test_gemma4_recipe_targets_the_built_in_config():
    """The Gemma 4 12B recipe names the built-in config (google/gemma-4-12B-it's text model as public
    ports record it) and DeepSeek's drafter shape: taps 5/17/29/41/46, block 7, 5 layers, mask token 4."""
    from dspark_jax.config import RopeScaling
    from dspark_jax.models.presets import target_config
    from dspark_jax.models.weights import count_target_params

    cfg = TRAIN_PRESETS["gemma-4-12b"]
    t = target_config(cfg.target)
    want = dict(vocab_size=262144, hidden_size=3840, num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
                global_head_dim=512, global_num_kv_heads=1, k_eq_v=True, rope_theta=1e6,
                sliding_rope_theta=1e4, sliding_window=1024, final_logit_softcap=30.0, norm_offset=0.0,
                query_scale=1.0, mask_token_id=4)  # fmt: skip
    assert {k: getattr(t, k) for k in want} == want
    assert t.rope_scaling == RopeScaling("proportional", partial_rotary_factor=0.25)  # on the full layers
    assert t.layer_types == tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(48))
    d = cfg.drafter
    assert (d.taps, d.block_size, d.num_layers, d.markov_rank) == ((5, 17, 29, 41, 46), 7, 5, 256)
    assert 11.9e9 < count_target_params(t) < 11.92e9
