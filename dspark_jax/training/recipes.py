"""Training recipes: the YAML files of ``dspark_jax/recipes/`` (package data) as :class:`TrainConfig`.

A recipe ``NAME`` is ``dspark_jax/recipes/NAME.yaml``: ``TrainConfig`` keys over the dataclass
defaults, or over the recipe named by its ``preset:`` key (``preset: stories260k`` in
``stories260k-dflash.yaml``; a recipe naming itself starts from the defaults). These files are
the only definition of the built-in presets: :data:`TRAIN_PRESETS` (``name -> TrainConfig``,
``python -m dspark_jax.train --preset NAME``) is computed from them, and ``--config`` takes a
recipe name or the path of any YAML / JSON file of config keys (:func:`load_config_file`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from dspark_jax.errors import DSparkInputError
from dspark_jax.training.overrides import apply_overrides, flatten_keys
from dspark_jax.training.train_config import TrainConfig

# The recipe a run starts from when neither --preset nor a config file's ``preset:`` names one.
DEFAULT_RECIPE = "stories260k"
_SUFFIXES = (".yaml", ".yml")


def recipe_names() -> list[str]:
    """Names of the built-in recipes (the packaged ``recipes/*.yaml``), sorted."""
    root = resources.files("dspark_jax").joinpath("recipes")
    return sorted(f.name[: -len(".yaml")] for f in root.iterdir() if f.name.endswith(".yaml"))


def recipe_text(name: str) -> str:
    """The YAML text of built-in recipe ``name``.

    Raises:
      DSparkInputError: unknown recipe.
    """
    names = recipe_names()
    if name not in names:
        raise DSparkInputError(f"unknown recipe {name!r}; built-in recipes: {', '.join(names)}")
    return resources.files("dspark_jax").joinpath("recipes").joinpath(f"{name}.yaml").read_text()


def parse_config_text(text: str, source: str, yaml_syntax: bool = True) -> dict[str, Any]:
    """The mapping of config keys in a YAML (or, with ``yaml_syntax=False``, JSON) document.

    Raises:
      DSparkInputError: unparsable text, or a document that is not a mapping.
    """
    try:
        if yaml_syntax:
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types
        raise DSparkInputError(f"cannot parse {source}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise DSparkInputError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def apply_config(cfg: TrainConfig, data: Mapping[str, Any]) -> TrainConfig:
    """``cfg`` with the keys of a parsed config file applied (values parsed like ``key=value`` overrides).

    Raises:
      DSparkInputError: unknown key or bad value.
    """
    try:
        flat = flatten_keys(data)  # a nested ``drafter:`` mapping, or the flat keys
        return apply_overrides(cfg, {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in flat.items()})
    except ValueError as e:
        raise DSparkInputError(str(e)) from None


def load_recipe(name: str, _chain: tuple[str, ...] = ()) -> TrainConfig:
    """The :class:`TrainConfig` of built-in recipe ``name`` (module docstring).

    Raises:
      DSparkInputError: unknown recipe, a cycle of ``preset:`` references, or a bad key.
    """
    if name in _chain:
        raise DSparkInputError(f"recipes refer to each other in a cycle: {' -> '.join(_chain + (name,))}")
    data = parse_config_text(recipe_text(name), f"recipe {name}")
    base = data.pop("preset", None)
    cfg = TrainConfig() if base in (None, name) else load_recipe(str(base), _chain + (name,))
    return apply_config(cfg, data)


def _read_config_source(spec: str) -> tuple[str, dict[str, Any]]:
    """``--config`` value -> ``(source label, parsed mapping)``: a file path, else a recipe name
    (``qwen3-8b`` or ``qwen3-8b.yaml``).

    Raises:
      DSparkInputError: neither a file nor a recipe, or unparsable.
    """
    path = Path(spec)
    if path.is_file():
        return str(path), parse_config_text(path.read_text(), str(path), yaml_syntax=path.suffix in _SUFFIXES)
    name = path.stem if path.suffix in _SUFFIXES else spec
    if path.name == spec and name in recipe_names():
        return f"recipe {name}", parse_config_text(recipe_text(name), f"recipe {name}")
    from dspark_jax.models.presets import BUILTIN_HF_CONFIGS

    hint = f"; {spec} is a target: --config RECIPE target={spec}" if spec in BUILTIN_HF_CONFIGS else ""
    raise DSparkInputError(f"config file not found: {path} (built-in recipes: {', '.join(recipe_names())}){hint}")


def load_config_file(spec: str, preset: str | None = None) -> TrainConfig:
    """The config of ``--config SPEC`` (a YAML/JSON file, or a recipe name) on top of a preset.

    The base is ``preset`` (``--preset``) when given, else the file's own ``preset:`` key, else
    :data:`DEFAULT_RECIPE`; the file's keys are applied over it.

    Raises:
      DSparkInputError: missing or unparsable file, unknown preset, unknown keys or bad values.
    """
    source, data = _read_config_source(spec)
    named = data.pop("preset", None)
    if named is not None and not preset:
        if str(named) not in TRAIN_PRESETS:
            raise DSparkInputError(f"{source}: unknown preset {str(named)!r}")
        preset = str(named)
    return apply_config(TRAIN_PRESETS[preset or DEFAULT_RECIPE], data)


# name -> TrainConfig of every built-in recipe (computed from the YAML files).
TRAIN_PRESETS: dict[str, TrainConfig] = {name: load_recipe(name) for name in recipe_names()}
